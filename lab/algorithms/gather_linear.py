"""Linear gather: every rank sends its block straight to the root (N-1 messages into one rank)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def gather_linear(peers: Peers, send: np.ndarray, recv: np.ndarray, bounds: list[tuple[int, int]],
                  dst: int) -> None:
    """Leave every rank's ``send`` in ``recv[bounds[j]]`` (rank j's block) on rank ``dst``.

    Every other rank sends its block to the root once; the root takes them in rank order,
    straight into place. Nothing is forwarded, so every byte crosses one link, but the root
    handles N-1 messages one after the other.

    Cost: (N-1)·α + (N-1)·B·β for blocks of B bytes; with T = N·B (the result): (N-1)/N·T·β.

    Bytes, exactly: every rank but the root sends B; the root receives (N-1)·B.

    Per rank, N=3, dst=1, ``send`` = [10 + rank]::

        rank 1 -> recv == [10, 11, 12];  ranks 0 and 2: recv untouched
    """
    n, rank = peers.world_size, peers.rank
    if rank != dst:
        # Everyone but the root: one message, straight to it.
        peers.send_buffer(dst, send)
        return
    # The root: its own block, then every other rank's, in rank order, straight into place.
    recv[bounds[dst][0]:bounds[dst][1]] = send
    for src in range(n):
        if src != dst:
            peers.recv_buffer(src, recv[bounds[src][0]:bounds[src][1]])


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    result byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, (n - 1) / n
