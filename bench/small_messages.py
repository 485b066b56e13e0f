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
    python bench/small_messages.py --compare --parts timing   # 2 ranks, back to back and after a barrier
    python bench/small_messages.py --compare --parts shared   # the same beside a busy loop, per waiting policy
    python bench/small_messages.py --ranks 2 --impls lab plan symm mpich --algorithms auto one_shot \
        --timing back-to-back after-barrier --burn 1 --compiled-wait default spin yield sleep

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
- ``symm``: ``lab.symm_mem.one_shot_all_reduce_out(buf, "sum", mesh, out)`` from a buffer of
  ``lab.symm_mem.empty`` (read in place by the peers, the sum written into ``out``), in the ``lab``
  pool (its algorithm is one_shot whatever ``--algorithms`` says);
- ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend, in the same rank processes;
- ``mpich``: ``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` through mpi4py under ``mpiexec`` (the
  ``peers`` extra; MPICH's ranks are new processes each round, started with numpy and mpi4py only,
  and time every size and timing of the round in one launch).

``compiled/call`` says how many collectives per call took the compiled path
(``mesh.stats()["collectives_compiled"]``, less the barriers' after a barrier): 1 for a compiled
call, 0 for the Python path. Each case checks its result once against the exact sum before timing
(any mismatch stops the run).
With several impls a summary follows: per ranks and size, each one's median as a ratio to
MPICH's and to gloo's medians in the same run, and the compiled call against the best Python path.

``--timing`` (default ``back-to-back``) says how a call is timed:

- ``back-to-back``: the calls in a loop, each timed on each rank; per call the longest of the
  ranks' times. A rank that leaves a call early starts the next one early, so a call's time can
  hold the previous call's skew, and a pipelined implementation overlaps calls;
- ``after-barrier``: before each call every rank meets in a barrier (``lab.barrier``; gloo's
  ``dist.barrier``; ``MPI_Barrier`` in MPICH's launch), then one call is timed. A barrier lets its
  ranks out at different times, and the rank out first would wait in the call for the last one; so
  a call's time here is the span from the **last rank's start** to the **last rank's return**, read
  on the one clock every rank shares (``time.perf_counter_ns``, the machine's ``CLOCK_MONOTONIC``:
  the ranks run on one machine). It holds the whole call of the last rank to enter and whatever
  the other ranks still do after it (no rank can return before the last one has entered). The
  table also shows the longest of the ranks' own times (exit skew included), and context switches
  per call count the barrier's.

With ``after-barrier`` a table follows per ranks and size, one row per case: the median µs back
to back and after a barrier, each with its ratio to MPICH's in the same column, and the longest
own time after a barrier. ``--burn N`` runs N busy loops (a Python process each, started before
the pools and killed after the last round) while a world size is timed: the other work that takes
a core. ``--compiled-wait`` takes names: ``spin`` (10^12 spins: never yields), ``yield`` (no spin,
10^12 yields: never naps), ``sleep`` (``0,0``: blocks on the futex at once), ``default`` (the lab's).
The compiled waiting policy governs the compiled plane's waits (plain call, plan, ``lab.barrier``);
``LAB_SHM_SPIN`` (``--spin``) the Python path's (``python``); the one-shot's waits (on two-shot's
counters, ``kernels/two_shot.py``) read neither and spin, yield, then nap with fixed counts.

``--compare`` runs the comparison of docs/compiled.md in four parts (``--parts``): ``head``, at 2,
4 and 8 ranks a 1 KB allreduce through ``lab`` (``auto``), ``python`` (``auto``,
``recursive_doubling``, ``tree``), ``plan``, MPICH and gloo; ``sweep``, 1 KB to 256 KB of ``lab``
(threshold raised to 256 KiB, so every size runs compiled) against ``python``; ``one``, on 1 rank
(no communication: the per-call Python cost) the plain call against the plan; ``timing``, 1 KB on
2 ranks through ``lab`` and ``plan`` (``auto`` and ``one_shot``), ``symm`` and MPICH, both timings
and their table. Each runs the default waiting policy; ``--compiled-wait`` compares others, and
the part ``shared`` (not run unless named) is ``timing`` with one busy loop running, under the
policies ``default``, ``spin``, ``yield`` and ``sleep``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import lab
from lab import mpich
from lab.reference import ensure_gloo

IMPLS = ("lab", "python", "plan", "symm", "gloo", "mpich")
TIMINGS = ("back-to-back", "after-barrier")
#: ``--compiled-wait`` by name: LAB_COMPILED_SPIN,LAB_COMPILED_YIELD (a count that never runs out)
WAIT_POLICIES = {"spin": "1000000000000,0", "yield": "0,1000000000000", "sleep": "0,0"}
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


def _operands(mesh: lab.Mesh, algorithm: str, nbytes: int, impl: str) -> tuple:
    """In one rank: the tensor ``impl`` reduces, checked once against the exact sum, the call to
    time, a barrier for it, and the tensor to scale back after each call (the result)."""
    numel = max(nbytes // 4, 1)
    x = torch.arange(numel, dtype=torch.float32) + mesh.rank
    if impl == "gloo":
        ensure_gloo(mesh)
        dist.all_reduce(x)
        _check(x, mesh.world_size, "gloo's allreduce")
        return (lambda: dist.all_reduce(x)), dist.barrier, x
    barrier = partial(lab.barrier, mesh)
    if impl == "symm":  # out of place from a symmetric buffer: x stays, out takes the sum
        source = lab.symm_mem.empty(mesh, (numel,), torch.float32)
        source.copy_(x)
        out = torch.empty_like(source)
        lab.symm_mem.one_shot_all_reduce_out(source, "sum", mesh, out)
        _check(out, mesh.world_size, "lab.symm_mem.one_shot_all_reduce_out")
        return (lambda: lab.symm_mem.one_shot_all_reduce_out(source, "sum", mesh, out)), barrier, out
    if impl == "plan":
        plan = lab.allreduce_init(mesh, x, algorithm=algorithm)
        plan()
        _check(x, mesh.world_size, f"a plan ({plan.algorithm})")
        return plan, barrier, x
    lab.allreduce(mesh, x, algorithm=algorithm)
    _check(x, mesh.world_size, f"the lab's allreduce ({algorithm})")
    return (lambda: lab.allreduce(mesh, x, algorithm=algorithm)), barrier, x


def time_calls(mesh: lab.Mesh, algorithm: str, nbytes: int, calls: int, impl: str = "lab",
               timing: str = "back-to-back") -> tuple[list[int], int, int, list[int] | None]:
    """In one rank: ns per call of ``calls`` allreduces through ``impl`` (``lab``/``python``: the
    plain call; ``plan``; ``symm``; ``gloo``), the context switches they cost, how many ran
    compiled, and (``timing="after-barrier"``: each call alone, after a barrier) when each began."""
    call, barrier, result = _operands(mesh, algorithm, nbytes, impl)
    for _ in range(WARMUP):
        call()
        result.mul_(1.0 / mesh.world_size)
    barrier()
    before_barrier = mesh.stats()["collectives_compiled"]
    barrier()
    compiled = mesh.stats()["collectives_compiled"]
    barriers = (compiled - before_barrier) * calls if timing == "after-barrier" else 0  # not the call's
    durations, starts = [], []
    before = _switches()
    for _ in range(calls):
        if timing == "after-barrier":
            barrier()
        start = time.perf_counter_ns()
        call()
        durations.append(time.perf_counter_ns() - start)
        starts.append(start)
        result.mul_(1.0 / mesh.world_size)
    switches = _switches() - before
    compiled = mesh.stats()["collectives_compiled"] - compiled - barriers
    if impl == "plan":
        call.free()
    return durations, switches, compiled, starts if timing == "after-barrier" else None


def mpich_rank(sizes: list[int], calls: int, warmup: int, timings: list[str]) -> None:
    """Inside each MPI rank (run from its source with ``python -c``: numpy and mpi4py only, no
    torch, no lab, so that mpiexec's ranks start in a second): per size and timing the ns of each
    call, the context switches, when each call began (after-barrier: ``MPI_Barrier`` before each
    ``MPI_Allreduce``); rank 0 prints every rank's as JSON."""
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
        for timing in timings:
            comm.Barrier()
            durations, starts = [], []
            before = switches()
            for _ in range(calls):
                if timing == "after-barrier":
                    comm.Barrier()
                start = time.perf_counter_ns()
                comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
                durations.append(time.perf_counter_ns() - start)
                starts.append(start)
                x *= np.float32(1.0 / n)
            out.append((durations, switches() - before, None, starts if timing == "after-barrier" else None))
    gathered = comm.gather(out)
    if comm.rank == 0:
        print(json.dumps(gathered), flush=True)


def run_mpich(world: int, sizes: list[int], calls: int, timings: list[str]) -> dict[tuple[int, str], list]:
    """MPICH's allreduce at each size and timing on ``world`` new ranks: per ``(size, timing)``,
    every rank's ``(durations, switches, None, starts)`` (the shape :func:`time_calls` returns)."""
    source = inspect.getsource(mpich_rank) + f"\nmpich_rank({sizes!r}, {calls}, {WARMUP}, {timings!r})\n"
    command = [mpich._mpiexec(), "-n", str(world), sys.executable, "-c", source]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mpiexec failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    per_rank = json.loads(done.stdout.strip().splitlines()[-1])  # [rank][size, timing] -> out
    cases = [(nbytes, timing) for nbytes in sizes for timing in timings]
    return {case: [per_rank[r][i] for r in range(world)] for i, case in enumerate(cases)}


def _slowest(out: list, own: bool = False) -> np.ndarray:
    """Per call, the slowest rank's µs: back to back (or ``own``), the longest of the ranks' times;
    after a barrier, from the last rank's start to the last rank's return (one clock: the ranks
    share the machine's ``CLOCK_MONOTONIC``), so the barrier's exit skew is not in it."""
    durations = np.array([d for d, *_ in out], dtype=np.float64)
    if own or out[0][3] is None:
        return durations.max(axis=0) / 1e3
    starts = np.array([s for *_, s in out], dtype=np.float64)
    return ((starts + durations).max(axis=0) - starts.max(axis=0)) / 1e3


def _launch(world: int, eager: int | None, environment: dict[str, str]) -> lab.Cluster:
    """A pool whose ranks see ``environment`` on top of ours."""
    return lab.launch(world, env=environment, **({} if eager is None else {"eager_bytes": eager}))


def _cases(args: argparse.Namespace, world: int, pools: dict) -> list:
    """Every ``(case, pool key)`` of ``args``, opening a pool per configuration into ``pools``; a
    case is ``(impl, algorithm, wait label, eager)`` (MPICH's pool key None: it starts its own)."""
    compiled_max = {} if args.compiled_max_bytes is None else {
        "LAB_COMPILED_MAX_BYTES": str(args.compiled_max_bytes)}
    python = {"LAB_COMPILED_MAX_BYTES": "0"}
    waits = [(spin, wait) for spin in args.spin for wait in args.compiled_wait]
    first = (waits[0], args.eager_bytes[0])
    cases = []
    for spin, wait in waits:
        for eager in args.eager_bytes:
            for impl in args.impls:
                if impl in ("mpich", "gloo") and ((spin, wait), eager) != first:
                    continue  # neither reads the lab's settings
                if impl == "mpich":
                    cases.append((("mpich", "mpich", None, None), None))
                    continue
                environment = {
                    **({} if spin is None else {"LAB_SHM_SPIN": spin}),
                    **(python if impl == "python" else compiled_max)}
                if wait not in (None, "default"):
                    spins_yields = WAIT_POLICIES.get(wait, wait).split(",")
                    environment["LAB_COMPILED_SPIN"], environment["LAB_COMPILED_YIELD"] = spins_yields
                label = "/".join(filter(None, (spin, wait))) or None
                key = (eager, *sorted(environment.items()))
                if key not in pools:
                    pools[key] = _launch(world, eager, environment)
                algorithms = (
                    ["gloo"] if impl == "gloo" else ["one_shot"] if impl == "symm" else
                    args.python_algorithms or args.algorithms if impl == "python" else args.algorithms)
                cases += [((impl, algorithm, label, eager), key) for algorithm in algorithms]
    return cases


def measure(args: argparse.Namespace, world: int) -> dict:
    """Every case of ``args`` on ``world`` ranks, in alternating rounds: ``{(case, nbytes, timing):
    [out per round]}``, a case being ``(impl, algorithm, wait, eager)``."""
    # One pool per configuration, all open at once; rounds alternate between them, so a burst
    # of load from elsewhere on the machine hits every configuration alike.
    pools, results = {}, {}
    try:
        cases = _cases(args, world, pools)
        for _ in range(args.rounds):
            for case, key in cases:
                impl, algorithm, _, _ = case
                if impl == "mpich":
                    for (nbytes, timing), out in run_mpich(world, args.bytes, args.calls,
                                                           args.timing).items():
                        results.setdefault((case, nbytes, timing), []).append(out)
                    continue
                for nbytes in args.bytes:
                    for timing in args.timing:
                        out = pools[key].run(time_calls, algorithm, nbytes, args.calls, impl, timing)
                        results.setdefault((case, nbytes, timing), []).append(out)
    finally:
        for cluster in pools.values():
            cluster.close()
    return results


@contextmanager
def burning(processes: int) -> Iterator[list[subprocess.Popen]]:
    """``processes`` busy loops (a Python process each, spinning wherever the scheduler puts it)
    while the block runs: the other work that takes a core. Yields them; each is killed and
    reaped when the block ends, however it ends."""
    burners = []
    try:
        for _ in range(processes):
            burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield burners
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def report(args: argparse.Namespace, world: int, results: dict) -> None:
    """Per timing, one row per case and size and, with several impls, the ratios (see the module
    docstring); then, where a call was timed after a barrier, the table of both timings."""
    for timing in args.timing:
        if timing != "back-to-back":
            print(
                f"# {world} ranks, each call after a barrier (the span from the last rank's start to the "
                "last rank's return; switches include the barrier's)", flush=True)
        rows(args, world, {(case, nbytes): out
                           for (case, nbytes, each), out in results.items() if each == timing})
    if "after-barrier" in args.timing:
        table(args, world, results)


def rows(args: argparse.Namespace, world: int, results: dict) -> None:
    """One row per case and size of one timing; then, with several impls, the ratios."""
    medians = {}
    for ((impl, algorithm, spin, eager), nbytes), rounds in results.items():
        per_round = [np.median(_slowest(out)) for out in rounds]
        slowest = np.concatenate([_slowest(out) for out in rounds])
        switches = np.mean([s for out in rounds for _, s, *_ in out]) / args.calls
        compiled = [c for out in rounds for _, _, c, _ in out if c is not None]
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


def table(args: argparse.Namespace, world: int, results: dict) -> None:
    """The one table: per size and case, the median µs of the slowest rank back to back and after a
    barrier, each with its ratio to MPICH's in the same column, and after a barrier the longest of
    the ranks' own times (which holds the barrier's exit skew: the rank out first waits for the
    last)."""
    medians = {}
    for (case, nbytes, timing), rounds in results.items():
        medians[case, nbytes, timing] = float(np.median(np.concatenate([_slowest(out) for out in rounds])))
        if timing == "after-barrier":
            own = np.concatenate([_slowest(out, own=True) for out in rounds])
            medians[case, nbytes, "own"] = float(np.median(own))
    for nbytes in args.bytes:
        print(
            f"\n{nbytes} B allreduce on {world} ranks, median µs of the slowest rank per call "
            f"({args.calls} calls x {args.rounds} rounds, load {os.getloadavg()[0]:.2f}):\n"
            "| impl | algorithm | wait | back to back | ÷ MPICH | after a barrier | ÷ MPICH | "
            "after a barrier, own time |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
        cases = list(dict.fromkeys(case for case, size, _ in medians if size == nbytes))
        reference = next((case for case in cases if case[0] == "mpich"), None)
        for case in cases:
            impl, algorithm, wait, eager = case
            cells = [impl, algorithm, " ".join(filter(None, (wait, eager and f"eager {eager}"))) or "-"]
            for timing in ("back-to-back", "after-barrier", "own"):
                value, ref = medians.get((case, nbytes, timing)), medians.get((reference, nbytes, timing))
                cells.append("-" if value is None else f"{value:.1f}")
                if timing != "own":
                    cells.append(f"{value / ref:.2f}x" if value is not None and ref else "-")
            print(f"| {' | '.join(cells)} |", flush=True)


def header(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
        f"{args.calls} calls x {args.rounds} rounds; timing {' and '.join(args.timing)}"
        f"{f'; {args.burn} busy loop(s) running' if args.burn else ''}", flush=True)
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


_PYTHON_ALGORITHMS = ["auto", "recursive_doubling", "tree"]
_TWO_WAYS = {
    "ranks": [2], "bytes": [1024], "impls": ["lab", "plan", "symm",
                                             "mpich"], "algorithms": ["auto", "one_shot"],
    "python_algorithms": None, "compiled_max_bytes": None, "timing": list(TIMINGS)}
#: ``--compare``'s parts: a title, and the settings that replace the command line's.
PARTS = {
    "head": ("1 KB allreduce: compiled plain call, Python path, plan, MPICH, gloo", {
        "ranks": [2, 4, 8], "bytes": [1024], "impls": ["lab", "python", "plan", "mpich", "gloo"],
        "algorithms": ["auto"], "python_algorithms": _PYTHON_ALGORITHMS, "compiled_max_bytes": None}),
    "sweep": ("size sweep: compiled (threshold raised to 256 KiB) against the Python path", {
        "ranks": [2, 4, 8], "bytes": [1024, 4096, 16384, 65536, 262144], "impls": ["lab", "python"],
        "algorithms": ["auto"], "python_algorithms": _PYTHON_ALGORITHMS, "compiled_max_bytes": 262144}),
    "one": ("1 rank (no communication): the per-call Python cost, plain call against plan", {
        "ranks": [1], "bytes": [1024], "impls": ["lab", "plan"], "algorithms": ["auto"],
        "python_algorithms": None, "compiled_max_bytes": None}),
    "timing": ("1 KB allreduce on 2 ranks, back to back and each call after a barrier: plain call, plan, "
               "one-shot, symmetric one-shot, MPICH", _TWO_WAYS),
    "shared": ("the same with one core taken by a busy loop: the compiled waiting policies",
               {**_TWO_WAYS, "burn": 1, "compiled_wait": ["default", "spin", "yield", "sleep"]})}


def _wait_policy(text: str) -> str:
    """A ``--compiled-wait`` value: ``SPIN,YIELD`` or a name of :data:`WAIT_POLICIES` or ``default``."""
    if text in WAIT_POLICIES or text == "default" or re.fullmatch(r"\d+,\d+", text):
        return text
    raise argparse.ArgumentTypeError(
        f"SPIN,YIELD (two counts) or one of default, {', '.join(WAIT_POLICIES)}; "
        f"got {text!r}")


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--timing", nargs="+", default=["back-to-back"], choices=TIMINGS,
                        help="back-to-back: calls in a loop; after-barrier: each call alone after a barrier")
    parser.add_argument("--burn", type=int, default=0, metavar="N",
                        help="busy loops (one process each) running while the cases are timed")
    parser.add_argument("--compiled-max-bytes", type=int, default=None,
                        help="LAB_COMPILED_MAX_BYTES of the lab and plan pools (default: lab's)")
    parser.add_argument("--spin", nargs="+", default=[None], help="LAB_SHM_SPIN values to compare")
    parser.add_argument(
        "--compiled-wait", nargs="+", default=[None], metavar="SPIN,YIELD", type=_wait_policy,
        help="compiled waiting policies to compare (LAB_COMPILED_SPIN,LAB_COMPILED_YIELD, "
        "or default, spin, yield, sleep)")
    parser.add_argument("--eager-bytes", type=int, nargs="+", default=[None],
                        help="shm eager thresholds to compare (default: lab's)")
    parser.add_argument("--compare", action="store_true",
                        help="the comparison of docs/compiled.md (ignores --algorithms, --bytes, --impls)")
    parser.add_argument("--parts", nargs="+", default=["head", "sweep", "one", "timing"], choices=list(PARTS),
                        help="with --compare: which of its parts to run (--ranks replaces all but one's)")
    return parser


def run(args: argparse.Namespace) -> None:
    """Every world size of ``args``: measured (with ``--burn`` busy loops running), then reported."""
    args.impls = _without_missing(args.impls)
    header(args)
    for world in args.ranks:
        with burning(args.burn):
            results = measure(args, world)
        report(args, world, results)


def main() -> None:
    args = _parser().parse_args()
    if not args.compare:
        args.ranks = args.ranks or [1, 2, 4, 8]
        run(args)
        return
    for name in args.parts:
        title, settings = PARTS[name]
        if args.ranks is not None and name != "one":
            settings = {**settings, "ranks": args.ranks}
        print(f"\n## {title}", flush=True)
        run(argparse.Namespace(**{**vars(args), **settings}))


if __name__ == "__main__":
    main()
