"""The public collectives: validate at the boundary, then run one algorithm on a flat buffer.

Every argument is checked before any message is sent (in the caller, also with
``async_op=True``), so a bad call raises the same error on every rank and leaves the mesh usable.
``async_op=True`` returns a :class:`lab.Work` at once; collectives issued on one mesh, async or
not, complete in issue order.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from lab.buffers import as_buffer, check_tensor, to_caller_type
from lab.chunking import row_bounds, split_bounds
from lab.collectives import registry
from lab.collectives.allreduce_double_tree import latency_bytes
from lab import checks, tuning
from lab.ops import DTYPES, DType, ReduceOp, check_reduces, parse_op

if TYPE_CHECKING:
    from lab.mesh import Mesh

#: Every collective's algorithms, by name (``"auto"`` picks one of them; see :func:`choose`): the
#: registry's entries (:mod:`lab.collectives.registry`), each callable. reduce and barrier have one each.
ALGORITHMS: dict[str, dict[str, registry.Algorithm]] = registry.ALGORITHMS
ALLREDUCE_ALGORITHMS = ALGORITHMS["allreduce"]
_REDUCE, = ALGORITHMS["reduce"]
_BARRIER, = ALGORITHMS["barrier"]


def forced_algorithm(collective: str) -> str | None:
    """The algorithm ``LAB_ALGO`` forces on ``collective``, or None (like ``NCCL_ALGO``).

    ``LAB_ALGO`` is a comma-separated list of names, each either ``algorithm`` (applies to every
    collective that has an algorithm of that name: ``ring`` forces allreduce, allgather and
    reduce_scatter and leaves broadcast alone) or ``collective=algorithm`` (that collective
    only; it wins over a bare name). A name no collective has is a ``ValueError`` naming
    ``LAB_ALGO``, raised by every collective that consults it.

        LAB_ALGO=ring                                   # ring wherever there is one
        LAB_ALGO=allreduce=tree,broadcast=scatter_allgather
    """
    targeted, bare = {}, []
    for entry in filter(None, (e.strip() for e in os.environ.get("LAB_ALGO", "").split(","))):
        target, _, name = (part.strip() for part in entry.rpartition("="))
        if target and name not in ALGORITHMS.get(target, {}):
            expected = (", ".join(f"{target}={a}" for a in ALGORITHMS[target]) if target in ALGORITHMS
                        else f"a collective among {', '.join(ALGORITHMS)}")
            raise ValueError(f"LAB_ALGO entry {entry!r} is not valid; expected {expected}")
        if not target and not any(name in algorithms for algorithms in ALGORITHMS.values()):
            known = sorted({a for algorithms in ALGORITHMS.values() for a in algorithms})
            raise ValueError(f"LAB_ALGO must name algorithms among {', '.join(known)}; got {name!r}")
        if target:
            targeted[target] = name
        else:
            bare.append(name)
    if collective in targeted:
        return targeted[collective]
    return next((name for name in bare if name in ALGORITHMS[collective]), None)


_OPS_BY_NAME = {o.value: o for o in ReduceOp}


def _parse_op(op: Any) -> ReduceOp:
    """:func:`lab.ops.parse_op`, with the common lower-case names looked up directly."""
    return _OPS_BY_NAME.get(op) or parse_op(op) if isinstance(op, str) else parse_op(op)


#: choose()'s answers: ``auto`` is decided once per (collective, size, N, transport, LAB_ALGO, models)
#: instead of on every call (parsing LAB_ALGO and comparing every model cost ~10 µs a call).
_CHOICES: dict[tuple, str] = {}
_MAX_CHOICES = 4096


def choose(collective: str, nbytes: int, world_size: int, transport: str) -> str:
    """The algorithm ``"auto"`` runs for ``collective`` on an ``nbytes`` tensor: ``LAB_ALGO``'s
    if it names one of this collective's, else the fitted model's fastest (:mod:`lab.tuning`)."""
    key = (collective, nbytes, world_size, transport, os.environ.get("LAB_ALGO", ""), tuning.fitted_models)
    chosen = _CHOICES.get(key)
    if chosen is None:
        chosen = forced_algorithm(collective) or tuning.choose(nbytes, world_size, transport, collective)
        if len(_CHOICES) >= _MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[key] = chosen
    return chosen


def check_algorithm(algorithm: Any, collective: str = "allreduce") -> str:
    """``algorithm`` if ``collective`` has it (or it is ``"auto"``), else a ``ValueError`` listing them."""
    choices = [*ALGORITHMS[collective], "auto"]
    if algorithm not in choices:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, choices))}; got {algorithm!r}")
    return algorithm


def _pick(mesh: Mesh, collective: str, algorithm: str, nbytes: int) -> str:
    """Check ``algorithm`` (before any communication) and resolve ``"auto"``.

    A mesh across hosts (``hosts=``, torchrun's nodes) lets allreduce's ``auto`` weigh
    ``"hierarchical"`` against the flat algorithms (:func:`lab.tuning.choose_across_hosts`);
    ``transport="auto"`` reads the ``shm`` fits inside one host and the ``tcp`` fits across hosts.
    """
    check_algorithm(algorithm, collective)
    if algorithm != "auto":
        return algorithm
    # Small enough for the compiled path (lab.plane): the model's pick if it compiles, else the
    # collective's first compilable algorithm (one Numba call beats a Python exchange).
    compiled_max_bytes = getattr(mesh, "compiled_max_bytes", 0)  # 0: no compiled path
    if 0 < compiled_max_bytes and nbytes <= compiled_max_bytes and not forced_algorithm(collective):
        compiled = registry.compiled(collective)
        if compiled:
            chosen = choose(collective, nbytes, mesh.world_size, "shm")
            return chosen if chosen in compiled else compiled[0]
    transport, hosts = mesh.transport, getattr(mesh, "host_count", 1)
    if hosts > 1 and collective == "allreduce" and transport in ("tcp", "auto") and not forced_algorithm(collective):
        return tuning.choose_across_hosts(nbytes, mesh.world_size, hosts, "shm" if transport == "auto" else "tcp")
    if transport == "auto":
        transport = "tcp" if hosts > 1 else "shm"
    return choose(collective, nbytes, mesh.world_size, transport)


def _segment_bytes() -> int | None:
    """Double tree's largest pipeline segment: ``LAB_SEGMENT_BYTES``, or None: sized from the
    tensor and N (tests force many segments)."""
    value = os.environ.get("LAB_SEGMENT_BYTES", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LAB_SEGMENT_BYTES must be a positive number of bytes; got {value!r}")
    return int(value)


def _check_root(mesh: Mesh, root: Any, name: str) -> int:
    if not checks.is_int(root) or not 0 <= root < mesh.world_size:
        raise ValueError(f"{name} must be a rank in [0, {mesh.world_size}); got {root!r}")
    return int(root)


class Signature(NamedTuple):
    """What every rank must agree on for one collective: :meth:`lab.Mesh.collective`'s arguments
    (they make its fingerprint)."""

    collective: str
    algorithm: str
    dtype: DType
    count: int
    op: str = ""
    root: int = -1
    compiled: bool = True  # may take the compiled path (lab.plane) when small enough


class Prepared(NamedTuple):
    """A collective whose arguments are checked and whose algorithm is chosen: ``run()`` does its
    communication on the tensor's current contents and returns what the public call returns."""

    run: Callable[[], Any]
    signature: Signature


def allreduce(mesh: Mesh, tensor: Any, op: Any = "sum", algorithm: str = "auto", async_op: bool = False) -> Any:
    """Reduce ``tensor`` elementwise across all ranks, in place; return ``tensor``.

    ``op``: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``. ``algorithm``: ``"ring"``,
    ``"tree"``, ``"naive"``, ``"recursive_doubling"``, ``"halving_doubling"`` (Rabenseifner),
    ``"double_tree"`` (NCCL's two binary trees), ``"hierarchical"`` (inside each host, then across
    hosts, then inside again) or ``"auto"`` (the fitted model's fastest).
    Every rank ends with bit-identical values.

    Per rank, N=2::

        x = torch.tensor([1.0, 2.0]) + mesh.rank   # rank 0: [1, 2]   rank 1: [2, 3]
        lab.allreduce(mesh, x)                     # both:   [3, 5]
    """
    return mesh.issue(prepare_allreduce(mesh, tensor, op, algorithm).run, async_op)


def prepare_allreduce(mesh: Mesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Prepared:
    """:func:`allreduce`'s checks and choices, done now; its communication, ready to run."""
    reduce_op = _parse_op(op)
    buffer = as_buffer(tensor)
    check_reduces(buffer.dtype, "allreduce")
    kernels = mesh.kernels(reduce_op, buffer.dtype)
    chosen = _pick(mesh, "allreduce", algorithm, buffer.nbytes)
    options = {}
    if chosen == "double_tree":  # its pipeline segments: forced, or sized from the tensor, N and the transport
        options = {"segment_bytes": _segment_bytes(),
                   "latency_bytes": latency_bytes(mesh.transport, getattr(mesh, "host_count", 1))}
    signature = Signature("allreduce", chosen, buffer.dtype, buffer.numel, reduce_op.value)

    def run() -> Any:
        flat = buffer.load()  # read now, after the collectives issued before this one
        with mesh.collective(*signature):
            kernels.prepare(flat, mesh.world_size)
            mesh.run(ALLREDUCE_ALGORITHMS[chosen], flat, kernels, **options)
        buffer.write_back()
        return tensor

    return Prepared(run, signature)


def broadcast(mesh: Mesh, tensor: Any, src: int = 0, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; return ``tensor``.

    ``algorithm``: ``"binomial"`` (⌈log2 N⌉ whole-tensor steps), ``"scatter_allgather"`` (van de
    Geijn: scatter, then ring allgather; for large tensors) or ``"auto"``.

    Per rank, N=3, src=1::

        x = torch.full((2,), float(mesh.rank))     # rank 0: [0, 0]  rank 1: [1, 1]  rank 2: [2, 2]
        lab.broadcast(mesh, x, src=1)              # all:    [1, 1]
    """
    return mesh.issue(prepare_broadcast(mesh, tensor, src, algorithm).run, async_op)


def prepare_broadcast(mesh: Mesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`broadcast`'s checks and choices, done now; its communication, ready to run."""
    src = _check_root(mesh, src, "src")
    buffer = as_buffer(tensor)
    chosen = _pick(mesh, "broadcast", algorithm, buffer.nbytes)
    signature = Signature("broadcast", chosen, buffer.dtype, buffer.numel, root=src)

    def run() -> Any:
        flat = buffer.load()
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["broadcast"][chosen], flat, src)
        buffer.write_back()
        return tensor

    return Prepared(run, signature)


def allgather(mesh: Mesh, tensor: Any, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, into a new tensor.

    Like ``torch.distributed.all_gather_into_tensor``: every rank passes the same shape; a 0-d
    tensor gathers into shape ``(N,)``. The result has the caller's type (torch or numpy).
    ``algorithm``: ``"ring"``, ``"recursive_doubling"`` or ``"auto"``.

    Per rank, N=2::

        lab.allgather(mesh, torch.tensor([mesh.rank, 10 + mesh.rank]))   # both: [0, 10, 1, 11]
    """
    return mesh.issue(prepare_allgather(mesh, tensor, algorithm).run, async_op)


def prepare_allgather(mesh: Mesh, tensor: Any, algorithm: str = "auto") -> Prepared:
    """:func:`allgather`'s checks and choices, done now; its communication, ready to run (each
    run returns a new tensor)."""
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor)) or (1,)
    out_shape = (mesh.world_size * shape[0], *shape[1:])
    numel = math.prod(shape)
    chosen = _pick(mesh, "allgather", algorithm, mesh.world_size * numel * dtype.storage.itemsize)
    bounds = split_bounds(mesh.world_size * numel, mesh.world_size)  # equal blocks of numel
    start, stop = bounds[mesh.rank]
    buffer = as_buffer(tensor, writable=False)
    signature = Signature("allgather", chosen, dtype, numel)

    def run() -> Any:
        out = mesh.new_flat(mesh.world_size * numel, dtype)
        out[start:stop] = buffer.load()  # read now, after the collectives issued before this one
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["allgather"][chosen], out, bounds)
        return to_caller_type(out, dtype, out_shape, like=tensor)

    return Prepared(run, signature)


def reduce_scatter(mesh: Mesh, tensor: Any, op: Any = "sum", algorithm: str = "auto", async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks and return block ``rank`` of the result as a new tensor.

    Blocks are split along dim 0 as ``numpy.array_split`` does (equal when N divides dim 0, like
    ``torch.distributed.reduce_scatter_tensor``; otherwise the first blocks get one extra row).
    ``tensor`` itself is not modified. ``algorithm``: ``"ring"``, ``"recursive_halving"`` or
    ``"auto"``.

    Per rank, N=2, sum::

        x = torch.arange(4.0) + mesh.rank          # rank 0: [0, 1, 2, 3]  rank 1: [1, 2, 3, 4]
        lab.reduce_scatter(mesh, x)                # rank 0: [1, 3]        rank 1: [5, 7]
    """
    return mesh.issue(prepare_reduce_scatter(mesh, tensor, op, algorithm).run, async_op)


def prepare_reduce_scatter(mesh: Mesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Prepared:
    """:func:`reduce_scatter`'s checks and choices, done now; its communication, ready to run
    (each run returns a new tensor)."""
    reduce_op = _parse_op(op)
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    check_reduces(dtype, "reduce_scatter")
    kernels = mesh.kernels(reduce_op, dtype)
    chosen = _pick(mesh, "reduce_scatter", algorithm, math.prod(shape) * dtype.storage.itemsize)
    buffer = as_buffer(tensor, writable=False)
    bounds = row_bounds(shape[0], math.prod(shape[1:]), mesh.world_size)
    start, stop = bounds[mesh.rank]
    rows = split_bounds(shape[0], mesh.world_size)[mesh.rank]
    signature = Signature("reduce_scatter", chosen, dtype, math.prod(shape), reduce_op.value)

    def run() -> Any:
        work = buffer.load().copy()  # read now (after earlier collectives); the caller's tensor stays as it was
        with mesh.collective(*signature):
            kernels.prepare(work, mesh.world_size)
            mesh.run(ALGORITHMS["reduce_scatter"][chosen], work, kernels, bounds)
        return to_caller_type(work[start:stop].copy(), dtype, (rows[1] - rows[0], *shape[1:]), like=tensor)

    return Prepared(run, signature)


def reduce(mesh: Mesh, tensor: Any, dst: int = 0, op: Any = "sum", async_op: bool = False) -> Any:
    """Reduce ``tensor`` elementwise across ranks into rank ``dst``'s ``tensor``, in place; return ``tensor``.

    Every other rank's ``tensor`` is left unchanged (binomial tree, ⌈log2 N⌉ steps).

    Per rank, N=3, dst=1, sum::

        x = torch.tensor([1.0, 2.0]) + mesh.rank   # rank 0: [1, 2]  rank 1: [2, 3]  rank 2: [3, 4]
        lab.reduce(mesh, x, dst=1)                 # rank 1: [6, 9]; ranks 0 and 2 unchanged
    """
    return mesh.issue(prepare_reduce(mesh, tensor, dst, op).run, async_op)


def prepare_reduce(mesh: Mesh, tensor: Any, dst: int = 0, op: Any = "sum") -> Prepared:
    """:func:`reduce`'s checks, done now; its communication, ready to run."""
    dst = _check_root(mesh, dst, "dst")
    reduce_op = _parse_op(op)
    buffer = as_buffer(tensor)
    check_reduces(buffer.dtype, "reduce")
    kernels = mesh.kernels(reduce_op, buffer.dtype)
    signature = Signature("reduce", _REDUCE, buffer.dtype, buffer.numel, reduce_op.value, root=dst)

    def run() -> Any:
        flat = buffer.load()
        with mesh.collective(*signature):
            if kernels.prescales and mesh.rank != dst:  # another rank's tensor stays as it was
                flat = flat.copy()
            kernels.prepare(flat, mesh.world_size)
            mesh.run(ALGORITHMS["reduce"][_REDUCE], flat, kernels, dst)
        if mesh.rank == dst:
            buffer.write_back()
        return tensor

    return Prepared(run, signature)


def all_to_all(mesh: Mesh, tensor: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
               algorithm: str = "auto", async_op: bool = False) -> Any:
    """Exchange blocks of rows: rank j gets block j of every rank's ``tensor``, concatenated in rank order.

    Like ``torch.distributed.all_to_all_single``, into a new tensor. ``input_split_sizes[j]``:
    the rows of ``tensor`` (along dim 0, in order) that go to rank j; it must sum to dim 0.
    ``output_split_sizes[i]``: the rows this rank receives from rank i, which must be what rank i
    sends it; the result has ``sum(output_split_sizes)`` rows. Either may be None: ``tensor`` split
    as ``numpy.array_split`` does, and block ``rank`` of a tensor of this rank's shape from each
    rank (every rank passes the same shape then). Sizes that disagree between ranks raise
    :class:`lab.CollectiveMismatchError` (the byte counts of the messages differ).
    ``tensor`` itself is not modified. ``algorithm``: ``"pairwise"`` (N-1 direct exchanges),
    ``"bruck"`` (⌈log2 N⌉ steps; equal splits only: with split sizes ``auto`` runs pairwise, and
    ``"bruck"`` is a ``ValueError``) or ``"auto"``.

    Per rank, N=2::

        x = torch.tensor([10.0, 11.0]) + 10 * mesh.rank   # rank 0: [10, 11]  rank 1: [20, 21]
        lab.all_to_all(mesh, x)                           # rank 0: [10, 20]  rank 1: [11, 21]

        x = torch.arange(3.0) + 10 * mesh.rank            # rank 0: [0, 1, 2]  rank 1: [10, 11, 12]
        lab.all_to_all(mesh, x, output_split_sizes=[1, 2] if mesh.rank == 0 else [2, 1],
                       input_split_sizes=[1, 2] if mesh.rank == 0 else [2, 1])
                                                          # rank 0: [0, 10, 11]  rank 1: [1, 2, 12]
    """
    prepared = prepare_all_to_all(mesh, tensor, output_split_sizes, input_split_sizes, algorithm)
    return mesh.issue(prepared.run, async_op)


def _split_sizes(sizes: Any, name: str, world_size: int, rows: int | None = None) -> list[int]:
    """``sizes`` as a list of N non-negative ints (summing to ``rows`` if given), else a
    ``ValueError``/``TypeError`` naming ``name``."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"{name} must be a sequence of {world_size} row counts (one per rank) or None; "
                        f"got {sizes!r}")
    sizes = sizes.tolist() if hasattr(sizes, "tolist") else list(sizes)
    if len(sizes) != world_size:
        raise ValueError(f"{name} must have one entry per rank ({world_size}); got {len(sizes)}")
    if not all(checks.is_int(s) and s >= 0 for s in sizes):
        raise ValueError(f"{name} must hold non-negative integers; got {sizes}")
    if rows is not None and sum(sizes) != rows:
        raise ValueError(f"{name} must sum to the tensor's dim 0 ({rows}); got {sizes} (sum {sum(sizes)})")
    return [int(s) for s in sizes]


def _bounds_of(sizes: list[int], row: int) -> list[tuple[int, int]]:
    """Element bounds of consecutive blocks of ``sizes`` rows of ``row`` elements each."""
    ends = itertools.accumulate(sizes, lambda end, size: end + size * row, initial=0)
    return list(itertools.pairwise(ends))


def prepare_all_to_all(mesh: Mesh, tensor: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                       algorithm: str = "auto") -> Prepared:
    """:func:`all_to_all`'s checks and choices, done now; its communication, ready to run (each
    run returns a new tensor)."""
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    n = mesh.world_size
    check_algorithm(algorithm, "all_to_all")
    even = [b - a for a, b in split_bounds(shape[0], n)]
    sends = even if input_split_sizes is None else _split_sizes(input_split_sizes, "input_split_sizes", n, shape[0])
    receives = ([even[mesh.rank]] * n if output_split_sizes is None
                else _split_sizes(output_split_sizes, "output_split_sizes", n))
    uneven = input_split_sizes is not None or output_split_sizes is not None
    if uneven and algorithm != "auto" and not ALGORITHMS["all_to_all"][algorithm].uneven:
        raise ValueError(f"algorithm {algorithm!r} needs equal blocks; with input_split_sizes or "
                         f"output_split_sizes use one of "
                         f"{', '.join(repr(a) for a, e in ALGORITHMS['all_to_all'].items() if e.uneven)} or 'auto'")
    row = math.prod(shape[1:])
    if uneven and algorithm == "auto":  # ranks' sizes differ: a choice every rank makes alike
        forced = forced_algorithm("all_to_all")
        chosen = forced if forced and ALGORITHMS["all_to_all"][forced].uneven else \
            next(a for a, entry in ALGORITHMS["all_to_all"].items() if entry.uneven)
    else:
        chosen = _pick(mesh, "all_to_all", algorithm, math.prod(shape) * dtype.storage.itemsize)
    buffer = as_buffer(tensor, writable=False)
    send_bounds, recv_bounds = _bounds_of(sends, row), _bounds_of(receives, row)
    # Ranks agree on their shapes only beyond dim 0 when split sizes are given: the fingerprint
    # counts one row then, and the compiled path (decided by agreed sizes) is not taken.
    signature = Signature("all_to_all", chosen, dtype, row if uneven else buffer.numel, compiled=not uneven)

    def run() -> Any:
        out = mesh.new_flat(sum(receives) * row, dtype)
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["all_to_all"][chosen], buffer.load(), out, send_bounds, recv_bounds)
        return to_caller_type(out, dtype, (sum(receives), *shape[1:]), like=tensor)

    return Prepared(run, signature)


def gather(mesh: Mesh, tensor: Any, dst: int = 0, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, into a new tensor on rank ``dst``.

    Every rank passes the same shape (a 0-d tensor gathers into shape ``(N,)``); rank ``dst``
    returns the result, with the caller's type (torch or numpy), every other rank ``None``.
    ``algorithm``: ``"binomial"`` (⌈log2 N⌉ rounds, MPICH's), ``"linear"`` (every rank sends
    straight to the root) or ``"auto"``.

    Per rank, N=3, dst=1::

        lab.gather(mesh, torch.tensor([mesh.rank, 10 + mesh.rank]), dst=1)
        # rank 1: tensor([0, 10, 1, 11, 2, 12]);  ranks 0 and 2: None
    """
    return mesh.issue(prepare_gather(mesh, tensor, dst, algorithm).run, async_op)


def prepare_gather(mesh: Mesh, tensor: Any, dst: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`gather`'s checks and choices, done now; its communication, ready to run (each run
    returns a new tensor on ``dst``, None elsewhere)."""
    dst = _check_root(mesh, dst, "dst")
    dtype = check_tensor(tensor)
    n = mesh.world_size
    shape = tuple(np.shape(tensor)) or (1,)
    numel = math.prod(shape)
    chosen = _pick(mesh, "gather", algorithm, n * numel * dtype.storage.itemsize)
    bounds = split_bounds(n * numel, n)  # equal blocks of numel
    buffer = as_buffer(tensor, writable=False)
    signature = Signature("gather", chosen, dtype, numel, root=dst)

    def run() -> Any:
        # Every rank's: the root's result, another rank's scratch (binomial collects its subtree
        # there; pages it never touches cost nothing).
        out = mesh.new_flat(n * numel, dtype)
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["gather"][chosen], buffer.load(), out, bounds, dst)
        if mesh.rank != dst:
            return None
        return to_caller_type(out, dtype, (n * shape[0], *shape[1:]), like=tensor)

    return Prepared(run, signature)


def scatter(mesh: Mesh, tensor: Any, src: int = 0, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Return block ``rank`` of rank ``src``'s ``tensor`` as a new tensor on every rank.

    Blocks are split along dim 0 as ``numpy.array_split`` does (equal when N divides dim 0).
    Every rank passes a tensor of the same shape; only ``src``'s contents are read, and none is
    modified. ``algorithm``: ``"binomial"`` (⌈log2 N⌉ rounds, MPICH's), ``"linear"`` (the root
    sends to every rank directly) or ``"auto"``.

    Per rank, N=3, src=1::

        x = torch.arange(4.0) + 10 * mesh.rank     # rank 1: [10, 11, 12, 13]
        lab.scatter(mesh, x, src=1)                # rank 0: [10, 11]  rank 1: [12]  rank 2: [13]
    """
    return mesh.issue(prepare_scatter(mesh, tensor, src, algorithm).run, async_op)


def prepare_scatter(mesh: Mesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`scatter`'s checks and choices, done now; its communication, ready to run (each run
    returns a new tensor)."""
    src = _check_root(mesh, src, "src")
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    numel = math.prod(shape)
    chosen = _pick(mesh, "scatter", algorithm, numel * dtype.storage.itemsize)
    buffer = as_buffer(tensor, writable=False)
    bounds = row_bounds(shape[0], math.prod(shape[1:]), mesh.world_size)
    start, stop = bounds[mesh.rank]
    rows = split_bounds(shape[0], mesh.world_size)[mesh.rank]
    signature = Signature("scatter", chosen, dtype, numel, root=src)

    def run() -> Any:
        # Only the root's tensor is read; elsewhere the algorithm sees a buffer of its size (scratch).
        send = buffer.load() if mesh.rank == src else mesh.new_flat(numel, dtype)
        out = mesh.new_flat(stop - start, dtype)
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["scatter"][chosen], send, out, bounds, src)
        return to_caller_type(out, dtype, (rows[1] - rows[0], *shape[1:]), like=tensor)

    return Prepared(run, signature)


def barrier(mesh: Mesh, async_op: bool = False) -> Any:
    """Return once every rank has entered the barrier (dissemination: ⌈log2 N⌉ rounds, no payload).

    Per rank, N=2::

        lab.barrier(mesh)   # neither rank returns before both have called it
    """
    return mesh.issue(prepare_barrier(mesh).run, async_op)


def prepare_barrier(mesh: Mesh) -> Prepared:
    """:func:`barrier`'s communication, ready to run."""
    signature = Signature("barrier", _BARRIER, DTYPES["float32"], 0)

    def run() -> None:
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["barrier"][_BARRIER])

    return Prepared(run, signature)


__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "all_to_all", "barrier", "gather",
           "scatter", "choose", "check_algorithm", "forced_algorithm", "ALGORITHMS", "ReduceOp"]
