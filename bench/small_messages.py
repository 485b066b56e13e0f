"""Small messages: the per-call cost of a 1 KB allreduce, and the context switches it causes.

    python bench/small_messages.py                          # 1, 2, 4, 8 ranks, each allreduce algorithm
    python bench/small_messages.py --ranks 4 --algorithms recursive_doubling tree --calls 3000
    python bench/small_messages.py --ranks 2 --bytes 4096 --eager-bytes 0  # rendezvous only
    python bench/small_messages.py --ranks 2 4 8 --spin 0 50   # Python-path wait strategies, alternating rounds
    python bench/small_messages.py --ranks 4 --impls plan --algorithms auto --compiled-wait 500,8 0,0 50,100000
    python bench/small_messages.py --ranks 4 --impls lab python plan mpich gloo --algorithms auto
    python bench/small_messages.py --ranks 2 --impls lab plan --algorithms one_shot two_shot auto  # one-shot's compiled call
    python bench/small_messages.py --compare --calls 300    # what docs/compiled.md "Measured" shows
    python bench/small_messages.py --compare --parts sweep --ranks 8  # one part of it, on 8 ranks

Per case: the median over calls of the slowest rank's time per call (like lab.benchmark), and the
context switches (voluntary + involuntary, from /proc/self/status) per call, averaged over ranks.
Configurations (``--spin``: ``LAB_SHM_SPIN``, polls before a Python-path wait blocks;
``--compiled-wait S,Y``: ``LAB_COMPILED_SPIN=S LAB_COMPILED_YIELD=Y``, the compiled path's spins
and yields before it naps; ``--eager-bytes``) each get
a pool, and rounds alternate between them: timings on shared cores are noisy, and alternating
spreads the noise over all of them alike.

``--impls`` (default ``lab``) picks what runs, each case in every round:

- ``lab``: the plain call ``lab.allreduce(mesh, x, algorithm=A)`` for each of ``--algorithms``, in a
  pool whose ranks take ``LAB_COMPILED_MAX_BYTES=--compiled-max-bytes`` (default: lab's, 64 KiB):
  the compiled data plane where the algorithm is compilable and the tensor small enough;
- ``python``: the same call with the compiled path off (``LAB_COMPILED_MAX_BYTES=0``, a pool of
  its own), for each of ``--python-algorithms`` (default: ``--algorithms``); the summary takes the
  fastest of them as "python best";
- ``plan``: ``plan = lab.allreduce_init(mesh, x, algorithm=A)`` once, then ``plan()`` per call,
  in the ``lab`` pool;
- ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend, in the same rank processes;
- ``mpich``: ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` through mpi4py under ``mpiexec`` (the
  ``peers`` extra; MPICH's ranks are new processes each round, started with numpy and mpi4py only,
  and time every size of the round in one launch).

``compiled/call`` says how many collectives per call took the compiled path
(``mesh.stats()["collectives_compiled"]``): 1 for a compiled call, 0 for the Python path. Each
case checks its result once against the exact sum before timing (any mismatch stops the run).
With several impls a summary follows: per ranks and size, each one's median as a ratio to
MPICH's and to gloo's medians in the same run, and the compiled call against the best Python path.

``--compare`` runs the comparison of docs/compiled.md in three parts (``--parts``): ``head``, at 2,
4 and 8 ranks a 1 KB allreduce through ``lab`` (``auto``), ``python`` (``auto``,
``recursive_doubling``, ``tree``), ``plan``, MPICH and gloo; ``sweep``, 1 KB to 256 KB of ``lab``
(threshold raised to 256 KiB, so every size runs compiled) against ``python``; ``one``, on 1 rank
(no communication: the per-call Python cost) the plain call against the plan. ``--compare``
runs the default waiting policy; ``--compiled-wait`` compares others.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import lab
from lab import mpich
from lab.reference import ensure_gloo

IMPLS = ("lab", "python", "plan", "gloo", "mpich")
WARMUP = 50  # calls before timing: Numba dispatch, first touch


def _switches() -> int:
    with open("/proc/self/status") as status:
        return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)


def _check(x: torch.Tensor, world_size: int, what: str) -> None:
    """``x`` holds the sum of every rank's ``arange(n) + rank`` (exact in float32 for these sizes)."""
    n = x.numel()
    expected = torch.arange(n, dtype=torch.float32) * world_size + world_size * (world_size - 1) / 2
    if not torch.equal(x, expected):
        bad = int((x != expected).nonzero()[0, 0])
        raise AssertionError(f"{what} of {4 * n} bytes on {world_size} ranks: element {bad} is "
                             f"{float(x[bad])}, expected {float(expected[bad])}")


def time_calls(mesh: lab.Mesh, algorithm: str, nbytes: int, calls: int,
               impl: str = "lab") -> tuple[list[int], int, int]:
    """In one rank: ns per call of ``calls`` allreduces through ``impl`` (``lab``/``python``: the
    plain call; ``plan``; ``gloo``), the context switches they cost, and how many ran compiled."""
    numel = max(nbytes // 4, 1)
    x = torch.arange(numel, dtype=torch.float32) + mesh.rank
    if impl == "gloo":
        ensure_gloo(mesh)
        dist.all_reduce(x)
        _check(x, mesh.world_size, "gloo's allreduce")

        def call() -> None:
            dist.all_reduce(x)
    elif impl == "plan":
        plan = lab.allreduce_init(mesh, x, algorithm=algorithm)
        plan()
        _check(x, mesh.world_size, f"a plan ({plan.algorithm})")
        call = plan
    else:
        lab.allreduce(mesh, x, algorithm=algorithm)
        _check(x, mesh.world_size, f"the lab's allreduce ({algorithm})")

        def call() -> None:
            lab.allreduce(mesh, x, algorithm=algorithm)

    for _ in range(WARMUP):
        call()
        x.mul_(1.0 / mesh.world_size)
    if impl == "gloo":
        dist.barrier()
    else:
        lab.barrier(mesh)
    compiled = mesh.stats()["collectives_compiled"]
    durations = []
    before = _switches()
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        durations.append(time.perf_counter_ns() - start)
        x.mul_(1.0 / mesh.world_size)
    switches = _switches() - before
    compiled = mesh.stats()["collectives_compiled"] - compiled
    if impl == "plan":
        plan.free()
    return durations, switches, compiled


def mpich_rank(sizes: list[int], calls: int, warmup: int) -> None:
    """Inside each MPI rank (run from its source with ``python -c``: numpy and mpi4py only, no
    torch, no lab, so that mpiexec's ranks start in a second): per size the ns of each call, the
    context switches; rank 0 prints every rank's as JSON."""
    import json
    import time

    import numpy as np
    from mpi4py import MPI

    def switches() -> int:
        with open("/proc/self/status") as status:
            return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)

    comm = MPI.COMM_WORLD
    n = comm.size
    out = []
    for nbytes in sizes:
        x = np.arange(max(nbytes // 4, 1), dtype=np.float32) + comm.rank
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        expected = np.arange(x.size, dtype=np.float32) * n + n * (n - 1) / 2
        if not np.array_equal(x, expected):
            raise AssertionError(f"MPICH's allreduce of {nbytes} bytes on {n} ranks: wrong result")
        for _ in range(warmup):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            x *= np.float32(1.0 / n)
        comm.Barrier()
        durations = []
        before = switches()
        for _ in range(calls):
            start = time.perf_counter_ns()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            durations.append(time.perf_counter_ns() - start)
            x *= np.float32(1.0 / n)
        out.append((durations, switches() - before, None))
    gathered = comm.gather(out)
    if comm.rank == 0:
        print(json.dumps(gathered), flush=True)


def run_mpich(world: int, sizes: list[int], calls: int) -> dict[int, list]:
    """MPICH's allreduce at each size on ``world`` new ranks: per size, every rank's
    ``(durations, switches, None)`` (the shape :func:`time_calls` returns)."""
    source = inspect.getsource(mpich_rank) + f"\nmpich_rank({sizes!r}, {calls}, {WARMUP})\n"
    command = [mpich._mpiexec(), "-n", str(world), sys.executable, "-c", source]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mpiexec failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    per_rank = json.loads(done.stdout.strip().splitlines()[-1])  # [rank][size] -> (durations, switches, None)
    return {nbytes: [per_rank[r][i] for r in range(world)] for i, nbytes in enumerate(sizes)}


def _slowest(out: list) -> np.ndarray:
    """Per call, the slowest rank's µs."""
    return np.max(np.array([d for d, _, _ in out], dtype=np.float64), axis=0) / 1e3


def _launch(world: int, eager: int | None, environment: dict[str, str]) -> lab.Cluster:
    """A pool whose ranks see ``environment`` on top of ours."""
    return lab.launch(world, env=environment, **({} if eager is None else {"eager_bytes": eager}))


def measure(args: argparse.Namespace, world: int) -> dict:
    """Every case of ``args`` on ``world`` ranks, in alternating rounds: ``{(case, nbytes): [out per round]}``,
    a case being ``(impl, algorithm, spin, eager)``."""
    # One pool per configuration, all open at once; rounds alternate between them, so a burst
    # of load from elsewhere on the machine hits every configuration alike.
    compiled_max = {} if args.compiled_max_bytes is None else {
        "LAB_COMPILED_MAX_BYTES": str(args.compiled_max_bytes)}
    thresholds = {
        "lab": compiled_max, "plan": compiled_max, "gloo": compiled_max,
        "python": {"LAB_COMPILED_MAX_BYTES": "0"}}
    waits = [(spin, wait) for spin in args.spin for wait in args.compiled_wait]
    first = (waits[0], args.eager_bytes[0])
    pools, cases, results = {}, [], {}
    try:
        for spin, wait in waits:
            for eager in args.eager_bytes:
                for impl in args.impls:
                    if impl in ("mpich", "gloo") and ((spin, wait), eager) != first:
                        continue  # neither reads the lab's settings
                    if impl == "mpich":
                        cases.append((("mpich", "mpich", None, None), None))
                        continue
                    environment = {**({} if spin is None else {"LAB_SHM_SPIN": spin}), **thresholds[impl]}
                    if wait is not None:
                        environment["LAB_COMPILED_SPIN"], environment["LAB_COMPILED_YIELD"] = wait.split(",")
                    label = "/".join(filter(None, (spin, wait))) or None
                    key = (eager, *sorted(environment.items()))
                    if key not in pools:
                        pools[key] = _launch(world, eager, environment)
                    algorithms = (["gloo"] if impl == "gloo" else args.python_algorithms or args.algorithms
                                  if impl == "python" else args.algorithms)
                    cases += [((impl, algorithm, label, eager), key) for algorithm in algorithms]
        for _ in range(args.rounds):
            for case, key in cases:
                impl, algorithm, _, _ = case
                if impl == "mpich":
                    for nbytes, out in run_mpich(world, args.bytes, args.calls).items():
                        results.setdefault((case, nbytes), []).append(out)
                    continue
                for nbytes in args.bytes:
                    out = pools[key].run(time_calls, algorithm, nbytes, args.calls, impl)
                    results.setdefault((case, nbytes), []).append(out)
    finally:
        for cluster in pools.values():
            cluster.close()
    return results


def report(args: argparse.Namespace, world: int, results: dict) -> None:
    """One row per case and size; then, with several impls, the ratios (see the module docstring)."""
    medians = {}
    for ((impl, algorithm, spin, eager), nbytes), rounds in results.items():
        per_round = [np.median(_slowest(out)) for out in rounds]
        slowest = np.concatenate([_slowest(out) for out in rounds])
        switches = np.mean([s for out in rounds for _, s, _ in out]) / args.calls
        compiled = [c for out in rounds for _, _, c in out if c is not None]
        medians[impl, algorithm, spin, eager, nbytes] = float(np.median(slowest)), per_round
        print(
            f"{world:>5} {nbytes:>7} {impl:>6} {algorithm:>18} {spin or '-':>13} "
            f"{eager if eager is not None else '-':>5} {np.median(slowest):>10.1f} "
            f"{np.percentile(slowest, 10):>7.1f} {np.percentile(slowest, 90):>8.1f} {switches:>13.2f} "
            f"{np.mean(compiled) / args.calls if compiled else float('nan'):>13.2f}   "
            f"({', '.join(f'{m:.0f}' for m in per_round)})", flush=True)
    if len(args.impls) < 2:
        return
    for nbytes in args.bytes:
        row = {key[:4]: value for key, value in medians.items() if key[4] == nbytes}
        refs = {name: value for name in ("mpich", "gloo") for key, value in row.items() if key[0] == name}
        python = {key: value for key, value in row.items() if key[0] == "python"}
        best = min(python.items(), key=lambda item: item[1][0]) if python else None
        for (impl, algorithm, spin, eager), (median, per_round) in row.items():
            if impl in ("mpich", "gloo"):
                continue
            ratios = []
            for name, (ref, ref_rounds) in refs.items():
                ratios.append(f"/{name} {median / ref:6.2f}x "
                              f"({', '.join(f'{a / b:.2f}' for a, b in zip(per_round, ref_rounds))})")
            if best and impl != "python":
                (_, best_algorithm, *_), (ref, ref_rounds) = best
                ratios.append(f"/python best ({best_algorithm}) {median / ref:5.2f}x "
                              f"({', '.join(f'{a / b:.2f}' for a, b in zip(per_round, ref_rounds))})")
            elif impl == "python" and best and (impl, algorithm, spin, eager) == best[0]:
                ratios.append("<- python best")
            print(
                f"  ratio {world:>2} ranks {nbytes:>7} B {impl:>6} {algorithm:>18}"
                f"{'' if spin is None else f' wait {spin}'}{'' if eager is None else f' eager {eager}'}: "
                f"{median:8.1f} µs  {'  '.join(ratios)}", flush=True)


def header(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
        f"{args.calls} calls x {args.rounds} rounds", flush=True)
    print(
        f"{'ranks':>5} {'bytes':>7} {'impl':>6} {'algorithm':>18} {'wait':>13} {'eager':>5} {'median µs':>10} "
        f"{'p10':>7} {'p90':>8} {'switches/call':>13} {'compiled/call':>13}   (median of each round)",
        flush=True)


def _without_missing(impls: list[str]) -> list[str]:
    """``impls`` less MPICH where it cannot run here (saying why)."""
    reason = mpich.unavailable() if "mpich" in impls else None
    if reason:
        print(f"# MPICH skipped: {reason}", flush=True)
    return [impl for impl in impls if impl != "mpich" or not reason]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="default: 1 2 4 8")
    parser.add_argument("--algorithms", nargs="+", default=["recursive_doubling", "tree"])
    parser.add_argument("--python-algorithms", nargs="+", default=None,
                        help="algorithms of the python impl (default: --algorithms)")
    parser.add_argument("--bytes", type=int, nargs="+", default=[1024])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the configurations")
    parser.add_argument("--impls", nargs="+", default=["lab"], choices=IMPLS, help="what to time (see above)")
    parser.add_argument("--compiled-max-bytes", type=int, default=None,
                        help="LAB_COMPILED_MAX_BYTES of the lab and plan pools (default: lab's)")
    parser.add_argument("--spin", nargs="+", default=[None], help="LAB_SHM_SPIN values to compare")
    parser.add_argument("--compiled-wait", nargs="+", default=[None], metavar="SPIN,YIELD",
                        help="compiled waiting policies to compare (LAB_COMPILED_SPIN,LAB_COMPILED_YIELD)")
    parser.add_argument("--eager-bytes", type=int, nargs="+", default=[None],
                        help="shm eager thresholds to compare (default: lab's)")
    parser.add_argument("--compare", action="store_true",
                        help="the comparison of docs/compiled.md (ignores --algorithms, --bytes, --impls)")
    parser.add_argument(
        "--parts", nargs="+", default=["head", "sweep", "one"], choices=["head", "sweep", "one"],
        help="with --compare: which of its parts to run (--ranks replaces head's and sweep's)")
    args = parser.parse_args()
    if not args.compare:
        args.ranks = args.ranks or [1, 2, 4, 8]
        args.impls = _without_missing(args.impls)
        header(args)
        for world in args.ranks:
            report(args, world, measure(args, world))
        return
    python_algorithms = ["auto", "recursive_doubling", "tree"]
    parts = {
        "head": ("1 KB allreduce: compiled plain call, Python path, plan, MPICH, gloo", {
            "ranks": [2, 4, 8], "bytes": [1024], "impls": ["lab", "python", "plan", "mpich", "gloo"],
            "algorithms": ["auto"], "python_algorithms": python_algorithms, "compiled_max_bytes": None}),
        "sweep": ("size sweep: compiled (threshold raised to 256 KiB) against the Python path", {
            "ranks": [2, 4, 8], "bytes": [1024, 4096, 16384, 65536, 262144], "impls": ["lab", "python"],
            "algorithms": ["auto"], "python_algorithms": python_algorithms, "compiled_max_bytes": 262144}),
        "one": ("1 rank (no communication): the per-call Python cost, plain call against plan", {
            "ranks": [1], "bytes": [1024], "impls": ["lab", "plan"], "algorithms": ["auto"],
            "python_algorithms": None, "compiled_max_bytes": None})}
    for name in args.parts:
        title, settings = parts[name]
        if args.ranks is not None and name != "one":
            settings = {**settings, "ranks": args.ranks}
        part = argparse.Namespace(**{**vars(args), **settings})
        print(f"\n## {title}", flush=True)
        part.impls = _without_missing(part.impls)
        header(part)
        for world in part.ranks:
            report(part, world, measure(part, world))


if __name__ == "__main__":
    main()
