"""gather and scatter: one root's blocks of rows, collected from or dealt to every rank."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from lab.buffers import as_buffer, check_tensor, to_caller_type
from lab.chunking import row_bounds, split_bounds
from lab.collectives.choice import ALGORITHMS, pick
from lab.collectives.prepared import Prepared, Signature, check_root, describe, issue

if TYPE_CHECKING:
    from lab.comm.protocols import CallMesh


def gather(mesh: CallMesh, tensor: Any, dst: int = 0, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, into a new tensor on rank ``dst``.

    Every rank passes the same shape (a 0-d tensor gathers into shape ``(N,)``); rank ``dst``
    returns the result, with the caller's type (torch or numpy), every other rank ``None``.
    ``algorithm``: ``"binomial"`` (⌈log2 N⌉ rounds, MPICH's), ``"linear"`` (every rank sends
    straight to the root) or ``"auto"``.

    Per rank, N=3, dst=1::

        lab.gather(mesh, torch.tensor([mesh.rank, 10 + mesh.rank]), dst=1)
        # rank 1: tensor([0, 10, 1, 11, 2, 12]);  ranks 0 and 2: None
    """
    return issue(mesh, prepare_gather(mesh, tensor, dst, algorithm), async_op)


def prepare_gather(mesh: CallMesh, tensor: Any, dst: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`gather`'s checks and choices, done now; its communication, ready to run (each run
    returns a new tensor on ``dst``, None elsewhere)."""
    dst = check_root(mesh, dst, "dst")
    dtype = check_tensor(tensor)
    n = mesh.world_size
    shape = tuple(np.shape(tensor)) or (1,)
    numel = math.prod(shape)
    chosen = pick(mesh, "gather", algorithm, n * numel * dtype.storage.itemsize)
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

    what = describe(mesh, "gather", dtype, numel, n * numel if mesh.rank == dst else 0, root=dst)
    return Prepared(run, signature, what=what)


def scatter(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto",
            async_op: bool = False) -> Any:
    """Return block ``rank`` of rank ``src``'s ``tensor`` as a new tensor on every rank.

    Blocks are split along dim 0 as ``numpy.array_split`` does (equal when N divides dim 0).
    Every rank passes a tensor of the same shape; only ``src``'s contents are read, and none is
    modified. ``algorithm``: ``"binomial"`` (⌈log2 N⌉ rounds, MPICH's), ``"linear"`` (the root
    sends to every rank directly) or ``"auto"``.

    Per rank, N=3, src=1::

        x = torch.arange(4.0) + 10 * mesh.rank     # rank 1: [10, 11, 12, 13]
        lab.scatter(mesh, x, src=1)                # rank 0: [10, 11]  rank 1: [12]  rank 2: [13]
    """
    return issue(mesh, prepare_scatter(mesh, tensor, src, algorithm), async_op)


def prepare_scatter(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Prepared:
    """:func:`scatter`'s checks and choices, done now; its communication, ready to run (each run
    returns a new tensor)."""
    src = check_root(mesh, src, "src")
    dtype = check_tensor(tensor)
    shape = tuple(np.shape(tensor))
    if not shape:
        raise ValueError("tensor must have at least one dimension to be split along dim 0; got a 0-d tensor")
    numel = math.prod(shape)
    chosen = pick(mesh, "scatter", algorithm, numel * dtype.storage.itemsize)
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

    return Prepared(run, signature, what=describe(mesh, "scatter", dtype, numel, stop - start, root=src))
