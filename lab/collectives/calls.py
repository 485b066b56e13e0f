"""The public collectives: validate at the boundary, then run one algorithm on a flat buffer.

Every argument is checked before any message is sent (in the caller, also with
``async_op=True``), so a bad call raises the same error on every rank and leaves the mesh usable.
``async_op=True`` returns a :class:`lab.Work` at once; collectives issued on one mesh, async or
not, complete in issue order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lab import checks
from lab.buffers import as_buffer, check_tensor, to_caller_type
from lab.chunking import row_bounds, split_bounds
from lab.collectives.choice import ALGORITHMS, check_algorithm, choose, forced_algorithm, lab_algo, pick
from lab.collectives.gather_scatter import gather, prepare_gather, prepare_scatter, scatter
from lab.collectives.prepared import (
    Prepared,
    Signature,
    check_root,
    compiled_run,
    describe,
    find_lane,
    gathered_by_lane,
    issue,
    lane_key,
    make_lane,
    parse_op,
    recording,
    remembered,
    scattered_by_lane,
)
from lab.ops import DTYPES, ReduceOp, check_reduces

if TYPE_CHECKING:
    from lab.comm.protocols import CallMesh

ALLREDUCE_ALGORITHMS = ALGORITHMS["allreduce"]
_REDUCE, = ALGORITHMS["reduce"]
_BARRIER, = ALGORITHMS["barrier"]


def allreduce(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto",
              async_op: bool = False) -> Any:
    """Reduce ``tensor`` elementwise across all ranks, in place; return ``tensor``.

    ``op``: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``. ``algorithm``: ``"ring"``,
    ``"tree"``, ``"naive"``, ``"recursive_doubling"``, ``"halving_doubling"`` (Rabenseifner),
    ``"double_tree"`` (NCCL's two binary trees), ``"hierarchical"`` (inside each host, then across
    hosts, then inside again), ``"ring_channels"`` (rings leaving each host through different
    ranks), ``"chain_tree"`` (a chain in each host, two binary trees across hosts) or ``"auto"``
    (the fitted model's fastest).
    Every rank ends with bit-identical values.

    Per rank, N=2::

        x = torch.tensor([1.0, 2.0]) + mesh.rank   # rank 0: [1, 2]   rank 1: [2, 3]
        lab.allreduce(mesh, x)                     # both:   [3, 5]
    """
    if async_op is False:
        lane = find_lane(mesh, "allreduce", tensor, op, algorithm)
        if lane is not None:  # (a call like one before, on a contiguous CPU tensor: see Lane)
            lane(tensor)
            return tensor
    return issue(mesh, prepare_allreduce(mesh, tensor, op, algorithm), async_op)


def prepare_allreduce(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Prepared:
    """:func:`allreduce`'s checks and choices, done now; its communication, ready to run."""
    reduce_op = parse_op(op)
    buffer = as_buffer(tensor)
    key = ("allreduce", reduce_op, algorithm, buffer.dtype, buffer.numel, lab_algo())
    signature, kernels, call = remembered(mesh, key,
                                          lambda: _allreduce_template(mesh, reduce_op, algorithm, buffer))
    algorithm_run = ALLREDUCE_ALGORITHMS[signature.algorithm]
    if call is not None and buffer.shared and type(tensor) is torch.Tensor:
        make_lane(mesh, lane_key("allreduce", tensor, op, algorithm), signature, algorithm_run,
                  (None, kernels))
    options = algorithm_run.options(mesh) if algorithm_run.options else {}  # (double tree's segments)

    def run() -> Any:
        flat = buffer.load()  # read now, after the collectives issued before this one
        if call is not None and buffer.shared:  # one compiled call, made once
            call(call.operands((flat, kernels)))
            return tensor
        with mesh.collective(*signature):
            kernels.prepare(flat, mesh.world_size)
            mesh.run(algorithm_run, flat, kernels, **options)
        buffer.write_back()
        return tensor

    def planned() -> Callable[[], Any] | None:
        return compiled_run(mesh, signature, algorithm_run, (buffer.flat, kernels), lambda: tensor,
                            call is not None and buffer.shared)

    what = describe(mesh, "allreduce", buffer.dtype, buffer.numel, buffer.numel, reduce_op=reduce_op.value)
    return Prepared(run, signature, planned, what)


def _allreduce_template(mesh: CallMesh, reduce_op: ReduceOp, algorithm: str, buffer: Any) -> tuple:
    """What an allreduce of ``buffer``'s dtype and size needs besides the tensor: checked, chosen,
    and its compiled call made where it takes one (None: the Python path, or an ``avg`` that
    divides before the exchange)."""
    check_reduces(buffer.dtype, "allreduce")
    kernels = mesh.kernels(reduce_op, buffer.dtype)
    chosen = pick(mesh, "allreduce", algorithm, buffer.nbytes)
    signature = Signature("allreduce", chosen, buffer.dtype, buffer.numel, reduce_op.value)
    call = None if kernels.prescales else mesh.compiled_call(signature, ALLREDUCE_ALGORITHMS[chosen],
                                                             (None, kernels))
    return signature, kernels, call


def broadcast(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto",
              async_op: bool = False) -> Any:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; return ``tensor``.

    ``algorithm``: ``"binomial"`` (⌈log2 N⌉ whole-tensor steps), ``"scatter_allgather"`` (van de
    Geijn: scatter, then ring allgather; for large tensors) or ``"auto"``.

    Per rank, N=3, src=1::

        x = torch.full((2,), float(mesh.rank))     # rank 0: [0, 0]  rank 1: [1, 1]  rank 2: [2, 2]
        lab.broadcast(mesh, x, src=1)              # all:    [1, 1]
    """
    if async_op is False:
        lane = find_lane(mesh, "broadcast", tensor, src, algorithm)
        if lane is not None:  # (a call like one before, on a contiguous CPU tensor: see Lane)
            lane(tensor)
            return tensor
    return issue(mesh, prepare_broadcast(mesh, tensor, src, algorithm), async_op)


def prepare_broadcast(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`broadcast`'s checks and choices, done now; its communication, ready to run."""
    root = check_root(mesh, src, "src")
    buffer = as_buffer(tensor)
    chosen = pick(mesh, "broadcast", algorithm, buffer.nbytes)
    signature = Signature("broadcast", chosen, buffer.dtype, buffer.numel, root=root)
    lane_under = lane_key("broadcast", tensor, src, algorithm) if buffer.shared and type(tensor) is torch.Tensor \
        else None

    def run() -> Any:
        flat = buffer.load()
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["broadcast"][chosen], flat, root)
        buffer.write_back()
        if lane_under is not None:  # once a first run went through (its ranks met on the root)
            make_lane(mesh, lane_under, signature, ALGORITHMS["broadcast"][chosen], (buffer.flat, root))
        return tensor

    def planned() -> Callable[[], Any] | None:
        return compiled_run(mesh, signature, ALGORITHMS["broadcast"][chosen], (buffer.flat, root),
                            lambda: tensor, buffer.shared)

    return Prepared(run, signature, planned,
                    describe(mesh, "broadcast", buffer.dtype, buffer.numel, buffer.numel, root=root))


def allgather(mesh: CallMesh, tensor: Any, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, into a new tensor.

    Like ``torch.distributed.all_gather_into_tensor``: every rank passes the same shape; a 0-d
    tensor gathers into shape ``(N,)``. The result has the caller's type (torch or numpy).
    ``algorithm``: ``"ring"``, ``"recursive_doubling"``, ``"pat"`` (NCCL's Parallel Aggregated Trees)
    or ``"auto"``.

    Per rank, N=2::

        lab.allgather(mesh, torch.tensor([mesh.rank, 10 + mesh.rank]))   # both: [0, 10, 1, 11]
    """
    if async_op is False:
        lane = find_lane(mesh, "allgather", tensor, algorithm, writes=False)
        if lane is not None:  # (a call like one before: see gathered_by_lane)
            return gathered_by_lane(mesh, lane, tensor)
    return issue(mesh, prepare_allgather(mesh, tensor, algorithm), async_op)


def prepare_allgather(mesh: CallMesh, tensor: Any, algorithm: str = "auto") -> Prepared:
    """:func:`allgather`'s checks and choices, done now; its communication, ready to run (each
    run returns a new tensor)."""
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor)) or (1,)
    out_shape = (mesh.world_size * shape[0], *shape[1:])
    numel = math.prod(shape)
    chosen = pick(mesh, "allgather", algorithm, mesh.world_size * numel * dtype.storage.itemsize)
    bounds = split_bounds(mesh.world_size * numel, mesh.world_size)  # equal blocks of numel
    start, stop = bounds[mesh.rank]
    buffer = as_buffer(tensor, writable=False)
    signature = Signature("allgather", chosen, dtype, numel)
    lane_under = lane_key("allgather", tensor, algorithm) if type(tensor) is torch.Tensor else None

    def run() -> Any:
        out = mesh.new_flat(mesh.world_size * numel, dtype)
        out[start:stop] = buffer.load()  # read now, after the collectives issued before this one
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["allgather"][chosen], out, bounds)
        if lane_under is not None:  # (on the result: a later call's is a new torch tensor)
            make_lane(mesh, lane_under, signature, ALGORITHMS["allgather"][chosen], (out, bounds),
                      world_count=True)
        return to_caller_type(out, dtype, out_shape, like=tensor)

    return Prepared(run, signature, what=describe(mesh, "allgather", dtype, numel, mesh.world_size * numel))


def reduce_scatter(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto",
                   async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks and return block ``rank`` of the result as a new tensor.

    Blocks are split along dim 0 as ``numpy.array_split`` does (equal when N divides dim 0, like
    ``torch.distributed.reduce_scatter_tensor``; otherwise the first blocks get one extra row).
    ``tensor`` itself is not modified. ``algorithm``: ``"ring"``, ``"recursive_halving"``, ``"pat"``
    (NCCL's Parallel Aggregated Trees) or ``"auto"``.

    Per rank, N=2, sum::

        x = torch.arange(4.0) + mesh.rank          # rank 0: [0, 1, 2, 3]  rank 1: [1, 2, 3, 4]
        lab.reduce_scatter(mesh, x)                # rank 0: [1, 3]        rank 1: [5, 7]
    """
    if async_op is False and type(tensor) is torch.Tensor and tensor.dim():
        lane = find_lane(mesh, "reduce_scatter", tensor, op, algorithm, tensor.shape[0], writes=False)
        if lane is not None:  # (a call like one before: see scattered_by_lane)
            return scattered_by_lane(mesh, lane, tensor)
    return issue(mesh, prepare_reduce_scatter(mesh, tensor, op, algorithm), async_op)


def prepare_reduce_scatter(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Prepared:
    """:func:`reduce_scatter`'s checks and choices, done now; its communication, ready to run
    (each run returns a new tensor)."""
    reduce_op = parse_op(op)
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    check_reduces(dtype, "reduce_scatter")
    kernels = mesh.kernels(reduce_op, dtype)
    chosen = pick(mesh, "reduce_scatter", algorithm, math.prod(shape) * dtype.storage.itemsize)
    buffer = as_buffer(tensor, writable=False)
    bounds = row_bounds(shape[0], math.prod(shape[1:]), mesh.world_size)
    start, stop = bounds[mesh.rank]
    rows = split_bounds(shape[0], mesh.world_size)[mesh.rank]
    signature = Signature("reduce_scatter", chosen, dtype, math.prod(shape), reduce_op.value)
    lane_under = lane_key("reduce_scatter", tensor, op, algorithm, shape[0]) \
        if type(tensor) is torch.Tensor and not kernels.prescales else None

    def run() -> Any:
        work = buffer.load().copy(
        )  # read now (after earlier collectives); the caller's tensor stays as it was
        with mesh.collective(*signature):
            kernels.prepare(work, mesh.world_size)
            mesh.run(ALGORITHMS["reduce_scatter"][chosen], work, kernels, bounds)
        if lane_under is not None:  # (on a copy: a later call's is a new torch tensor)
            make_lane(mesh, lane_under, signature, ALGORITHMS["reduce_scatter"][chosen],
                      (work, kernels, bounds), out_count=stop - start)
        return to_caller_type(work[start:stop].copy(), dtype, (rows[1] - rows[0], *shape[1:]), like=tensor)

    what = describe(mesh, "reduce_scatter", dtype, math.prod(shape), stop - start, reduce_op=reduce_op.value)
    return Prepared(run, signature, what=what)


def reduce(mesh: CallMesh, tensor: Any, dst: int = 0, op: Any = "sum", async_op: bool = False) -> Any:
    """Reduce ``tensor`` elementwise across ranks into rank ``dst``'s ``tensor``, in place; return ``tensor``.

    Every other rank's ``tensor`` is left unchanged (binomial tree, ⌈log2 N⌉ steps).

    Per rank, N=3, dst=1, sum::

        x = torch.tensor([1.0, 2.0]) + mesh.rank   # rank 0: [1, 2]  rank 1: [2, 3]  rank 2: [3, 4]
        lab.reduce(mesh, x, dst=1)                 # rank 1: [6, 9]; ranks 0 and 2 unchanged
    """
    return issue(mesh, prepare_reduce(mesh, tensor, dst, op), async_op)


def prepare_reduce(mesh: CallMesh, tensor: Any, dst: int = 0, op: Any = "sum") -> Prepared:
    """:func:`reduce`'s checks, done now; its communication, ready to run."""
    dst = check_root(mesh, dst, "dst")
    reduce_op = parse_op(op)
    buffer = as_buffer(tensor, writable=mesh.rank == dst)  # the others only read theirs: read-only is fine
    check_reduces(buffer.dtype, "reduce")
    kernels = mesh.kernels(reduce_op, buffer.dtype)
    signature = Signature("reduce", _REDUCE, buffer.dtype, buffer.numel, reduce_op.value, root=dst)

    def run() -> Any:
        flat = buffer.load()
        with mesh.collective(*signature):
            # another rank's tensor stays as it was; the compiled algorithm takes a writable array
            if mesh.rank != dst and (kernels.prescales or not flat.flags.writeable):
                flat = flat.copy()
            kernels.prepare(flat, mesh.world_size)
            mesh.run(ALGORITHMS["reduce"][_REDUCE], flat, kernels, dst)
        if mesh.rank == dst:
            buffer.write_back()
        return tensor

    what = describe(mesh, "reduce", buffer.dtype, buffer.numel, buffer.numel, root=dst,
                    reduce_op=reduce_op.value)
    return Prepared(run, signature, what=what)


def all_to_all(mesh: CallMesh, tensor: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
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
    return issue(mesh, prepared, async_op)


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


def prepare_all_to_all(mesh: CallMesh, tensor: Any, output_split_sizes: Any = None,
                       input_split_sizes: Any = None, algorithm: str = "auto") -> Prepared:
    """:func:`all_to_all`'s checks and choices, done now; its communication, ready to run (each
    run returns a new tensor)."""
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    n = mesh.world_size
    check_algorithm(algorithm, "all_to_all")
    even = [b - a for a, b in split_bounds(shape[0], n)]
    sends = even if input_split_sizes is None else _split_sizes(input_split_sizes, "input_split_sizes", n,
                                                                shape[0])
    receives = ([even[mesh.rank]] * n if output_split_sizes is None else _split_sizes(
        output_split_sizes, "output_split_sizes", n))
    uneven = input_split_sizes is not None or output_split_sizes is not None
    if uneven and algorithm != "auto" and not ALGORITHMS["all_to_all"][algorithm].uneven:
        raise ValueError(
            f"algorithm {algorithm!r} needs equal blocks; with input_split_sizes or "
            f"output_split_sizes use one of "
            f"{', '.join(repr(a) for a, e in ALGORITHMS['all_to_all'].items() if e.uneven)} or 'auto'")
    row = math.prod(shape[1:])
    if uneven and algorithm == "auto":  # ranks' sizes differ: a choice every rank makes alike
        forced = forced_algorithm("all_to_all")
        chosen = forced if forced and ALGORITHMS["all_to_all"][forced].uneven else \
            next(a for a, entry in ALGORITHMS["all_to_all"].items() if entry.uneven)
    else:
        chosen = pick(mesh, "all_to_all", algorithm, math.prod(shape) * dtype.storage.itemsize)
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

    what = describe(mesh, "all_to_all", dtype, math.prod(shape),
                    sum(receives) * row, split_sizes={"in": sends, "out": receives} if uneven else None)
    return Prepared(run, signature, what=what)


def barrier(mesh: CallMesh, async_op: bool = False) -> Any:
    """Return once every rank has entered the barrier (dissemination: ⌈log2 N⌉ rounds, no payload).

    Per rank, N=2::

        lab.barrier(mesh)   # neither rank returns before both have called it
    """
    if async_op is False and not recording(mesh):  # (a recorded barrier takes the full path, which notes it)
        # The compiled call, made once (a barrier's lane; False: none, on a transport without mailboxes)
        call = remembered(mesh, ("barrier", lab_algo()), lambda: prepare_barrier(mesh).planned() or False)
        if call:
            return mesh.issue_queue.run_alone(call, refused=mesh.refused)
    return issue(mesh, prepare_barrier(mesh), async_op)


def prepare_barrier(mesh: CallMesh) -> Prepared:
    """:func:`barrier`'s communication, ready to run."""
    signature = Signature("barrier", _BARRIER, DTYPES["float32"], 0)

    def run() -> None:
        with mesh.collective(*signature):
            mesh.run(ALGORITHMS["barrier"][_BARRIER])

    return Prepared(run, signature, lambda: compiled_run(mesh, signature, ALGORITHMS["barrier"][_BARRIER],
                                                         (), lambda: None),
                    describe(mesh, "barrier", DTYPES["float32"], 0, 0))


__all__ = [
    "ALGORITHMS", "Prepared", "ReduceOp", "Signature", "all_to_all", "allgather", "allreduce", "barrier",
    "broadcast", "check_algorithm", "choose", "forced_algorithm", "gather", "prepare_all_to_all",
    "prepare_allgather", "prepare_allreduce", "prepare_barrier", "prepare_broadcast", "prepare_gather",
    "prepare_reduce", "prepare_reduce_scatter", "prepare_scatter", "reduce", "reduce_scatter", "scatter"]
