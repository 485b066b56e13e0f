"""The reference: the same collectives through ``torch.distributed`` with the gloo backend."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lab.chunking import split_bounds
from lab.comm.mesh import Mesh
from lab.hosts.rendezvous import env_store, pool_store
from lab.ops import parse_op

_EPSILON = {
    torch.float32: 2.0**-23, torch.float64: 2.0**-52, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
_TORCH_REDUCE_OPS = {
    "sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG", "band": "BAND", "bor": "BOR",
    "bxor": "BXOR"}


def ensure_gloo(mesh: Mesh) -> None:
    """Join a gloo process group (once per process) through the pool's store, or torchrun's."""
    if dist.is_initialized():
        return
    store = pool_store() if "LAB_STORE" in os.environ else env_store()
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=mesh.rank,
                            world_size=mesh.world_size, timeout=timedelta(milliseconds=mesh.recv_timeout_ms))


def gloo_collective(mesh: Mesh, op: str, tensor: Any, /, **options: Any) -> Any:
    """Run collective ``op`` on ``tensor`` through gloo inside a rank; same semantics as ``lab``.

    Returns what the lab's collective returns (the tensor, reduced or broadcast in place, or a
    new tensor; ``None`` for barrier, and for gather off ``dst``), with the caller's type.
    ``options``: ``op=`` for reductions, ``src=`` for broadcast and scatter, ``dst=`` for reduce
    and gather, ``output_split_sizes=``/``input_split_sizes=`` for all_to_all (``algorithm=`` is
    accepted and ignored: gloo picks its own). Like the lab's, gloo's reduce leaves the other
    ranks' ``tensor`` as it was.
    """
    if op not in REFERENCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REFERENCE_OPS))}; got {op!r}")
    ensure_gloo(mesh)
    is_numpy = isinstance(tensor, np.ndarray)
    t = torch.from_numpy(np.ascontiguousarray(tensor)) if is_numpy else tensor.contiguous()
    reduce_op = getattr(dist.ReduceOp, _TORCH_REDUCE_OPS[parse_op(options.get("op", "sum")).value])
    result = _GLOO[op](t, mesh.rank, mesh.world_size, reduce_op, options)
    if result is None:
        return None
    if is_numpy:
        result = result.numpy()
        if op in _IN_PLACE:
            tensor[...] = result
            return tensor
        return result
    if op in _IN_PLACE and result is not tensor:
        tensor.copy_(result)
        return tensor
    return result


# Each collective through gloo: (contiguous tensor, rank, world size, reduce op, options) -> result.


def _allreduce(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    dist.all_reduce(t, op=reduce_op)
    return t


def _broadcast(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    dist.broadcast(t, src=options.get("src", 0))
    return t


def _allgather(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    flat = t.reshape(-1)
    out = torch.empty(n * flat.numel(), dtype=t.dtype)
    dist.all_gather_single(out, flat)  # all_gather_into_tensor, renamed in torch 2.13
    shape = tuple(t.shape) or (1,)
    return out.reshape(n * shape[0], *shape[1:])


def _reduce_scatter(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    blocks = [t[a:b].contiguous() for a, b in split_bounds(t.shape[0], n)]
    result = torch.empty_like(blocks[rank])
    dist.reduce_scatter(result, blocks, op=reduce_op)
    return result


def _reduce(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    dst = options.get("dst", 0)
    dist.reduce(t if rank == dst else t.clone(), dst=dst,
                op=reduce_op)  # gloo may use a non-root buffer as scratch
    return t


def _all_to_all(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    rows = [b - a for a, b in split_bounds(t.shape[0], n)]
    sends = list(options.get("input_split_sizes") or rows)
    receives = list(options.get("output_split_sizes") or [rows[rank]] * n)
    result = torch.empty((sum(receives), *t.shape[1:]), dtype=t.dtype)
    dist.all_to_all_single(result, t, receives, sends)
    return result


def _gather(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor | None:
    dst = options.get("dst", 0)
    flat = t.reshape(tuple(t.shape) or (1,))
    pieces = [torch.empty_like(flat) for _ in range(n)] if rank == dst else None
    dist.gather(flat, pieces, dst=dst)
    return None if pieces is None else torch.cat(pieces)


def _scatter(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> torch.Tensor:
    src = options.get("src", 0)
    blocks = [t[a:b].contiguous() for a, b in split_bounds(t.shape[0], n)]
    result = torch.empty_like(blocks[rank])
    if t.shape[0] % n == 0:
        dist.scatter(result, blocks if rank == src else None, src=src)
    else:  # gloo's scatter takes equal blocks only: the same exchange as an all_to_all from src alone
        sends = [b.shape[0] for b in blocks] if rank == src else [0] * n
        receives = [blocks[rank].shape[0] if i == src else 0 for i in range(n)]
        dist.all_to_all_single(result, t if rank == src else t[:0], receives, sends)
    return result


def _barrier(t: torch.Tensor, rank: int, n: int, reduce_op: Any, options: dict) -> None:
    dist.barrier()


_GLOO = {
    "allreduce": _allreduce, "broadcast": _broadcast, "allgather": _allgather,
    "reduce_scatter": _reduce_scatter, "reduce": _reduce, "all_to_all": _all_to_all, "barrier": _barrier,
    "gather": _gather, "scatter": _scatter}
REFERENCE_OPS = tuple(_GLOO)
_IN_PLACE = ("allreduce", "broadcast", "reduce")  # the result is the caller's tensor


def tolerance(stack: torch.Tensor, op: Any = "sum") -> torch.Tensor:
    """Per-element bound on ``|lab - gloo|`` for a reduction of ``stack`` (ranks x elements).

    Both sides add the same N values in different orders; each result is within
    (N-1)·eps·Σ|x| of the exact sum, so they differ by at most 2(N-1)·eps·Σ|x| (relative to
    Π|x| for prod, plus one rounding of the division for avg). Integers, min and max: exact.
    """
    n = stack.shape[0]
    op = parse_op(op).value
    if not stack.dtype.is_floating_point or op in ("min", "max") or n == 1:
        return torch.zeros(stack.shape[1:], dtype=torch.float64)
    eps = _EPSILON[stack.dtype]
    magnitude = stack.double().abs()
    if op == "prod":
        return 2 * (n - 1) * eps * magnitude.prod(0)
    if op == "avg":
        return (2 * (n - 1) + 1) * eps * magnitude.sum(0) / n
    return 2 * (n - 1) * eps * magnitude.sum(0)


def _gloo_rank(mesh: Mesh, op: str, inputs: list, options: dict[str, Any]) -> Any:
    return gloo_collective(mesh, op, inputs[mesh.rank], **options)


def gloo_reference(op: str, world_size: int, inputs: list, /, **options: Any) -> list:
    """Run collective ``op`` through gloo on ``inputs`` (one tensor per rank); per-rank outputs.

    ``op`` is positional, so the reduction can still be given as a keyword (``op="max"``).

        >>> lab.gloo_reference("allreduce", 2, [torch.ones(3), torch.ones(3)])
        [tensor([2., 2., 2.]), tensor([2., 2., 2.])]
    """
    from lab.launch import spawn

    if op not in REFERENCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REFERENCE_OPS))}; got {op!r}")
    if len(inputs) != world_size:
        raise ValueError(f"inputs must hold one tensor per rank ({world_size}); got {len(inputs)}")
    return spawn(_gloo_rank, world_size, args=(op, list(inputs), options))
