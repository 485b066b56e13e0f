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
so a message for a later step, or a credit for a send that is not waiting, wakes nobody. The pipe
does not fill: a sender has at most ``slots`` descriptors, ``slots`` credits and 8 eager frames
(32 KiB) outstanding, within the pipe's 64 KiB. A pipe whose writer died reads as end-of-file,
which surfaces at once as PeerLostError.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import termios
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lab import checks, fingerprint
from lab.errors import CollectiveMismatchError, DeadlineError, PeerLostError
from lab.transport.base import (
    TAG_BYTES,
    AbortNotice,
    Recv,
    Send,
    Silence,
    TagMismatch,
    Transport,
    root_cause,
    same_context,
    silence_error,
)
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
)

#: Non-blocking polls before a wait blocks (``LAB_SHM_SPIN`` overrides).
DEFAULT_SPIN = 50
#: A wait on the pipes looks at the shared memory this often: a peer that took the compiled path
#: or the two-shot for this collective (or left an earlier one's message there) has nothing to send here.
SHARED_LOOK_S = 0.01
_DRAIN_BYTES = 64 * 1024  # a whole pipe per read

#: Also lab.transport.shm_endpoints' public names, re-exported: tests and older imports take them from here.
__all__ = ["DEFAULT_EAGER_BYTES", "DEFAULT_SEGMENT_BYTES", "DEFAULT_SLOTS", "DEFAULT_SPIN", "EAGER_CREDITS",
           "MAILBOX_BUDGET_BYTES", "MAILBOX_DEPTH", "MAX_EAGER_BYTES", "Mailbox", "ShmEndpoints", "ShmTransport",
           "create_endpoints", "mailbox_slot_bytes"]


class _Job:
    """Progress of one send or receive: one eager message, or rendezvous segments."""

    __slots__ = ("array", "bytes", "combine", "eager", "offset", "peer", "segments_left")

    def __init__(self, peer: int, array: np.ndarray, segment_bytes: int, eager_bytes: int, combine=None) -> None:
        self.peer = peer
        self.array = array
        self.bytes = array.view(np.uint8)
        self.offset = 0
        self.eager = array.nbytes <= eager_bytes
        self.segments_left = 1 if self.eager else -(-array.nbytes // segment_bytes)
        self.combine = combine


class ShmTransport(Transport):
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
        self._poller = _PipePoller(self._read_fd)
        liveness = np.array([self._read_fd.get(peer, -1) for peer in range(self.world_size)], np.int64)
        self._shared = ShmMappings(endpoints, liveness)  # the segments' slots, the mailboxes and the scratch
        #: The compiled path's mailboxes (lab.plane) and the two-shot allreduce and registered buffers
        #: (lab.transport.peer_memory); None for one rank.
        self.mailbox, self.scratch = self._shared.mailbox, self._shared.scratch
        peers = list(self._read_fd)
        self._credits = {p: self.slots for p in peers}
        self._eager_credits = {p: EAGER_CREDITS for p in peers}
        self._eager_unreturned = {p: 0 for p in peers}  # eager messages consumed, credit not yet returned
        self._next_slot = {p: 0 for p in peers}
        self._arrived: dict[int, deque] = {p: deque() for p in peers}  # descriptors not yet consumed
        self._parked: dict[int, list] = {p: [] for p in peers}  # other contexts' messages, copied out
        self._partial = {p: b"" for p in peers}  # the start of a frame whose rest is still in the pipe
        self._notices: list[AbortNotice] = []  # what failing peers told this rank, in arrival order
        self._closed = False

    # -- the exchange loop -------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float, where: object
    ) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        segment_bytes, eager_bytes = self.segment_bytes, self.eager_bytes
        sending = []
        for send in sends:
            data = send.data
            if not sending and data.nbytes <= eager_bytes and self._eager_credits[send.dst]:
                # The common small send, at once: one write, no progress record (nothing queued
                # before it to this peer, so the pipe's order is the issue order).
                self._write(send.dst, DESCRIPTOR.pack(EAGER, 0, data.nbytes, tag) + data.tobytes(), "sending", where)
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
                awaited = frozenset([job.peer for job in sending] + [job.peer for job in receiving
                                                                    if not self._arrived[job.peer]])
                if awaited and not self._wait(silence, where, awaited):
                    self._raise_if_behind(self._shared.pending_fingerprints(), tag, "the shared memory", where)

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
        self._shared.slot(self.rank, job.peer, slot)[:nbytes] = job.bytes[job.offset : job.offset + nbytes]
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
        parked = self._parked[peer]
        if parked and any(same_context(entry[3], tag) for entry in parked):
            return True
        arrived = self._arrived[peer]
        while arrived and not same_context(arrived[0][3], tag):
            kind, slot, nbytes, got_tag, payload = arrived.popleft()
            if kind == EAGER:
                self._eager_consumed(peer)
            else:
                payload = bytearray(self._shared.slot(peer, self.rank, slot)[:nbytes])
                self._return_credit(peer, CREDIT_FRAME)
            parked.append((kind, slot, nbytes, got_tag, payload))
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
        parked = self._parked[job.peer]
        index = next((i for i, entry in enumerate(parked) if same_context(entry[3], tag)), None) if parked else None
        if index is None:
            kind, slot, nbytes, got_tag, payload = self._arrived[job.peer].popleft()
        else:
            kind, slot, nbytes, got_tag, payload = parked[index]
            del parked[index]
        if got_tag != tag:
            raise TagMismatch(job.peer, tag, got_tag)
        expected = min(self.segment_bytes, job.bytes.size - job.offset) if not job.eager else job.bytes.size
        if nbytes != expected or (kind == EAGER) != job.eager:
            raise CollectiveMismatchError(
                f"rank {self.rank} expected {job.bytes.size} bytes from rank {job.peer} in {where}, got a "
                f"{'message' if kind == EAGER else 'segment'} of {nbytes}"
            )
        if job.eager:
            incoming = np.frombuffer(payload, dtype=job.array.dtype)
            target = job.array
        else:
            incoming = (self._shared.slot(job.peer, self.rank, slot)[:nbytes] if payload is None
                        else np.frombuffer(payload, np.uint8)).view(job.array.dtype)
            itemsize = job.array.itemsize
            target = job.array[job.offset // itemsize : (job.offset + nbytes) // itemsize]
        if job.combine is None:
            target[:] = incoming
        else:
            job.combine(target, incoming)
        if job.eager:
            if index is None:
                self._eager_consumed(job.peer)
            job.segments_left = 0
            return
        if index is None:  # hand the slot back
            self._return_credit(job.peer, CREDIT_FRAME)
        job.offset += nbytes
        job.segments_left -= 1

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
                parked = next((entry[3] for entry in self._parked[src] if same_context(entry[3], prefix)), None)
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

    def _raise_if_told(self, where: object) -> None:
        """A peer's abort notice has come of a failure other than a deadline: its root cause,
        raised now (the wait is in vain; see :func:`lab.transport.base.root_cause`)."""
        cause = root_cause(self._notices, self.rank, deadlines=False)
        if cause is not None:
            raise cause.error(self.rank, where)

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
            first = next((entry[3] for entry in self._parked[peer] if same_context(entry[3], tag)), None)
            if first is None and self._ready(peer, tag, where):
                first = self._arrived[peer][0][3]
            if first is not None:
                heads[peer] = [first]
        self._raise_if_told(where)
        self._raise_if_behind(heads, tag, "the pipes", where)

    def _raise_if_behind(self, pending: Mapping[int, list[bytes]], tag: bytes, queue: str, where: object) -> None:
        """``pending`` (messages by sender) holds one of this mesh's collectives not later than
        ``tag``'s, on ``queue``, the other queue than this rank's: a CollectiveMismatchError."""
        context, _, seq = fingerprint.FINGERPRINT.unpack_from(tag)[:3]
        for peer, tags in pending.items():
            for got in tags:
                got_context, p2p_tag, got_seq, collective = fingerprint.FINGERPRINT.unpack_from(got)[:4]
                if got_context == context and collective and not p2p_tag and got_seq <= seq:
                    why = (": the ranks disagree on which path it takes (LAB_COMPILED_MAX_BYTES?)"
                           if got[:fingerprint.FINGERPRINT.size] == tag[:fingerprint.FINGERPRINT.size] else ", which this rank never received" if got_seq < seq else "")
                    raise CollectiveMismatchError(
                        f"rank {self.rank} is in {fingerprint.describe(tag)} ({where}); rank {peer} sent "
                        f"{fingerprint.describe(got)} through {queue}{why}")

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
        arrived, size, header = self._arrived[peer], len(data), DESCRIPTOR.size
        position = 0
        while position + header <= size:
            kind, slot, nbytes, tag = DESCRIPTOR.unpack_from(data, position)
            if kind in (EAGER, ABORT):
                end = position + header + nbytes
                if end > size:
                    break  # the rest of this frame is still in the pipe
                if kind == EAGER:
                    arrived.append((kind, 0, nbytes, tag, memoryview(data)[position + header : end]))
                else:
                    self._notices.append(AbortNotice.decode(bytes(data[position + header : end]), peer))
                position = end
                continue
            position += header
            if kind == CREDIT:
                self._credits[peer] += 1
            elif kind == EAGER_CREDIT:
                self._eager_credits[peer] += slot
            else:
                arrived.append((kind, slot, nbytes, tag, None))
        self._partial[peer] = bytes(data[position:])

    def queued_bytes(self, peer: int) -> int:
        """Bytes ``peer`` has sent that this rank holds but has not consumed (eager payloads and
        descriptors in its queue, plus what is still in the pipe): what the flood test bounds."""
        in_pipe = struct.unpack("i", fcntl.ioctl(self._read_fd[peer], termios.FIONREAD, b"\0\0\0\0"))[0]
        held = len(self._partial[peer]) + in_pipe
        for _, _, nbytes, _, payload in self._arrived[peer]:
            held += DESCRIPTOR.size + (len(payload) if payload is not None else 0)
        return held

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """Also the next message in each mailbox ring (a peer that took the compiled path where this
        rank took the pipes: a size on either side of the compiled path's threshold)."""
        for peer in self._arrived:
            with contextlib.suppress(PeerLostError):
                self._drain(peer, "diagnosis")
        tags = {peer: [entry[3] for entry in arrived] for peer, arrived in self._arrived.items() if arrived}
        for peer, pending in self._shared.pending_fingerprints().items():
            tags.setdefault(peer, []).extend(pending)
        return tags

    def send_notice(self, notice: AbortNotice) -> None:
        """One frame per peer, written whole (at most ``PIPE_BUF`` bytes) or not at all: a pipe
        with no room for it, or whose reader is gone, is skipped."""
        if self._closed:
            return
        frame = DESCRIPTOR.pack(ABORT, 0, len(payload := notice.encode()), b"") + payload
        for fd in self._write_fd.values():
            os.set_blocking(fd, False)
            try:
                os.write(fd, frame)
            except OSError:
                pass
            finally:
                os.set_blocking(fd, True)

    def notices(self, awaited: Iterable[int], grace_s: float) -> list[AbortNotice]:
        if self._closed:
            return []
        awaited, grace = frozenset(awaited), Silence(grace_s)
        while True:
            for peer in self._arrived:
                with contextlib.suppress(PeerLostError):  # (what it sent before it went is read)
                    self._drain(peer, "a failure")
            if not awaited or grace.expired() or any(notice.via in awaited for notice in self._notices):
                return list(self._notices)
            self._poller.readable(awaited, grace)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (*self._read_fd.values(), *self._write_fd.values()):
            os.close(fd)
        self.mailbox = self.scratch = None  # let go of the mappings' views, so that they can be unmapped
        self._shared.close()


class _PipePoller:
    """Waits for the pipes of a set of peers: one ``poll`` object per set awaited."""

    def __init__(self, read_fd: Mapping[int, int]) -> None:
        self._read_fd = read_fd
        self._peer_of_fd = {fd: peer for peer, fd in read_fd.items()}
        self._pollers: dict[frozenset[int], select.poll] = {}
        self._spin = _spin_from_env()

    def readable(self, peers: frozenset[int], silence: Silence) -> list[int]:
        """The peers of ``peers`` whose pipes have something (data or end-of-file), or none once
        ``silence``'s next wait is up. Spin first (``LAB_SHM_SPIN`` polls, each followed by
        ``sched_yield``), then block in ``poll``."""
        poller = self._pollers.get(peers)
        if poller is None:
            poller = self._pollers[peers] = select.poll()
            for peer in peers:
                poller.register(self._read_fd[peer], select.POLLIN)
        events = None
        for _ in range(self._spin):
            events = poller.poll(0)
            if events:
                break
            os.sched_yield()
        if not events and not silence.expired():
            events = poller.poll(min(silence.wait_s(), SHARED_LOOK_S) * 1000)
        return [self._peer_of_fd[fd] for fd, _ in events] if events else []


def _spin_from_env() -> int:
    """``LAB_SHM_SPIN``: how many non-blocking polls (each followed by ``sched_yield``) a wait tries
    before it blocks; default 50, which measured fastest at 2, 4 and 8 ranks on 2 quiet cores (see docs/how-it-works.md)."""
    return checks.env_int("LAB_SHM_SPIN", DEFAULT_SPIN)
