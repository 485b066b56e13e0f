"""Pairwise all-to-all: N-1 steps, each rank swapping one block with one peer (bandwidth-optimal)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def all_to_all_pairwise(peers: Peers, send: np.ndarray, recv: np.ndarray, send_bounds: list[tuple[int, int]],
                        recv_bounds: list[tuple[int, int]]) -> None:
    """Rank r sends ``send[send_bounds[j]]`` to rank j and receives rank j's block into ``recv[recv_bounds[j]]``.

    Step s (s = 1..N-1): send our block for r + s, receive the block from r - s (mod N); step 0
    is the local copy of our own block. Each pair of ranks exchanges exactly once, directly.

    Cost: (N-1)·α + (N-1)/N·T·β for T = bytes of ``send``: every byte travels once, but N-1
    steps; it wins for large blocks, Bruck's for small ones.

    Bytes, exactly (S_j = bytes of ``send`` block j, R_j = bytes of ``recv`` block j): sends
    Σ_{j≠r} S_j and receives Σ_{j≠r} R_j; with N | rows, (N-1)/N·T each way.

    Per rank, N=2, ``send`` = [10r, 10r + 1]::

        rank 0 -> recv == [0, 10];  rank 1 -> recv == [1, 11]
    """
    n, rank = peers.world_size, peers.rank
    # Step 0: our own block stays here.
    recv[recv_bounds[rank][0]:recv_bounds[rank][1]] = send[send_bounds[rank][0]:send_bounds[rank][1]]
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        # Send our block for dst; take src's block for us.
        peers.sendrecv_buffer(dst, send[send_bounds[dst][0]:send_bounds[dst][1]], src,
                              recv[recv_bounds[src][0]:recv_bounds[src][1]])


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, (n - 1) / n
