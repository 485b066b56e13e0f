"""Ring allgather: the second half of ring allreduce."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.chunking import ring_chunk


def allgather_ring(peers: Peers, buf: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Given chunk ``peers.rank`` of ``buf`` on every rank, fill in every other chunk.

    N-1 steps round the ring: at step s rank r sends chunk (r-s) mod N to rank r+1 and receives
    chunk (r-s-1) mod N from rank r-1, so each completed chunk travels once round the ring.

    Cost: (N-1)·α + (N-1)/N·T·β for a T-byte result; each rank sends and receives (N-1)/N·T bytes.

    Per rank, N=3, ``buf`` = [0, 0, 0] with ``buf[r] = 10 + r`` on rank r::

        every rank -> buf == [10, 11, 12]
    """
    n, rank = peers.world_size, peers.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        # Forward the chunk completed most recently; take the next one from the left.
        peers.sendrecv_buffer(right, ring_chunk(buf, bounds, rank - step), left,
                              ring_chunk(buf, bounds, rank - step - 1))


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, (n - 1) / n
