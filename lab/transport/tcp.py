"""The ``"tcp"`` transport: the same collectives over real sockets, on one host or many.

Wire format: :mod:`lab.transport.frames` (every frame authenticated; nothing received is ever
unpickled; a frame altered, replayed, reordered or injected in transit raises
:class:`lab.PeerLostError`).

Parking. A frame of another mesh that comes before its receive is read whole, checked and held
(:mod:`lab.transport.parking`); one over a bound raises before it is allocated, closing the link.

Progress. Sockets are non-blocking and one selector drives every send and receive of an
exchange at once, so a ring step (send right, receive left) cannot deadlock however large the
chunk; a reduction streams through a bounded scratch segment into the output. A wait raises
:class:`lab.DeadlineError` only after ``timeout_s`` without a byte moving: a peer that streams a
large tensor is busy, not silent.

Threads. Several threads may drive it at once, each a frame at a time on a connection
(:mod:`lab.transport.tcp_turns`).

Joining. :func:`lab.transport.handshake.connect_mesh` makes one authenticated connection per
pair of ranks, with the two frame keys of each; this module exchanges frames over them.
"""

from __future__ import annotations

import contextlib
import hmac
import selectors
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lab import fingerprint
from lab.errors import DeadlineError, LabError, PeerLostError
from lab.transport.base import (
    MAX_NOTICE_BYTES,
    TAG_BYTES,
    AbortNotice,
    Recv,
    Send,
    Silence,
    Transport,
    locked,
    root_cause,
    same_context,
    silence_error,
)
from lab.transport.frames import (
    ABORT,
    DATA,
    HEAD_BYTES,
    HEADER,
    MAC_BYTES,
    Job,
    forged,
    judge,
    peek_header,
    recv_some,
    send_whole,
)
from lab.transport.handshake import MAGIC, VERSION, Link, connect_mesh
from lab.transport.parking import Parking, check_arrival
from lab.transport.tcp_turns import Turns

#: A wait looks up at least this often (seconds): a close() on another thread does not wake a
#: selector, and a call still waiting when its mesh closes must fail at once, not at its deadline.
CLOSED_LOOK_S = 0.05
#: How long a failing rank's abort notice may take to go out on one connection, and to come in
#: whole once its header has (its sender writes it in one piece).
NOTICE_IO_S = 0.2


@dataclass
class TcpEndpoints:
    """What a rank of a local pool needs: its place and the job's secret (it meets the others via
    the store)."""

    rank: int
    world_size: int
    secret: bytes

    def close_in_parent(self) -> None:
        """Nothing is shared through the parent."""


class TcpTransport(Turns, Transport):
    """A rank's end of the TCP mesh. ``secret``: the job's shared secret (bytes, never sent)."""
    def __init__(self, rank: int, world_size: int, store, secret: bytes, host: str = "127.0.0.1",
                 prefix: str = "lab/tcp") -> None:
        if not secret:
            raise ValueError("secret must be a non-empty bytes string shared by every rank of the job")
        self.rank, self.world_size = rank, world_size
        self._links: dict[int, Link] = {}
        if world_size > 1:
            self._links = connect_mesh(rank, world_size, store, host, secret, prefix)
        self._closed = False
        self._start_turns()  # (several threads' calls: lab.transport.tcp_turns)
        self.parking = Parking(rank, self._links)  # other contexts' frames: (tag, payload)
        self._notices: list[AbortNotice] = []  # what failing peers told this rank, in arrival order
        self._torn: set[int] = set()  # peers whose connection holds a frame this rank sent only in part
        self._peer_of = {}
        for peer, link in self._links.items():
            link.sock.setblocking(False)
            self._peer_of[link.sock.fileno()] = peer

    # -- the exchange loop -------------------------------------------------------------------

    @locked
    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float,
                 where: object) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        sending, receiving = {}, {}
        for send in sends:  # (its sequence number, so its MAC, taken when its first byte goes)
            job = sending[send.dst] = Job(send.dst, send.data, None)
            job.header[:HEADER.size] = HEADER.pack(MAGIC, VERSION, DATA, tag, job.bytes.nbytes)
        for recv in recvs:
            # Its sequence number (and so its MAC) is the next frame's on the wire, known when
            # its header arrives (frames of other meshes may come first, and take theirs).
            receiving[recv.src] = Job(recv.src, recv.out, None, recv.combine)
        self._local.silence_s = timeout_s
        try:
            self._run(sending, receiving, tag, timeout_s, where)
        except BaseException:
            self._left_unsent(sending, receiving)
            raise

    def _open(self, job: Job, tag: bytes, where: object) -> None:
        """Judge the header ``job`` has just read (:meth:`_judge`). A frame of another context is
        parked, and ``job`` waits for the next header; one that is not what ``job`` expects raises."""
        kind, got_tag, nbytes, mac = judge(self._links[job.peer], self.rank, job.peer, bytes(job.header),
                                           where)
        self._links[job.peer].received += 1
        if kind == ABORT:
            self._take_notice(job.peer, nbytes, mac, where)
            self._raise_if_told(where)
            job.header_done = 0  # (a deadline's notice: weighed when this rank's own wait ends)
            return
        if not same_context(got_tag, tag):
            self._park(job.peer, got_tag, nbytes, mac, where)
            job.header_done = 0  # (this thread still reads the connection: the next frame's header)
            return
        job.mac = mac
        check_arrival(self.rank, job.peer, tag, got_tag, job.bytes.nbytes, nbytes, where)

    def _park(self, peer: int, got_tag: bytes, nbytes: int, mac, where: object) -> None:
        """Read a frame of another context (mesh) whole, check its MAC, and hold it until its
        receive comes. Its header is authentic (``_open``), so ``nbytes`` is what the peer sent;
        the parking's bounds come first. Its sender streams it, so reading it blocking (up to the
        exchange's silence limit) cannot deadlock."""
        try:
            self.parking.room_for(peer, got_tag, nbytes, where)
        except LabError:
            self._links[peer].sock.close()  # the stream stops mid-frame: the connection is unusable
            raise
        try:
            payload = self._read_rest(peer, nbytes, mac, self._local.silence_s)
        except TimeoutError:
            raise DeadlineError(
                f"rank {self.rank} timed out receiving a frame of another mesh from rank {peer} "
                f"in {where}", peers=(peer,)) from None
        if payload is None:
            forged(self._links[peer], self.rank, peer, "frame", where)
        self.parking.park(peer, got_tag, nbytes, payload, where)
        self._waiters.wake_others()  # (another thread may wait for it)

    def _run(self, sending: dict, receiving: dict, tag: bytes, timeout_s: float, where: object) -> None:
        silence = Silence(timeout_s)
        while True:
            pending, held_up = {}, []  # (held up: another thread's frame is on that connection)
            for peer, job in sending.items():
                if not job.done:
                    if self._writer.get(peer, job) is not job:
                        held_up.append(peer)
                        continue
                    pending[peer] = pending.get(peer, 0) | selectors.EVENT_WRITE
            for peer, job in receiving.items():
                if not job.done and not self._take_parked(job, tag, where):
                    if self._reader.get(peer, job) is not job:
                        held_up.append(peer)
                        continue
                    pending[peer] = pending.get(peer, 0) | selectors.EVENT_READ
            if not pending and not held_up:
                return
            ready = self._wait_ready(pending, min(silence.wait_s(), CLOSED_LOOK_S))  # (woken at a turn's end)
            if not ready:
                if not silence.expired():
                    continue  # a long wait taken in slices
                raise silence_error(self.rank, [*pending, *held_up], where)
            for key, events in ready:
                peer = self._peer_of[key.fileobj.fileno()]
                try:
                    if events & selectors.EVENT_WRITE and peer in sending:
                        self._send_some(sending[peer])
                    if events & selectors.EVENT_READ and peer in receiving:
                        self._recv_some(receiving[peer], tag, where)
                except PeerLostError:
                    raise  # already says what happened (a failed MAC, a malformed frame)
                except (ConnectionError, BrokenPipeError) as exc:
                    raise PeerLostError(f"rank {self.rank}: rank {peer} is gone ({exc}) in {where}") from None
            silence.progress()  # a peer moved bytes

    def _read_frame(self, job: Job, tag: bytes, where: object) -> None:
        """Read what has come of ``job``'s frame (this thread's turn: :meth:`_recv_some`)."""
        sock = self._links[job.peer].sock
        try:
            while job.header_done < HEAD_BYTES:
                job.header_done += recv_some(sock, memoryview(job.header)[job.header_done:])
                if job.header_done == HEAD_BYTES:
                    self._open(job, tag, where)  # (if it parked the frame, header_done is 0 again)
            if not job.recv_payload(sock):
                return  # (a segment reduced: our sends to this peer go on before the next)
            while job.trailer_done < MAC_BYTES:
                job.trailer_done += recv_some(sock, memoryview(job.trailer)[job.trailer_done:])
            if not hmac.compare_digest(bytes(job.trailer), job.mac.digest()):
                forged(self._links[job.peer], self.rank, job.peer, "frame", where)
        except BlockingIOError:
            return

    @locked
    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """Peek at the next frame header from each of ``expected``'s peers (read whole and parked
        if it is another context's, as a receive parks it) until one's tag starts with its
        prefix; between looks, wait for any of their sockets to be readable."""
        silence = Silence(timeout_s)  # not moved on by progress: a plain deadline
        self._local.silence_s = timeout_s  # how long parking a frame may wait for its rest
        while True:
            for src, prefix in expected.items():
                first = self._next_tag(src, prefix, where)
                if first is not None and first.startswith(prefix):
                    return src
            if silence.expired():
                return None
            self._wait_ready(dict.fromkeys(expected, selectors.EVENT_READ),
                             min(silence.wait_s(), CLOSED_LOOK_S))

    def _next_tag(self, peer: int, prefix: bytes, where: object) -> bytes | None:
        """The tag of the first frame of ``prefix``'s context from ``peer``, parked or next on the
        wire (frames of other contexts before it are parked), without taking it; None if its
        header has not arrived whole."""
        parked = self.parking.first(peer, prefix)
        if parked is not None or peer in self._reader:  # (another thread reads a frame of it: not now)
            return parked
        link = self._links[peer]
        while True:
            try:
                data = link.sock.recv(HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError as exc:
                raise PeerLostError(f"rank {self.rank}: rank {peer} is gone ({exc}) in {where}") from None
            if not data:
                raise PeerLostError(
                    f"rank {self.rank}: rank {peer} closed its connection (waiting in {where})")
            if len(data) < HEAD_BYTES:
                return None
            kind, got_tag, nbytes, mac = judge(self._links[peer], self.rank, peer, data, where)
            if kind == ABORT:
                link.sock.recv(HEAD_BYTES)
                link.received += 1
                self._take_notice(peer, nbytes, mac, where)
                self._raise_if_told(where)
                continue
            if same_context(got_tag, prefix):
                return got_tag
            # Another mesh's frame: take its header off the wire (it is all here), then park it whole.
            link.sock.recv(HEAD_BYTES)
            link.received += 1
            self._park(peer, got_tag, nbytes, mac, where)

    @locked
    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """The parked frames, and the tag of the next unread frame from each peer whose header MAC
        checks out (a header an attacker slipped in must not turn a deadline into a mismatch
        blaming a rank)."""
        tags = self.parking.tags()
        for peer, link in self._links.items():
            with contextlib.suppress(OSError):
                peeked = None if peer in self._reader else peek_header(link)  # (not in another's frame)
                if peeked is not None and peeked[0] == DATA:
                    tags.setdefault(peer, []).append(peeked[1])
        return tags

    def stray(self, tag: bytes) -> tuple[int, bytes] | None:
        """Among the parked frames only (one still in a socket is met by the next receive from its
        peer, or at the end: :func:`lab.comm.unread.raise_if_unread`), without the lock: a glance."""
        return fingerprint.earlier(tag, self.parking.tags()) if self.parking.messages else None

    def _raise_if_told(self, where: object) -> None:
        """A peer's abort notice has come of a failure other than a deadline: its root cause,
        raised now (the wait is in vain; see :func:`lab.transport.base.root_cause`)."""
        cause = root_cause(self._notices, self.rank, deadlines=False)
        if cause is not None:
            raise cause.error(self.rank, where)

    def _take_notice(self, peer: int, nbytes: int, mac, where: object) -> None:
        """Read the rest of an abort notice whose authentic header was just taken, check its MAC
        and keep it (in :attr:`_notices`)."""
        try:
            payload = self._read_rest(peer, nbytes, mac, NOTICE_IO_S)
        except OSError as exc:
            raise PeerLostError(f"rank {self.rank}: rank {peer} sent part of an abort notice ({exc}) "
                                f"in {where}") from None
        if payload is None:
            forged(self._links[peer], self.rank, peer, "abort notice", where)
        self._notices.append(AbortNotice.decode(payload.tobytes(), peer))

    @locked
    def send_notice(self, notice: AbortNotice, to: Iterable[int] | None = None) -> None:
        """One frame per connection (to the peers ``to``; None: all), sequenced and MACed as any
        frame; none on a connection left in the middle of a frame (or in another thread's). One
        whose peer does not take it within ``NOTICE_IO_S`` carries no more."""
        if self._closed:
            return
        payload = notice.encode()
        for peer in self._links if to is None else to:
            if peer in self._writer:
                continue  # (another thread's frame is going out on it)
            if peer not in self._torn and not send_whole(self._links[peer], ABORT, payload, NOTICE_IO_S):
                self._torn.add(peer)  # (it may have gone out in part)

    @locked
    def notices(self, awaited: Iterable[int], grace_s: float) -> list[AbortNotice]:
        """The notices at the head of each connection (behind a message, one is not seen), and
        those ``awaited`` send within ``grace_s``."""
        if self._closed:
            return []
        awaited, grace = [peer for peer in awaited if peer in self._links], Silence(grace_s)
        while True:
            for peer in self._links:
                with contextlib.suppress(LabError, OSError):  # (a lost or unreadable peer tells nothing)
                    while self._notice_next(peer):
                        pass
            if not awaited or grace.expired() or any(notice.via in awaited for notice in self._notices):
                return list(self._notices)
            self._wait_ready(dict.fromkeys(awaited, selectors.EVENT_READ), grace.wait_s())

    def _notice_next(self, peer: int) -> bool:
        """Take the next frame from ``peer`` if it is an abort notice whose header has come."""
        link = self._links[peer]
        peeked = None if peer in self._reader else peek_header(link)  # (None: not whole, or read in part)
        if peeked is None or peeked[0] != ABORT or peeked[2] > MAX_NOTICE_BYTES:
            return False
        _, _, nbytes, mac = peeked
        link.sock.recv(HEAD_BYTES)
        link.received += 1
        self._take_notice(peer, nbytes, mac, "a failure")
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_selectors()
        for link in self._links.values():
            link.sock.close()
