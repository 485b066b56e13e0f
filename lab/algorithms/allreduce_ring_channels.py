"""Ring allreduce over channels (NCCL's): C rings, each on 1/C of the tensor, each leaving every
host through a different rank, so that with one NIC per rank (rails) the rings' steps between
hosts run side by side on C NICs instead of one after the other on one.

Each ring step is C slots; in slot k, the rank at local index i sends its message of channel
(i+1+k) mod C and receives its message of channel (i+k) mod C, one ``sendrecv_buffer``. Both
ends of a message meet in the same slot: the sender at local i sends channel c in slot
(c-1-i) mod C, and its next rank in channel c (local i+1, or across hosts the next host's local
c, C dividing every host's size) receives channel c in that slot. Every message between hosts
goes in slot 0 (an exit is local (c-1) mod L), so all channels cross hosts at once, on C NICs,
and the other C-1 slots stay inside hosts.

Deadlock-free with blocking transports: every rank runs the same sequence of slots (step, k),
and in each slot every rank sends one message and receives one. At the first slot some rank has
not finished, every rank has finished all earlier ones, so all are in this one, where the
messages form cycles of ``sendrecv_buffer`` calls, each moving its send and its receive at once.
Two ranks exchange in slot order at both ends, so a receive always matches the message it expects.
"""

from __future__ import annotations

import numpy as np

from lab.algorithms.peers import Peers, host_groups
from lab.chunking import ring_chunk, split_bounds
from lab.ops import Reduction

#: At most this many channels: one per rail of the common host of 8 GPUs and 8 NICs.
MAX_CHANNELS = 8


def allreduce_ring_channels(peers: Peers, buf: np.ndarray, reduction: Reduction,
                            channels: int | None = None) -> None:
    """Reduce ``buf`` in place across all ranks over C rings, each a ring allreduce of 1/C of it.

    Channel c (:func:`channel_rings`) visits the hosts in order and, on each host, its ranks
    rotated to start at local index c: it enters host h through local rank c and leaves it from
    local rank (c-1) mod L_h. So the C channels cross between hosts from C different ranks, one
    NIC each under rails, where a flat ring crosses from one. C (``channels``) must divide every
    host's rank count; default :func:`channel_count` (L for L <= 8; 1, the plain ring, on hosts
    of 3 and 2 ranks). On one host the rings are one cycle: channels only cut messages finer.

    Channel c reduce-scatters, then allgathers, part c of the tensor (``split_bounds(count, C)``)
    in chunks of about T/(N·C), the channels' messages in C slots per ring step, every message
    between hosts in slot 0: all channels cross hosts at once. Deadlock-free with blocking
    transports (the slots and the argument: the module's docstring).

    Cost: 2(N-1)·C messages of T/(N·C) per rank: 2(N-1)·C·α + 2(N-1)/N·T·β on one link, the
    ring's bytes in C times its messages. Across hosts with rails: each ring step is one slot
    between hosts, all NICs at once, and C-1 inside:
    2(N-1)·(α' + T/(N·C)·β' + (C-1)·(α + T/(N·C)·β)), against the flat ring's
    2(N-1)·(α' + T/N·β') through one rank's NIC. With one NIC per host the C messages of slot 0
    share it, and the channels gain nothing. Bit-identical on every rank: each chunk is reduced
    once, in one order round its ring, then copied.

    Bytes, exactly: channel c's part P_c in chunks ``split_bounds(P_c, N)``; a rank sends every
    chunk of each part but its own (reduce-scatter) and but the next one's (allgather), and
    receives as much: 2(N-1)/N·T when N·C divides the element count (:func:`bytes_sent`). Between
    hosts of L = C ranks each rank sends 2(N-1)/N·T/C (a flat ring: 2(N-1)/N·T from one rank).

    Per rank, 2 hosts x 2 ranks, sum, ``buf`` = arange(8) + rank::

        channel_rings([[0, 1], [2, 3]])     # [[0, 1, 2, 3], [1, 0, 3, 2]]
        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = peers.world_size, peers.rank
    hosts = host_groups(peers)
    rings = channel_rings(hosts, channels)
    count, local = len(rings), next(group.index(rank) for group in hosts if rank in group)
    # Each channel: its part of the tensor, cut into N chunks, and this rank's place in its ring.
    lanes = []
    for ring, (start, stop) in zip(rings, split_bounds(buf.size, count)):
        part, place = buf[start:stop], ring.index(rank)
        lanes.append((part, split_bounds(part.size, n), place, ring[(place + 1) % n], ring[place - 1]))
    # The channel this rank sends in, and the one it receives in, in each slot of a ring step.
    slots = [(lanes[(local + 1 + k) % count], lanes[(local + k) % count]) for k in range(count)]
    # Phase 1, reduce-scatter: each step passes on the partial sums built last step and folds in
    # the previous rank's, channel by channel; then chunk `place` of each part holds everything.
    for step in range(n - 1):
        for (part, bounds, place, right, _), (into, into_bounds, into_place, _, left) in slots:
            peers.sendrecv_buffer(right, ring_chunk(part, bounds, place - step - 1), left,
                                  ring_chunk(into, into_bounds, into_place - step - 2), reduction)
    # Finish our chunk of every channel here, once (avg divides).
    for part, bounds, place, _, _ in lanes:
        reduction.finalize(ring_chunk(part, bounds, place), n)
    # Phase 2, allgather: every finished chunk travels round its ring, in the same slots.
    for step in range(n - 1):
        for (part, bounds, place, right, _), (into, into_bounds, into_place, _, left) in slots:
            peers.sendrecv_buffer(right, ring_chunk(part, bounds, place - step), left,
                                  ring_chunk(into, into_bounds, into_place - step - 1))


def channel_rings(hosts: list[list[int]], channels: int | None = None) -> list[list[int]]:
    """The ring of each channel: the hosts in order, each host's ranks rotated to start at local
    index c. ``channels``: C, which must divide every host's number of ranks (a ``ValueError``
    naming it otherwise); default the largest such number up to :data:`MAX_CHANNELS`.

        channel_rings([[0, 1, 2], [3, 4, 5]])  # [[0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 3], [2, 0, 1, 5, 3, 4]]
    """
    sizes = {len(group) for group in hosts}
    if channels is None:
        channels = channel_count(sizes)
    elif isinstance(channels, bool) or not isinstance(channels, int) or channels < 1 \
            or any(size % channels for size in sizes):
        raise ValueError(f"channels must be a positive int that divides every host's number of ranks "
                         f"({', '.join(map(str, sorted(sizes)))}); got {channels!r}")
    return [[group[(c + i) % len(group)] for group in hosts for i in range(len(group))]
            for c in range(channels)]


def channel_count(sizes: set[int]) -> int:
    """The default number of channels for hosts of these numbers of ranks: the largest up to
    :data:`MAX_CHANNELS` that divides every one (``{8}`` -> 8, ``{12}`` -> 6, ``{3, 2}`` -> 1)."""
    return max(c for c in range(1, MAX_CHANNELS + 1) if all(size % c == 0 for size in sizes))


def shape(world_size: int) -> tuple[float, float]:
    """The cost above on one host (where fits are made: :func:`channel_count` channels on one link) as
    (latency steps on the critical path, bytes through the busiest rank per tensor byte), for
    ``auto``'s model (:mod:`lab.tuning`) and the reports; across hosts, see
    :func:`across_hosts_us`."""
    n = world_size
    return 2 * (n - 1) * channel_count({n}), 2 * (n - 1) / n


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count N·C divides (``python -m lab``'s check),
    on any hosts: each channel is a ring over all N ranks."""
    return 2 * total * (world_size - 1) // world_size, "2T(N-1)/N"


def across_hosts_us(nbytes: int, world_size: int, hosts: int, inside: tuple[float, float],
                    across: tuple[float, float], nics_per_host: int = 1) -> float:
    """The time on ``hosts`` hosts of L = N/H ranks and C channels (the default for L,
    :func:`channel_count`), for ``auto`` across hosts: each of the 2(N-1) ring steps is one slot
    between hosts, whose C messages of T/(N·C) queue on the host's ``nics_per_host`` links,
    ⌈C/nics⌉·(α' + T/(N·C)·β') on the busiest at ``across``'s (α', β'), and C-1 slots inside,
    α + T/(N·C)·β each at ``inside``'s. With one link per host (the lab's emulated hosts) that is
    more than the flat ring's 2(N-1)·(α' + T/N·β')."""
    (alpha, beta), (alpha_x, beta_x) = inside, across
    channels = channel_count({world_size // hosts})
    chunk = nbytes / (world_size * channels)
    between = -(-channels // nics_per_host) * (alpha_x + chunk * beta_x)
    return 2 * (world_size - 1) * (between + (channels - 1) * (alpha + chunk * beta))
