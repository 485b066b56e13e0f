"""Tree allreduce: binomial reduce to rank 0, then binomial broadcast (latency-optimal)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.broadcast_binomial import broadcast_binomial
from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable
from lab.ops import Reduction


@compilable
def allreduce_tree(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks in 2·ceil(log2 N) rounds of whole-tensor messages.

    Cost: 2·ceil(log2 N)·(α + T·β): fewer steps than the ring's 2(N-1), so it wins when α
    dominates (small tensors), and loses when T·β does. Rank 0 receives and sends
    ceil(log2 N)·T bytes; a leaf sends T and receives T. Results are bit-identical on every rank
    (rank 0 reduces, everyone receives its bytes).

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = peers.world_size, peers.rank
    # Reduce up the tree: at distance 1, 2, 4, ... fold in a child's partial result, until we
    # are the child at that distance and hand ours to the parent.
    mask = 1
    while mask < n:
        if rank & mask:
            peers.send_buffer(rank - mask, buf)
            break
        if rank + mask < n:
            peers.recv_buffer(rank + mask, buf, reduction)
        mask <<= 1
    # Rank 0 holds everything: finish it there once (avg divides), so all ranks get its bits.
    if rank == 0:
        reduction.finalize(buf, n)
    # Broadcast down the same tree.
    broadcast_binomial(peers, buf, 0)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    return 2 * d, 2 * d


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    # one message per child, plus one to the parent
    children, mask = 0, 1
    while mask < world_size and not rank & mask:
        children += rank + mask < world_size
        mask <<= 1
    messages = children + (rank != 0)
    return messages * total, f"{messages}T"
