"""Naive allreduce: everyone sends to rank 0, rank 0 sends the result back (the O(N) baseline)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.ops import Reduction


def allreduce_naive(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks through rank 0: the lesson's bad baseline.

    Cost: 2(N-1)·(α + T·β), all of it through one rank: rank 0 receives (N-1)·T bytes and sends
    (N-1)·T bytes, so its link is the bottleneck and the time grows linearly with N. Every other
    rank sends T and receives T.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = peers.world_size, peers.rank
    if rank == 0:
        # Fold in every other rank's whole tensor, one after the other.
        for src in range(1, n):
            peers.recv_buffer(src, buf, reduction)
        reduction.finalize(buf, n)
        # Send the result back to each of them, one after the other.
        for dst in range(1, n):
            peers.send_buffer(dst, buf)
    else:
        peers.send_buffer(0, buf)
        peers.recv_buffer(0, buf)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return 2 * (n - 1), 2 * (n - 1)


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    return (total * (world_size - 1), "(N-1)T") if rank == 0 else (total, "T")
