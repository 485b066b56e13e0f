"""Double binary tree allreduce (NCCL's): two complementary binary trees, each reducing and
broadcasting half of the tensor, pipelined in segments."""

from __future__ import annotations

import numpy as np

from lab.chunking import split_bounds
from lab.collectives.fold import power_terms
from lab.peers import Peers
from lab.ops import Reduction

#: Pipeline segment: each half of the tensor travels up and down its tree in pieces this big.
SEGMENT_BYTES = 64 * 1024


def binary_tree(world_size: int, rank: int) -> tuple[int, list[int]]:
    """(parent, children) of ``rank`` in NCCL's in-order binary tree (parent -1 at the root).

    A rank's level is its lowest set bit b: odd ranks are leaves, rank r has children r - b/2 and
    r + b/2 (the right one moved down while it is past the end), and rank 0 is the root with one
    child, the largest power of two below N. Depth: ⌈log2 N⌉.

        N = 6:  0
                └─ 4
                   ├─ 2 ─┬─ 1
                   │     └─ 3
                   └─ 5
    """
    if rank == 0:
        top = 1 << (world_size - 1).bit_length() if world_size > 1 else 1
        return -1, [top >> 1] if world_size > 1 else []
    bit = rank & -rank
    parent = (rank ^ bit) | (bit << 1)
    if parent >= world_size:
        parent = rank ^ bit
    children, low = [], bit >> 1
    if low:
        children.append(rank - low)
        while low and rank + low >= world_size:
            low >>= 1
        if low:
            children.append(rank + low)
    return parent, children


def double_trees(world_size: int, rank: int) -> list[tuple[int, list[int]]]:
    """(parent, children) of ``rank`` in each of the two trees.

    The second tree is the first mirrored (r -> N-1-r) when N is even, shifted by one
    (r -> r-1 mod N) when N is odd: the first tree's leaves (odd ranks) are the second's inner
    nodes, so every rank forwards data in one tree and only sends and receives once in the other.
    """
    if world_size % 2 == 0:
        to, back = (lambda r: world_size - 1 - r), (lambda r: world_size - 1 - r)
    else:
        to, back = (lambda r: (r - 1) % world_size), (lambda r: (r + 1) % world_size)
    parent, children = binary_tree(world_size, to(rank))
    second = (back(parent) if parent >= 0 else -1, [back(c) for c in children])
    return [binary_tree(world_size, rank), second]


def allreduce_double_tree(peers: Peers, buf: np.ndarray, reduction: Reduction, segment_bytes: int = SEGMENT_BYTES) -> None:
    """Reduce ``buf`` in place across all ranks: half through each of two binary trees.

    Tree t reduces half t of the tensor to its root and broadcasts it back down, segment by
    segment (``segment_bytes`` each), so a rank forwards segment s while its children already
    send segment s+1. Each rank handles the segments in one fixed order, (phase, segment, tree),
    reduce phase first: every wait is on a message earlier in that order, so no cycle of blocked
    sends can form, however small the transport's buffers.

    Cost: about 2·⌈log2 N⌉·α for the first segment to go up and down, then each further segment
    adds its own steps; bandwidth: a rank that is an inner node in one tree (two children) and a
    leaf in the other sends and receives 2T, but the depth stays log2 N while the ring's grows
    as N: it wins at large N where neither tree nor ring does. Bit-identical on every rank: each
    segment is reduced once, at its tree's root, and copied down.

    Bytes, exactly (T_t = bytes of half t, ``split_bounds(count, 2)``; c_t = this rank's
    children in tree t; u_t = 1 unless it is tree t's root): sends and receives
    Σ_t (c_t + u_t)·T_t. With N even, a rank sends 2T as an inner node of one tree and a leaf of
    the other (3·T/2 + T/2); the roots less.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n = peers.world_size
    trees = double_trees(n, peers.rank)
    halves = [buf[a:b] for a, b in split_bounds(buf.size, 2)]
    per_segment = max(1, segment_bytes // max(buf.itemsize, 1))
    segments = max(1, -(-halves[0].size // per_segment))
    pieces = [[half[s * per_segment:(s + 1) * per_segment] for s in range(segments)] for half in halves]
    # Reduce phase: fold each child's segment into ours, then hand the sum to our parent.
    for s in range(segments):
        for (parent, children), half in zip(trees, pieces):
            for child in children:
                peers.recv_buffer(child, half[s], reduction)
            if parent >= 0:
                peers.send_buffer(parent, half[s])
            else:
                reduction.finalize(half[s], n)  # the root holds every contribution: finish it once
    # Broadcast phase: take the finished segment from our parent, pass it to our children.
    for s in range(segments):
        for (parent, children), half in zip(trees, pieces):
            if parent >= 0:
                peers.recv_buffer(parent, half[s])
            for child in children:
                peers.send_buffer(child, half[s])


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    # the first segment's trip up and down (later ones pipeline behind it); an inner node that is
    # also a leaf moves 2T
    return 2 * d, 2.0


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    # each half, T/2, once per child and once to the parent, in each tree
    links = sum(len(children) + (parent >= 0) for parent, children in double_trees(world_size, rank))
    return links * total // 2, f"{links}T/2"
