"""Recursive-halving reduce-scatter: log2 N exchanges of halving size (MPICH's short-to-mid choice)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import Fold, fold_of, power_terms, real_rank, virtual_bounds
from lab.algorithms.peers import Peers
from lab.compiled import compilable
from lab.ops import Reduction


@compilable
def halve(peers: Peers, buf: np.ndarray, reduction: Reduction, fold: Fold, vbounds: list[tuple[int,
                                                                                               int]]) -> None:
    """The power-of-two core, on virtual ranks: leave the reduction of ``buf[vbounds[v]]`` on v.

    Round k (k = 1..log2 p) pairs v with v XOR p/2^k. Each still holds partial sums for a run of
    2·p/2^k virtual ranks' blocks; it sends the half its partner keeps and folds the partner's
    copy of its own half into its own: the run halves every round.
    """
    v, lo, hi = fold.vrank, 0, fold.p
    mask = fold.p // 2
    while mask:
        partner, mid = v ^ mask, lo + mask
        keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
        # Send the half the partner keeps; fold the partner's partial sums of our half into ours.
        peers.sendrecv_buffer(real_rank(fold, partner), buf[vbounds[give[0]][0]:vbounds[give[1] - 1][1]],
                              real_rank(fold, partner), buf[vbounds[keep[0]][0]:vbounds[keep[1] - 1][1]],
                              reduction)
        lo, hi = keep
        mask //= 2


@compilable
def reduce_scatter_recursive_halving(peers: Peers, buf: np.ndarray, reduction: Reduction,
                                     bounds: list[tuple[int, int]]) -> None:
    """Leave the reduction over all ranks of chunk ``peers.rank`` (``buf[bounds[rank]]``) in place.

    Powers of two: log2 N rounds; in round k rank r exchanges with r XOR N/2^k, sending the half
    of its current run of blocks that the partner keeps (T/2, then T/4, ... T/N bytes) and
    reducing the other half. Other N: the standard fold (:mod:`lab.algorithms.fold`): even ranks
    below 2r hand their whole buffer to the odd neighbour first and get their block back last.
    Other chunks of ``buf`` are left holding partial sums.

    Cost (N = 2^k): log2 N·α + (N-1)/N·T·β, the ring's bandwidth term in log2 N steps instead of
    N-1. Other N: (log2 p + 2)·α + ((p-1)/p + 1)·T·β on the folded pairs.

    Bytes, exactly (T = bytes of ``buf``, B_i = bytes of block i, G_k(v) = bytes of the blocks
    of the 2^k virtual ranks in v's aligned group of 2^k, S(v) = G_0(v) = v's own blocks):

    - N = 2^k, N | count: every rank sends and receives (N-1)/N·T.
    - virtual rank v (core): sends T - S(v), receives Σ_{k=0}^{log2 p - 1} G_k(v);
      a folded odd rank 2i+1 also receives T (fold-in) and sends B_{2i} (its partner's block);
    - an even rank 2i < 2r: sends T, receives B_{2i}.

    Per rank, N=3, sum, ``buf`` = [r, r, r] with one element per chunk::

        rank 0 -> buf[0] == 3;  rank 1 -> buf[1] == 3;  rank 2 -> buf[2] == 3
    """
    n, rank = peers.world_size, peers.rank
    fold = fold_of(n, rank)
    mine = buf[bounds[rank][0]:bounds[rank][1]]
    if fold.sits_out:
        # Hand everything to the odd neighbour; it sends back our finished block at the end.
        peers.send_buffer(rank + 1, buf)
        peers.recv_buffer(rank + 1, mine)
        return
    if fold.folded:
        # Fold the even neighbour's whole buffer into ours: we now speak for both.
        peers.recv_buffer(rank - 1, buf, reduction)
    vbounds = virtual_bounds(fold, bounds)
    halve(peers, buf, reduction, fold, vbounds)
    # Our blocks hold every contribution: finish them here, once (avg divides).
    start, stop = vbounds[fold.vrank]
    reduction.finalize(buf[start:stop], n)
    if fold.folded:
        # Give the even neighbour its finished block.
        peers.send_buffer(rank - 1, buf[bounds[rank - 1][0]:bounds[rank - 1][1]])


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n, t = world_size, power_terms(world_size)
    return t.lp + t.f, (n - 1) / n + t.f / 2
