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

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

    from lab.peers import Peers
    from lab.ops import Reduction


@dataclass(frozen=True)
class Fold:
    """Where ``rank`` stands in the fold of ``world_size`` ranks."""

    world_size: int
    rank: int

    @property
    def p(self) -> int:
        """The largest power of two <= N: how many ranks run the power-of-two algorithm."""
        return 1 << (self.world_size.bit_length() - 1)

    @property
    def extra(self) -> int:
        """r = N - p: how many ranks sit out (the even ranks 0, 2, ..., 2r-2)."""
        return self.world_size - self.p

    @property
    def sits_out(self) -> bool:
        """Even ranks below 2r: they hand their data to rank + 1 and wait for the result."""
        return self.rank < 2 * self.extra and self.rank % 2 == 0

    @property
    def folded(self) -> bool:
        """Odd ranks below 2r: they act for themselves and for rank - 1."""
        return self.rank < 2 * self.extra and self.rank % 2 == 1

    @property
    def vrank(self) -> int:
        """This rank's number among the p ranks that run the algorithm (not for one that sits out)."""
        return self.rank // 2 if self.rank < 2 * self.extra else self.rank - self.extra

    def real(self, vrank: int) -> int:
        """The rank that plays virtual rank ``vrank``."""
        return 2 * vrank + 1 if vrank < self.extra else vrank + self.extra

    def blocks(self, vrank: int) -> tuple[int, int]:
        """The original blocks [first, stop) that virtual rank ``vrank`` speaks for."""
        return (2 * vrank, 2 * vrank + 2) if vrank < self.extra else (vrank + self.extra, vrank + self.extra + 1)

    def virtual_bounds(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Element bounds per virtual rank, from element bounds per original block (one per rank)."""
        spans = (self.blocks(v) for v in range(self.p))
        return [(bounds[first][0], bounds[stop - 1][1]) for first, stop in spans]

    def enter_allreduce(self, peers: Peers, buf: np.ndarray, reduction: Reduction) -> bool:
        """Fold-in for an allreduce: a rank that sits out hands ``buf`` to its odd neighbour and
        waits for the finished result (returns False: it is done); a folded rank reduces its even
        neighbour's tensor into ``buf`` and speaks for both (returns True, as do the others)."""
        if self.sits_out:
            peers.send_buffer(self.rank + 1, buf)
            peers.recv_buffer(self.rank + 1, buf)
            return False
        if self.folded:
            peers.recv_buffer(self.rank - 1, buf, reduction.combine)
        return True

    def leave_allreduce(self, peers: Peers, buf: np.ndarray) -> None:
        """Fold-out: a folded rank gives its even neighbour the result."""
        if self.folded:
            peers.send_buffer(self.rank - 1, buf)


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
