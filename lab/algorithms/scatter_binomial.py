"""Binomial-tree scatter from any root (MPICH's): ⌈log2 N⌉ rounds, each subtree's blocks sent once."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def relative_offset(bounds: list[tuple[int, int]], root: int, i: int) -> int:
    """Where relative slot ``i`` (rank ``root + i``'s block) starts when the blocks of ``bounds``
    are laid out from the root's on, wrapping round: rank root, root + 1, ..., N-1, 0, ...;
    ``i = N`` is the end of the whole layout."""
    n = len(bounds)
    first = bounds[root][0]
    if root + i < n:
        return bounds[root + i][0] - first
    return bounds[n - 1][1] - first + bounds[root + i - n][0]


@compilable
def scatter_binomial(peers: Peers, send: np.ndarray, recv: np.ndarray, bounds: list[tuple[int, int]],
                     src: int) -> None:
    """Leave block ``rank`` of rank ``src``'s ``send`` (``send[bounds[rank]]``) in ``recv`` on every rank.

    Ranks are numbered relative to the root (v = (rank - src) mod N). The root lays its blocks
    out in relative order (rotated so its own comes first); rank v receives the run of its
    subtree's blocks, relative ranks v .. v + 2^k - 1 (2^k: v's lowest set bit), from its parent
    in one message, then forwards each child's part of the run, farthest child first, and keeps
    the first block. Only the root's ``send`` is read.

    Cost: ⌈log2 N⌉·α + (N-1)/N·T·β for T = bytes of ``send`` (the root sends every other block
    once, through its link; every rank receives its subtree's blocks once).

    Bytes, exactly (B_j = bytes of rank j's block): rank v receives the blocks of its subtree,
    relative ranks v .. min(v + 2^k, N) - 1 (the root: none), and sends them all but its own.

    Per rank, N=3, src=1, ``send`` (on rank 1) = [10, 11, 12, 13]::

        rank 0 -> recv == [10, 11];  rank 1 -> recv == [12];  rank 2 -> recv == [13]
    """
    n, rank = peers.world_size, peers.rank
    relative = (rank - src) % n
    # Our subtree: relative ranks v .. end - 1 (the root's: all of them).
    mask = 1
    while mask < n and not relative & mask:
        mask <<= 1
    end = min(relative + mask, n)
    start = relative_offset(bounds, src, relative)
    if relative == 0:
        # The root: its blocks in relative order (already so when its own block comes first).
        first = bounds[src][0]
        work = send if first == 0 else np.concatenate((send[first:], send[:first]))
    else:
        # Receive our subtree's run from the parent (a leaf's run is its own block: straight into recv).
        size = relative_offset(bounds, src, end) - start
        work = recv if end == relative + 1 else np.empty_like(send[:size])
        peers.recv_buffer((rank - mask) % n, work)
    # Forward each child's part of the run, farthest subtree first.
    mask >>= 1
    while mask:
        child = relative + mask
        if child < n:
            peers.send_buffer((rank + mask) % n,
                              work[relative_offset(bounds, src, child) -
                                   start:relative_offset(bounds, src, min(child + mask, n)) - start])
        mask >>= 1
    # Keep our own block, the run's first.
    if end != relative + 1 or relative == 0:
        recv[:] = work[:relative_offset(bounds, src, relative + 1) - start]


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return power_terms(n).d, (n - 1) / n
