"""The ``"shm"`` transport's endpoints: the pipes, segments and mailboxes the parent builds, their
sizes, the frames the pipes carry, and a rank's mappings of the shared memory.

Layout. Rank ``i`` owns one shared-memory segment (an anonymous ``memfd``: it has no name in
``/dev/shm``, so nothing can be left behind, and the kernel frees it when the last rank exits).
The segment holds, for every destination ``j``, ``slots`` slots of ``segment_bytes`` each: the
rendezvous path's slots (:mod:`lab.transport.shm`), so shared memory per rank is bounded by
``(world_size - 1) * slots * segment_bytes`` whatever the tensor size. One pipe per directed edge
carries the frames: a 48-byte descriptor (kind, slot or eager-credit count, byte count, tag), an
eager message's payload right behind it.

Shared scratch. One more memfd, shared by every rank, holds the compiled path's mailboxes
(:class:`Mailbox`, :mod:`lab.compiled.plane`) and, from the next page on, every rank's two-shot slot and
registered-tensor arena (:mod:`lab.transport.peer_memory`): the two-shot allreduce reads its peers'
memory there in place, with no descriptor and no pipe.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
from dataclasses import dataclass, field

import numpy as np

from kernels import mailbox_layout, rings
from lab.transport import peer_memory
from lab.transport.base import TAG_BYTES, SharedFd

DEFAULT_SEGMENT_BYTES = 256 * 1024
DEFAULT_SLOTS = 4
#: Slots per ring of the compiled path's mailboxes, and the most address space they take per pool.
MAILBOX_DEPTH = 4
MAILBOX_BUDGET_BYTES = 64 * 1024 * 1024
#: Eager messages a sender may have outstanding at one receiver (returned half at a time).
EAGER_CREDITS = 8

#: The kinds of frame: a rendezvous segment's descriptor, a slot handed back, an eager message,
#: a batch of eager credits handed back, an abort notice (its payload inline, as an eager one's).
DATA, CREDIT, EAGER, EAGER_CREDIT, ABORT = 1, 2, 3, 4, 5
DESCRIPTOR = struct.Struct(f"<BxxxIQ{TAG_BYTES}s")  # kind, slot (eager credits: count), nbytes, tag: 48 bytes
CREDIT_FRAME = DESCRIPTOR.pack(CREDIT, 0, 0, b"")
EAGER_CREDIT_FRAME = DESCRIPTOR.pack(EAGER_CREDIT, EAGER_CREDITS // 2, 0, b"")
#: A fingerprint's first two words (context, number), as the mailboxes compare them.
_CONTEXT_AND_SEQ = struct.Struct("<qq")
#: The largest eager payload: descriptor and payload in one atomic pipe write.
MAX_EAGER_BYTES = select.PIPE_BUF - DESCRIPTOR.size
DEFAULT_EAGER_BYTES = MAX_EAGER_BYTES


@dataclass
class ShmEndpoints:
    """What one rank needs to join the shm mesh; pickled into the rank's process at start."""

    rank: int
    world_size: int
    segment_bytes: int
    slots: int
    eager_bytes: int
    inbox: dict[int, SharedFd]  # src -> read end of the pipe src -> rank
    outbox: dict[int, SharedFd]  # dst -> write end of the pipe rank -> dst
    segments: list[SharedFd] = field(default_factory=list)  # one per rank, empty for world_size 1
    mailbox: SharedFd | None = None  # every rank's compiled-path mailboxes (lab.compiled.plane); None: no compiled path
    mailbox_slot_bytes: int = 0
    mailbox_depth: int = 0
    scratch_slot_bytes: int = 0  # the two-shot slots and registered arenas, after the mailboxes (0: none)
    scratch_arena_bytes: int = 0

    def close_in_parent(self) -> None:
        """Close the parent's copies once the rank's process holds its own."""
        for shared in (*self.inbox.values(), *self.outbox.values(), *self.segments):
            shared.close()
        if self.mailbox is not None:
            self.mailbox.close()


@dataclass
class Mailbox:
    """A rank's view of the mailboxes (``kernels.mailbox``), what :class:`lab.compiled.plane.CompiledPlane` runs on."""

    region: np.ndarray  # uint8, 64-byte aligned, shared by every rank
    rank: int
    world_size: int
    slot_bytes: int
    depth: int
    liveness_fds: np.ndarray  # per rank: the pipe it writes to us (POLLHUP once it died); -1 for us
    scratch_start: int = 0  # where the shared scratch starts in region (lab.transport.peer_memory)
    scratch_slot_bytes: int = 0  # its slots' bytes (0: no scratch)


def mailbox_slot_bytes(world_size: int) -> int:
    """Slot payload bytes: 64 KiB, less where N(N-1) rings of MAILBOX_DEPTH slots would pass
    MAILBOX_BUDGET_BYTES (4 KiB at least; larger messages go as several pieces)."""
    rings = max(1, world_size * (world_size - 1) * MAILBOX_DEPTH)
    return max(4096, min(64 * 1024, MAILBOX_BUDGET_BYTES // rings // 64 * 64))


def create_endpoints(world_size: int, segment_bytes: int, slots: int,
                     eager_bytes: int = DEFAULT_EAGER_BYTES) -> list[ShmEndpoints]:
    """Build the full mesh in the parent: N(N-1) pipes and N segments (all closed again if any
    of them cannot be made, so a failed setup leaves no descriptor behind)."""
    if segment_bytes < 64 or segment_bytes % 64:
        raise ValueError(f"segment_bytes must be a positive multiple of 64; got {segment_bytes}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1; got {slots}")
    if not 0 <= eager_bytes <= MAX_EAGER_BYTES:
        raise ValueError(f"eager_bytes must be in [0, {MAX_EAGER_BYTES}]; got {eager_bytes}")
    endpoints = [
        ShmEndpoints(r, world_size, segment_bytes, slots, eager_bytes, {}, {}) for r in range(world_size)]
    segments: list[SharedFd] = []
    mailbox: SharedFd | None = None
    try:
        for src in range(world_size):
            for dst in range(world_size):
                if src != dst:
                    reader, writer = os.pipe()
                    endpoints[dst].inbox[src] = SharedFd(reader)
                    endpoints[src].outbox[dst] = SharedFd(writer)
        if world_size > 1:
            size = (world_size - 1) * slots * segment_bytes
            for rank in range(world_size):
                segments.append(SharedFd(os.memfd_create(f"lab-rank{rank}", os.MFD_CLOEXEC)))
                os.ftruncate(segments[-1].fd, size)
            # One more (sparse) memfd, shared by every rank: the compiled path's mailboxes, then, from
            # the next page on, the two-shot slots and registered arenas (lab.transport.peer_memory).
            slot_bytes = mailbox_slot_bytes(world_size)
            scratch_slot, arena = peer_memory.slot_bytes_from_env(), peer_memory.arena_bytes_from_env()
            mailbox = SharedFd(os.memfd_create("lab-mailboxes", os.MFD_CLOEXEC))
            os.ftruncate(
                mailbox.fd,
                _scratch_offset(world_size, slot_bytes) +
                peer_memory.region_bytes(world_size, scratch_slot, arena))
    except BaseException:
        for ep in endpoints:
            ep.close_in_parent()
        for shared in (*segments, *([mailbox] if mailbox else [])):
            shared.close()
        raise
    for ep in endpoints:
        ep.segments = segments  # shared: closing one endpoint's copy closes the parent's fd once
        if world_size > 1:
            ep.mailbox, ep.mailbox_slot_bytes, ep.mailbox_depth = mailbox, slot_bytes, MAILBOX_DEPTH
            ep.scratch_slot_bytes, ep.scratch_arena_bytes = scratch_slot, arena
    return endpoints


def _scratch_offset(world_size: int, mailbox_slot_bytes: int) -> int:
    """Where the scratch starts in the mailboxes' memfd: the first page after the mailboxes."""
    return -(-mailbox_layout.region_bytes(world_size, mailbox_slot_bytes, MAILBOX_DEPTH) // 4096) * 4096


class ShmMappings:
    """A rank's mappings of the mesh's shared memory, made inside the rank's process from its
    endpoints (whose memfds are closed once mapped): every rank's segment, and the mailboxes'
    memfd as :attr:`mailbox` and :attr:`scratch` (both None for one rank). In the mailboxes'
    region, the pipes' counters (:mod:`kernels.mailbox_layout`): each data frame this rank writes
    to a peer's pipe is counted there (:meth:`sent`), and each it consumes of a peer's
    (:meth:`taken`), so that :meth:`unread` sees a message not received without a system call."""
    def __init__(self, endpoints: ShmEndpoints, liveness_fds: np.ndarray) -> None:
        self.world_size = endpoints.world_size
        self.slots = endpoints.slots
        self.segment_bytes = endpoints.segment_bytes
        self._maps, self._files = [], []  # the mappings, and their memfds' (st_dev, st_ino)
        for segment in endpoints.segments:
            self._map(segment)
        self.segments = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        #: The two-shot allreduce and registered buffers (lab.transport.peer_memory).
        self.scratch: peer_memory.SharedScratch | None = None
        self.mailbox: Mailbox | None = None
        self._words: np.ndarray | None = None  # the mailboxes' region as int64 (the pipes' counters)
        self._sent_at: dict[int, int] = {}  # per peer: where the count of frames to it is, in _words
        self._taken_at: dict[int, int] = {}
        shared = endpoints.mailbox
        if shared is None:
            return
        self._map(shared)  # page-aligned: 64-byte aligned
        region = np.frombuffer(self._maps[-1], np.uint8)
        if endpoints.scratch_slot_bytes:
            start = self._scratch_start = _scratch_offset(self.world_size, endpoints.mailbox_slot_bytes)
            self.scratch = peer_memory.SharedScratch(region[start:], endpoints.rank, self.world_size,
                                                     endpoints.scratch_slot_bytes,
                                                     endpoints.scratch_arena_bytes, liveness_fds)
        self.mailbox = box = Mailbox(region, endpoints.rank, self.world_size, endpoints.mailbox_slot_bytes,
                                     endpoints.mailbox_depth, liveness_fds)
        if self.scratch is not None:  # (the compiled one-shot's: kernels.one_shot)
            box.scratch_start, box.scratch_slot_bytes = self._scratch_start, endpoints.scratch_slot_bytes
        self._words = region.view(np.int64)
        self._stride = mailbox_layout.slot_stride(box.slot_bytes)
        self._in_channels = np.full(self.world_size, -1, np.int64)  # where each channel peer -> us starts
        for peer in range(self.world_size):
            if peer != box.rank:
                out_channel, in_channel = mailbox_layout.channel_offsets(box.rank, peer, self.world_size,
                                                                         box.slot_bytes, box.depth)
                self._in_channels[peer] = in_channel
                self._sent_at[peer] = (out_channel + mailbox_layout.PIPE_SENT) >> 3
                self._taken_at[peer] = (in_channel + mailbox_layout.PIPE_TAKEN) >> 3

    def _map(self, shared: SharedFd) -> None:
        stat = os.fstat(shared.fd)
        self._maps.append(mmap.mmap(shared.fd, stat.st_size))
        self._files.append((stat.st_dev, stat.st_ino))
        shared.close()

    def slot(self, owner: int, dst: int, slot: int) -> np.ndarray:
        """Slot ``slot`` of the region in ``owner``'s segment that carries data to ``dst``."""
        region = (dst - owner - 1) % self.world_size
        start = (region * self.slots + slot) * self.segment_bytes
        return self.segments[owner][start:start + self.segment_bytes]

    def sent(self, peer: int) -> None:
        """Count a data frame written to ``peer``'s pipe."""
        words = self._words  # (None once closed: a call still running at close may be here)
        if words is not None:
            words[self._sent_at[peer]] += 1

    def taken(self, peer: int) -> None:
        """Count a data frame of ``peer``'s pipe consumed."""
        words = self._words
        if words is not None:
            words[self._taken_at[peer]] += 1

    def unread(self, tag: bytes) -> bool:
        """Whether a message of a collective before ``tag``'s waits in a mailbox (its ring's next),
        or a pipe holds a data frame not consumed (by the counters): a few loads a peer."""
        words = self._words
        return words is not None and rings.anything_unread(words, self._in_channels, self.mailbox.depth,
                                                           self._stride, *_CONTEXT_AND_SEQ.unpack_from(tag))

    def pending_fingerprints(self) -> dict[int, list[bytes]]:
        """The next message in each mailbox ring, and each peer's two-shot round this rank has not
        entered: what a peer that took the compiled path or the two-shot left unconsumed."""
        tags: dict[int, list[bytes]] = {}
        if self.mailbox is not None:
            box = self.mailbox
            pending = mailbox_layout.pending_fingerprints(box.region, box.rank, box.world_size,
                                                          box.slot_bytes, box.depth)
            for peer, tag in pending.items():
                tags.setdefault(peer, []).append(tag)
        if self.scratch is not None:
            for peer, tag in self.scratch.pending_fingerprints().items():
                tags.setdefault(peer, []).append(tag)
        return tags

    def close(self) -> None:
        """Unmap now, whoever still holds views (a plan, a lane, a failed transfer's traceback):
        :func:`lab.transport.peer_memory.unmap`; a registered tensor outliving the mesh keeps its
        contents, as plain memory from now on."""
        keep = []
        if self.scratch is not None:
            self.scratch.closed = True
            keep = [(self._scratch_start + offset, nbytes) for offset, nbytes in self.scratch.in_use()]
        self.segments, self.mailbox, self.scratch, self._words = [], None, None, None
        for m, file in zip(self._maps, self._files):
            peer_memory.unmap(m, file, keep if m is self._maps[-1] else [])
        self._maps, self._files = [], []


def parse_frames(data: bytearray) -> tuple[list[tuple[int, int, int, bytes, memoryview | None]], int]:
    """The whole frames at the start of ``data`` (what a pipe gave), as ``(kind, slot, nbytes,
    tag, payload)`` (``payload``: a view into ``data`` for EAGER and ABORT frames, else None), and
    where the first frame not yet whole starts (its rest is still in the pipe)."""
    frames, size, header, position = [], len(data), DESCRIPTOR.size, 0
    while position + header <= size:
        kind, slot, nbytes, tag = DESCRIPTOR.unpack_from(data, position)
        if kind in (EAGER, ABORT):
            end = position + header + nbytes
            if end > size:
                break
            frames.append(
                (kind, 0 if kind == EAGER else slot, nbytes, tag, memoryview(data)[position + header:end]))
            position = end
        else:
            frames.append((kind, slot, nbytes, tag, None))
            position += header
    return frames, position
