"""PAT's schedule: which blocks each message of NCCL's Parallel Aggregated Trees carries, in order.

Read from NCCL's ``PatRSAlgorithm`` and ``PatAGAlgorithm`` (src/include/collectives.h, 2.23 on)
and written anew as a list of messages. Offsets are relative: at rank r, offset s names block
(r + s) mod N. Dimension d links rank r with ranks r ± 2^d; N is padded to P = 2^⌈log2 N⌉ and
offsets past N are skipped (NCCL's ``s >= nranks``).

Reduce-scatter: the partial of offset s > 0 leaves once, over dimension lowbit(s) (the lowest
set bit of s), and is folded into offset s - 2^lowbit(s) of the rank it reaches, so block r's
partials climb a binomial tree rooted at r. Allgather runs the same trees the other way.
NCCL's *aggregation* packs the partials that cross the same dimension at the same time into one
message: F of them, at a stride of D = P/F offsets (``aggFactor``, ``aggDelta``). NCCL sizes F
to its step buffers; the lab's messages have no such limit, so it takes NCCL's largest F, the
smallest power of two >= ⌊N/2⌋, whence D is 2, or 4 when N = 2^k + 1. The messages:

- *low groups* g = 1..D-1: offsets s ≡ g (mod D), over dimension lowbit(g);
- *high dimensions* d = log2 D..log2 P - 1: offsets whose lowest bit is d, one message each.

Reduce-scatter sends the low groups from g = D-1 down to 1 (NCCL's ``as`` loop), then the high
dimensions upwards (its ``scale`` loop); allgather the high dimensions downwards, then the low
groups depth-first, the farther peer first (its ``nextAs``: 2, 3, 1 for D = 4). Each is one
message per entry: ⌈log2 N⌉ of them, or ⌈log2 N⌉ + 1 when N = 2^k + 1 > 3, and N-1 blocks in all.

Per rank, N = 8::

    reduce_scatter_messages(8)   # ((0, (1, 3, 5, 7)), (1, (2, 6)), (2, (4,)))
    allgather_messages(8)        # ((2, (4,)), (1, (2, 6)), (0, (1, 3, 5, 7)))
    reduce_scatter_messages(5)   # ((0, (3,)), (1, (2,)), (0, (1,)), (2, (4,)))
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np


def aggregation(world_size: int) -> tuple[int, int]:
    """(F, D): NCCL's ``aggFactor`` at its largest (F < ⌊N/2⌋ doubles it) and ``aggDelta`` = P/F."""
    padded = 1 << (world_size - 1).bit_length() if world_size > 1 else 1
    factor = 1
    while factor < world_size // 2:
        factor *= 2
    return factor, padded // factor


def lowest_bit(offset: int) -> int:
    """The index of ``offset``'s lowest set bit (``offset`` > 0): the dimension it moves over."""
    return (offset & -offset).bit_length() - 1


def _low_group(world_size: int, group: int, delta: int) -> tuple[int, range]:
    return lowest_bit(group), range(group, world_size, delta)


def _high_dimension(world_size: int, dim: int) -> tuple[int, range]:
    return dim, range(1 << dim, world_size, 2 << dim)


def _depth_first(base: int, dims: int) -> Iterator[int]:
    """The low groups below ``base`` in ``PatAGAlgorithm::nextAs``'s order: farther peer first."""
    for dim in reversed(range(dims)):
        yield base + (1 << dim)
        yield from _depth_first(base + (1 << dim), dim)


@functools.cache
def reduce_scatter_messages(world_size: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(dimension d, offsets s) of each reduce-scatter message in order: rank r sends its partials of
    blocks r + s to rank r + 2^d, which folds them into its partials of the same blocks."""
    factor, delta = aggregation(world_size)
    low_dims, dims = delta.bit_length() - 1, (factor * delta).bit_length() - 1
    messages = [_low_group(world_size, g, delta) for g in range(delta - 1, 0, -1)]
    messages += [_high_dimension(world_size, d) for d in range(low_dims, dims)]
    return tuple((dim, tuple(offsets)) for dim, offsets in messages if offsets)


@functools.cache
def allgather_messages(world_size: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(dimension d, offsets s) of each allgather message in order: rank r receives blocks r + s from
    rank r + 2^d, which holds them at offsets s - 2^d."""
    factor, delta = aggregation(world_size)
    low_dims, dims = delta.bit_length() - 1, (factor * delta).bit_length() - 1
    messages = [_high_dimension(world_size, d) for d in reversed(range(low_dims, dims))]
    messages += [_low_group(world_size, g, delta) for g in _depth_first(0, low_dims)]
    return tuple((dim, tuple(offsets)) for dim, offsets in messages if offsets)


def message_count(world_size: int) -> int:
    """How many messages each rank sends (and receives): the latency steps of either collective."""
    return len(reduce_scatter_messages(world_size))


def packed(blocks: list[np.ndarray]) -> np.ndarray:
    """The blocks one after the other: the block itself when there is one (no copy)."""
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def landing(blocks: list[np.ndarray]) -> np.ndarray:
    """Where a message for ``blocks`` is received: the block itself when there is one, else a new
    buffer that :func:`unpack` spreads over them."""
    if len(blocks) == 1:
        return blocks[0]
    return np.empty_like(blocks[0], shape=(sum(block.size for block in blocks),))


def unpack(message: np.ndarray, blocks: list[np.ndarray]) -> None:
    """Copy ``message`` into ``blocks`` in order (nothing to do when it is the one block itself)."""
    if len(blocks) > 1:
        start = 0
        for block in blocks:
            block[...] = message[start:start + block.size]
            start += block.size
