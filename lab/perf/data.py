"""``lab.perf``'s data: each rank's input pattern, the exact result it must hold, the check."""

from __future__ import annotations

import numpy as np
import torch

from lab.catalog import COLLECTIVES as CATALOG
from lab.perf.spec import TYPES, Spec


def layout(collective: str, nbytes: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """``(size, count)`` as nccl-tests prints them for ``nbytes`` (its getCollByteCount): where the
    collective splits the buffer in N, count is each rank's share and size N shares.

    >>> layout("allreduce", 1024, 3, 4), layout("allgather", 1024, 3, 4)
    ((1024, 256), (1020, 85))
    """
    count = nbytes // itemsize
    if CATALOG[collective].splits:
        count //= world_size
        return count * world_size * itemsize, count
    return count * itemsize, count


#: The int64 arrays of a buffer's length a rank builds at once at most (indices, patterns, exact results).
INT64_ARRAYS = 5


def rank_bytes(nbytes: int, itemsize: int) -> int:
    """About the most memory a rank holds at a size of ``nbytes`` (nccl-tests' size, the whole
    buffer) of ``itemsize``-byte elements: its send and receive buffers and :data:`INT64_ARRAYS`
    int64 arrays of as many elements (an upper bound of the measured peaks: 10 bytes a byte of
    size for allreduce of float, 40 of int8).

    >>> rank_bytes(1 << 20, 4)
    12582912
    """
    return 2 * nbytes + INT64_ARRAYS * 8 * (nbytes // itemsize)


def exact_limit(dtype: str) -> int:
    """The integers up to which ``dtype`` holds every one exactly (its largest, for integer types)."""
    torch_dtype = TYPES[dtype]
    if torch_dtype.is_floating_point:
        return 2 * round(1 / torch.finfo(torch_dtype).eps)  # 2 ** (mantissa bits + 1)
    return int(torch.iinfo(torch_dtype).max)


def _period(world_size: int, op: str | None, limit: int) -> int:
    """How many indices the pattern runs before it repeats: every partial result stays exact."""
    power = {"sum": 2, "avg": 3}.get(op or "", 1)  # a sum of N values; avg's values carry a factor N more
    return max(1, min(1 << 20, limit // world_size**power))


def pattern(index: np.ndarray, rank: int, world_size: int, op: str | None, limit: int) -> np.ndarray:
    """A rank's inputs at ``index`` (int64): ``(index mod P)·N + rank``, distinct for every rank and
    index within a period of P (so a block in the wrong place shows), times N for avg (so each
    rank's share, and the average, is an integer); for prod 1 or 2, so products are powers of two.
    P keeps every partial result an exact integer of the type, whatever order the algorithm adds in.

    >>> pattern(np.arange(4), rank=1, world_size=2, op="sum", limit=2 ** 24).tolist()
    [1, 3, 5, 7]
    """
    if op == "prod":
        return 1 + (index + rank) % 2
    values = (index % _period(world_size, op, limit)) * world_size + rank
    return values * world_size if op == "avg" else values


def reduced(index: np.ndarray, world_size: int, op: str, limit: int) -> np.ndarray:
    """The exact reduction of every rank's :func:`pattern` at ``index``, in closed form (a rank's
    check would otherwise build all N ranks' inputs).

    >>> reduced(np.arange(4), world_size=2, op="sum", limit=2 ** 24).tolist()
    [1, 5, 9, 13]
    """
    n = world_size
    if op == "prod":  # 2 ** (the ranks whose index + rank is odd)
        return np.where(index % 2 == 0, 1 << (n // 2), 1 << ((n + 1) // 2)).astype(np.int64)
    base = (index % _period(n, op, limit)) * n
    return {"min": base, "max": base + n - 1}.get(op, n * base + n * (n - 1) // 2)  # sum; avg = sum of x/N


def as_tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    """Exact integers as a tensor of nccl-tests type ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(TYPES[dtype])


def count_wrong(result: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``result`` that are not ``expected``'s, bit for bit (all of them where the
    shapes differ).

    >>> count_wrong(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0]))
    1
    """
    if result.shape != expected.shape or result.dtype != expected.dtype:
        return max(result.numel(), expected.numel())
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[result.element_size()]
    return int((result.reshape(-1).view(bits) != expected.reshape(-1).view(bits)).sum())


def expected(spec: Spec, count: int, rank: int, world_size: int) -> torch.Tensor:
    """What rank ``rank`` holds after the collective, each rank's input its :func:`pattern` over
    ``count`` elements (allgather) or N·count (reduce_scatter, alltoall)."""
    n, limit, op, name = world_size, exact_limit(spec.dtype), spec.op, spec.collective
    own = np.arange(count, dtype=np.int64)  # indices of the elements this rank ends up with
    block = own + rank * count  # ... and of its block in every rank's input (reduce_scatter, alltoall)
    if name == "allreduce" or (name == "reduce" and rank == spec.root):
        values = reduced(own, n, op, limit)
    elif name in ("broadcast", "reduce"):  # reduce: the others' tensors are left as they were
        values = pattern(own, spec.root if name == "broadcast" else rank, n, op, limit)
    elif name == "reduce_scatter":
        values = reduced(block, n, op, limit)
    elif name == "allgather":
        values = np.concatenate([pattern(own, j, n, op, limit) for j in range(n)])
    else:  # all_to_all
        values = np.concatenate([pattern(block, j, n, op, limit) for j in range(n)])
    return as_tensor(values, spec.dtype)
