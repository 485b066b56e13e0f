"""Allreduce latency on 4 ranks, lab (shm, queue) against gloo in the same run.

    python bench/quick_latency.py                       # ring, 1 KB and 16 MB, 4 ranks
    python bench/quick_latency.py --sizes 1024 1048576 --algorithms ring tree --ranks 4

Timing is taken inside the ranks around each call of a back-to-back loop (the collective itself
keeps the ranks in step; one barrier before the loop), after warm-up calls (Numba, first touch
of buffers); a call's time is the slowest rank's, and the median over calls is reported, with
algbw and busbw (nccl-tests: busbw = algbw·2(N-1)/N).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

import lab
from lab.reference import ensure_gloo, gloo_collective


def time_allreduce(mesh: lab.Mesh, nbytes: int, algorithm: str, iterations: int, warmup: int) -> dict[str, list[int]]:
    """In one rank: per-call durations (ns) of the lab's allreduce and of gloo's."""
    ensure_gloo(mesh)
    x = torch.randn(nbytes // 4)
    durations: dict[str, list[int]] = {"lab": [], "gloo": []}
    for impl in ("lab", "gloo"):
        dist.barrier()
        for i in range(warmup + iterations):
            start = time.perf_counter_ns()
            if impl == "lab":
                lab.allreduce(mesh, x, algorithm=algorithm)
            else:
                gloo_collective(mesh, "allreduce", x)
            elapsed = time.perf_counter_ns() - start
            if i >= warmup:
                durations[impl].append(elapsed)
            x.mul_(0.25)  # keep values bounded
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 16 * 1024 * 1024], help="bytes")
    parser.add_argument("--algorithms", nargs="+", default=["ring"])
    parser.add_argument("--transports", nargs="+", default=["shm", "queue"])
    args = parser.parse_args()
    n = args.ranks
    print(f"allreduce float32, {n} ranks; median over calls of the slowest rank's time")
    print(f"{'transport':>9} {'algorithm':>9} {'bytes':>10} {'lab µs':>10} {'gloo µs':>10} {'gloo/lab':>8} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10}")
    for transport in args.transports:
        with lab.launch(n, transport=transport) as cluster:
            for nbytes in args.sizes:
                iterations = 50 if nbytes <= 1 << 20 else 10
                for algorithm in args.algorithms:
                    per_rank = cluster.run(time_allreduce, nbytes, algorithm, iterations, 3)
                    med = {impl: float(np.median(np.max([r[impl] for r in per_rank], axis=0))) / 1e3
                           for impl in ("lab", "gloo")}
                    algbw = nbytes / (med["lab"] * 1e3)
                    print(f"{transport:>9} {algorithm:>9} {nbytes:>10} {med['lab']:>10.1f} {med['gloo']:>10.1f} "
                          f"{med['gloo'] / med['lab']:>8.2f} {algbw:>10.3f} {algbw * 2 * (n - 1) / n:>10.3f}")


if __name__ == "__main__":
    main()
