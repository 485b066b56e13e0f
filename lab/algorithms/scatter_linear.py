"""Linear scatter: the root sends every rank its block directly (N-1 messages out of one rank)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def scatter_linear(peers: Peers, send: np.ndarray, recv: np.ndarray, bounds: list[tuple[int, int]],
                   src: int) -> None:
    """Leave block ``rank`` of rank ``src``'s ``send`` (``send[bounds[rank]]``) in ``recv`` on every rank.

    The root sends each other rank its block, in rank order, straight from ``send``, and copies
    its own; every other rank receives once, straight into ``recv``. Only the root's ``send`` is read.

    Cost: (N-1)·α + (N-1)/N·T·β for T = bytes of ``send`` (every byte crosses one link, the
    root's, one message after the other).

    Bytes, exactly (B_j = bytes of rank j's block): the root sends Σ_{j≠src} B_j; rank j receives B_j.

    Per rank, N=3, src=1, ``send`` (on rank 1) = [10, 11, 12, 13]::

        rank 0 -> recv == [10, 11];  rank 1 -> recv == [12];  rank 2 -> recv == [13]
    """
    n, rank = peers.world_size, peers.rank
    if rank != src:
        # Everyone but the root: one message, straight into place.
        peers.recv_buffer(src, recv)
        return
    # The root: every other rank's block, in rank order, then its own.
    for dst in range(n):
        if dst != src:
            peers.send_buffer(dst, send[bounds[dst][0]:bounds[dst][1]])
    recv[:] = send[bounds[src][0]:bounds[src][1]]


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, (n - 1) / n
