"""Recursive-doubling allreduce: log2 N whole-tensor exchanges (MPICH's choice for short tensors)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import enter_allreduce, fold_of, leave_allreduce, power_terms, real_rank
from lab.algorithms.peers import Peers
from lab.compiled import compilable
from lab.ops import Reduction


@compilable
def allreduce_recursive_doubling(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks in log2 N rounds of whole-tensor exchange.

    Round k pairs rank r with r XOR 2^k: both send their whole partial result and fold in the
    other's, so after round k each rank holds the reduction of its aligned group of 2^(k+1).
    Non-powers of two: the standard fold (:mod:`lab.algorithms.fold`): the even ranks below 2r
    hand their tensor to the odd neighbour first and get the result back at the end.

    Bit-identical on every rank: partners compute ``mine ⊕ theirs`` and ``theirs ⊕ mine``,
    which are the same bits because every kernel is commutative (IEEE addition and
    multiplication are; float16/bfloat16 round the same float32 value), so by induction each
    group of 2^k holds identical bits; avg divides the identical sum identically on every rank.

    Cost (N = 2^k): log2 N·(α + T·β): the fewest steps of any allreduce, but every step moves
    the whole tensor, so it wins for small T. Other N: (log2 p + 2)·(α + T·β).

    Bytes, exactly (T = bytes of ``buf``, p = 2^⌊log2 N⌋, r = N - p): every rank that runs the
    rounds sends and receives log2(p)·T; the odd ranks below 2r also receive T (fold-in) and send
    T (fold-out); the even ranks below 2r send T and receive T, nothing else.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = peers.world_size, peers.rank
    fold = fold_of(n, rank)
    # Fold in: an even rank below 2r hands its tensor to its odd neighbour and waits for the result.
    if not enter_allreduce(fold, peers, buf, reduction):
        return
    v, mask = fold.vrank, 1
    incoming = np.empty_like(buf)
    while mask < fold.p:
        partner = real_rank(fold, v ^ mask)
        # Swap whole partial results with the partner, then fold theirs into ours.
        peers.sendrecv_buffer(partner, buf, partner, incoming)
        reduction.combine(buf, incoming)
        mask *= 2
    # Every rank holds the same bits of the full reduction: finish it (avg divides) identically.
    reduction.finalize(buf, n)
    # Fold out: give the even neighbour the result.
    leave_allreduce(fold, peers, buf)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    t = power_terms(world_size)
    return t.lp + t.f, t.lp + t.f


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    fold = fold_of(world_size, rank)
    if fold.sits_out:
        return total, "T (folded out)"
    lp = fold.p.bit_length() - 1
    return lp * total + (total if fold.folded else 0), f"{lp}T" + (" + T (fold)" if fold.folded else "")
