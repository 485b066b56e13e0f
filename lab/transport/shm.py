"""The ``"shm"`` transport: descriptors through pipes, tensor bytes through shared memory.

Two protocols. A message of at most ``eager_bytes`` (default 4,048: a 48-byte descriptor plus the
payload fit one ``PIPE_BUF`` write) is *eager*: its bytes travel inline in the pipe, right behind
its descriptor, and the receiver copies or reduces them from what it read: one ``write`` and one
``read``, no slot, no credit round trip. Larger messages take the *rendezvous* path below. What a
fast sender can queue eagerly at a receiver that is not reading is bounded by eager credits: a
sender holds ``EAGER_CREDITS`` (8) per peer, spends one per eager message, and the receiver hands
them back ``EAGER_CREDITS // 2`` at a time as it consumes messages; so at most 8 eager messages
(8 x 4,096 bytes of frames, 32 KiB) wait at a receiver per sender, in its pipe or its queue.

Rendezvous. Rank ``i`` owns one shared-memory segment holding, for every destination ``j``,
``slots`` slots of ``segment_bytes`` each (:mod:`lab.transport.shm_endpoints`: the memfds, the
frames, the mailboxes and the shared scratch). A send copies the data into the next free slot and
writes a 48-byte descriptor (slot, byte count, tag) to the pipe ``i -> j``; the receiver copies or
reduces (Numba kernel) straight out of that slot and returns a credit on the pipe ``j -> i``. A
sender with no credit waits, so a slot is never overwritten before its reader is done, and shared
memory per rank is bounded by ``(world_size - 1) * slots * segment_bytes`` whatever the tensor
size: larger tensors flow through in segments, pipelined across the slots.

Control plane. One OS pipe per directed edge (single producer, single consumer), chosen over
``multiprocessing.Queue`` for its latency (see docs/how-it-works.md), used raw: frames of a 48-byte
descriptor (plus an eager payload), each written atomically with one ``write`` of at most
``PIPE_BUF`` bytes, and drained many at a time with one ``read`` (a frame cut by the read's size
waits for the rest in a per-peer buffer). A wait polls only the pipes of the peers it waits for,
so a message for a later step, or a credit for a send that is not waiting, wakes nobody (several
threads may wait at once, each for its own context, the transport's lock let go). The pipe
does not fill: a sender has at most ``slots`` descriptors, ``slots`` credits and 8 eager frames
(32 KiB) outstanding, within the pipe's 64 KiB. A pipe whose writer died reads as end-of-file,
which surfaces at once as PeerLostError.

Unread messages. Each data frame written to a pipe, and each consumed, is counted in the
mailboxes' region (:class:`lab.transport.shm_endpoints.ShmMappings`): where the counts differ, a
pipe holds a message not received yet, which a collective's first look (:meth:`holds_unread`, and
a compiled call's, :func:`kernels.rings.look_back`) sees without a system call.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from lab.errors import DeadlineError, PeerLostError
from lab.transport.base import (
    TAG_BYTES,
    AbortNotice,
    Recv,
    Send,
    Silence,
    Transport,
    locked,
    same_context,
    silence_error,
)
from lab.transport.parking import Parking, check_arrival, raise_if_behind
from lab.transport.pipe_notices import PipeNotices
from lab.transport.pipe_poller import DEFAULT_SPIN, PipePoller
from lab.transport.pipe_unread import PipeUnread
from lab.transport.shm_endpoints import (
    ABORT,
    CREDIT,
    CREDIT_FRAME,
    DATA,
    DEFAULT_EAGER_BYTES,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SLOTS,
    DESCRIPTOR,
    EAGER,
    EAGER_CREDIT,
    EAGER_CREDIT_FRAME,
    EAGER_CREDITS,
    MAILBOX_BUDGET_BYTES,
    MAILBOX_DEPTH,
    MAX_EAGER_BYTES,
    Mailbox,
    ShmEndpoints,
    ShmMappings,
    create_endpoints,
    mailbox_slot_bytes,
    parse_frames,
)

_DRAIN_BYTES = 64 * 1024  # a whole pipe per read

#: Also lab.transport.shm_endpoints' public names, re-exported: tests and older imports take them from here.
__all__ = [
    "DEFAULT_EAGER_BYTES", "DEFAULT_SEGMENT_BYTES", "DEFAULT_SLOTS", "DEFAULT_SPIN", "EAGER_CREDITS",
    "MAILBOX_BUDGET_BYTES", "MAILBOX_DEPTH", "MAX_EAGER_BYTES", "Mailbox", "ShmEndpoints", "ShmTransport",
    "create_endpoints", "mailbox_slot_bytes"]


class _Job:
    """Progress of one send or receive: one eager message, or rendezvous segments."""

    __slots__ = ("array", "bytes", "combine", "eager", "offset", "peer", "segments_left")

    def __init__(self, peer: int, array: np.ndarray, segment_bytes: int, eager_bytes: int,
                 combine=None) -> None:
        self.peer = peer
        self.array = array
        self.bytes = array.view(np.uint8)
        self.offset = 0
        self.eager = array.nbytes <= eager_bytes
        self.segments_left = 1 if self.eager else -(-array.nbytes // segment_bytes)
        self.combine = combine


class ShmTransport(PipeNotices, PipeUnread, Transport):
    """A rank's end of the shm mesh (built inside the rank's process from its endpoints)."""
    def __init__(self, endpoints: ShmEndpoints) -> None:
        self.rank = endpoints.rank
        self.world_size = endpoints.world_size
        self.segment_bytes = endpoints.segment_bytes
        self.slots = endpoints.slots
        self.eager_bytes = endpoints.eager_bytes
        self._read_fd = {peer: shared.fd for peer, shared in endpoints.inbox.items()}
        self._write_fd = {peer: shared.fd for peer, shared in endpoints.outbox.items()}
        for fd in self._read_fd.values():
            os.set_blocking(fd, False)  # drains never block; waiting is the poller's job
        self._lock = threading.RLock()  # (several threads' calls: lab.transport.base's Threads)
        self._poller = PipePoller(self._read_fd, self._lock)
        liveness = np.array([self._read_fd.get(peer, -1) for peer in range(self.world_size)], np.int64)
        self._shared = ShmMappings(endpoints, liveness)  # the segments' slots, the mailboxes and the scratch
        #: The compiled path's mailboxes (lab.compiled.plane) and the two-shot allreduce and registered buffers
        #: (lab.transport.peer_memory); None for one rank.
        self.mailbox, self.scratch = self._shared.mailbox, self._shared.scratch
        peers = list(self._read_fd)
        self._credits = {p: self.slots for p in peers}
        self._eager_credits = {p: EAGER_CREDITS for p in peers}
        self._eager_unreturned = {p: 0 for p in peers}  # eager messages consumed, credit not yet returned
        self._next_slot = {p: 0 for p in peers}
        self._arrived: dict[int, deque] = {p: deque() for p in peers}  # descriptors not yet consumed
        self.parking = Parking(self.rank,
                               peers)  # other contexts' messages, copied out: (kind, slot, nbytes, payload)
        self._partial = {p: b"" for p in peers}  # the start of a frame whose rest is still in the pipe
        self._notices: list[AbortNotice] = []  # what failing peers told this rank, in arrival order
        self._closed = False

    # -- the exchange loop -------------------------------------------------------------------

    @locked
    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float,
                 where: object) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        segment_bytes, eager_bytes = self.segment_bytes, self.eager_bytes
        sending = []
        for send in sends:
            data = send.data
            if not sending and data.nbytes <= eager_bytes and self._eager_credits[send.dst]:
                # The common small send, at once: one write, no progress record (nothing queued
                # before it to this peer, so the pipe's order is the issue order).
                self._write(send.dst,
                            DESCRIPTOR.pack(EAGER, 0, data.nbytes, tag) + data.tobytes(), "sending", where)
                self._eager_credits[send.dst] -= 1
            else:
                sending.append(_Job(send.dst, data, segment_bytes, eager_bytes))
        receiving = [_Job(r.src, r.out, segment_bytes, eager_bytes, r.combine) for r in recvs]
        silence = Silence(timeout_s)
        while True:
            moved = False
            for job in sending:
                while job.segments_left and self._can_send(job):
                    self._push_segment(job, tag, where)
                    moved = True
            for job in receiving:
                while job.segments_left and self._ready(job.peer, tag, where):
                    self._consume_segment(job, tag, where)
                    moved = True
            sending = [job for job in sending if job.segments_left]
            receiving = [job for job in receiving if job.segments_left]
            if not (sending or receiving):
                return
            if moved:  # an awaited peer made progress
                silence.progress()
            if not any(self._can_send(job) for job in sending):
                # Wait for the peers that hold us up: senders out of credit, receivers with nothing queued.
                awaited = frozenset([job.peer for job in sending] +
                                    [job.peer for job in receiving if not self._arrived[job.peer]])
                try:
                    if awaited and not self._wait(silence, where, awaited):
                        raise_if_behind(self.rank, self._shared.pending_fingerprints(), tag,
                                        "the shared memory", where)
                except PeerLostError:  # (what it sent before it went may be here: drained by another thread)
                    if not any(self._ready(job.peer, tag, where) for job in receiving):
                        raise

    def _can_send(self, job: _Job) -> bool:
        return (self._eager_credits if job.eager else self._credits)[job.peer] > 0

    def _push_segment(self, job: _Job, tag: bytes, where: object) -> None:
        if job.eager:
            # Descriptor and payload in one atomic write: no slot, no credit back per message.
            frame = DESCRIPTOR.pack(EAGER, 0, job.bytes.size, tag) + job.bytes.tobytes()
            self._write(job.peer, frame, "sending", where)
            self._eager_credits[job.peer] -= 1
            job.segments_left = 0
            return
        # Copy the next piece into our next free slot for this peer, then tell the peer where it is.
        nbytes = min(self.segment_bytes, job.bytes.size - job.offset)
        slot = self._next_slot[job.peer]
        self._shared.slot(self.rank, job.peer, slot)[:nbytes] = job.bytes[job.offset:job.offset + nbytes]
        self._write(job.peer, DESCRIPTOR.pack(DATA, slot, nbytes, tag), "sending", where)
        self._credits[job.peer] -= 1
        self._next_slot[job.peer] = (slot + 1) % self.slots
        job.offset += nbytes
        job.segments_left -= 1

    def _write(self, peer: int, frame: bytes, doing: str, where: object) -> None:
        try:
            os.write(self._write_fd[peer], frame)
        except OSError:
            raise PeerLostError(f"rank {self.rank}: rank {peer} is gone ({doing} in {where})") from None
        self._shared.sent(peer)  # (every frame written here is a data frame: see Unread messages)

    def _return_credit(self, peer: int, frame: bytes) -> None:
        """Hand a slot (or eager credits) back to ``peer`` for data we have taken. A sender that
        has finished its sends and exited needs no credit: its data is whole here, and anything
        still awaited from it finds its pipe closed (a PeerLostError then, not now)."""
        try:
            os.write(self._write_fd[peer], frame)
        except BrokenPipeError:
            pass

    def _ready(self, peer: int, tag: bytes, where: object) -> bool:
        """True if a message of ``tag``'s context from ``peer`` can be consumed now. What arrived
        first for another context (a mesh or sub-mesh the peer entered in another order) is
        parked on the way: copied out of its slot, its credit returned at once."""
        if self.parking.first(peer, tag) is not None:
            return True
        arrived = self._arrived[peer]
        while arrived and not same_context(arrived[0][3], tag):
            kind, slot, nbytes, got_tag, payload = arrived[0]
            self.parking.room_for(peer, got_tag, nbytes, where)
            arrived.popleft()
            if kind == EAGER:
                self._eager_consumed(peer)
            else:
                payload = bytearray(self._shared.slot(peer, self.rank, slot)[:nbytes])
                self._return_credit(peer, CREDIT_FRAME)
            self.parking.park(peer, got_tag, nbytes, (kind, slot, nbytes, payload), where)
        return bool(arrived)

    def _eager_consumed(self, peer: int) -> None:
        # Hand eager credits back in batches: one message per EAGER_CREDITS // 2 received.
        self._eager_unreturned[peer] += 1
        if self._eager_unreturned[peer] == EAGER_CREDITS // 2:
            self._eager_unreturned[peer] = 0
            self._return_credit(peer, EAGER_CREDIT_FRAME)

    def _consume_segment(self, job: _Job, tag: bytes, where: object) -> None:
        # Copy or reduce straight out of the eager payload or the sender's slot (or, for a parked
        # message, out of its copy: its credit went back when it was parked).
        held = self.parking.take(job.peer, tag)
        if held is None:
            kind, slot, nbytes, got_tag, payload = self._arrived[job.peer].popleft()
        else:
            got_tag, (kind, slot, nbytes, payload) = held
        self._shared.taken(job.peer)
        expected = min(self.segment_bytes, job.bytes.size - job.offset) if not job.eager else job.bytes.size
        same_kind = (kind == EAGER) == job.eager  # (an eager message where a segment is due: sizes disagree)
        check_arrival(self.rank, job.peer, tag, got_tag, expected, nbytes if same_kind else -1, where,
                      f"a {'message' if kind == EAGER else 'segment'} of {nbytes}")
        if job.eager:
            incoming = np.frombuffer(payload, dtype=job.array.dtype)
            target = job.array
        else:
            incoming = (self._shared.slot(job.peer, self.rank, slot)[:nbytes]
                        if payload is None else np.frombuffer(payload, np.uint8)).view(job.array.dtype)
            itemsize = job.array.itemsize
            target = job.array[job.offset // itemsize:(job.offset + nbytes) // itemsize]
        if job.combine is None:
            target[:] = incoming
        else:
            job.combine(target, incoming)
        if job.eager:
            if held is None:
                self._eager_consumed(job.peer)
            job.segments_left = 0
            return
        if held is None:  # hand the slot back
            self._return_credit(job.peer, CREDIT_FRAME)
        job.offset += nbytes
        job.segments_left -= 1

    @locked
    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """Drain the pipes of ``expected``'s peers (other contexts' messages are parked on the
        way, as a receive parks them) until one's first message of its context starts with its
        prefix; between looks, wait as an exchange does (spin, then poll)."""
        silence = Silence(timeout_s)  # not moved on by progress: a plain deadline
        while True:
            for src in expected:
                self._drain(src, where)  # non-blocking: what is in the pipe now
            self._raise_if_told(where)
            for src, prefix in expected.items():
                parked = self.parking.first(src, prefix)
                first = parked if parked is not None else (
                    self._arrived[src][0][3] if self._ready(src, prefix, where) else None)
                if first is not None and first.startswith(prefix):
                    return src
            if silence.expired():
                return None
            try:
                self._wait(silence, where, frozenset(expected))
            except DeadlineError:
                return None

    # -- reading the pipes ---------------------------------------------------------------------

    def _wait(self, silence: Silence, where: object, peers: frozenset[int]) -> bool:
        """Wait until one of ``peers`` sends something (spin, then poll), then take in everything
        they sent; False if nothing came in a slice (at most :data:`SHARED_LOOK_S`)."""
        readable = self._poller.readable(peers, silence)
        if not readable and silence.expired():
            raise silence_error(self.rank, peers, where)
        for peer in readable:  # none: a long wait taken in slices
            self._drain(peer, where)
        self._raise_if_told(where)
        return bool(readable)

    @locked
    def park_pending(self, tag: bytes, where: object) -> None:
        """While this rank waits in the shared memory (the compiled path's mailboxes, the
        two-shot's flags) in the collective of ``tag``: drain every pipe, parking other meshes'
        messages as a receive parks them (their senders get their credits back and go on). A
        message of this mesh's collective or an earlier one there is a mismatch, raised now, as is
        the root cause a peer's abort notice names."""
        heads = {}
        for peer in self._arrived:
            with contextlib.suppress(PeerLostError):  # a lost peer is the wait's to report
                self._drain(peer, where)
            first = self.parking.first(peer, tag)
            if first is None and self._ready(peer, tag, where):
                first = self._arrived[peer][0][3]
            if first is not None:
                heads[peer] = [first]
        self._raise_if_told(where)
        raise_if_behind(self.rank, heads, tag, "the pipes", where)

    def _drain(self, peer: int, where: object) -> None:
        """Read every frame waiting in ``peer``'s pipe: credits count, descriptors queue."""
        try:
            data = os.read(self._read_fd[peer], _DRAIN_BYTES)
        except BlockingIOError:
            return
        if not data:
            raise PeerLostError(f"rank {self.rank}: rank {peer} closed its connection (waiting in {where})")
        # Writable (Numba's kernels take writable arrays); payloads below are views of it, not copies.
        data = bytearray(self._partial[peer] + data if self._partial[peer] else data)
        frames, whole = parse_frames(data)
        for kind, slot, nbytes, tag, payload in frames:
            if kind == ABORT:
                self._notices.append(AbortNotice.decode(bytes(payload), peer))
            elif kind == CREDIT:
                self._credits[peer] += 1
            elif kind == EAGER_CREDIT:
                self._eager_credits[peer] += slot
            else:
                self._arrived[peer].append((kind, slot, nbytes, tag, payload))
        self._partial[peer] = bytes(data[whole:])  # the start of a frame whose rest is still in the pipe
        self._poller.waiters.wake_others()  # (what came may be for another thread's call)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (*self._read_fd.values(), *self._write_fd.values()):
            os.close(fd)
        self.mailbox = self.scratch = None  # let go of the mappings' views, so that they can be unmapped
        self._shared.close()
