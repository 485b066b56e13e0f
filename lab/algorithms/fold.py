"""The standard fold that lets power-of-two algorithms run on any number of ranks (MPICH's).

With p the largest power of two <= N and r = N - p extra ranks, the first 2r ranks pair up:
even rank 2i hands its data to odd rank 2i+1 before the algorithm and gets its share back after
it, and sits out in between. The p ranks left are numbered 0..p-1 ("virtual ranks"): odd rank
2i+1 becomes i (i < r), rank j >= 2r becomes j - r. So virtual rank v speaks for the original
blocks 2v and 2v+1 (v < r) or block v + r: always a contiguous run, in rank order, which keeps
every message of the power-of-two algorithms one contiguous slice.

    N = 6 (p = 4, r = 2):   ranks  0 1 | 2 3 | 4 5
                            virtual  - 0 |  - 1 | 2 3      (ranks 0 and 2 sit out)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lab.compiled import compilable

if TYPE_CHECKING:
    from lab.algorithms.peers import Peers
    from lab.ops import Reduction


class Fold(NamedTuple):
    """Where ``rank`` stands in the fold of ``world_size`` ranks (made by :func:`fold_of`)."""

    world_size: int
    rank: int
    p: int  # the largest power of two <= N: how many ranks run the power-of-two algorithm
    extra: int  # r = N - p: how many ranks sit out (the even ranks 0, 2, ..., 2r-2)
    sits_out: bool  # even ranks below 2r: they hand their data to rank + 1 and wait for the result
    folded: bool  # odd ranks below 2r: they act for themselves and for rank - 1
    vrank: int  # this rank's number among the p ranks that run the algorithm (not for one that sits out)


@compilable
def fold_of(world_size: int, rank: int) -> Fold:
    """``rank``'s place in the fold of ``world_size`` ranks."""
    p = 1
    while p * 2 <= world_size:
        p *= 2
    extra = world_size - p
    paired = rank < 2 * extra
    return Fold(world_size, rank, p, extra, paired and rank % 2 == 0, paired and rank % 2 == 1,
                rank // 2 if paired else rank - extra)


@compilable
def real_rank(fold: Fold, vrank: int) -> int:
    """The rank that plays virtual rank ``vrank``."""
    return 2 * vrank + 1 if vrank < fold.extra else vrank + fold.extra


@compilable
def virtual_bounds(fold: Fold, bounds: np.ndarray) -> np.ndarray:
    """Element bounds per virtual rank (a (p, 2) array), from element bounds per original block
    (one ``(start, stop)`` row per rank): virtual rank v spans blocks 2v and 2v + 1 (v < r) or
    block v + r."""
    spans = np.empty((fold.p, 2), np.int64)
    for v in range(fold.p):
        first, last = (2 * v, 2 * v + 1) if v < fold.extra else (v + fold.extra, v + fold.extra)
        spans[v, 0], spans[v, 1] = bounds[first][0], bounds[last][1]
    return spans


@compilable
def enter_allreduce(fold: Fold, peers: Peers, buf: np.ndarray, reduction: Reduction) -> bool:
    """Fold-in for an allreduce: a rank that sits out hands ``buf`` to its odd neighbour and
    waits for the finished result (returns False: it is done); a folded rank reduces its even
    neighbour's tensor into ``buf`` and speaks for both (returns True, as do the others)."""
    if fold.sits_out:
        peers.send_buffer(fold.rank + 1, buf)
        peers.recv_buffer(fold.rank + 1, buf)
        return False
    if fold.folded:
        peers.recv_buffer(fold.rank - 1, buf, reduction)
    return True


@compilable
def leave_allreduce(fold: Fold, peers: Peers, buf: np.ndarray) -> None:
    """Fold-out: a folded rank gives its even neighbour the result."""
    if fold.folded:
        peers.send_buffer(fold.rank - 1, buf)


class PowerTerms(NamedTuple):
    """The powers of two in N ranks' costs: ``d`` = ⌈log2 N⌉, ``p`` = 2^⌊log2 N⌋, ``lp`` = log2 p,
    and ``f`` = 2 when the fold runs (N not a power of two: its hand-over and hand-back steps each
    move the whole tensor), else 0."""

    d: int
    p: int
    lp: int
    f: int


def power_terms(world_size: int) -> PowerTerms:
    lp = world_size.bit_length() - 1
    p = 1 << lp
    d = (world_size - 1).bit_length()  # ⌈log2 N⌉, 0 for N = 1
    return PowerTerms(d, p, lp, 0 if world_size == p else 2)
