"""Two-shot allreduce against ring, gloo (and MPICH where mpi4py is installed), and the copy floor.

In one run, on one pool per world size (shm): the copy bandwidth of one rank (numpy copy of
16 MB, median of 20), then per size allreduce with ``ring``, ``two_shot``, ``two_shot`` on
``lab.empty`` tensors (no copy in) and gloo, timed inside the ranks by ``lab.benchmark``'s rules
(warm-up first; a call's time is its slowest rank's; the median over calls). Each row says how far
it is from the floor: two-shot moves about 4T bytes through each rank's memory (T in, T read
while reducing, T read and written out), so ``floor = 4T / copy_bw`` (3T for registered tensors).

Run:  python bench/two_shot.py [--ranks 4] [--sizes 262144,1048576,4194304,16777216]
The machine is shared: note the load average printed with the table; ratios hold for one run only.
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch
import torch.distributed as dist

import lab
from lab import mpich
from lab.benchmark import copy_bandwidth, iterations_for, summarize, time_collective
from lab.reference import ensure_gloo

SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]


def time_registered(mesh: lab.Mesh, nbytes: int) -> list[int]:
    """In one rank: each timed two_shot call on a lab.empty tensor, as lab.benchmark times the others."""
    iterations, warmup = iterations_for(nbytes)
    ensure_gloo(mesh)
    x = lab.empty(mesh, (nbytes // 4,))
    x.copy_(torch.arange(nbytes // 4, dtype=torch.float32).mul_(1e-6).add_(mesh.rank))
    durations = []
    dist.barrier()
    for i in range(warmup + iterations):
        start = time.perf_counter_ns()
        lab.allreduce(mesh, x, algorithm="two_shot")
        elapsed = time.perf_counter_ns() - start
        if i >= warmup:
            durations.append(elapsed)
        x.mul_(1.0 / mesh.world_size)
    return durations


def sweep(world_size: int, sizes: list[int], copy_gbps: float) -> pd.DataFrame:
    rows = []
    with lab.launch(world_size) as cluster:
        for nbytes in sizes:
            cases = {"ring": cluster.run(time_collective, "allreduce", "lab", nbytes, "ring"),
                     "two_shot": cluster.run(time_collective, "allreduce", "lab", nbytes, "two_shot"),
                     "two_shot lab.empty": cluster.run(time_registered, nbytes),
                     "gloo": cluster.run(time_collective, "allreduce", "gloo", nbytes)}
            for name, per_rank in cases.items():
                rows.append({"N": world_size, "bytes": nbytes, "impl": name,
                             **summarize(per_rank, "allreduce", nbytes, world_size)})
    if mpich.unavailable() is None:
        for nbytes in sizes:
            row = mpich.measure(world_size, nbytes)
            rows.append({"N": world_size, "bytes": nbytes, "impl": "mpich",
                         **{k: row[k] for k in ("median_us", "p10_us", "p90_us", "algbw_GBps", "busbw_GBps", "calls")}})
    frame = pd.DataFrame(rows)
    passes = frame["impl"].map(lambda impl: 3 if impl == "two_shot lab.empty" else 4)
    frame["floor_us"] = passes * frame["bytes"] / (copy_gbps * 1e3)
    frame["x floor"] = frame["median_us"] / frame["floor_us"]
    frame["vs gloo"] = frame.apply(lambda r: frame[(frame["bytes"] == r["bytes"]) & (frame["impl"] == "gloo")]
                                   ["median_us"].iloc[0] / r["median_us"], axis=1)
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4", help="comma-separated world sizes (default 4)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated tensor bytes")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; one rank copies {copy_gbps:.1f} GB/s"
          + ("" if mpich.unavailable() is None else f"; MPICH skipped: {mpich.unavailable()}"))
    sizes = [int(s) for s in args.sizes.split(",")]
    for world_size in (int(n) for n in args.ranks.split(",")):
        frame = sweep(world_size, sizes, copy_gbps)
        columns = ["N", "bytes", "impl", "median_us", "p10_us", "p90_us", "busbw_GBps", "floor_us", "x floor",
                   "vs gloo"]
        print(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
