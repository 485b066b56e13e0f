"""Recursive-doubling allgather: log2 N exchanges of doubling size (latency-optimal)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import Fold, fold_of, power_terms, real_rank, virtual_bounds
from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def double(peers: Peers, buf: np.ndarray, fold: Fold, vbounds: list[tuple[int, int]]) -> None:
    """The power-of-two core, on virtual ranks: given ``buf[vbounds[v]]`` on every v, fill in all.

    Round k (k = 0..log2 p - 1) pairs v with v XOR 2^k; each sends the run of 2^k virtual ranks'
    blocks it has (its aligned group) and receives the partner's group, so the run doubles.
    """
    v, mask = fold.vrank, 1
    while mask < fold.p:
        partner = v ^ mask
        mine, theirs = v - v % mask, partner - partner % mask
        # Swap aligned groups of `mask` virtual ranks' blocks: ours for the partner's.
        peers.sendrecv_buffer(real_rank(fold, partner), buf[vbounds[mine][0]:vbounds[mine + mask - 1][1]],
                              real_rank(fold, partner), buf[vbounds[theirs][0]:vbounds[theirs + mask - 1][1]])
        mask *= 2


@compilable
def allgather_recursive_doubling(peers: Peers, buf: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Given chunk ``peers.rank`` of ``buf`` on every rank, fill in every other chunk.

    Powers of two: log2 N rounds; in round k rank r swaps with r XOR 2^k everything it has so far
    (T/N, then 2T/N, ... T/2 bytes). Other N: the standard fold (:mod:`lab.algorithms.fold`):
    even ranks below 2r hand their chunk to the odd neighbour first and receive the whole
    result last.

    Cost (N = 2^k): log2 N·α + (N-1)/N·T·β for a T-byte result: the ring's bandwidth in log2 N
    steps instead of N-1. Other N: (log2 p + 2)·α + ((N-1)/N + 1)·T·β on the folded pairs.

    Bytes, exactly (T = bytes of the result, B_i = bytes of chunk i, G_k(v) = bytes of the chunks
    of the 2^k virtual ranks in v's aligned group of 2^k, S(v) = G_0(v)):

    - N = 2^k, N | count: every rank sends and receives (N-1)/N·T.
    - virtual rank v (core): sends Σ_{k=0}^{log2 p - 1} G_k(v), receives T - S(v);
      a folded odd rank 2i+1 also receives B_{2i} (fold-in) and sends T (fold-out);
    - an even rank 2i < 2r: sends B_{2i}, receives T.

    Per rank, N=3, ``buf`` = [0, 0, 0] with ``buf[r] = 10 + r`` on rank r::

        every rank -> buf == [10, 11, 12]
    """
    n, rank = peers.world_size, peers.rank
    fold = fold_of(n, rank)
    if fold.sits_out:
        # Hand our chunk to the odd neighbour; it sends back the whole result at the end.
        peers.send_buffer(rank + 1, buf[bounds[rank][0]:bounds[rank][1]])
        peers.recv_buffer(rank + 1, buf)
        return
    if fold.folded:
        # Take the even neighbour's chunk: we now speak for both.
        peers.recv_buffer(rank - 1, buf[bounds[rank - 1][0]:bounds[rank - 1][1]])
    double(peers, buf, fold, virtual_bounds(fold, bounds))
    if fold.folded:
        # Give the even neighbour the whole result.
        peers.send_buffer(rank - 1, buf)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n, t = world_size, power_terms(world_size)
    return t.lp + t.f, (n - 1) / n + t.f / 2
