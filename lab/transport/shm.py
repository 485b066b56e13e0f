"""The ``"shm"`` transport: descriptors through pipes, tensor bytes through shared memory.

Layout. Rank ``i`` owns one shared-memory segment (an anonymous ``memfd``: it has no name in
``/dev/shm``, so nothing can be left behind, and the kernel frees it when the last rank exits).
The segment holds, for every destination ``j``, ``slots`` slots of ``segment_bytes`` each. A send
copies the data into the next free slot and writes a 48-byte descriptor (slot, byte count, tag)
to the pipe ``i -> j``; the receiver copies or reduces (Numba kernel) straight out of that slot
and returns a credit on the pipe ``j -> i``. A sender with no credit waits, so a slot is never
overwritten before its reader is done, and shared memory per rank is bounded by
``(world_size - 1) * slots * segment_bytes`` whatever the tensor size: larger tensors flow
through in segments, pipelined across the slots.

Control plane. One OS pipe per directed edge (single producer, single consumer), chosen over
``multiprocessing.Queue`` for its latency (see the README), used raw: fixed-size messages, each
written atomically with one ``write`` (smaller than ``PIPE_BUF``), and drained many at a time with
one ``read``; one ``poll`` object watches every incoming pipe. The pipe never fills: a sender has
at most ``slots`` descriptors and ``slots`` credits outstanding. A pipe whose writer died reads
as end-of-file, which surfaces at once as PeerLostError.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lab.errors import CollectiveMismatchError, DeadlineError, PeerLostError
from lab.transport.base import TAG_BYTES, Recv, Send, SharedFd, TagMismatch, Transport, wait_slice

DEFAULT_SEGMENT_BYTES = 256 * 1024
DEFAULT_SLOTS = 4

_DATA, _CREDIT = 1, 2
_MESSAGE = struct.Struct(f"<BxxxIQ{TAG_BYTES}s")  # kind, slot, nbytes, tag: 48 bytes
_CREDIT_MESSAGE = _MESSAGE.pack(_CREDIT, 0, 0, b"")
_DRAIN_BYTES = _MESSAGE.size * 256  # a whole number of messages per read


@dataclass
class ShmEndpoints:
    """What one rank needs to join the shm mesh; pickled into the rank's process at start."""

    rank: int
    world_size: int
    segment_bytes: int
    slots: int
    inbox: dict[int, SharedFd]  # src -> read end of the pipe src -> rank
    outbox: dict[int, SharedFd]  # dst -> write end of the pipe rank -> dst
    segments: list[SharedFd] = field(default_factory=list)  # one per rank, empty for world_size 1

    def close_in_parent(self) -> None:
        """Close the parent's copies once the rank's process holds its own."""
        for shared in (*self.inbox.values(), *self.outbox.values(), *self.segments):
            shared.close()


def create_endpoints(world_size: int, segment_bytes: int, slots: int) -> list[ShmEndpoints]:
    """Build the full mesh in the parent: N(N-1) pipes and N segments (all closed again if any
    of them cannot be made, so a failed setup leaves no descriptor behind)."""
    if segment_bytes < 64 or segment_bytes % 64:
        raise ValueError(f"segment_bytes must be a positive multiple of 64; got {segment_bytes}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1; got {slots}")
    endpoints = [ShmEndpoints(r, world_size, segment_bytes, slots, {}, {}) for r in range(world_size)]
    segments: list[SharedFd] = []
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
    except BaseException:
        for ep in endpoints:
            ep.close_in_parent()
        for shared in segments:
            shared.close()
        raise
    for ep in endpoints:
        ep.segments = segments  # shared: closing one endpoint's copy closes the parent's fd once
    return endpoints


class _Job:
    """Progress of one send or receive through its segments."""

    __slots__ = ("peer", "array", "bytes", "offset", "segments_left", "combine")

    def __init__(self, peer: int, array: np.ndarray, segment_bytes: int, combine=None) -> None:
        self.peer = peer
        self.array = array
        self.bytes = array.view(np.uint8)
        self.offset = 0
        self.segments_left = max(1, -(-array.nbytes // segment_bytes))
        self.combine = combine


class ShmTransport(Transport):
    """A rank's end of the shm mesh (built inside the rank's process from its endpoints)."""

    def __init__(self, endpoints: ShmEndpoints) -> None:
        self.rank = endpoints.rank
        self.world_size = endpoints.world_size
        self.segment_bytes = endpoints.segment_bytes
        self.slots = endpoints.slots
        self._read_fd = {peer: shared.fd for peer, shared in endpoints.inbox.items()}
        self._write_fd = {peer: shared.fd for peer, shared in endpoints.outbox.items()}
        self._peer_of_fd = {fd: peer for peer, fd in self._read_fd.items()}
        self._poller = select.poll()
        for fd in self._read_fd.values():
            os.set_blocking(fd, False)  # drains never block; waiting is the poller's job
            self._poller.register(fd, select.POLLIN)
        self._maps = []
        for segment in endpoints.segments:
            self._maps.append(mmap.mmap(segment.fd, os.fstat(segment.fd).st_size))
            segment.close()
        self._memory = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        peers = list(self._read_fd)
        self._credits = {p: self.slots for p in peers}
        self._next_slot = {p: 0 for p in peers}
        self._arrived: dict[int, deque] = {p: deque() for p in peers}  # descriptors not yet consumed
        self._closed = False

    # -- slots ---------------------------------------------------------------------------------

    def _slot(self, owner: int, dst: int, slot: int) -> np.ndarray:
        """Slot ``slot`` of the region in ``owner``'s segment that carries data to ``dst``."""
        region = (dst - owner - 1) % self.world_size
        start = (region * self.slots + slot) * self.segment_bytes
        return self._memory[owner][start : start + self.segment_bytes]

    # -- the exchange loop -------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float, where: object
    ) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        sending = [_Job(s.dst, s.data, self.segment_bytes) for s in sends]
        receiving = [_Job(r.src, r.out, self.segment_bytes, r.combine) for r in recvs]
        deadline = time.monotonic() + timeout_s
        while True:
            moved = False
            for job in sending:
                while job.segments_left and self._credits[job.peer]:
                    self._push_segment(job, tag, where)
                    moved = True
            for job in receiving:
                while job.segments_left and self._arrived[job.peer]:
                    self._consume_segment(job, tag, where)
                    moved = True
            sending = [job for job in sending if job.segments_left]
            receiving = [job for job in receiving if job.segments_left]
            if not (sending or receiving):
                return
            if moved:  # an awaited peer made progress: the silence starts over
                deadline = time.monotonic() + timeout_s
            if not any(self._credits[job.peer] for job in sending):
                self._wait(deadline, where, {job.peer for job in sending + receiving})

    def _push_segment(self, job: _Job, tag: bytes, where: object) -> None:
        # Copy the next piece into our next free slot for this peer, then tell the peer where it is.
        nbytes = min(self.segment_bytes, job.bytes.size - job.offset)
        slot = self._next_slot[job.peer]
        self._slot(self.rank, job.peer, slot)[:nbytes] = job.bytes[job.offset : job.offset + nbytes]
        try:
            os.write(self._write_fd[job.peer], _MESSAGE.pack(_DATA, slot, nbytes, tag))
        except OSError:
            raise PeerLostError(f"rank {self.rank}: rank {job.peer} is gone (sending in {where})") from None
        self._credits[job.peer] -= 1
        self._next_slot[job.peer] = (slot + 1) % self.slots
        job.offset += nbytes
        job.segments_left -= 1

    def _consume_segment(self, job: _Job, tag: bytes, where: object) -> None:
        # Copy or reduce straight out of the sender's slot, then hand the slot back.
        slot, nbytes, got_tag = self._arrived[job.peer].popleft()
        if got_tag != tag:
            raise TagMismatch(job.peer, tag, got_tag)
        expected = min(self.segment_bytes, job.bytes.size - job.offset)
        if nbytes != expected:
            raise CollectiveMismatchError(
                f"rank {self.rank} expected {expected} bytes from rank {job.peer} in {where}, got {nbytes}"
            )
        incoming = self._slot(job.peer, self.rank, slot)[:nbytes].view(job.array.dtype)
        itemsize = job.array.itemsize
        target = job.array[job.offset // itemsize : (job.offset + nbytes) // itemsize]
        if job.combine is None:
            target[:] = incoming
        else:
            job.combine(target, incoming)
        try:
            os.write(self._write_fd[job.peer], _CREDIT_MESSAGE)
        except OSError:
            raise PeerLostError(f"rank {self.rank}: rank {job.peer} is gone (receiving in {where})") from None
        job.offset += nbytes
        job.segments_left -= 1

    # -- reading the pipes ---------------------------------------------------------------------

    def _wait(self, deadline: float, where: object, peers: set[int]) -> None:
        """Block until a message arrives (from anyone), then take in everything that arrived."""
        remaining = deadline - time.monotonic()
        events = self._poller.poll(wait_slice(remaining) * 1000) if remaining > 0 else []
        if not events:
            if time.monotonic() < deadline:
                return  # a long wait taken in slices
            names = ", ".join(str(p) for p in sorted(peers))
            raise DeadlineError(f"rank {self.rank} timed out waiting for rank {names} in {where}",
                                peers=sorted(peers))
        for fd, _ in events:
            self._drain(self._peer_of_fd[fd], where)

    def _drain(self, peer: int, where: object) -> None:
        """Read every message waiting in ``peer``'s pipe: credits count, descriptors queue."""
        try:
            data = os.read(self._read_fd[peer], _DRAIN_BYTES)
        except BlockingIOError:
            return
        if not data:
            raise PeerLostError(f"rank {self.rank}: rank {peer} closed its connection (waiting in {where})")
        for kind, slot, nbytes, tag in _MESSAGE.iter_unpack(data):
            if kind == _CREDIT:
                self._credits[peer] += 1
            else:
                self._arrived[peer].append((slot, nbytes, tag))

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        for peer in self._arrived:
            with contextlib.suppress(PeerLostError):
                self._drain(peer, "diagnosis")
        return {peer: [tag for _, _, tag in arrived] for peer, arrived in self._arrived.items() if arrived}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (*self._read_fd.values(), *self._write_fd.values()):
            os.close(fd)
        self._memory = []
        for m in self._maps:
            # A failed transfer's traceback may still hold views of a slot; the mapping then goes
            # when they do (and with the process), so there is nothing to force here.
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []
