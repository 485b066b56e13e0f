"""Binomial-tree broadcast from any root (latency-optimal: ceil(log2 N) rounds)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def broadcast_binomial(peers: Peers, buf: np.ndarray, src: int) -> None:
    """Copy rank ``src``'s ``buf`` into ``buf`` on every rank.

    Ranks are numbered relative to the root (v = (rank - src) mod N). Rank v receives once, from
    v minus its lowest set bit, then forwards to v + 2^k for each 2^k below that bit, largest
    first, so the set of ranks holding the data doubles every round.

    Cost: ceil(log2 N)·(α + T·β) on the critical path. The root sends ceil(log2 N)·T bytes;
    every other rank receives T and sends T times its number of children.

    Per rank, N=4, src=2, ``buf`` = [rank]::

        every rank -> buf == [2]
    """
    n, rank = peers.world_size, peers.rank
    relative = (rank - src) % n
    # Receive once from the parent: the rank that differs from us in our lowest set bit.
    mask = 1
    while mask < n:
        if relative & mask:
            peers.recv_buffer((rank - mask) % n, buf)
            break
        mask <<= 1
    # Forward to each child, farthest subtree first, so it can start forwarding early.
    mask >>= 1
    while mask:
        if relative + mask < n:
            peers.send_buffer((rank + mask) % n, buf)
        mask >>= 1


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    return d, d
