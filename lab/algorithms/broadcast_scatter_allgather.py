"""Scatter-allgather broadcast (van de Geijn): binomial scatter, then ring allgather (large tensors)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.allgather_ring import allgather_ring
from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.chunking import split_bounds


def broadcast_scatter_allgather(peers: Peers, buf: np.ndarray, src: int) -> None:
    """Copy rank ``src``'s ``buf`` into ``buf`` on every rank.

    The tensor is cut into N chunks, chunk v for the rank v places after the root (v = (rank -
    src) mod N). Scatter down the binomial tree: rank v receives chunks [v, v + lowbit(v)) from
    v - lowbit(v) and passes on the upper halves of that run to its children, so each rank ends
    with its own chunk. Then ring allgather: N-1 steps, each chunk travels round the ring.

    Cost: (⌈log2 N⌉ + N - 1)·α + 2(N-1)/N·T·β on the critical path: the root sends (N-1)/N·T
    instead of binomial's ⌈log2 N⌉·T, so it wins for large T; it loses for small T (more steps).

    Bytes, exactly (T = bytes of ``buf``, B_v = bytes of chunk v, R_v = bytes of chunks
    [v, min(v + lowbit(v), N)) and R_0 = T): in the scatter rank v receives R_v (the root
    nothing) and sends R_v - B_v; in the allgather it sends T - B_{v+1 mod N} and receives
    T - B_v. With N | count the root sends 2(N-1)/N·T and receives (N-1)/N·T.

    Per rank, N=4, src=2, ``buf`` = [rank]::

        every rank -> buf == [2]
    """
    n, rank = peers.world_size, peers.rank
    relative = (rank - src) % n
    chunks = split_bounds(buf.size, n)  # chunk v belongs to relative rank v

    def run(first: int, stop: int) -> np.ndarray:
        return buf[chunks[first][0]:chunks[min(stop, n) - 1][1]]

    # Scatter: receive our run of chunks from the parent (the rank our lowest set bit away).
    mask = 1
    while mask < n:
        if relative & mask:
            peers.recv_buffer((rank - mask) % n, run(relative, relative + mask))
            break
        mask <<= 1
    # Pass the upper half of our run to each child, largest first.
    mask >>= 1
    while mask:
        if relative + mask < n:
            peers.send_buffer((rank + mask) % n, run(relative + mask, relative + 2 * mask))
        mask >>= 1
    # Allgather round the ring: real rank r owns chunk (r - src) mod N.
    allgather_ring(peers, buf, [chunks[(r - src) % n] for r in range(n)])


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n, d = world_size, power_terms(world_size).d
    return d + n - 1, 2 * (n - 1) / n
