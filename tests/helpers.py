"""What the test modules share: rank pools and subprocess environments, the per-rank checks of
every collective, the failure collectors, faults injected into a rank, and the comparison with gloo.

Rank-side functions live here, in an importable module, so that rank processes can unpickle them.

- Pools and processes: :func:`pool`, :func:`child_env`, :func:`free_port`, :func:`sigint_as_ctrl_c`,
  :func:`shm_entries`, :func:`wait_until` (one process's step awaited by another, not slept out), :func:`enter_together`,
  :func:`require_hosts` (skips, saying why, where emulated hosts cannot be made).
- Per-rank checks (``check_*``: each returns its rank's failures as text; inputs ``index * STRIDE
  + rank``, exact expected values; see tests/test_collectives.py's docstring for the wire set) and
  :func:`assert_no_failures`, which collects every rank's.
- Faults (tests/test_faults.py, tests/test_hosts.py): :func:`faulty_job` makes a rank die or stall at
  a chosen transfer; :func:`assert_death_reported_without_a_deadline`, :func:`assert_stall_ended_by_the_pool`.
- Against gloo (tests/test_gloo.py, tests/test_hosts.py): :func:`compare_with_gloo`,
  :func:`large_allreduce`, :func:`assert_matches_and_identical`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import lab
import lab.lesson
from lab.hosts.emulated import Hosts
from lab.reference import gloo_collective, tolerance

# -- pools and processes ---------------------------------------------------------------------------


def shm_entries() -> set[str]:
    """What /dev/shm holds, less multiprocessing's semaphores (another test process may be making
    them; the lab's own memory is memfds, which never appear here) and less what a process outside
    this one's tree holds open or mapped: another pytest worker's job, running side by side, is not
    this worker's to count (a segment nobody holds is counted, whoever left it)."""
    names = {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}
    return names - _held_by_others(names) if names else names


def _held_by_others(names: set[str]) -> set[str]:
    """Those of ``names`` (in /dev/shm) that a process other than this one and its descendants
    has open or mapped."""
    ours = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
    paths, held = {f"/dev/shm/{name}": name for name in names}, set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(paths[path] for path in (line.rstrip("\n").split(maxsplit=5)[-1] for line in maps)
                            if path in paths)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    held.add(paths[target])
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return held


def slow_from_five(params, world_size=lambda p: p) -> list:
    """``params`` for a parametrization or a fixture, those of world size 5 or more marked slow: the
    fast loop keeps 1-4 (3, not a power of two, included), CI runs every size."""
    return [pytest.param(p, marks=pytest.mark.slow) if world_size(p) >= 5 else p for p in params]


def pool(world_size: int, transport: str, **options) -> lab.Cluster:
    """A rank pool for one test module (the caller closes it)."""
    return lab.launch(world_size, transport=transport, recv_timeout_ms=60_000, **options)


def sigint_as_ctrl_c() -> None:
    """A ``preexec_fn`` for a child a test interrupts with SIGINT: a shell without job control
    starts background jobs with SIGINT ignored, children inherit that, and Python then never
    raises KeyboardInterrupt; the child gets the default back, as a terminal's program has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a Python subprocess that imports this checkout's lab and tests."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(ready, what: str, limit_s: float = 120.0) -> None:
    """Poll ``ready()`` until it holds: one process waits for another's step by what it can observe
    (a file the other wrote, a handle completed, a process gone), never by a sleep that a loaded
    machine can outlast. ``limit_s`` only ends a hang, naming ``what`` was awaited."""
    end = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(f"still waiting for {what} after {limit_s:.0f} s")
        time.sleep(0.01)


def enter_together(mesh: lab.Mesh, flags: str) -> None:
    """Every rank leaves the file ``ready<rank>`` in the folder ``flags`` and waits for the others':
    they start their next call together, so that a rank a loaded machine started late is not taken
    for a silent one by the others' short deadline."""
    (Path(flags) / f"ready{mesh.rank}").touch()
    ready = [Path(flags) / f"ready{rank}" for rank in range(mesh.world_size)]
    wait_until(lambda: all(path.exists() for path in ready), "every rank to start")


@functools.cache
def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (None: they can)."""
    try:
        Hosts(1).close()
    except lab.EmulationUnavailable as exc:
        return str(exc)
    return None


def require_hosts() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)


# -- per-rank checks of every collective -----------------------------------------------------------

STRIDE = 3

DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]

OPS = ["sum", "prod", "min", "max", "avg"]

ALGORITHMS = {
    "allreduce": ["ring", "tree", "naive", "recursive_doubling", "halving_doubling", "double_tree",
                  "auto"], "broadcast": ["binomial", "scatter_allgather",
                                         "auto"], "allgather": ["ring", "recursive_doubling", "pat", "auto"],
    "reduce_scatter": ["ring", "recursive_halving", "pat",
                       "auto"], "all_to_all": ["pairwise", "bruck", "auto"]}

FIRST_ALGORITHMS = {"ring", "tree", "naive", "binomial", "auto"}  # the full matrix at N = 1-4

FULL_MATRIX_WORLDS = (3, 4)  # the later algorithms' full matrix: a fold with an extra rank, a power of two

SWEEP_DTYPES = ["float32", "int64", "bfloat16"]

#: The largest world size whose per-rank matrices run every dtype (see :func:`matrix_dtypes`).
MATRIX_MAX_WORLD = 4


def matrix_dtypes(world_size: int, dtypes):
    """``dtypes`` (names, or a dict by name) whole at N = 1-4; from N = 5 (CI's world sizes,
    :func:`slow_from_five`) only those of SWEEP_DTYPES, every op each takes.

    A world size changes the schedule: which chunk travels where, how many rounds, the fold of the
    extra ranks, the fold order; that is the same for every dtype of one width. A dtype and an op
    change the kernel, which folds the N inputs in one loop whatever N is. So the dtype x op
    product runs whole where it costs little (N = 1-4, 3 not a power of two), and N = 5-8 (five to
    eight ranks on this machine's 2 cores) run every op on a 4-, an 8- and a 2-byte dtype: every
    width and kernel family (float, integer, half), with each world size's schedule."""
    keep = [name for name in dtypes if world_size <= MATRIX_MAX_WORLD or name in SWEEP_DTYPES]
    return {name: dtypes[name] for name in keep} if isinstance(dtypes, dict) else keep


PROD_VALUES = np.array([-2.0, -1.0, 1.0, 2.0])  # products stay exact powers of two


def counts(world_size: int) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by ranks, and many segments."""
    return sorted({0, 1, max(world_size - 1, 0), 2 * world_size + 1, 2053})


def dtypes_for(world_size: int, algorithm: str, full: bool = True) -> list[str]:
    """Every dtype at N = 1-4, except for the later algorithms away from FULL_MATRIX_WORLDS; the wire
    set's three widths (SWEEP_DTYPES) with ``full=False`` (see the module's docstring) and from N = 5
    (:func:`matrix_dtypes`)."""
    if not full or world_size > MATRIX_MAX_WORLD:
        return SWEEP_DTYPES
    return DTYPES if algorithm in FIRST_ALGORITHMS or world_size in FULL_MATRIX_WORLDS else SWEEP_DTYPES


def ops_for(dtype: str, full: bool = True) -> list[str]:
    """Every op the dtype takes; with ``full=False`` (the wire set) every op on float32 only, sum
    on the other dtypes."""
    ops = OPS if dtype not in ("int32", "int64") else OPS[:-1]  # avg needs a floating dtype
    return ops if full or dtype == "float32" else ["sum"]


def values(count: int, rank: int, dtype: str, op: str = "sum") -> np.ndarray:
    """Rank ``rank``'s input as float64 values: ``index * stride + rank`` (bounded where needed)."""
    pattern = np.arange(count) * STRIDE + rank
    if op == "prod":
        return PROD_VALUES[pattern % 4]
    if dtype in ("float16", "bfloat16"):
        return (pattern % 32).astype(np.float64)  # sums of 8 ranks stay exact in 8 mantissa bits
    return pattern.astype(np.float64)


def tensor(v: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.tensor(v).to(getattr(torch, dtype))  # a copy: collectives write in place


def expected_reduction(stack: np.ndarray, op: str, dtype: str) -> torch.Tensor:
    """The exact reduction of a (ranks, count) stack of float64 values, in ``dtype``."""
    world_size = stack.shape[0]
    if op == "avg":
        total = tensor(stack.sum(axis=0), dtype)  # exact in dtype by construction
        divisor = torch.tensor(world_size, dtype=torch.float64 if dtype == "float64" else torch.float32)
        accumulate = torch.float64 if dtype == "float64" else torch.float32
        return (total.to(accumulate) / divisor).to(getattr(torch, dtype))
    reduce = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return tensor(reduce(stack, axis=0), dtype)


HALF_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def reduction_matches(got: torch.Tensor, want: torch.Tensor, stack: np.ndarray, op: str, dtype: str) -> bool:
    """Exactly ``want``; for ``avg`` of the half types (each contribution divided by N first, then
    summed: N roundings) within the README's bound, N·u·mean|x| (u: the type's unit roundoff)."""
    if op != "avg" or dtype not in HALF_UNIT_ROUNDOFF:
        return torch.equal(got, want)
    if got.shape != want.shape:
        return False
    n = stack.shape[0]
    bound = n * HALF_UNIT_ROUNDOFF[dtype] * np.abs(stack).mean(axis=0).reshape(got.shape)
    return bool(((got.double() - torch.from_numpy(stack.mean(axis=0)).reshape(got.shape)).abs()
                 <= torch.from_numpy(bound)).all())


def describe_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    wrong = (got != want).nonzero()
    first = tuple(wrong[0].tolist())
    return f"{len(wrong)} wrong elements, first at {first}: got {got[first].item()} want {want[first].item()}"


def check_allreduce(mesh: lab.Mesh, full: bool = True) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for algorithm in ALGORITHMS["allreduce"]:
            for dtype in dtypes_for(mesh.world_size, algorithm, full):
                for op in ops_for(dtype, full):
                    stack = np.stack([values(count, r, dtype, op) for r in range(mesh.world_size)])
                    x = tensor(stack[mesh.rank], dtype)
                    result = lab.allreduce(mesh, x, op=op, algorithm=algorithm)
                    want = expected_reduction(stack, op, dtype)
                    if result is not x or not reduction_matches(x, want, stack, op, dtype):
                        failures.append(f"rank {mesh.rank} allreduce {algorithm} {op} {dtype}[{count}]: " +
                                        ("not in place" if result is not x else describe_mismatch(x, want)))
    return failures


def check_broadcast(mesh: lab.Mesh, full: bool = True) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for algorithm in ALGORITHMS["broadcast"]:
            for dtype, src in [
                (d, s) for d in dtypes_for(mesh.world_size, algorithm, full) for s in range(mesh.world_size)]:
                x = tensor(values(count, mesh.rank, dtype), dtype)
                result = lab.broadcast(mesh, x, src=src, algorithm=algorithm)
                want = tensor(values(count, src, dtype), dtype)
                if result is not x or not torch.equal(x, want):
                    failures.append(f"rank {mesh.rank} broadcast {algorithm} src={src} {dtype}[{count}]: " +
                                    ("not in place" if result is not x else describe_mismatch(x, want)))
    return failures


def check_allgather(mesh: lab.Mesh, full: bool = True) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for algorithm, dtype in [
            (a, d) for a in ALGORITHMS["allgather"] for d in dtypes_for(mesh.world_size, a, full)]:
            for shape in [(count,), (count, 2)]:

                def rank_input(r: int, shape=shape, dtype=dtype) -> torch.Tensor:
                    return tensor(values(int(np.prod(shape)), r, dtype), dtype).reshape(shape)

                x = rank_input(mesh.rank)
                before = x.clone()
                got = lab.allgather(mesh, x, algorithm=algorithm)
                want = torch.cat([rank_input(r) for r in range(mesh.world_size)])
                if not torch.equal(got, want) or not torch.equal(x, before):
                    failures.append(f"rank {mesh.rank} allgather {algorithm} {dtype}{list(shape)}: " +
                                    describe_mismatch(got, want))
    return failures


def check_reduce_scatter(mesh: lab.Mesh, full: bool = True) -> list[str]:
    failures = []
    n = mesh.world_size
    for rows in counts(n):
        for algorithm, dtype in [
            (a, d) for a in ALGORITHMS["reduce_scatter"] for d in dtypes_for(n, a, full)]:
            for op in ops_for(dtype, full):
                for shape in [(rows,), (rows, 3)]:
                    numel = int(np.prod(shape))
                    stack = np.stack([values(numel, r, dtype, op) for r in range(n)])
                    x = tensor(stack[mesh.rank], dtype).reshape(shape)
                    before = x.clone()
                    got = lab.reduce_scatter(mesh, x, op=op, algorithm=algorithm)
                    reduced = expected_reduction(stack, op, dtype).reshape(shape)
                    want = torch.tensor_split(reduced, n)[mesh.rank] if rows else reduced[:0]
                    own = np.stack([
                        torch.tensor_split(torch.from_numpy(r).reshape(shape), n)[mesh.rank].numpy()
                        for r in stack]) if rows else stack[:, :0].reshape(n, *want.shape)
                    if not reduction_matches(got, want, own, op, dtype) or not torch.equal(x, before):
                        failures.append(
                            f"rank {mesh.rank} reduce_scatter {algorithm} {op} {dtype}{list(shape)}: " +
                            describe_mismatch(got, want))
    return failures


def check_other_inputs(mesh: lab.Mesh) -> list[str]:
    """numpy arrays, non-contiguous tensors, multi-dimensional and 0-d tensors keep their type."""
    failures = []
    n, rank = mesh.world_size, mesh.rank
    # numpy in, numpy out (float16 included), in place
    for dtype in ["float32", "int64", "float16"]:
        a = values(2 * n + 1, rank, dtype).astype(dtype)
        lab.allreduce(mesh, a)
        want = sum(values(2 * n + 1, r, dtype) for r in range(n)).astype(dtype)
        if not isinstance(a, np.ndarray) or not np.array_equal(a, want):
            failures.append(f"rank {rank} numpy allreduce {dtype}")
        g = lab.allgather(mesh, values(3, rank, dtype).astype(dtype))
        if not isinstance(g, np.ndarray) or not np.array_equal(
                g,
                np.concatenate([values(3, r, dtype) for r in range(n)]).astype(dtype)):
            failures.append(f"rank {rank} numpy allgather {dtype}")
    # a non-contiguous view: the result lands in the caller's strided tensor, neighbours untouched
    base = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + rank
    view = base[:, 1::2]
    lab.allreduce(mesh, view, algorithm="ring")
    want = sum(torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + r for r in range(n))
    if not torch.equal(base[:, 1::2], want[:, 1::2]) or not torch.equal(
            base[:, ::2], (torch.arange(24.0).reshape(4, 6) + rank)[:, ::2]):
        failures.append(f"rank {rank} non-contiguous allreduce")
    transposed = (torch.arange(6.0).reshape(2, 3) + rank).t()
    got = lab.reduce_scatter(mesh, transposed)
    full = sum((torch.arange(6.0).reshape(2, 3) + r).t() for r in range(n))
    if not torch.equal(got, torch.tensor_split(full, n)[rank]):
        failures.append(f"rank {rank} non-contiguous reduce_scatter")
    # 0-d tensors: allreduce and broadcast keep the shape; allgather gives (N,)
    scalar = torch.tensor(float(rank))
    lab.allreduce(mesh, scalar)
    if scalar.shape != () or scalar.item() != sum(range(n)):
        failures.append(f"rank {rank} 0-d allreduce")
    gathered = lab.allgather(mesh, torch.tensor(rank))
    if not torch.equal(gathered, torch.arange(n)):
        failures.append(f"rank {rank} 0-d allgather")
    # a tensor that requires grad is reduced in place like any other
    w = torch.arange(5.0, requires_grad=True)
    lab.allreduce(mesh, w, op="max")
    if not torch.equal(w.detach(), torch.arange(5.0)):
        failures.append(f"rank {rank} requires_grad allreduce")
    return failures


def check_reduce(mesh: lab.Mesh, full: bool = True) -> list[str]:
    """In place on dst; every other rank's tensor (numpy too) exactly as it was."""
    failures = []
    n = mesh.world_size
    for count in counts(n):
        for dtype in dtypes_for(n, "reduce", full):
            for op in ops_for(dtype, full):
                for dst in range(n):
                    stack = np.stack([values(count, r, dtype, op) for r in range(n)])
                    x = tensor(stack[mesh.rank], dtype)
                    before = x.clone()
                    result = lab.reduce(mesh, x, dst=dst, op=op)
                    want = expected_reduction(stack, op, dtype) if mesh.rank == dst else before
                    ok = reduction_matches(x, want, stack, op, dtype) if mesh.rank == dst else torch.equal(
                        x, before)
                    if result is not x or not ok:
                        failures.append(f"rank {mesh.rank} reduce dst={dst} {op} {dtype}[{count}]: " +
                                        ("not in place" if result is not x else describe_mismatch(x, want)))
    a = values(2 * n + 1, mesh.rank, "float32").astype(np.float32)
    lab.reduce(mesh, a, dst=n - 1, op="max")
    want = np.max([values(2 * n + 1, r, "float32") for r in range(n)], axis=0) if mesh.rank == n - 1 \
        else values(2 * n + 1, mesh.rank, "float32")
    if not np.array_equal(a, want.astype(np.float32)):
        failures.append(f"rank {mesh.rank} numpy reduce")
    return failures


def check_all_to_all(mesh: lab.Mesh, full: bool = True) -> list[str]:
    """Rank j gets block j (array_split along dim 0) of every rank, in rank order; input untouched."""
    failures = []
    n = mesh.world_size
    for rows in counts(n):
        for algorithm, dtype in [(a, d) for a in ALGORITHMS["all_to_all"] for d in dtypes_for(n, a, full)]:
            for shape in [(rows,), (rows, 2)]:

                def rank_input(r: int, shape=shape, dtype=dtype) -> torch.Tensor:
                    return tensor(values(int(np.prod(shape)), r, dtype), dtype).reshape(shape)

                x = rank_input(mesh.rank)
                before = x.clone()
                got = lab.all_to_all(mesh, x, algorithm=algorithm)
                want = torch.cat([torch.tensor_split(rank_input(r), n)[mesh.rank] for r in range(n)])
                if not torch.equal(got, want) or not torch.equal(x, before):
                    failures.append(f"rank {mesh.rank} all_to_all {algorithm} {dtype}{list(shape)}: " +
                                    describe_mismatch(got, want))
    g = lab.all_to_all(mesh, np.arange(2 * n, dtype=np.int32) + 100 * mesh.rank)
    if not isinstance(g, np.ndarray) or g.tolist() != [
            100 * r + k for r in range(n) for k in (2 * mesh.rank, 2 * mesh.rank + 1)]:
        failures.append(f"rank {mesh.rank} numpy all_to_all")
    return failures


def assert_no_failures(outputs: list[list[str]]) -> None:
    failures = [f for per_rank in outputs for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:25])


# -- faults injected into a rank -------------------------------------------------------------------

DEADLINE_MS = 1500  # the deadline of the stall cases: peers give up on a stalled rank after it

DEATH_DEADLINE_MS = 30_000  # the death cases: a death reported before this did not wait for a deadline

EXIT_GUARD_S = 120  # an interrupted parent must exit: far past its grace periods, only a hang fails it

STALL_S = 20 * DEADLINE_MS / 1000  # a stalled rank sleeps this long, unless the pool ends it first


def run_collective(mesh: lab.Mesh, which: str, numel: int) -> None:
    x = torch.arange(numel, dtype=torch.float32) + mesh.rank
    if which.startswith("allreduce"):
        lab.allreduce(mesh, x, algorithm=which.split("-")[1])
    elif which == "broadcast":
        lab.broadcast(mesh, x, src=mesh.world_size - 1)
    else:
        getattr(lab, which)(mesh, x)


def inject(mesh: lab.Mesh, victim: int, at_transfer: int, fault: str, stamp: str) -> None:
    """Make rank ``victim`` die or stall at its ``at_transfer``-th transfer, after writing the
    moment (``time.time()``) to the file ``stamp``."""
    if mesh.rank != victim:
        return
    transport = mesh._transport
    original = transport.exchange
    count = 0

    def faulty_exchange(*args, **kwargs):
        nonlocal count
        count += 1
        if count == at_transfer:
            with open(stamp, "w") as file:
                file.write(repr(time.time()))
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "exit":
                os._exit(3)
            else:  # stall far past everyone's deadline: the pool ends this rank long before it wakes
                time.sleep(STALL_S)
        return original(*args, **kwargs)

    transport.exchange = faulty_exchange


def faulty_job(mesh: lab.Mesh, which: str, numel: int, victim: int, at_transfer: int, fault: str,
               stamp: str) -> None:
    inject(mesh, victim, at_transfer, fault, stamp)
    for _ in range(100):  # every rank transfers at least once per call: the fault always fires
        run_collective(mesh, which, numel)


def assert_death_reported_without_a_deadline(error: lab.RankError, since_fault: float, case) -> None:
    """The peers learned of the death from the closed pipe/connection (no deadline fired)."""
    assert "DeadlineError" not in error.others, (case, str(error))
    assert since_fault < DEATH_DEADLINE_MS / 1000, f"{since_fault:.1f} s after the fault: {case}"


def assert_stall_ended_by_the_pool(error: lab.RankError, since_fault: float, case) -> None:
    """The peers' deadlines fired and the pool ended the stalled rank before it woke up."""
    assert f"recv_timeout_ms={DEADLINE_MS}" in error.others, (case, str(error))
    assert since_fault < STALL_S, f"{since_fault:.1f} s after the stall began: {case}"


# -- against gloo ----------------------------------------------------------------------------------

FLOATS = ["float32", "float64", "float16", "bfloat16"]

INTS = ["int32", "int64"]

ALLREDUCE = ["ring", "tree", "naive", "recursive_doubling", "halving_doubling", "double_tree", "auto"]


def random_stack(world_size: int, count: int, dtype: str, op: str, seed: int) -> torch.Tensor:
    """(ranks, count) random inputs; rank r's row is reproducible from ``seed`` and r alone."""
    rows = []
    for rank in range(world_size):
        rng = np.random.default_rng([seed, rank, count])
        if dtype in INTS:
            row = rng.integers(-3, 4, count) if op == "prod" else rng.integers(-1000, 1000, count)
        else:
            row = rng.uniform(0.5, 1.5, count) * rng.choice([-1, 1], count) if op == "prod" else rng.normal(
                0, 10, count)
        rows.append(torch.tensor(row).to(getattr(torch, dtype)))
    return torch.stack(rows)


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(
        t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def gloo_ops(dtype: str, full: bool) -> list[str]:
    """Every op the dtype takes; the wire set (``full=False``): every op on float32, sum elsewhere."""
    if not full and dtype != "float32":
        return ["sum"]
    return ["sum", "prod", "min", "max"] + (["avg"] if dtype in FLOATS else [])


def compare_with_gloo(mesh: lab.Mesh, sizes: list[int], seed: int,
                      full: bool = True) -> tuple[list[str], list[str]]:
    """Run each primitive through the lab and through gloo; return (failures, allreduce digests).
    ``full``: every dtype and op (from N = 5, :func:`matrix_dtypes`); otherwise the wire set."""
    failures, digests = [], []
    n, rank = mesh.world_size, mesh.rank

    def check(what: str, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
        error = (got.double() - ref.double()).abs()
        if got.shape != ref.shape or bool((error > tol).any()):
            worst = float(error.max()) if error.numel() else 0.0
            failures.append(f"rank {rank} {what}: max |lab - gloo| = {worst:.3g} over tolerance")

    for count in sizes:
        for dtype in matrix_dtypes(n, FLOATS + INTS) if full else SWEEP_DTYPES:
            for op in gloo_ops(dtype, full):
                stack = random_stack(n, count, dtype, op, seed)
                mine = stack[rank]
                ref = gloo_collective(mesh, "allreduce", mine.clone(), op=op)
                for algorithm in ALLREDUCE:
                    got = lab.allreduce(mesh, mine.clone(), op=op, algorithm=algorithm)
                    check(f"allreduce {algorithm} {op} {dtype}[{count}]", got, ref, tolerance(stack, op))
                    digests.append(digest(got))
                rows = stack.reshape(n, count, 1)[rank]
                ref = gloo_collective(mesh, "reduce_scatter", rows.clone(), op=op)
                tol = torch.tensor_split(tolerance(stack, op).reshape(count, 1), n)[rank]
                for algorithm in ["ring", "recursive_halving", "pat"]:
                    got = lab.reduce_scatter(mesh, rows, op=op, algorithm=algorithm)
                    check(f"reduce_scatter {algorithm} {op} {dtype}[{count}]", got, ref, tol)
                dst = n // 2
                got = lab.reduce(mesh, mine.clone(), dst=dst, op=op)
                ref = gloo_collective(mesh, "reduce", mine.clone(), dst=dst, op=op)
                check(f"reduce dst={dst} {op} {dtype}[{count}]", got, ref,
                      tolerance(stack, op) if rank == dst else torch.zeros(count))
            stack = random_stack(n, count, dtype, "sum", seed + 1)
            for src, algorithm in [
                (s, a) for s in sorted({0, n - 1}) for a in ["binomial", "scatter_allgather"]]:
                got = lab.broadcast(mesh, stack[rank].clone(), src=src, algorithm=algorithm)
                check(f"broadcast {algorithm} src={src} {dtype}[{count}]", got,
                      gloo_collective(mesh, "broadcast", stack[rank].clone(), src=src), torch.zeros(count))
                digests.append(digest(got))
            for algorithm in ["ring", "recursive_doubling", "pat"]:
                got = lab.allgather(mesh, stack[rank], algorithm=algorithm)
                check(f"allgather {algorithm} {dtype}[{count}]", got,
                      gloo_collective(mesh, "allgather", stack[rank]), torch.zeros(n * count))
            ref = gloo_collective(mesh, "all_to_all", stack[rank])
            for algorithm in ["pairwise", "bruck"]:
                got = lab.all_to_all(mesh, stack[rank], algorithm=algorithm)
                check(f"all_to_all {algorithm} {dtype}[{count}]", got, ref, torch.zeros(ref.shape))
    return failures, digests


def large_allreduce(mesh: lab.Mesh, count: int) -> tuple[list[str], list[str]]:
    """A multi-segment float32 sum per algorithm, against gloo."""
    failures, digests = [], []
    stack = random_stack(mesh.world_size, count, "float32", "sum", 7)
    ref = gloo_collective(mesh, "allreduce", stack[mesh.rank].clone())
    tol = tolerance(stack)
    for algorithm in ALLREDUCE[:-1]:
        got = lab.allreduce(mesh, stack[mesh.rank].clone(), algorithm=algorithm)
        if bool(((got.double() - ref.double()).abs() > tol).any()):
            failures.append(f"rank {mesh.rank} large allreduce {algorithm}")
        digests.append(digest(got))
    return failures, digests


def assert_matches_and_identical(outputs: list[tuple[list[str], list[str]]]) -> None:
    failures = [f for per_rank, _ in outputs for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:25])
    digests = [d for _, d in outputs]
    assert all(d == digests[0] for d in digests), "allreduce results differ between ranks"


def run_without_buffers(steps: list[tuple]) -> None:
    """Run every rank's steps where a message moves only while both its ends are in the step that
    holds it (nothing is ever buffered); fail if the ranks get stuck."""
    position, moved = [0] * len(steps), set()

    def pending(rank: int) -> list[tuple[int, int, int]]:
        send, recv = steps[rank][position[rank]]
        messages = ([(rank, send.peer, send.slot)] if send else []) + ([
            (recv.peer, rank, recv.slot)] if recv else [])
        return [m for m in messages if m not in moved]

    while any(position[r] < len(steps[r]) for r in range(len(steps))):
        progress = False
        for rank in range(len(steps)):
            if position[rank] == len(steps[rank]):
                continue
            for message in pending(rank):
                other = message[1] if message[0] == rank else message[0]
                if position[other] < len(steps[other]) and message in pending(other):
                    moved.add(message)
                    progress = True
            if not pending(rank):
                position[rank] += 1
                progress = True
        assert progress, f"stuck at steps {position}"


# -- what several modules' tests share ------------------------------------------------------------


def rooted(mesh: lab.Mesh, collective: str, x: torch.Tensor, root: int) -> object:
    """The rooted ``collective`` (broadcast, scatter, reduce, gather) of ``x`` at ``root``."""
    if collective == "broadcast":
        return lab.broadcast(mesh, x, src=root)
    if collective == "scatter":
        return lab.scatter(mesh, x, src=root)
    if collective == "reduce":
        return lab.reduce(mesh, x, dst=root)
    return lab.gather(mesh, x, dst=root)


def write(tmp_path: Path, name: str, text: str) -> Path:
    """``text`` in the file ``name`` under ``tmp_path``; its path."""
    path = tmp_path / name
    path.write_text(text)
    return path


def line_of(text: str, needle: str) -> int:
    """The 1-based number of the first line of ``text`` that holds ``needle``."""
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


def refusal(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """``python -m lab ARGV``'s error line, once it exited with status 2 (and printed no traceback)."""
    # imported here: the command line imports pandas, which the ranks that import helpers must not
    from lab.__main__ import main as lab_main

    with pytest.raises(SystemExit) as exited:
        lab_main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"python -m lab {argv[0]}") and ": error: " in line, err
    return line
