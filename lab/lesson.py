"""The lesson's own signatures, as thin wrappers over the lab's collectives.

Each takes ``rank`` and ``world_size`` explicitly, as the lesson's program does, and checks them
against the mesh (a disagreement is a ``ValueError``, raised before any communication).

    def step(mesh):
        x = torch.arange(8.0) + mesh.rank
        return ring_allreduce(mesh, mesh.rank, mesh.world_size, x)
"""

from __future__ import annotations

from typing import Any

from lab.collectives import calls as collectives
from lab.comm.mesh import Mesh


def _check(mesh: Mesh, rank: int, world_size: int) -> None:
    if rank != mesh.rank:
        raise ValueError(f"rank must be this process's rank {mesh.rank}; got {rank!r}")
    if world_size != mesh.world_size:
        raise ValueError(f"world_size must be the mesh's world size {mesh.world_size}; got {world_size!r}")


def ring_allreduce(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Sum ``tensor`` in place across ranks with the two-phase ring; returns it."""
    _check(mesh, rank, world_size)
    return collectives.allreduce(mesh, tensor, "sum", "ring")


def tree_allreduce(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Sum ``tensor`` in place across ranks with binomial reduce + broadcast; returns it."""
    _check(mesh, rank, world_size)
    return collectives.allreduce(mesh, tensor, "sum", "tree")


def broadcast(mesh: Mesh, rank: int, world_size: int, tensor: Any, src: int) -> Any:
    """Binomial-tree broadcast of rank ``src``'s ``tensor``, in place; returns it."""
    _check(mesh, rank, world_size)
    return collectives.broadcast(mesh, tensor, src)


def allgather(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Every rank's ``tensor`` concatenated along dim 0 (N-1 ring rotations); a new tensor."""
    _check(mesh, rank, world_size)
    return collectives.allgather(mesh, tensor)


def reduce_scatter(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Block ``rank`` of the sum over ranks (the first half of ring allreduce); a new tensor."""
    _check(mesh, rank, world_size)
    return collectives.reduce_scatter(mesh, tensor, "sum")


def recursive_doubling_allreduce(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Sum ``tensor`` in place in log2 N whole-tensor exchanges (short tensors); returns it."""
    _check(mesh, rank, world_size)
    return collectives.allreduce(mesh, tensor, "sum", "recursive_doubling")


def halving_doubling_allreduce(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Sum ``tensor`` in place: recursive-halving reduce-scatter, recursive-doubling allgather
    (Rabenseifner; long tensors); returns it."""
    _check(mesh, rank, world_size)
    return collectives.allreduce(mesh, tensor, "sum", "halving_doubling")


def double_tree_allreduce(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Sum ``tensor`` in place, half through each of two complementary binary trees (NCCL's); returns it."""
    _check(mesh, rank, world_size)
    return collectives.allreduce(mesh, tensor, "sum", "double_tree")


def reduce(mesh: Mesh, rank: int, world_size: int, tensor: Any, dst: int) -> Any:
    """Sum ``tensor`` into rank ``dst``'s, in place, over a binomial tree; other ranks' unchanged."""
    _check(mesh, rank, world_size)
    return collectives.reduce(mesh, tensor, dst, "sum")


def all_to_all(mesh: Mesh, rank: int, world_size: int, tensor: Any) -> Any:
    """Block j of every rank's ``tensor`` (split along dim 0) to rank j, in rank order; a new tensor."""
    _check(mesh, rank, world_size)
    return collectives.all_to_all(mesh, tensor)


def barrier(mesh: Mesh, rank: int, world_size: int) -> None:
    """Return once every rank has entered (dissemination)."""
    _check(mesh, rank, world_size)
    collectives.barrier(mesh)
