"""Ring allreduce: reduce-scatter, then allgather (bandwidth-optimal)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.allgather_ring import allgather_ring
from lab.algorithms.peers import Peers
from lab.algorithms.reduce_scatter_ring import reduce_scatter_ring
from lab.chunking import split_bounds
from lab.ops import Reduction


def allreduce_ring(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks, in 2(N-1) steps over chunks of about T/N.

    Cost: 2(N-1)·α + 2(N-1)/N·T·β. Each rank sends and receives exactly 2(N-1)/N·T bytes when N
    divides the element count (each chunk is sent N-1 times in each phase), which approaches 2T
    and never exceeds it however large N grows. Every rank ends with bit-identical results: each
    chunk is reduced once, in one order, on its owner, then copied verbatim round the ring.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    bounds = split_bounds(buf.size, peers.world_size)
    # Phase 1: after N-1 steps rank r owns the full reduction of chunk r.
    reduce_scatter_ring(peers, buf, reduction, bounds)
    # Phase 2: the owned chunks travel round the ring until every rank has all of them.
    allgather_ring(peers, buf, bounds)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return 2 * (n - 1), 2 * (n - 1) / n


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    return 2 * total * (world_size - 1) // world_size, "2T(N-1)/N"
