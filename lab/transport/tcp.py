"""The ``"tcp"`` transport: the same collectives over real sockets, on one host or many.

Wire format. One TCP connection per pair of ranks. Every message is a frame: a fixed 48-byte
header (magic ``LABT``, version, kind, the 32-byte tag, payload length) and its own 32-byte MAC,
the raw tensor bytes, and a 32-byte MAC of the whole frame. Both MACs are keyed BLAKE3 under a key
that only this connection's two ranks hold, over a per-direction sequence number and what precedes
them. Nothing received from a socket is ever unpickled. A receiver believes nothing in a header
before its MAC checks out: a forged, replayed or reordered header is refused before its length
allocates a byte or its tag blames a rank. It checks magic, version and length before reading a
payload byte, the tag before using it, and the frame's MAC before the exchange returns: a frame
that was altered, replayed, reordered or injected by anyone in the middle raises
:class:`lab.PeerLostError` ("failed authentication"; the result is never returned).

Parking. A frame of another mesh (context) that arrives before its receive is read whole, checked
and held aside (see :mod:`lab.transport.base`). What is held is bounded: ``MAX_PARKED_BYTES_PER_PEER``
from one peer and ``MAX_PARKED_BYTES`` from all peers together (the payload bytes); a frame that
would exceed either is a :class:`lab.LabError` naming the bound, raised before it is allocated.

Progress. Sockets are non-blocking and one selector drives every send and receive of an
exchange at once, so a ring step (send right, receive left) cannot deadlock however large the
chunk; a reduction streams through a bounded scratch segment into the output. A wait raises
:class:`lab.DeadlineError` only after ``timeout_s`` without a byte moving: a peer that streams a
large tensor is busy, not silent.

Joining. :func:`lab.transport.handshake.connect_mesh` makes one authenticated connection per
pair of ranks, with the two frame keys of each (proofs, the listener and its evictions, the
connector's retries: see :mod:`lab.transport.handshake`); this module frames and exchanges
messages over them.
"""

from __future__ import annotations

import contextlib
import hmac
import math
import selectors
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError
from lab.transport.base import (
    CONTEXT_BYTES,
    MAX_NOTICE_BYTES,
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
from lab.transport.handshake import MAGIC, VERSION, Link, connect_mesh

_DATA, _ABORT = 1, 2  # frame kinds: a message; an abort notice (lab.transport.base.AbortNotice) as payload
_HEADER = struct.Struct(f"<4sBBxx{TAG_BYTES}sQ")  # magic, version, kind, tag, payload bytes: 48
MAC_BYTES = 32  # keyed BLAKE3: after the header, and after the payload
_HEAD_BYTES = _HEADER.size + MAC_BYTES  # what a receiver reads and checks before believing a length
#: Frames announcing more payload than this are rejected (a garbled length must not allocate).
MAX_FRAME_BYTES = 1 << 36
#: Payload bytes of other meshes' frames held aside from one peer, and from all peers together,
#: waiting for their receive. A frame that would exceed either is a LabError (see ``_room_for``).
#: Read when a frame arrives: a job that needs more can raise them in every rank before it starts.
MAX_PARKED_BYTES_PER_PEER = 1 << 30
MAX_PARKED_BYTES = 4 << 30
SCRATCH_BYTES = 256 * 1024
#: A wait looks up at least this often (seconds): a close() on another thread does not wake a
#: selector, and a call still waiting when its mesh closes must fail at once, not at its deadline.
CLOSED_LOOK_S = 0.05
#: How long a failing rank's abort notice may take to go out on one connection, and to come in
#: whole once its header has (its sender writes it in one piece).
NOTICE_IO_S = 0.2


def frame_mac(key: bytes, sequence: int) -> blake3.blake3:
    """A running MAC of one frame: keyed BLAKE3 (a PRF, 3-4x the speed of HMAC-SHA256 here, and
    it releases the GIL on large buffers) over the sequence number, then the header (its digest
    there is the header's MAC), that MAC, and the payload (its digest then is the frame's MAC)."""
    return blake3.blake3(sequence.to_bytes(8, "little"), key=key)


def head(key: bytes, sequence: int, header: bytes) -> tuple[bytes, blake3.blake3]:
    """The header's MAC, and the frame's running MAC ready for the payload."""
    mac = frame_mac(key, sequence)
    mac.update(header)
    tag = mac.digest()
    mac.update(tag)
    return tag, mac


def _size(nbytes: int) -> str:
    """``"1.5 GiB"``, ``"96 KiB"``, ``"12 B"`` for an error message."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def parking_bound(held: int, total: int, nbytes: int) -> str | None:
    """The bound that parking ``nbytes`` more would pass, with ``held`` bytes parked from that peer
    and ``total`` from all (as the error names it), or None while there is room."""
    if held + nbytes > MAX_PARKED_BYTES_PER_PEER:
        return f"MAX_PARKED_BYTES_PER_PEER ({_size(MAX_PARKED_BYTES_PER_PEER)}; {_size(held)} held from it already)"
    if total + nbytes > MAX_PARKED_BYTES:
        return f"MAX_PARKED_BYTES ({_size(MAX_PARKED_BYTES)} from all peers; {_size(total)} held already)"
    return None


def check_frame(rank: int, peer: int, tag: bytes, got_tag: bytes, expected_bytes: int, nbytes: int,
                where: object) -> None:
    """A frame of the receive's context from ``peer`` must carry its tag and byte count."""
    if got_tag != tag:
        raise TagMismatch(peer, tag, got_tag)
    if nbytes != expected_bytes:
        raise CollectiveMismatchError(f"rank {rank} expected {expected_bytes} bytes from rank {peer} in {where}, "
                                      f"got {nbytes}")


def recv_some(sock: socket.socket, view: memoryview) -> int:
    """``sock.recv_into(view)``; a closed connection is a ``ConnectionError``."""
    got = sock.recv_into(view)
    if not got:
        raise ConnectionError("connection closed")
    return got


class _Job:
    """One frame in flight: header and its MAC, payload, MAC; sent or received a piece at a time.
    A receive's ``mac`` is made when its header arrives (``None`` until then)."""

    __slots__ = ("peer", "array", "bytes", "header", "header_done", "offset", "combine", "scratch", "filled",
                 "mac", "trailer", "trailer_done")

    def __init__(self, peer: int, array: np.ndarray, mac, combine=None) -> None:
        self.peer, self.array, self.combine, self.mac = peer, array, combine, mac
        self.bytes = memoryview(array.view(np.uint8))
        self.header = bytearray(_HEAD_BYTES)
        self.header_done = 0
        self.offset = 0  # payload bytes done
        self.scratch = None
        self.filled = 0
        self.trailer = bytearray(MAC_BYTES)
        self.trailer_done = 0

    @property
    def done(self) -> bool:
        return self.trailer_done == MAC_BYTES


@dataclass
class TcpEndpoints:
    """What a rank of a local pool needs: its place and the job's secret (it meets the others via
    the store)."""

    rank: int
    world_size: int
    secret: bytes

    def close_in_parent(self) -> None:
        """Nothing is shared through the parent."""


class TcpTransport(Transport):
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
        self._selector = selectors.DefaultSelector()
        self._parked: dict[int, list[tuple[bytes, np.ndarray]]] = {p: [] for p in self._links}  # other contexts'
        self._parked_bytes = {p: 0 for p in self._links}  # their payload bytes, per peer
        self._silence_s = math.inf  # the current exchange's timeout_s (each exchange sets it; parking reads it)
        self._watched: dict[int, int] = {}  # peer -> selector events currently registered
        self._notices: list[AbortNotice] = []  # what failing peers told this rank, in arrival order
        self._torn: set[int] = set()  # peers whose connection holds a frame this rank sent only in part
        self._peer_of = {}
        for peer, link in self._links.items():
            link.sock.setblocking(False)
            self._peer_of[link.sock.fileno()] = peer

    # -- the exchange loop -------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float, where: object
    ) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        sending, receiving = {}, {}
        for send in sends:
            link = self._links[send.dst]
            job = sending[send.dst] = _Job(send.dst, send.data, None)
            header = _HEADER.pack(MAGIC, VERSION, _DATA, tag, job.bytes.nbytes)
            header_mac, job.mac = head(link.send_key, link.sent, header)
            job.header[:] = header + header_mac
            link.sent += 1
        for recv in recvs:
            if self._take_parked(recv, tag, where):
                continue
            # Its sequence number (and so its MAC) is the next frame's on the wire, known when
            # its header arrives (frames of other meshes may come first, and take theirs).
            receiving[recv.src] = _Job(recv.src, recv.out, None, recv.combine)
        self._silence_s = timeout_s
        try:
            self._run(sending, receiving, tag, timeout_s, where)
        except BaseException:
            self._left_unsent(sending)
            raise

    def _left_unsent(self, sending: dict[int, _Job]) -> None:
        """After a failed exchange: a frame never started gives its sequence number back, so that
        an abort notice can take it; a connection left in the middle of a frame carries no more."""
        for peer, job in sending.items():
            if job.header_done == 0:
                self._links[peer].sent -= 1
            elif not job.done:
                self._torn.add(peer)

    def _take_parked(self, recv: Recv, tag: bytes, where: object) -> bool:
        """Serve ``recv`` from a parked frame of its context, if one arrived earlier."""
        parked = self._parked[recv.src]
        index = next((i for i, (got, _) in enumerate(parked) if same_context(got, tag)), None)
        if index is None:
            return False
        got_tag, payload = parked.pop(index)
        self._parked_bytes[recv.src] -= payload.nbytes
        check_frame(self.rank, recv.src, tag, got_tag, recv.out.nbytes, payload.nbytes, where)
        if recv.combine is None:
            recv.out.view(np.uint8)[:] = payload
        else:
            recv.combine(recv.out, payload.view(recv.out.dtype))
        return True

    def _judge(self, peer: int, head_bytes: bytes, where: object) -> tuple[int, bytes, int, blake3.blake3]:
        """(kind, tag, payload bytes, the frame's running MAC) of the next frame's header from
        ``peer``, MAC first: nothing in it is believed before. A forged or malformed header raises."""
        link = self._links[peer]
        header, header_mac = head_bytes[:_HEADER.size], head_bytes[_HEADER.size:]
        expected, mac = head(link.recv_key, link.received, header)
        if not hmac.compare_digest(header_mac, expected):
            self._forged(peer, "frame header", where)
        magic, version, kind, got_tag, nbytes = _HEADER.unpack(header)
        longest = {_DATA: MAX_FRAME_BYTES, _ABORT: MAX_NOTICE_BYTES}.get(kind, -1)  # (-1: no such kind)
        if magic != MAGIC or version != VERSION or nbytes > longest:
            link.sock.close()
            raise PeerLostError(f"rank {self.rank}: rejected a malformed frame from rank {peer} "
                                f"(magic {magic!r}, version {version}, kind {kind}, length {nbytes}); "
                                "connection closed")
        return kind, got_tag, nbytes, mac

    def _open(self, job: _Job, tag: bytes, where: object) -> None:
        """Judge the header ``job`` has just read (:meth:`_judge`). A frame of another context is
        parked, and ``job`` waits for the next header; one that is not what ``job`` expects raises."""
        kind, got_tag, nbytes, mac = self._judge(job.peer, bytes(job.header), where)
        self._links[job.peer].received += 1
        if kind == _ABORT:
            self._take_notice(job.peer, nbytes, mac, where)
            self._raise_if_told(where)
            job.header_done = 0  # (a deadline's notice: weighed when this rank's own wait ends)
            return
        if not same_context(got_tag, tag):
            self._park(job.peer, got_tag, nbytes, mac, where)
            job.header_done = 0
            return
        job.mac = mac
        check_frame(self.rank, job.peer, tag, got_tag, job.bytes.nbytes, nbytes, where)

    def _forged(self, peer: int, what: str, where: object) -> None:
        """A MAC did not check out: close the connection (nothing after it can be trusted) and raise."""
        self._links[peer].sock.close()
        raise PeerLostError(f"rank {self.rank}: a {what} from rank {peer} failed authentication in {where} "
                            "(altered, replayed, reordered or injected in transit); connection closed")

    def _park(self, peer: int, got_tag: bytes, nbytes: int, mac, where: object) -> None:
        """Read a frame of another context (mesh) whole, check its MAC, and hold it until its
        receive comes. Its header is authentic (``_open``), so ``nbytes`` is what the peer sent;
        ``_room_for`` bounds it. Its sender streams it, so reading it blocking (up to the
        exchange's silence limit) cannot deadlock."""
        self._room_for(peer, got_tag, nbytes, where)
        link = self._links[peer]
        payload, trailer = np.empty(nbytes, np.uint8), bytearray(MAC_BYTES)
        link.sock.settimeout(self._silence_s if self._silence_s < float("inf") else None)
        try:
            for buffer in (memoryview(payload), memoryview(trailer)):
                done = 0
                while done < len(buffer):
                    done += recv_some(link.sock, buffer[done:])
        except TimeoutError:
            raise DeadlineError(f"rank {self.rank} timed out receiving a frame of another mesh from rank {peer} "
                                f"in {where}", peers=(peer,)) from None
        finally:
            link.sock.setblocking(False)
        mac.update(payload)
        if not hmac.compare_digest(bytes(trailer), mac.digest()):
            self._forged(peer, "frame", where)
        self._parked[peer].append((got_tag, payload))
        self._parked_bytes[peer] += nbytes

    def _room_for(self, peer: int, got_tag: bytes, nbytes: int, where: object) -> None:
        """Refuse to park a frame beyond ``MAX_PARKED_BYTES_PER_PEER`` or ``MAX_PARKED_BYTES``.

        An error, not back-pressure: a parked frame is only taken by a later exchange, and what
        this one waits for is behind it in the same stream, so not reading it would only turn the
        overflow into a silent wait until the deadline, blaming a rank that is not late."""
        bound = parking_bound(self._parked_bytes[peer], sum(self._parked_bytes.values()), nbytes)
        if bound is None:
            return
        self._links[peer].sock.close()  # the stream stops mid-frame: the connection is unusable
        context = int.from_bytes(got_tag[:CONTEXT_BYTES], "little")  # (the mesh's id and the tag)
        raise LabError(
            f"rank {self.rank}: rank {peer} sent a {_size(nbytes)} message of another mesh or tag (context {context:016x}) "
            f"while this rank waited in {where}; holding it until its receive would exceed "
            f"lab.transport.tcp.{bound}. The ranks enter the collectives of their meshes and sub-meshes in "
            "orders too far apart: enter them in the same order, or raise the bound in every rank; "
            "connection closed")

    def _run(self, sending: dict, receiving: dict, tag: bytes, timeout_s: float, where: object) -> None:
        silence = Silence(timeout_s)
        while True:
            pending = {}
            for peer, job in sending.items():
                if not job.done:
                    pending[peer] = pending.get(peer, 0) | selectors.EVENT_WRITE
            for peer, job in receiving.items():
                if not job.done:
                    pending[peer] = pending.get(peer, 0) | selectors.EVENT_READ
            if not pending:
                return
            self._watch(pending)
            ready = self._selector.select(min(silence.wait_s(), CLOSED_LOOK_S))
            if not ready:
                if not silence.expired():
                    continue  # a long wait taken in slices
                raise silence_error(self.rank, pending, where)
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

    def _watch(self, wanted: dict[int, int]) -> None:
        """Make the selector watch exactly ``wanted`` (peer -> events), changing only what differs."""
        for peer in [p for p in self._watched if p not in wanted]:
            self._selector.unregister(self._links[peer].sock)
            del self._watched[peer]
        for peer, events in wanted.items():
            if peer not in self._watched:
                self._selector.register(self._links[peer].sock, events)
            elif self._watched[peer] != events:
                self._selector.modify(self._links[peer].sock, events)
            self._watched[peer] = events

    def _send_some(self, job: _Job) -> None:
        sock = self._links[job.peer].sock
        with contextlib.suppress(BlockingIOError):
            while job.header_done < _HEAD_BYTES:
                job.header_done += sock.send(memoryview(job.header)[job.header_done:])
            while job.offset < job.bytes.nbytes:
                sent = sock.send(job.bytes[job.offset:job.offset + (4 << 20)])
                job.mac.update(job.bytes[job.offset:job.offset + sent])
                job.offset += sent
            if job.trailer_done == 0:
                job.trailer[:] = job.mac.digest()
            while job.trailer_done < MAC_BYTES:
                job.trailer_done += sock.send(memoryview(job.trailer)[job.trailer_done:])

    def _recv_some(self, job: _Job, tag: bytes, where: object) -> None:
        sock = self._links[job.peer].sock
        try:
            while job.header_done < _HEAD_BYTES:
                job.header_done += recv_some(sock, memoryview(job.header)[job.header_done:])
                if job.header_done == _HEAD_BYTES:
                    self._open(job, tag, where)  # (if it parked the frame, header_done is 0 again)
            while job.offset < job.bytes.nbytes:
                if job.combine is None:  # straight into the output
                    got = recv_some(sock, job.bytes[job.offset:])
                    job.mac.update(job.bytes[job.offset:job.offset + got])
                    job.offset += got
                    continue
                # Reduce: fill a bounded segment, then fold it into the output in one kernel call.
                # (A frame whose MAC then fails raises: the half-reduced output is never returned.)
                if job.scratch is None:
                    job.scratch = np.empty(SCRATCH_BYTES, np.uint8)
                segment = min(SCRATCH_BYTES, job.bytes.nbytes - job.offset)  # whole elements
                view = memoryview(job.scratch)
                got = recv_some(sock, view[job.filled:segment])
                job.mac.update(view[job.filled:job.filled + got])
                job.filled += got
                if job.filled == segment:
                    start, count = job.offset // job.array.itemsize, segment // job.array.itemsize
                    job.combine(job.array[start:start + count], job.scratch[:segment].view(job.array.dtype))
                    job.offset += segment
                    job.filled = 0
                    # Back to the loop after each reduced segment: our sends to this peer go on
                    # between segments, so a backlog we reduce does not look like silence there.
                    if job.offset < job.bytes.nbytes:
                        return
            while job.trailer_done < MAC_BYTES:
                job.trailer_done += recv_some(sock, memoryview(job.trailer)[job.trailer_done:])
            if not hmac.compare_digest(bytes(job.trailer), job.mac.digest()):
                self._forged(job.peer, "frame", where)
        except BlockingIOError:
            return

    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """Peek at the next frame header from each of ``expected``'s peers (read whole and parked
        if it is another context's, as a receive parks it) until one's tag starts with its
        prefix; between looks, wait for any of their sockets to be readable."""
        silence = Silence(timeout_s)  # not moved on by progress: a plain deadline
        self._silence_s = timeout_s  # how long parking a frame may wait for its rest
        while True:
            for src, prefix in expected.items():
                first = self._next_tag(src, prefix, where)
                if first is not None and first.startswith(prefix):
                    return src
            if silence.expired():
                return None
            self._watch(dict.fromkeys(expected, selectors.EVENT_READ))
            self._selector.select(min(silence.wait_s(), CLOSED_LOOK_S))

    def _next_tag(self, peer: int, prefix: bytes, where: object) -> bytes | None:
        """The tag of the first frame of ``prefix``'s context from ``peer``, parked or next on the
        wire (frames of other contexts before it are parked), without taking it; None if its
        header has not arrived whole."""
        parked = next((got for got, _ in self._parked[peer] if same_context(got, prefix)), None)
        if parked is not None:
            return parked
        link = self._links[peer]
        while True:
            try:
                data = link.sock.recv(_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError as exc:
                raise PeerLostError(f"rank {self.rank}: rank {peer} is gone ({exc}) in {where}") from None
            if not data:
                raise PeerLostError(f"rank {self.rank}: rank {peer} closed its connection (waiting in {where})")
            if len(data) < _HEAD_BYTES:
                return None
            kind, got_tag, nbytes, mac = self._judge(peer, data, where)
            if kind == _ABORT:
                link.sock.recv(_HEAD_BYTES)
                link.received += 1
                self._take_notice(peer, nbytes, mac, where)
                self._raise_if_told(where)
                continue
            if same_context(got_tag, prefix):
                return got_tag
            # Another mesh's frame: take its header off the wire (it is all here), then park it whole.
            link.sock.recv(_HEAD_BYTES)
            link.received += 1
            self._park(peer, got_tag, nbytes, mac, where)

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """The tag of the next unread frame from each peer whose header MAC checks out (a header
        an attacker slipped in must not turn a deadline into a mismatch blaming a rank)."""
        tags = {}
        for peer, link in self._links.items():
            with contextlib.suppress(OSError):
                data = link.sock.recv(_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if len(data) == _HEAD_BYTES:
                    header, header_mac = data[:_HEADER.size], data[_HEADER.size:]
                    if hmac.compare_digest(header_mac, head(link.recv_key, link.received, header)[0]) \
                            and _HEADER.unpack(header)[2] == _DATA:
                        tags[peer] = [_HEADER.unpack(header)[3]]
        return tags

    def _raise_if_told(self, where: object) -> None:
        """A peer's abort notice has come of a failure other than a deadline: its root cause,
        raised now (the wait is in vain; see :func:`lab.transport.base.root_cause`)."""
        cause = root_cause(self._notices, self.rank, deadlines=False)
        if cause is not None:
            raise cause.error(self.rank, where)

    def _take_notice(self, peer: int, nbytes: int, mac, where: object) -> None:
        """Read the rest of an abort notice whose authentic header was just taken, check its MAC
        and keep it (in :attr:`_notices`)."""
        link = self._links[peer]
        payload = bytearray(nbytes + MAC_BYTES)
        link.sock.settimeout(NOTICE_IO_S)
        try:
            done = 0
            while done < len(payload):
                done += recv_some(link.sock, memoryview(payload)[done:])
        except OSError as exc:
            raise PeerLostError(f"rank {self.rank}: rank {peer} sent part of an abort notice ({exc}) "
                                f"in {where}") from None
        finally:
            link.sock.setblocking(False)
        mac.update(payload[:nbytes])
        if not hmac.compare_digest(bytes(payload[nbytes:]), mac.digest()):
            self._forged(peer, "abort notice", where)
        self._notices.append(AbortNotice.decode(bytes(payload[:nbytes]), peer))

    def send_notice(self, notice: AbortNotice, to: Iterable[int] | None = None) -> None:
        """One frame per connection (to the peers ``to``; None: all), sequenced and MACed as any
        frame; none on a connection left in the middle of a frame. One whose peer does not take
        it within ``NOTICE_IO_S`` carries no more."""
        if self._closed:
            return
        payload = notice.encode()
        for peer in self._links if to is None else to:
            link = self._links[peer]
            if peer in self._torn:
                continue
            header = _HEADER.pack(MAGIC, VERSION, _ABORT, bytes(TAG_BYTES), len(payload))
            header_mac, mac = head(link.send_key, link.sent, header)
            mac.update(payload)
            link.sent += 1
            link.sock.settimeout(NOTICE_IO_S)
            try:
                link.sock.sendall(header + header_mac + payload + mac.digest())
            except OSError:
                self._torn.add(peer)  # (it may have gone out in part)
            finally:
                with contextlib.suppress(OSError):
                    link.sock.setblocking(False)

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
            self._watch(dict.fromkeys(awaited, selectors.EVENT_READ))
            self._selector.select(grace.wait_s())

    def _notice_next(self, peer: int) -> bool:
        """Take the next frame from ``peer`` if it is an abort notice whose header has come."""
        link = self._links[peer]
        data = link.sock.recv(_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        if len(data) < _HEAD_BYTES:
            return False
        header, header_mac = data[:_HEADER.size], data[_HEADER.size:]
        expected, mac = head(link.recv_key, link.received, header)
        if not hmac.compare_digest(header_mac, expected):
            return False  # (a frame this rank read in part: what follows is not a header)
        _, _, kind, _, nbytes = _HEADER.unpack(header)
        if kind != _ABORT or nbytes > MAX_NOTICE_BYTES:
            return False
        link.sock.recv(_HEAD_BYTES)
        link.received += 1
        self._take_notice(peer, nbytes, mac, "a failure")
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._selector.close()
        for link in self._links.values():
            link.sock.close()
