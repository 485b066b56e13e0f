"""The public collectives: validate at the boundary, then run one algorithm on a flat buffer.

Every argument is checked before any message is sent (in the caller, also with
``async_op=True``), so a bad call raises the same error on every rank and leaves the mesh usable.
``async_op=True`` returns a :class:`lab.Work` at once; collectives issued on one mesh, async or
not, complete in issue order.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from lab.buffers import as_buffer, check_tensor, new_flat, to_caller_type
from lab.chunking import row_bounds, split_bounds
from lab.collectives.allgather_ring import allgather_ring
from lab.collectives.allreduce_naive import allreduce_naive
from lab.collectives.allreduce_ring import allreduce_ring
from lab.collectives.allreduce_tree import allreduce_tree
from lab.collectives.broadcast_binomial import broadcast_binomial
from lab.collectives.reduce_scatter_ring import reduce_scatter_ring
from lab.mesh import Mesh
from lab import tuning
from lab.ops import ReduceOp, parse_op, reduction

ALLREDUCE_ALGORITHMS = {"ring": allreduce_ring, "tree": allreduce_tree, "naive": allreduce_naive}

def choose_allreduce(nbytes: int, world_size: int, transport: str) -> str:
    """The algorithm ``"auto"`` runs (``LAB_ALGO`` overrides; see :mod:`lab.tuning`)."""
    forced = os.environ.get("LAB_ALGO")
    if forced:
        return _check_algorithm(forced, "LAB_ALGO", allow_auto=False)
    return tuning.choose(nbytes, world_size, transport)


def _check_algorithm(algorithm: Any, name: str = "algorithm", allow_auto: bool = True) -> str:
    choices = [*ALLREDUCE_ALGORITHMS, "auto"] if allow_auto else list(ALLREDUCE_ALGORITHMS)
    if algorithm not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {algorithm!r}")
    return algorithm


def _check_root(mesh: Mesh, root: Any, name: str) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < mesh.world_size:
        raise ValueError(f"{name} must be a rank in [0, {mesh.world_size}); got {root!r}")
    return int(root)


def allreduce(mesh: Mesh, tensor: Any, op: Any = "sum", algorithm: str = "auto", async_op: bool = False) -> Any:
    """Reduce ``tensor`` elementwise across all ranks, in place; return ``tensor``.

    ``op``: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``. ``algorithm``: ``"ring"``,
    ``"tree"``, ``"naive"`` or ``"auto"`` (ring or tree by message size). Every rank ends with
    bit-identical values.

    Per rank, N=2::

        x = torch.tensor([1.0, 2.0]) + mesh.rank   # rank 0: [1, 2]   rank 1: [2, 3]
        lab.allreduce(mesh, x)                     # both:   [3, 5]
    """
    reduce_op = parse_op(op)
    _check_algorithm(algorithm)
    buffer = as_buffer(tensor)
    kernels = reduction(reduce_op, buffer.dtype)
    chosen = choose_allreduce(buffer.nbytes, mesh.world_size, mesh.transport) if algorithm == "auto" else algorithm

    def run() -> Any:
        with mesh.collective("allreduce", chosen, buffer.dtype, buffer.flat.size, reduce_op.value):
            ALLREDUCE_ALGORITHMS[chosen](mesh, buffer.flat, kernels)
        buffer.write_back()
        return tensor

    return mesh.issue(run, async_op)


def broadcast(mesh: Mesh, tensor: Any, src: int = 0, async_op: bool = False) -> Any:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; return ``tensor``.

    Per rank, N=3, src=1::

        x = torch.full((2,), float(mesh.rank))     # rank 0: [0, 0]  rank 1: [1, 1]  rank 2: [2, 2]
        lab.broadcast(mesh, x, src=1)              # all:    [1, 1]
    """
    src = _check_root(mesh, src, "src")
    buffer = as_buffer(tensor)

    def run() -> Any:
        with mesh.collective("broadcast", "binomial", buffer.dtype, buffer.flat.size, root=src):
            broadcast_binomial(mesh, buffer.flat, src)
        buffer.write_back()
        return tensor

    return mesh.issue(run, async_op)


def allgather(mesh: Mesh, tensor: Any, async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, into a new tensor.

    Like ``torch.distributed.all_gather_into_tensor``: every rank passes the same shape; a 0-d
    tensor gathers into shape ``(N,)``. The result has the caller's type (torch or numpy).

    Per rank, N=2::

        lab.allgather(mesh, torch.tensor([mesh.rank, 10 + mesh.rank]))   # both: [0, 10, 1, 11]
    """
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor)) or (1,)
    out_shape = (mesh.world_size * shape[0], *shape[1:])
    numel = math.prod(shape)
    out = new_flat(mesh.world_size * numel, dtype)
    bounds = split_bounds(out.size, mesh.world_size)  # equal blocks of numel
    start, stop = bounds[mesh.rank]
    out[start:stop] = as_buffer(tensor, writable=False).flat

    def run() -> Any:
        with mesh.collective("allgather", "ring", dtype, numel):
            allgather_ring(mesh, out, bounds)
        return to_caller_type(out, dtype, out_shape, like=tensor)

    return mesh.issue(run, async_op)


def reduce_scatter(mesh: Mesh, tensor: Any, op: Any = "sum", async_op: bool = False) -> Any:
    """Reduce ``tensor`` across ranks and return block ``rank`` of the result as a new tensor.

    Blocks are split along dim 0 as ``numpy.array_split`` does (equal when N divides dim 0, like
    ``torch.distributed.reduce_scatter_tensor``; otherwise the first blocks get one extra row).
    ``tensor`` itself is not modified.

    Per rank, N=2, sum::

        x = torch.arange(4.0) + mesh.rank          # rank 0: [0, 1, 2, 3]  rank 1: [1, 2, 3, 4]
        lab.reduce_scatter(mesh, x)                # rank 0: [1, 3]        rank 1: [5, 7]
    """
    reduce_op = parse_op(op)
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    kernels = reduction(reduce_op, dtype)
    work = as_buffer(tensor, writable=False).flat.copy()
    bounds = row_bounds(shape[0], math.prod(shape[1:]), mesh.world_size)

    def run() -> Any:
        with mesh.collective("reduce_scatter", "ring", dtype, work.size, reduce_op.value):
            reduce_scatter_ring(mesh, work, kernels, bounds)
        start, stop = bounds[mesh.rank]
        rows = split_bounds(shape[0], mesh.world_size)[mesh.rank]
        return to_caller_type(work[start:stop].copy(), dtype, (rows[1] - rows[0], *shape[1:]), like=tensor)

    return mesh.issue(run, async_op)


__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter", "choose_allreduce", "ReduceOp"]
