"""Two-shot allreduce: each slice reduced once by its owner, in rank order, then shared; on shm, in place."""

from __future__ import annotations

import numpy as np

from lab.algorithms.allgather_ring import allgather_ring
from lab.algorithms.peers import Peers
from lab.chunking import split_bounds
from lab.ops import Reduction


def allreduce_two_shot(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks: rank r owns slice r (``numpy.array_split``
    bounds), reduces it from every rank's copy in rank order 0..N-1, and every rank copies every
    finished slice. Every rank ends bit-identical, and with the same bits at any N on any transport.

    On the shm transport's root mesh the ranks read each other's memory (``peers.shared_allreduce``,
    :mod:`lab.transport.peer_memory`): copy in once (not at all for a ``lab.empty`` tensor), reduce
    slice r straight from the N inputs, copy the N-1 other slices out. No messages; in rounds of
    S bytes (``LAB_SHM_SCRATCH_BYTES``), three flag waits each.
    Cost: 3·⌈T/S⌉·α + about 4T/B, B the copy bandwidth of one core (a 1-byte load or store
    per byte: T in, T read by the reduction, T read and written out), against the ring's
    2(N-1)·α + 2(N-1)/N·T·β over messages that are each copied in and out of a slot.

    Elsewhere (another transport, a sub-mesh), the same schedule over messages: N-1 steps in which
    rank r sends slice r+s to its owner and takes rank r-s's copy of slice r, the reduction in rank
    order, then a ring allgather. Cost: 2(N-1)·α + 2(N-1)/N·T·β, as a ring, with (N-1)/N·T of
    scratch. Either way each rank sends and receives 2(N-1)/N·T bytes when N divides the element
    count (on shm ``mesh.stats()`` counts what this schedule would send, as ``lab.sim`` records it).

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    shared = getattr(peers, "shared_allreduce", None)
    if shared is not None and shared(buf, reduction):
        return
    n, rank = peers.world_size, peers.rank
    bounds = split_bounds(buf.size, n)
    start, stop = bounds[rank]
    mine = buf[start:stop]
    copies = np.empty_like(buf,
                           shape=(n,
                                  stop - start))  # row p: rank p's copy of our slice (virtual when recorded)
    copies[rank] = mine
    # Step 1: hand slice r+s to its owner, take rank r-s's copy of our slice.
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        peers.sendrecv_buffer(dst, buf[bounds[dst][0]:bounds[dst][1]], src, copies[src])
    # Step 2: reduce our slice in rank order 0..N-1 (the order the shm path uses).
    if n > 1:
        mine[:] = copies[0]
        for src in range(1, n):
            reduction.combine(mine, copies[src])
    reduction.finalize(mine, n)
    # Step 3: every finished slice travels round the ring.
    allgather_ring(peers, buf, bounds)


def shape(world_size: int) -> tuple[float, float]:
    """The message schedule's cost above as (latency steps on the critical path, bytes through the
    busiest rank per tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return 2 * (n - 1), 2 * (n - 1) / n


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    return 2 * total * (world_size - 1) // world_size, "2T(N-1)/N"
