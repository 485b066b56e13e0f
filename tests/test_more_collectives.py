"""gather, scatter, uneven all_to_all, receive from any source, the dtypes collectives only move,
and the bitwise reductions (band, bor, bxor).

Every case runs inside the ranks, and every rank checks its own output: inputs are
``index * stride + rank`` (as bit patterns where a dtype cannot hold them: bool, the float8 types),
so a misplaced block shows. Pools start once per module: shm at every world size 1-8, queue and
tcp at two sizes each, and two emulated hosts under ``transport="auto"`` (shared memory inside a
host, TCP across: the mixed transport) where namespaces can be made. Every algorithm, count and
root runs on every pool, in a width (1, 2, 4, 8, 16 bytes) that changes with the count and root;
every dtype, at one count and root, runs on every pool too (a transport moves bytes, so the
widths are what differs there).
Counts: 0, 1, fewer than ranks, not divisible, and one past the compiled path's threshold (the
Python path on shm).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import assert_no_failures, matrix_dtypes, pool, slow_from_five

import lab
from lab.compiled.plane import DEFAULT_MAX_BYTES
from lab.ops import DTYPES, REDUCE_DTYPES
from lab.reference import gloo_collective

STRIDE = 3
ALGORITHMS = ("binomial", "linear", "auto")  # gather's and scatter's
#: One dtype of each width (1, 2, 4, 8 and 16 bytes), for the full matrix.
WIDTHS = ("bool", "bfloat16", "float32", "complex64", "complex128")
LARGE = DEFAULT_MAX_BYTES // 4 + 7  # float32 elements: past the compiled path's threshold


def counts(world_size: int) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by ranks, and enough for several blocks of rows."""
    return sorted({0, 1, max(world_size - 1, 0), 2 * world_size + 1, 67})


def make(count: int, rank: int, dtype: str, cols: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s input: ``index * stride + rank`` in ``dtype`` (bit patterns where it cannot hold
    them), shaped ``(count // cols, cols)`` when ``cols`` is given."""
    pattern = torch.arange(count, dtype=torch.int64) * STRIDE + rank
    entry = DTYPES[dtype]
    if dtype == "bool":
        t = pattern % 2 == 1
    elif entry.bits is not None:  # float16, bfloat16, float8, float4, complex32: as bit patterns
        t = (pattern % 251).to(entry.bits).view(entry.torch_dtype)
    elif dtype.startswith("complex"):
        t = torch.complex(pattern.double(), -pattern.double()).to(entry.torch_dtype)
    elif entry.is_floating:
        t = pattern.to(entry.torch_dtype)
    else:
        t = (pattern % 127).to(entry.torch_dtype)  # int8 and uint8 hold it
    return t if cols is None else t.reshape(-1, cols)


def raw(t: torch.Tensor | np.ndarray) -> bytes:
    """The bytes of a tensor (torch.equal does not take every dtype: compare bits)."""
    if isinstance(t, torch.Tensor):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return np.ascontiguousarray(t).tobytes()


def same(got, want) -> bool:
    """Same type, shape, dtype and bytes."""
    if type(got) is not type(want) or tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return False
    return raw(got) == raw(want)


# -- gather and scatter ---------------------------------------------------------------------------


def check_gather_scatter(mesh: lab.Mesh) -> list[str]:
    """Every algorithm, count and root, in a width that changes with both; every dtype once; 2-D
    and numpy; one large tensor."""
    n, rank, failures = mesh.world_size, mesh.rank, []

    def one(algorithm: str, count: int, root: int, dtype: str, cols: int | None = None, numpy: bool = False):
        inputs = [make(count, r, dtype, cols) for r in range(n)]
        if numpy:
            inputs = [t.numpy() for t in inputs]
        got = lab.gather(mesh, inputs[rank], dst=root, algorithm=algorithm)
        concat = np.concatenate if numpy else torch.cat
        want = concat([t.reshape(t.shape or (1,)) for t in inputs]) if rank == root else None
        if (got is None) != (want is None) or (want is not None and not same(got, want)):
            failures.append(
                f"rank {rank} gather {algorithm} {dtype}[{count}] cols={cols} dst={root} numpy={numpy}")
        # Only the root's contents are read: the others pass their own (different) tensor.
        block = (np.array_split if numpy else torch.tensor_split)(inputs[root], n)[rank]
        got = lab.scatter(mesh, inputs[rank], src=root, algorithm=algorithm)
        if not same(got, block):
            failures.append(
                f"rank {rank} scatter {algorithm} {dtype}[{count}] cols={cols} src={root} numpy={numpy}")

    for algorithm in ALGORITHMS:
        for i, count in enumerate(counts(n)):
            for root in range(n):  # every count and root; the widths in turn (each meets every count)
                one(algorithm, count, root, WIDTHS[(i + root) % len(WIDTHS)])
        one(algorithm, 6 * n + 3, n - 1, "int64", cols=3)  # 2N+1 rows: not divisible by N
        one(algorithm, 2 * n, 0, "complex64", numpy=True)
        one(algorithm, 9, n // 2, "bool", numpy=True)
        one(algorithm, LARGE, n - 1, "float32")  # past the compiled path's threshold
        for dtype in DTYPES:
            one(algorithm, 2 * n + 1, (n - 1) // 2, dtype)
    x = make(4, rank, "float32")
    got = lab.gather(mesh, x[0], dst=0)  # 0-d gathers into (N,)
    if rank == 0 and not torch.equal(got, torch.tensor([make(4, r, "float32")[0] for r in range(n)])):
        failures.append(f"rank {rank} 0-d gather: {got}")
    if not torch.equal(x, make(4, rank, "float32")):
        failures.append(f"rank {rank} gather modified its input")
    return failures


def check_compiled_path(mesh: lab.Mesh) -> list[str]:
    """On shm, small gathers and scatters of every dtype run in one compiled call."""
    if mesh.world_size == 1 or mesh.transport != "shm":
        return []
    before = mesh.stats()["collectives_compiled"]
    for algorithm in ("binomial", "linear"):
        for dtype in ("bool", "complex128", "float8_e5m2"):
            lab.gather(mesh, make(5, mesh.rank, dtype), dst=mesh.world_size - 1, algorithm=algorithm)
            lab.scatter(mesh, make(5, mesh.rank, dtype), src=mesh.world_size - 1, algorithm=algorithm)
    ran = mesh.stats()["collectives_compiled"] - before
    return [] if ran == 12 else [f"rank {mesh.rank}: {ran} of 12 small gathers/scatters ran compiled"]


def subtree(relative: int, n: int) -> int:
    """How many ranks the binomial subtree of relative rank ``relative`` holds (itself included)."""
    mask = 1
    while mask < n and not relative & mask:
        mask <<= 1
    return min(relative + mask, n) - relative


def byte_model(collective: str, algorithm: str, rank: int, root: int, n: int, block: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank``, blocks of ``block`` bytes: the docstrings' counts."""
    relative = (rank - root) % n
    if algorithm == "linear":
        mine = (0, (n - 1) * block) if rank == root else (block, 0)
    else:
        size = subtree(relative, n) * block
        mine = (0 if rank == root else size, size - block)
    return mine if collective == "gather" else (mine[1], mine[0])  # scatter: the same, reversed


def check_byte_counts(mesh: lab.Mesh) -> list[str]:
    """Every rank's payload counters against :func:`byte_model`, every algorithm and root."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    for algorithm in ("binomial", "linear"):
        for root in range(n):
            for collective, option, x in (("gather", "dst", torch.zeros(5)), ("scatter", "src",
                                                                              torch.zeros(5 * n))):
                mesh.reset_stats()
                getattr(lab, collective)(mesh, x, algorithm=algorithm, **{option: root})
                stats = mesh.stats()
                want = byte_model(collective, algorithm, rank, root, n, 20)
                if (stats["bytes_sent"], stats["bytes_received"]) != want:
                    failures.append(f"rank {rank} {collective} {algorithm} root {root}: "
                                    f"{stats['bytes_sent']}/{stats['bytes_received']}, model {want}")
    return failures


# -- uneven all_to_all ----------------------------------------------------------------------------


def splits(n: int, pattern: str) -> list[list[int]]:
    """``table[i][j]``: the rows rank i sends rank j."""
    if pattern == "mixed":  # zeros included, different on every pair
        return [[(3 * i + j) % 4 for j in range(n)] for i in range(n)]
    if pattern == "one":  # everything from rank 0 to rank n-1
        return [[5 if (i, j) == (0, n - 1) else 0 for j in range(n)] for i in range(n)]
    return [[0] * n for _ in range(n)]  # "zeros"


def check_uneven_all_to_all(mesh: lab.Mesh) -> list[str]:
    """Every pattern, width and algorithm that takes split sizes; 2-D rows; numpy; one-sided None."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    for pattern in ("mixed", "one", "zeros"):
        table = splits(n, pattern)
        for dtype in (*WIDTHS, "float8_e4m3fn", "uint64"):
            for cols in (1, 3):
                inputs = [make(sum(table[i]) * cols, i, dtype, cols) for i in range(n)]
                sends = table[rank]
                receives = [table[i][rank] for i in range(n)]
                for algorithm in ("pairwise", "auto"):
                    got = lab.all_to_all(mesh, inputs[rank], output_split_sizes=receives,
                                         input_split_sizes=sends, algorithm=algorithm)
                    want = torch.cat([
                        inputs[i][sum(table[i][:rank]):sum(table[i][:rank + 1])] for i in range(n)])
                    if not same(got, want):
                        failures.append(f"rank {rank} all_to_all {algorithm} {pattern} {dtype} x{cols}")
                    if mesh.flight_records()[-1].algorithm != "pairwise":
                        failures.append(f"rank {rank} all_to_all auto with split sizes ran "
                                        f"{mesh.flight_records()[-1].algorithm}")
    # numpy, and one side None: equal input blocks, output sizes given (and the other way round).
    x = np.arange(2 * n, dtype=np.complex64) * STRIDE + rank
    got = lab.all_to_all(mesh, x, output_split_sizes=[2] * n)
    want = np.concatenate([
        (np.arange(2 * n, dtype=np.complex64) * STRIDE + i)[2 * rank:2 * rank + 2] for i in range(n)])
    if not same(got, want):
        failures.append(f"rank {rank} all_to_all numpy output_split_sizes only")
    got = lab.all_to_all(mesh, x, input_split_sizes=[2] * n)
    if not same(got, want):
        failures.append(f"rank {rank} all_to_all numpy input_split_sizes only")
    with lab.all_to_all_init(mesh, torch.arange(2.0 * n) + 100 * rank, [2] * n, [2] * n) as plan:
        if not torch.equal(plan(),
                           torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * i for i in range(n)])):
            failures.append(f"rank {rank} all_to_all_init with split sizes")
    return failures


def mismatched_split_sizes(mesh: lab.Mesh) -> str:
    """Rank 0 expects 3 rows from rank 1, which sends 2: a CollectiveMismatchError there, never a
    wrong result (another rank may finish, or lose rank 0: the mixed transport closes its TCP half
    when its shm half fails)."""
    n = mesh.world_size
    receives = [2] * n
    if mesh.rank == 0:
        receives[1] = 3
    try:
        lab.all_to_all(mesh, torch.arange(2.0 * n), output_split_sizes=receives, input_split_sizes=[2] * n)
    except lab.CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    except lab.PeerLostError:
        return "peer lost"
    return "no error"


# -- receive from any source ----------------------------------------------------------------------


def check_any_source(mesh: lab.Mesh, per_sender: int = 3) -> list[str]:
    """Every rank sends ``per_sender`` tensors (torch and numpy, several dtypes) to every other,
    then takes them all from any source: each sender's arrive in the order it sent them."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    if n == 1:
        return []

    def payload(src: int, dst: int, i: int):
        kinds = [
            torch.tensor([src, dst, i]),
            np.array([src + 1j * dst, i], np.complex128),
            torch.tensor([src % 2 == 1, i % 2 == 1])]
        return kinds[i % len(kinds)]

    for receiver in range(n):  # each rank in turn takes everyone's (sends are bounded: no one waits on two)
        if receiver != rank:
            for i in range(per_sender):
                mesh.send(receiver, payload(rank, receiver, i))
            continue
        seen = dict.fromkeys(range(n), 0)
        for _ in range(per_sender * (n - 1)):
            src, got = mesh.recv(None)
            if src == rank or not same(got, payload(src, rank, seen[src])):
                failures.append(f"rank {rank} recv(None) #{seen[src]} from {src}: {got}")
            seen[src] += 1
    # recv(src) and recv(None) share each sender's order.
    if rank == 0:
        first = mesh.recv(n - 1)
        src, second = mesh.recv(None)
        if not (same(first, payload(n - 1, 0, 0)) and src == n - 1 and same(second, payload(n - 1, 0, 1))):
            failures.append(f"rank {rank} recv(src) then recv(None): {first}, {src} {second}")
    elif rank == n - 1:
        mesh.send(0, payload(n - 1, 0, 0))
        mesh.send(0, payload(n - 1, 0, 1))
    lab.barrier(mesh)
    if rank == 0:
        try:
            mesh.recv(None, timeout_ms=150)
            failures.append(f"rank {rank} recv(None) with nothing sent returned")
        except lab.DeadlineError as exc:
            if sorted(exc.peers) != list(range(1, n)):
                failures.append(f"rank {rank} DeadlineError names {exc.peers}")
    lab.barrier(mesh)
    # While some ranks are already in a collective, recv(None) takes only tensors.
    if rank == n - 1:
        got = sorted(mesh.recv(None)[0] for _ in range(n - 1))
        if got != list(range(n - 1)):
            failures.append(f"rank {rank} recv(None) beside a collective: {got}")
    else:
        mesh.send(n - 1, torch.tensor([rank]))
    lab.allreduce(mesh, torch.ones(4))
    if n >= 4:  # on a sub-mesh (context ids): ranks 0 and 2, 1 and 3, ...
        sub = mesh.split(color=rank % 2)
        if sub.rank:
            sub.send(0, torch.tensor([sub.rank]))
        else:
            got = sorted(int(sub.recv(None)[1][0]) for _ in range(sub.world_size - 1))
            if got != list(range(1, sub.world_size)):
                failures.append(f"rank {rank} sub-mesh recv(None): {got}")
        lab.barrier(mesh)
    return failures


def check_tags(mesh: lab.Mesh) -> list[str]:
    """Point-to-point tags: a receive of one tag never takes another's; each (sender, tag) keeps
    its order; recv(None) with a tag takes only that tag; a large message of one tag waits aside
    while a small one of another is received."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    if n == 1:
        return []
    tags = (0, 5, 2**31 - 1)
    for receiver in range(n):  # each rank in turn takes everyone's (sends are bounded)
        if receiver != rank:
            for tag in tags:  # sent in this order, received in the reverse one
                for i in range(2):
                    mesh.send(receiver, torch.tensor([rank, tag, i]), tag=tag)
            continue
        for tag in reversed(tags):
            for src in range(n):
                for i in range(2 * (src != rank)):
                    got = mesh.recv(src, tag=tag)
                    if not torch.equal(got, torch.tensor([src, tag, i])):
                        failures.append(f"rank {rank} recv({src}, tag={tag}) #{i}: {got}")
    lab.barrier(mesh)
    # recv(None) of a tag skips what waits with another tag.
    if rank == 0:
        got = sorted(int(mesh.recv(None, tag=9)[1][0]) for _ in range(n - 1))
        if got != list(range(1, n)):
            failures.append(f"rank {rank} recv(None, tag=9): {got}")
        got = sorted(int(mesh.recv(None, tag=3)[1][0]) for _ in range(n - 1))
        if got != sorted(-r for r in range(1, n)):
            failures.append(f"rank {rank} recv(None, tag=3): {got}")
    else:
        mesh.send(0, torch.tensor([-rank]), tag=3)
        mesh.send(0, torch.tensor([rank]), tag=9)
    lab.barrier(mesh)
    # A large message parked while a later small one of another tag is received first.
    large = torch.arange(65_536, dtype=torch.float32)
    if rank == 1:
        mesh.send(0, large, tag=1)
        mesh.send(0, torch.tensor([7.0]), tag=2)
    elif rank == 0:
        small, big = mesh.recv(1, tag=2), mesh.recv(1, tag=1)
        if not (torch.equal(small, torch.tensor([7.0])) and torch.equal(big, large)):
            failures.append(f"rank {rank}: the large tagged message came back as {big[:4]}..., small {small}")
    lab.barrier(mesh)
    return failures


# -- arguments checked before any message ---------------------------------------------------------


def bad_arguments(mesh: lab.Mesh) -> list[str]:
    """Each bad call raises, naming the parameter, before any message: no counter moves."""
    n, failures = mesh.world_size, []
    x = torch.arange(2.0 * n)
    cases = [
        (lambda: lab.gather(mesh, x, dst=n), ValueError, "dst must be a rank"),
        (lambda: lab.gather(mesh, x, dst=-1), ValueError, "dst must be a rank"),
        (lambda: lab.gather(mesh, x, dst=True), ValueError, "dst must be a rank"),
        (lambda: lab.gather(mesh, x, algorithm="ring"), ValueError, "algorithm must be one of"),
        (lambda: lab.gather(mesh, [1.0]), TypeError, "tensor must be"),
        (lambda: lab.scatter(mesh, x, src=n), ValueError, "src must be a rank"),
        (lambda: lab.scatter(mesh, x, src=0.5), ValueError, "src must be a rank"),
        (lambda: lab.scatter(mesh, torch.tensor(1.0)), ValueError, "at least one dimension"),
        (lambda: lab.all_to_all(mesh, x, input_split_sizes=[2] *
                                (n + 1)), ValueError, "input_split_sizes must have"),
        (lambda: lab.all_to_all(mesh, x, output_split_sizes=[-1] + [2] *
                                (n - 1)), ValueError, "output_split_sizes must hold non-negative"),
        (lambda: lab.all_to_all(mesh, x, input_split_sizes=[3] * n), ValueError,
         "must sum to the tensor's dim 0"),
        (lambda: lab.all_to_all(mesh, x, input_split_sizes=[2.0] * n), ValueError,
         "input_split_sizes must hold"),
        (lambda: lab.all_to_all(mesh, x, output_split_sizes="22"), TypeError,
         "output_split_sizes must be a sequence"),
        (lambda: lab.all_to_all(mesh, x, [2] * n, [2] * n, algorithm="bruck"), ValueError,
         "'bruck' needs equal blocks"),
        (lambda: lab.allreduce(mesh, torch.ones(3, dtype=torch.bool)), TypeError, "allreduce cannot reduce"),
        (lambda: lab.reduce(mesh, np.ones(3, np.complex64)), TypeError, "reduce cannot reduce"),
        (lambda: lab.reduce_scatter(mesh, torch.ones(3, dtype=torch.uint8)), TypeError,
         "reduce_scatter cannot reduce"),
        (lambda: mesh.recv(None, timeout_ms=-1), ValueError, "timeout_ms must be"),
        (lambda: mesh.recv(None, tag=-1), ValueError, "tag must be an int in [0, 2**31)")]
    if n > 1:
        cases += [(lambda: mesh.send((mesh.rank + 1) % n, x, tag=2**31), ValueError, "tag must be an int"),
                  (lambda: mesh.send((mesh.rank + 1) % n, x, tag=1.0), ValueError, "tag must be an int")]
    if n == 1:
        cases.append((lambda: mesh.recv(None), ValueError, "only one rank"))
    before = mesh.stats()
    for call, kind, text in cases:
        try:
            call()
            failures.append(f"rank {mesh.rank}: no error for {text!r}")
        except kind as exc:
            if text not in str(exc):
                failures.append(f"rank {mesh.rank}: {type(exc).__name__} {exc!s} lacks {text!r}")
            if kind is TypeError and "reduce" in text and not all(d in str(exc) for d in REDUCE_DTYPES):
                failures.append(f"rank {mesh.rank}: {exc} does not list the dtypes that reduce")
    if mesh.stats() != before:
        failures.append(f"rank {mesh.rank}: bad calls moved the counters: {before} -> {mesh.stats()}")
    if not torch.equal(lab.allgather(mesh, torch.tensor([mesh.rank])), torch.arange(n)):
        failures.append(f"rank {mesh.rank}: the mesh is not usable after the bad calls")
    return failures


# -- against gloo --------------------------------------------------------------------------------


def against_gloo(mesh: lab.Mesh) -> list[str]:
    """gather, scatter and all_to_all_single with split sizes: the lab's against gloo's, every
    root; and the bitwise allreduces."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    for count in (1, 2 * n + 1, 4 * n):
        x = torch.arange(count, dtype=torch.float32) * STRIDE + rank
        for root in range(n):
            for op, option in (("gather", "dst"), ("scatter", "src")):
                want = gloo_collective(mesh, op, x.clone(), **{option: root})
                got = getattr(lab, op)(mesh, x.clone(), **{option: root})
                if (got is None) != (want is None) or (got is not None and not torch.equal(got, want)):
                    failures.append(f"rank {rank} {op} [{count}] root {root}: {got} vs gloo {want}")
    for op in ("band", "bor", "bxor"):
        x = torch.arange(2 * n + 1, dtype=torch.int64) * STRIDE * 7 + rank
        if not torch.equal(lab.allreduce(mesh, x.clone(), op=op),
                           gloo_collective(mesh, "allreduce", x.clone(), op=op)):
            failures.append(f"rank {rank} allreduce {op} differs from gloo's")
    table = splits(n, "mixed")
    x = torch.arange(sum(table[rank]) * 2, dtype=torch.int64).reshape(-1, 2) * STRIDE + rank
    sizes = {"output_split_sizes": [table[i][rank] for i in range(n)], "input_split_sizes": table[rank]}
    if not torch.equal(lab.all_to_all(mesh, x, **sizes), gloo_collective(mesh, "all_to_all", x, **sizes)):
        failures.append(f"rank {rank} uneven all_to_all differs from gloo's all_to_all_single")
    return failures


def bitwise_ops(mesh: lab.Mesh) -> list[str]:
    """band, bor and bxor (torch's BAND, BOR, BXOR) on int32 and int64 (from N = 5 int64:
    helpers.matrix_dtypes), every count and allreduce algorithm, and reduce and reduce_scatter; an
    exact reference; a float is a TypeError before any message. Small tensors on shm take the
    Python path: compiled code has no bitwise reduction."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    combine = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    for op, function in combine.items():
        for dtype in (getattr(torch, name) for name in matrix_dtypes(n, ["int32", "int64"])):
            for count in counts(n):
                inputs = [torch.arange(count, dtype=torch.int64) * STRIDE * 7 + r for r in range(n)]
                want = torch.from_numpy(function.reduce(np.stack([i.numpy() for i in inputs]))).to(dtype) \
                    if count else torch.empty(0, dtype=dtype)
                for algorithm in lab.collectives.choice.ALGORITHMS["allreduce"]:
                    if algorithm == "hierarchical" and mesh.host_count < 2:
                        continue
                    got = lab.allreduce(mesh, inputs[rank].to(dtype, copy=True), op=op, algorithm=algorithm)
                    if not torch.equal(got, want):
                        failures.append(f"rank {rank} {op} {dtype} [{count}] {algorithm}")
                got = lab.reduce(mesh, inputs[rank].to(dtype, copy=True), dst=n - 1, op=op)
                if rank == n - 1 and not torch.equal(got, want):
                    failures.append(f"rank {rank} reduce {op} {dtype} [{count}]")
                got = lab.reduce_scatter(mesh, inputs[rank].to(dtype), op=op)
                if not torch.equal(got, torch.tensor_split(want, n)[rank]):
                    failures.append(f"rank {rank} reduce_scatter {op} {dtype} [{count}]")
    try:
        lab.allreduce(mesh, torch.ones(3), op="bxor")
        failures.append(f"rank {rank}: bxor of floats did not raise")
    except TypeError as exc:
        if "needs an integer dtype" not in str(exc):
            failures.append(f"rank {rank}: {exc}")
    return failures


def plans(mesh: lab.Mesh) -> list[str]:
    """gather_init and scatter_init run on the tensor's current contents each time."""
    n, rank, failures = mesh.world_size, mesh.rank, []
    x = torch.zeros(3)
    with lab.gather_init(mesh, x, dst=n - 1) as gather, lab.scatter_init(mesh, x, src=0) as scatter:
        for k in range(2):
            x.copy_(torch.arange(3.0) + 10 * rank + k)
            got = gather()
            want = torch.cat([torch.arange(3.0) + 10 * r + k for r in range(n)]) if rank == n - 1 else None
            if (got is None) != (want is None) or (want is not None and not torch.equal(got, want)):
                failures.append(f"rank {rank} gather plan run {k}")
            if not torch.equal(scatter(), torch.tensor_split(torch.arange(3.0) + k, n)[rank]):
                failures.append(f"rank {rank} scatter plan run {k}")
    return failures


# -- the pools -----------------------------------------------------------------------------------

POOLS = slow_from_five(
    [*(("shm", n) for n in range(1, 9)), ("queue", 3), ("queue", 5), ("tcp", 2), ("tcp", 6),
     ("auto", 4)], lambda p: p[1])


@pytest.fixture(scope="module", params=POOLS, ids=lambda p: f"{p[0]}-N{p[1]}")
def cluster(request):
    transport, world_size = request.param
    options = {"hosts": 2} if transport == "auto" else {"segment_bytes": 256, "slots": 2}
    try:
        with pool(world_size, transport, **options) as c:
            yield c
    except lab.EmulationUnavailable as exc:
        pytest.skip(f"two emulated hosts: {exc}")


def test_gather_scatter_every_algorithm_count_root_dtype(cluster):
    assert_no_failures(cluster.run(check_gather_scatter))
    assert_no_failures(cluster.run(check_compiled_path))


def test_gather_scatter_byte_counts(cluster):
    if cluster.transport != "shm":
        pytest.skip(
            "the counters count what the algorithm sends, whatever the transport: shm's pools check them")
    assert_no_failures(cluster.run(check_byte_counts))


def test_uneven_all_to_all(cluster):
    assert_no_failures(cluster.run(check_uneven_all_to_all))


def test_recv_from_any_source_keeps_each_senders_order(cluster):
    assert_no_failures(cluster.run(check_any_source))


def test_point_to_point_tags(cluster):
    assert_no_failures(cluster.run(check_tags))


def test_bad_arguments_raise_before_any_message(cluster):
    assert_no_failures(cluster.run(bad_arguments))


def test_bitwise_ops(cluster):
    assert_no_failures(cluster.run(bitwise_ops))


def test_plans(cluster):
    assert_no_failures(cluster.run(plans))


def test_mismatched_split_sizes_raise(cluster):
    if cluster.world_size < 2:
        pytest.skip("needs two ranks")
    outcomes = cluster.run(mismatched_split_sizes)
    assert outcomes[0].startswith("mismatch:") and "expected 12 bytes from rank 1" in outcomes[0], outcomes
    assert all(o in ("no error", "peer lost") or o.startswith("mismatch:") for o in outcomes), outcomes
    cluster.close()  # the mismatch leaves messages behind: this pool is done


@pytest.mark.parametrize("world_size", [3, 5])
def test_against_gloo(world_size):
    with pool(world_size, "shm") as c:
        assert_no_failures(c.run(against_gloo))


def test_numpy_dtypes_map_to_their_own():
    """np.bool_, np.complex64, np.uint16, ... are their own DType (numpy has them: no bit patterns)."""
    from lab.ops import dtype_of

    for name in ("bool", "uint8", "int8", "int16", "uint16", "uint32", "uint64", "complex64", "complex128"):
        found = dtype_of(np.zeros(2, dtype=name))
        assert found.name == name and found.storage == np.dtype(name) and found.bits is None
    assert len({d.code for d in DTYPES.values()}) == len(DTYPES)
    assert math.prod(np.shape(make(6, 1, "float4_e2m1fn_x2", cols=3))) == 6
