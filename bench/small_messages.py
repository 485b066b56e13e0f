"""Small messages: the per-call cost of a 1 KB allreduce, and the context switches it causes.

    python bench/small_messages.py                          # 1, 2, 4, 8 ranks, each allreduce algorithm
    python bench/small_messages.py --ranks 4 --algorithms recursive_doubling tree --calls 3000
    python bench/small_messages.py --ranks 2 --bytes 4096 --eager-bytes 0  # rendezvous only
    python bench/small_messages.py --ranks 2 4 8 --spin 0 50   # wait strategies, alternating rounds

Per case: the median over calls of the slowest rank's time per call (like lab.benchmark), and the
context switches (voluntary + involuntary, from /proc/self/status) per call, averaged over ranks.
Configurations (``--spin``: ``LAB_SHM_SPIN``, polls before a wait blocks; ``--eager-bytes``) each get
a pool, and rounds alternate between them: timings on shared cores are noisy, and alternating
spreads the noise over all of them alike.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import lab


def _switches() -> int:
    with open("/proc/self/status") as status:
        return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)


def time_calls(mesh: lab.Mesh, algorithm: str, nbytes: int, calls: int) -> tuple[list[int], int]:
    """In one rank: ns per call of ``calls`` allreduces, and the context switches they cost."""
    x = torch.arange(max(nbytes // 4, 1), dtype=torch.float32) + mesh.rank
    for _ in range(50):  # warm-up: Numba dispatch, first touch
        lab.allreduce(mesh, x, algorithm=algorithm)
        x.mul_(1.0 / mesh.world_size)
    lab.barrier(mesh)
    durations = []
    before = _switches()
    for _ in range(calls):
        start = time.perf_counter_ns()
        lab.allreduce(mesh, x, algorithm=algorithm)
        durations.append(time.perf_counter_ns() - start)
        x.mul_(1.0 / mesh.world_size)
    return durations, _switches() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--algorithms", nargs="+", default=["recursive_doubling", "tree"])
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the configurations")
    parser.add_argument("--spin", nargs="+", default=[None], help="LAB_SHM_SPIN values to compare")
    parser.add_argument("--eager-bytes", type=int, nargs="+", default=[None],
                        help="shm eager thresholds to compare (default: lab's)")
    args = parser.parse_args()
    print(f"{'ranks':>5} {'algorithm':>18} {'spin':>5} {'eager':>5} {'median µs':>10} {'p10':>7} {'p90':>7} "
          f"{'switches/call':>13}   (median of each round)")
    for world in args.ranks:
        # One pool per configuration, all open at once; rounds alternate between them, so a burst
        # of load from elsewhere on the machine hits every configuration alike.
        pools = {}
        for spin in args.spin:
            for eager in args.eager_bytes:
                if spin is not None:
                    os.environ["LAB_SHM_SPIN"] = spin  # the ranks take the caller's environment
                pools[spin, eager] = lab.launch(world, **({} if eager is None else {"eager_bytes": eager}))
        try:
            results: dict = {}
            for _ in range(args.rounds):
                for key, cluster in pools.items():
                    for algorithm in args.algorithms:
                        out = cluster.run(time_calls, algorithm, args.bytes, args.calls)
                        results.setdefault((key, algorithm), []).append(out)
            for ((spin, eager), algorithm), rounds in results.items():
                per_round = [np.median(np.max(np.array([d for d, _ in out], dtype=np.float64), axis=0)) / 1e3
                             for out in rounds]
                slowest = np.concatenate([np.max(np.array([d for d, _ in out], dtype=np.float64), axis=0)
                                          for out in rounds]) / 1e3
                switches = np.mean([s for out in rounds for _, s in out]) / args.calls
                print(f"{world:>5} {algorithm:>18} {spin or '-':>5} {eager if eager is not None else '-':>5} "
                      f"{np.median(slowest):>10.1f} {np.percentile(slowest, 10):>7.1f} "
                      f"{np.percentile(slowest, 90):>7.1f} {switches:>13.2f}   "
                      f"({', '.join(f'{m:.0f}' for m in per_round)})", flush=True)
        finally:
            for cluster in pools.values():
                cluster.close()
            os.environ.pop("LAB_SHM_SPIN", None)


if __name__ == "__main__":
    main()
