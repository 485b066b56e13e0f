"""Dissemination barrier: ⌈log2 N⌉ rounds of empty messages (Hensgen, Finkel and Manber)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def barrier_dissemination(peers: Peers) -> None:
    """Return once every rank has entered.

    Round k: signal rank r + 2^k and wait for rank r - 2^k. After round k a rank has heard,
    directly or through others, from the 2^(k+1) - 1 ranks before it, so after ⌈log2 N⌉ rounds
    from all of them. Works for any N (no fold needed).

    Cost: ⌈log2 N⌉·α. Bytes: none; ⌈log2 N⌉ messages sent and received per rank.

    Per rank, N=3: every rank returns only after all three have called it.
    """
    n, rank = peers.world_size, peers.rank
    empty = np.empty(0, np.uint8)
    distance = 1
    while distance < n:
        # Signal the rank `distance` ahead; wait for the one `distance` behind.
        peers.sendrecv_buffer((rank + distance) % n, empty, (rank - distance) % n, empty)
        distance *= 2


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    return d, 0.0
