"""Hierarchical allreduce: reduce-scatter inside each host, allreduce across hosts, allgather inside."""

from __future__ import annotations

import numpy as np

from lab.algorithms.allgather_ring import allgather_ring
from lab.algorithms.allreduce_recursive_doubling import allreduce_recursive_doubling
from lab.algorithms.allreduce_ring import allreduce_ring
from lab.algorithms.peers import Peers, hierarchy
from lab.algorithms.reduce_scatter_ring import reduce_scatter_ring
from lab.chunking import split_bounds
from lab.ops import Reduction

#: Shards of at least this many bytes cross hosts by ring (bandwidth-optimal), smaller ones by
#: recursive doubling (⌈log2 H⌉ latency terms instead of 2(H-1)).
INTER_RING_MIN_BYTES = 64 * 1024


def allreduce_hierarchical(peers: Peers, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks in three phases, for N = H·L ranks on H hosts of L.

    1. Ring reduce-scatter among the L ranks of each host: local rank i ends with shard i (about
       T/L bytes) summed over its host. L-1 steps over shared memory (``transport="auto"``).
    2. Allreduce of shard i across the H hosts, among the H ranks with local rank i: a ring for
       shards of at least ``INTER_RING_MIN_BYTES``, else recursive doubling. All L local ranks do
       this at once, each over its own connections through the host's one link.
    3. Ring allgather among the L ranks of each host: every rank ends with every shard.

    Cost (ring across hosts), with α, β inside a host and α', β' per host link:
    2(L-1)·(α + T/L·β) + 2(H-1)·(α' + T/H·β'): the L shards cross the link together, T/(H·L)
    each per step. Bytes per rank: 2(L-1)/L·T inside the host plus 2(H-1)/H·T/L across hosts
    (when L divides the elements, and L·H divides them); so each host link carries
    2(H-1)/H·T each way in 2(H-1) steps, against 2(N-1)/N·T in 2(N-1) steps for a flat ring over
    all N ranks laid out host by host (almost twice as many bytes at H = 2, and N-1 more steps
    paying the link's α'). Every rank ends bit-identical: each shard is reduced in one order on
    its owners, then copied verbatim.

    Hosts with different numbers of ranks: L is the smallest; on a larger host, local rank j >= L
    first hands its whole buffer to local rank j mod L (which folds it in) and gets the result
    back at the end: T more each way for those two ranks, two more steps.

    Per rank, 2 hosts x 2 ranks, sum, ``buf`` = arange(4) + rank::

        every rank -> buf == 4 * arange(4) + 6
    """
    place = hierarchy(peers)
    host, shards = place.host, place.shards
    if place.leaders is None:
        # A host's extra rank: its buffer is folded into a leader's, and the result comes back.
        host.send_buffer(host.rank % shards, buf)
        host.recv_buffer(host.rank % shards, buf)
        return
    partial = reduction.partial()  # sums only: avg divides once, at the end
    extras = range(host.rank + shards, host.world_size, shards)
    for extra in extras:  # Step 0 (larger hosts only): fold in the extra ranks' buffers
        host.recv_buffer(extra, buf, partial)
    leaders, cross = place.leaders, place.cross
    bounds = split_bounds(buf.size, shards)
    start, stop = bounds[leaders.rank]
    # Step 1: reduce-scatter inside the host; local rank i now holds its host's sum of shard i.
    reduce_scatter_ring(leaders, buf, partial, bounds)
    # Step 2: allreduce shard i across the hosts; it now holds every rank's contribution.
    shard = buf[start:stop]
    across = allreduce_ring if shard.nbytes >= INTER_RING_MIN_BYTES else allreduce_recursive_doubling
    across(cross, shard, partial)
    reduction.finalize(shard, peers.world_size)
    # Step 3: allgather inside the host: every leader gets every finished shard.
    allgather_ring(leaders, buf, bounds)
    for extra in extras:  # Step 4 (larger hosts only): the extra ranks get the result
        host.send_buffer(extra, buf)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    # on one host (where fits are made) it is a ring's reduce-scatter and allgather; across
    # hosts, see across_hosts_us
    return 2 * (n - 1), 2 * (n - 1) / n


def across_hosts_us(nbytes: int, world_size: int, hosts: int, inside: tuple[float, float],
                    across: tuple[float, float], nics_per_host: int = 1) -> float:
    """The time on ``hosts`` hosts of L = N/H ranks, for ``auto`` across hosts: ring phases inside
    the host at ``inside``'s (α, β), 2(L-1)·(α + T/L·β), plus the ring across hosts at ``across``'s
    (α', β'), 2(H-1)·(α' + T/H·β'): the L shards share the host's link, or with ``nics_per_host``
    NICs ⌈L/nics⌉ of them each, 2(H-1)·(α' + ⌈L/nics⌉·T/(H·L)·β')."""
    (alpha, beta), (alpha_x, beta_x) = inside, across
    per_host = world_size // hosts
    shards_per_nic = -(-per_host // nics_per_host)
    return (2 * (per_host - 1) * (alpha + nbytes / per_host * beta) + 2 * (hosts - 1) *
            (alpha_x + shards_per_nic * nbytes / (hosts * per_host) * beta_x))
