"""Ring reduce-scatter: the first half of ring allreduce."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.chunking import ring_chunk
from lab.ops import Reduction


def reduce_scatter_ring(peers: Peers, buf: np.ndarray, reduction: Reduction,
                        bounds: list[tuple[int, int]]) -> None:
    """Leave the reduction over all ranks of chunk ``peers.rank`` (``buf[bounds[rank]]``) in place.

    N-1 steps round the ring. At step s rank r sends chunk (r-s-1) mod N to rank r+1 and folds
    chunk (r-s-2) mod N from rank r-1 into its own copy; at the last step it folds in chunk r,
    which then holds all N contributions. (The lesson's printed indices, (r-s) and (r-s-1), leave
    rank r with chunk r+1 instead; torch's reduce_scatter returns block r on rank r, so we shift.)
    Other chunks of ``buf`` are left holding partial sums.

    Cost: (N-1)·α + (N-1)/N·T·β for a T-byte buffer; each rank sends and receives (N-1)/N·T bytes.

    Per rank, N=3, sum, ``buf`` = [r, r, r] with one element per chunk::

        rank 0 -> buf[0] == 3;  rank 1 -> buf[1] == 3;  rank 2 -> buf[2] == 3
    """
    n, rank = peers.world_size, peers.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        # Pass on the partial sum built last step; fold the left neighbour's partial into ours.
        peers.sendrecv_buffer(right, ring_chunk(buf, bounds, rank - step - 1), left,
                              ring_chunk(buf, bounds, rank - step - 2), reduction)
    # Chunk `rank` now holds every contribution: finish it here, once (avg divides).
    reduction.finalize(ring_chunk(buf, bounds, rank), n)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, (n - 1) / n
