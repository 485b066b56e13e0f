"""Halving-doubling allreduce (Rabenseifner): recursive-halving reduce-scatter, then
recursive-doubling allgather (MPICH's choice for long tensors; gloo's halving_doubling)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.allgather_recursive_doubling import double
from lab.algorithms.fold import enter_allreduce, fold_of, leave_allreduce, power_terms
from lab.algorithms.peers import Peers
from lab.algorithms.reduce_scatter_recursive_halving import halve
from lab.chunking import split_bounds
from lab.ops import Reduction


def allreduce_halving_doubling(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks in 2·log2 N rounds of halving, then doubling size.

    The tensor is cut into p chunks (p = 2^⌊log2 N⌋). Reduce-scatter by recursive halving: in
    round k rank v swaps half of what it still reduces with v XOR p/2^k (T/2, T/4, ... T/p
    bytes), leaving the finished chunk v on v. Allgather by recursive doubling: the same
    exchanges in reverse (T/p, ... T/2), until every rank has every chunk. Non-powers of two:
    the standard fold (:mod:`lab.algorithms.fold`): the even ranks below 2r hand their whole
    tensor to the odd neighbour first and get the whole result back at the end.

    Cost (N = 2^k): 2·log2 N·α + 2(N-1)/N·T·β: the ring's bandwidth term with log2 N steps
    instead of N-1, so it beats the ring whenever α matters. Other N: (2·log2 p + 2)·α +
    (2(p-1)/p + 2)·T·β on the folded pairs. Bit-identical on every rank: each chunk is reduced
    once, on its owner, and then copied.

    Bytes, exactly (T = bytes of ``buf``, chunk v = ``split_bounds(count, p)[v]``): every rank
    that runs the rounds sends and receives 2(p-1)/p·T when p divides the element count (in
    general: T - C_v + Σ_k G_k(v) each way, C_v its chunk, G_k(v) its aligned group of 2^k
    chunks); the odd ranks below 2r also receive T (fold-in) and send T (fold-out); the even
    ranks below 2r send T and receive T, nothing else.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = peers.world_size, peers.rank
    fold = fold_of(n, rank)
    # Fold in: an even rank below 2r hands its tensor to its odd neighbour and waits for the result.
    if not enter_allreduce(fold, peers, buf, reduction):
        return
    chunks = split_bounds(buf.size, fold.p)
    # Reduce-scatter by recursive halving: chunk v ends fully reduced on virtual rank v.
    halve(peers, buf, reduction, fold, chunks)
    # Finish our chunk once, here (avg divides), so every rank gets these bits.
    start, stop = chunks[fold.vrank]
    reduction.finalize(buf[start:stop], n)
    # Allgather by recursive doubling: every virtual rank ends with every chunk.
    double(peers, buf, fold, chunks)
    # Fold out: give the even neighbour the result.
    leave_allreduce(fold, peers, buf)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    t = power_terms(world_size)
    return 2 * t.lp + t.f, 2 * (t.p - 1) / t.p + t.f


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    fold = fold_of(world_size, rank)
    if fold.sits_out:
        return total, "T (folded out)"
    return (2 * total * (fold.p - 1) // fold.p + (total if fold.folded else 0),
            "2T(p-1)/p" + (" + T (fold)" if fold.folded else ""))
