"""The mailboxes' shared region: where every counter, doorbell and slot sits.

The creator maps ``region_bytes(world_size, slot_bytes, depth)`` zeroed bytes (an
anonymous ``mmap`` or a ``memfd``: fresh pages are zero) and hands every rank the same mapping as a
64-byte aligned uint8 array. Every field below sits on its own 64-byte cache line, so a line has
one writer and two ranks never fight over it::

    per rank r (128 bytes)      doorbell (int32: the futex word r sleeps on; any peer bumps it)
                                sleeping (int64: 1 while r may be asleep on its doorbell; r writes)
    per ordered pair (s -> d)   sent     (int64: pieces s has published; s writes), and on its line
                                         pipe sent (int64: data frames s has written to its pipe to d)
                                taken    (int64: pieces d has consumed;  d writes), and on its line
                                         pipe taken (int64: data frames d has consumed of that pipe)
                                depth x  slot: 64-byte header (fingerprint[32], piece bytes,
                                               message bytes), then slot_bytes of payload
                                               (the stride rounded up to 64 bytes)

The pipe counters are the shm transport's (:mod:`lab.transport.shm`): where they differ, the
pipe from s holds a message d has not received, which a compiled call looks at before its
first transfer (:func:`kernels.rings.look_back`) without a system call.

Each pair's slots form a single-producer/single-consumer ring: piece number n goes to slot
n % depth. Counters start at 0 and only grow (int64: they never wrap). A message larger than
``slot_bytes`` goes as consecutive pieces of whole elements; a message of 0 bytes is one empty
piece, so its fingerprint is still checked. ``sendrecv_buffer`` interleaves the pieces of its send
and of its receive, so two ranks exchanging messages larger than a ring never both wait on a full one.

:func:`region_bytes` sizes the region (plain Python in the parent that maps it, inlined in
compiled code); :func:`pending_fingerprints` reads it from plain Python after a failure.

    >>> region_bytes(2, 4096, 4)       # 2 ranks, 4 slots of 4 KiB per ordered pair
    33792

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

LINE = 64
FINGERPRINT_BYTES = 32
HEADER_BYTES = LINE  # fingerprint[32], piece bytes (int64), message bytes (int64), padding
MIN_SLOT_BYTES = 64  # room for whole elements of every numpy scalar type
RANK_AREA_BYTES = 2 * LINE
DOORBELL = 0  # int32 futex word, within the rank's area
SLEEPING = LINE  # int64 flag, within the rank's area
SENT = 0  # within a channel
TAKEN = LINE
PIPE_SENT = SENT + 8  # (on the line of sent: one writer)
PIPE_TAKEN = TAKEN + 8  # (on the line of taken)
SLOTS = 2 * LINE
# The header's int64 words: fingerprint 0-3, then these.
PIECE_WORD = 4
MESSAGE_WORD = 5

# Rows of MailboxPeers.rings (one column per peer): where the two channels with that peer start,
# and their counters. Our own counters are ours alone to write, so we keep them; the peer's are
# as last loaded (a sender reloads ``taken`` only when the ring looks full).
OUT_CHANNEL, IN_CHANNEL = 0, 1  # byte offsets of the channels rank -> peer and peer -> rank
SENT_BY_ME, TAKEN_BY_PEER = 2, 3  # of the channel rank -> peer
TAKEN_BY_ME, SENT_BY_PEER = 4, 5  # of the channel peer -> rank
# MailboxPeers.waiting: the current wait's rounds without progress, when it began (0: not yet
# timed), when it last polled liveness and when it last called its hook.
IDLE_ROUNDS, WAIT_STARTED, LIVENESS_CHECKED, HOOK_CALLED = 0, 1, 2, 3


# Plain Python that compiled code calls too (register_jitable): the shm transport sizes the region
# in its parent process, which must not pay for a compilation.
@register_jitable
def slot_stride(slot_bytes):
    return HEADER_BYTES + (slot_bytes + LINE - 1) // LINE * LINE


@register_jitable
def channel_bytes(slot_bytes, depth):
    return SLOTS + depth * slot_stride(slot_bytes)


@register_jitable
def channel_offsets(rank, peer, world_size, slot_bytes, depth):
    """Where the channels ``rank -> peer`` and ``peer -> rank`` start in the region. Channel
    (src, dst) is number src * (N - 1) + dst, not counting dst == src."""
    size = channel_bytes(slot_bytes, depth)
    first_channel = world_size * RANK_AREA_BYTES
    out_channel = first_channel + (rank * (world_size - 1) + peer - (1 if peer > rank else 0)) * size
    in_channel = first_channel + (peer * (world_size - 1) + rank - (1 if rank > peer else 0)) * size
    return out_channel, in_channel


@register_jitable
def region_bytes(world_size, slot_bytes, depth):
    """The bytes of the shared region ``open_mailbox(..., world_size, slot_bytes, depth, ...)`` uses
    (a multiple of 64). Plain Python from Python, inlined in compiled code."""
    return world_size * RANK_AREA_BYTES + world_size * (world_size - 1) * channel_bytes(slot_bytes, depth)


def pending_fingerprints(region, rank: int, world_size: int, slot_bytes: int, depth: int) -> dict[int, bytes]:
    """For each peer that has published a message to ``rank`` that ``rank`` has not taken (its
    ``sent`` ahead of our ``taken``): the 32-byte fingerprint of the next such piece. Plain numpy
    on the shared region (no compilation), for a diagnosis after a failure; a rank still running
    may move the counters meanwhile."""
    region = region if isinstance(region, np.ndarray) else np.frombuffer(region, np.uint8)
    region = region.reshape(-1).view(np.uint8)
    stride = slot_stride(slot_bytes)

    def word(offset: int) -> int:
        return int(region[offset:offset + 8].view(np.int64)[0])

    pending = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        _, in_channel = channel_offsets(rank, peer, world_size, slot_bytes, depth)
        sent, taken = word(in_channel + SENT), word(in_channel + TAKEN)
        if sent > taken:
            slot = in_channel + SLOTS + (taken % depth) * stride
            pending[peer] = region[slot:slot + FINGERPRINT_BYTES].tobytes()
    return pending
