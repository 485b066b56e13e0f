"""The pipelined double tree against ring and tree: on shm ranks, and simulated at 1,024 ranks.

    python bench/double_tree.py shm                       # 4 ranks, 1 MB and 16 MB, 5 rounds
    python bench/double_tree.py shm --ranks 4 8 --sizes 1048576 16777216 --rounds 7 --calls 5
    python bench/double_tree.py sim                       # 1,024 ranks, α 5 µs, 100 Gbit/s
    python bench/double_tree.py sim --ranks 256 --alpha-us 20 --gbit 10

``shm``: one pool per world size; each round runs every size and algorithm (in that order, rounds
alternating, so the noise of shared cores spreads over all of them alike): a checked call, one
warm-up call, then ``--calls`` timed calls, each after a barrier; a call's time is the slowest
rank's. Per case: the median over every timed call, and double tree's ratio to ring and to tree
in the same run. The load average is printed before and after: on a busy machine, trust ratios,
not absolute times.

``sim``: :func:`lab.sim.simulate` of each algorithm at each size (1 KB to 64 MB), its time and
double tree's ratio to ring and to tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import lab
import lab.sim

ALGORITHMS = ("double_tree", "ring", "tree")


def timed_calls(mesh: lab.Mesh, algorithm: str, nbytes: int, calls: int) -> list[int]:
    """In one rank: check one call, warm up once, then ns per call of ``calls`` allreduces."""
    n = mesh.world_size
    x = torch.arange(nbytes // 4, dtype=torch.float32) + mesh.rank
    lab.allreduce(mesh, x, algorithm=algorithm)
    expected = torch.arange(nbytes // 4, dtype=torch.float32) * n + n * (n - 1) / 2
    if not torch.equal(x, expected):
        raise AssertionError(f"{algorithm} on {n} ranks, {nbytes} bytes: wrong result")
    lab.allreduce(mesh, x, algorithm=algorithm)
    durations = []
    for _ in range(calls):
        lab.barrier(mesh)
        start = time.perf_counter_ns()
        lab.allreduce(mesh, x, algorithm=algorithm)
        durations.append(time.perf_counter_ns() - start)
    return durations


def shm(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()}")
    for ranks in args.ranks:
        medians_ms: dict[tuple[int, str], list[float]] = {}
        with lab.launch(ranks, transport="shm") as cluster:
            for _ in range(args.rounds):
                for nbytes in args.sizes:
                    for algorithm in ALGORITHMS:
                        per_rank = cluster.run(timed_calls, algorithm, nbytes, args.calls)
                        slowest = [max(call) / 1e6 for call in zip(*per_rank)]
                        medians_ms.setdefault((nbytes, algorithm), []).extend(slowest)
        for nbytes in args.sizes:
            ms = {a: statistics.median(medians_ms[nbytes, a]) for a in ALGORITHMS}
            print(
                f"N={ranks} {nbytes:>10,} B  " + "  ".join(f"{a} {ms[a]:8.2f} ms" for a in ALGORITHMS) +
                f"   double_tree/ring {ms['double_tree'] / ms['ring']:.2f}"
                f"  double_tree/tree {ms['double_tree'] / ms['tree']:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")


def sim(args: argparse.Namespace) -> None:
    network = lab.sim.Network(alpha_us=args.alpha_us, gbit=args.gbit)
    for ranks in args.ranks:
        for nbytes in args.sizes:
            us = {
                a: lab.sim.simulate("allreduce", a, world_size=ranks, nbytes=nbytes, network=network).time_us
                for a in ALGORITHMS}
            print(
                f"N={ranks} {nbytes:>10,} B  " + "  ".join(f"{a} {us[a]:10.1f} us" for a in ALGORITHMS) +
                f"   double_tree/ring {us['double_tree'] / us['ring']:.2f}"
                f"  double_tree/tree {us['double_tree'] / us['tree']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("where", choices=["shm", "sim"])
    parser.add_argument("--ranks", type=int, nargs="+")
    parser.add_argument("--sizes", type=int, nargs="+", help="bytes per rank's tensor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per case and round")
    parser.add_argument("--alpha-us", type=float, default=5.0)
    parser.add_argument("--gbit", type=float, default=100.0)
    args = parser.parse_args()
    if args.where == "shm":
        args.ranks, args.sizes = args.ranks or [4], args.sizes or [1 << 20, 16 << 20]
        shm(args)
    else:
        args.ranks, args.sizes = args.ranks or [1024], args.sizes or [
            1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
        sim(args)


if __name__ == "__main__":
    main()
