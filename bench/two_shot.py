"""Two-shot and one-shot allreduce against ring, gloo (and MPICH where mpi4py is installed), and the copy floor.

In one run, on one pool per world size (shm): the copy bandwidth of one rank (numpy copy of
16 MB, median of 20), then per size allreduce with ``ring``, ``two_shot``, ``two_shot`` on
``lab.empty`` tensors (no copy in), ``one_shot``, ``lab.symm_mem.one_shot_all_reduce`` from a
``lab.symm_mem.empty`` buffer (read in place, out of place) and gloo, timed inside the ranks by
``lab.benchmark``'s rules (warm-up first; a call's time is its slowest rank's; the median over
calls). Each row says how far it is from the floor, the bytes each rank moves through its memory
at one rank's copy bandwidth: two-shot about 4T (T in, T read while reducing, T read and written
out; 3T for registered tensors), one-shot (N+2)T (T in, N·T read, T out; (N+1)T from a symmetric
buffer), the others counted as two-shot.

Run:  python bench/two_shot.py [--ranks 4] [--sizes 1024,16384,65536,262144,1048576,4194304,16777216]
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

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


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


def time_symmetric(mesh: lab.Mesh, nbytes: int) -> list[int]:
    """In one rank: each timed ``lab.symm_mem.one_shot_all_reduce_out`` from a symmetric buffer."""
    iterations, warmup = iterations_for(nbytes)
    ensure_gloo(mesh)
    x = lab.symm_mem.empty(mesh, (nbytes // 4,), torch.float32)
    x.copy_(torch.arange(nbytes // 4, dtype=torch.float32).mul_(1e-6).add_(mesh.rank))
    out = torch.empty_like(x)
    durations = []
    dist.barrier()
    for i in range(warmup + iterations):
        start = time.perf_counter_ns()
        lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, out)
        elapsed = time.perf_counter_ns() - start
        if i >= warmup:
            durations.append(elapsed)
    return durations


#: Bytes through one rank's memory per tensor byte (the floor), by case, at N ranks.
PASSES = {
    "two_shot lab.empty": lambda n: 3, "one_shot": lambda n: n + 2, "one_shot symm_mem": lambda n: n + 1}


def sweep(world_size: int, sizes: list[int], copy_gbps: float) -> pd.DataFrame:
    rows = []
    with lab.launch(world_size) as cluster:
        for nbytes in sizes:
            cases = {
                "ring": cluster.run(time_collective, "allreduce", "lab", nbytes,
                                    "ring"), "two_shot": cluster.run(time_collective, "allreduce", "lab",
                                                                     nbytes, "two_shot"),
                "two_shot lab.empty": cluster.run(time_registered, nbytes),
                "one_shot": cluster.run(time_collective, "allreduce", "lab", nbytes,
                                        "one_shot"), "one_shot symm_mem": cluster.run(time_symmetric, nbytes),
                "gloo": cluster.run(time_collective, "allreduce", "gloo", nbytes)}
            for name, per_rank in cases.items():
                rows.append({
                    "N": world_size, "bytes": nbytes, "impl": name,
                    **summarize(per_rank, "allreduce", nbytes, world_size)})
    if mpich.unavailable() is None:
        for nbytes in sizes:
            row = mpich.measure(world_size, nbytes)
            rows.append({
                "N": world_size, "bytes": nbytes, "impl": "mpich",
                **{k: row[k]
                   for k in ("median_us", "p10_us", "p90_us", "algbw_GBps", "busbw_GBps", "calls")}})
    frame = pd.DataFrame(rows)
    passes = frame.apply(lambda r: PASSES.get(r["impl"], lambda n: 4)(r["N"]), axis=1)
    frame["floor_us"] = passes * frame["bytes"] / (copy_gbps * 1e3)
    frame["x floor"] = frame["median_us"] / frame["floor_us"]
    frame["vs gloo"] = frame.apply(
        lambda r: frame[
            (frame["bytes"] == r["bytes"]) & (frame["impl"] == "gloo")]["median_us"].iloc[0] / r["median_us"],
        axis=1)
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4", help="comma-separated world sizes (default 4)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated tensor bytes")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth()
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; one rank copies {copy_gbps:.1f} GB/s"
        + ("" if mpich.unavailable() is None else f"; MPICH skipped: {mpich.unavailable()}"))
    sizes = [int(s) for s in args.sizes.split(",")]
    for world_size in (int(n) for n in args.ranks.split(",")):
        frame = sweep(world_size, sizes, copy_gbps)
        columns = [
            "N", "bytes", "impl", "median_us", "p10_us", "p90_us", "busbw_GBps", "floor_us", "x floor",
            "vs gloo"]
        print(frame[columns].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
