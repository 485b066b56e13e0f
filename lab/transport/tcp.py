"""The ``"tcp"`` transport: the same collectives over real sockets, on one host or many.

Wire format. One TCP connection per pair of ranks. Every message is a frame: a fixed 48-byte
header (magic ``LABT``, version, kind, the 32-byte tag, payload length) followed by the raw tensor
bytes. Nothing received from a socket is ever unpickled. A receiver checks magic, version and
length before reading a payload byte, and the tag before using it.

Progress. Sockets are non-blocking and one selector drives every send and receive of an
exchange at once, so a ring step (send right, receive left) cannot deadlock however large the
chunk; a reduction streams through a bounded scratch segment into the output.

Joining. Ranks meet through a ``torch.distributed.TCPStore`` (the pool's, or torchrun's): each
publishes ``host:port`` of a listener, the lower rank of each pair accepts and the higher one
connects, and both prove they belong to this job with an HMAC of a per-job secret over the
other's random challenge before any frame is read. The listener binds loopback unless told
otherwise and is closed once the mesh is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError
from lab.transport.base import TAG_BYTES, Recv, Send, TagMismatch, Transport

MAGIC = b"LABT"
VERSION = 1
_DATA = 1
_HEADER = struct.Struct(f"<4sBBxx{TAG_BYTES}sQ")  # magic, version, kind, tag, payload bytes: 48
_HELLO = struct.Struct("<4sBxxxI32s32s")  # magic, version, rank, challenge, proof: 76 bytes
#: Frames announcing more payload than this are rejected (a garbled length must not allocate).
MAX_FRAME_BYTES = 1 << 36
SCRATCH_BYTES = 256 * 1024
CONNECT_TIMEOUT_S = 60.0


def _proof(secret: bytes, challenge: bytes, rank: int) -> bytes:
    return hmac.new(secret, challenge + rank.to_bytes(4, "little"), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return bytes(data)


class _Job:
    """One frame in flight: a send (header, then payload) or a receive (header, then payload)."""

    __slots__ = ("peer", "array", "bytes", "header", "header_done", "offset", "combine", "scratch", "filled")

    def __init__(self, peer: int, array: np.ndarray, combine=None) -> None:
        self.peer, self.array, self.combine = peer, array, combine
        self.bytes = memoryview(array.view(np.uint8))
        self.header = bytearray(_HEADER.size)
        self.header_done = 0
        self.offset = 0  # payload bytes done
        self.scratch = None
        self.filled = 0

    @property
    def done(self) -> bool:
        return self.header_done == _HEADER.size and self.offset == self.bytes.nbytes


@dataclass
class TcpEndpoints:
    """What a rank of a local pool needs: nothing but its place (it meets the others via the store)."""

    rank: int
    world_size: int

    def close_in_parent(self) -> None:
        """Nothing is shared through the parent."""


class TcpTransport(Transport):
    """A rank's end of the TCP mesh."""

    def __init__(self, rank: int, world_size: int, store, host: str = "127.0.0.1",
                 secret: bytes | None = None, prefix: str = "lab/tcp") -> None:
        self.rank, self.world_size = rank, world_size
        self._sockets: dict[int, socket.socket] = {}
        self._closed = False
        secret = secret or self._job_secret(store, prefix)
        if world_size > 1:
            self._connect(store, host, secret, prefix)
        self._selector = selectors.DefaultSelector()
        self._watched: dict[int, int] = {}  # peer -> selector events currently registered
        self._peer_of = {}
        for peer, sock in self._sockets.items():
            sock.setblocking(False)
            self._peer_of[sock.fileno()] = peer

    # -- joining -------------------------------------------------------------------------------

    def _job_secret(self, store, prefix: str) -> bytes:
        """The per-job secret: ``LAB_TCP_SECRET`` if set, else rank 0 draws one into the store."""
        if os.environ.get("LAB_TCP_SECRET"):
            return os.environ["LAB_TCP_SECRET"].encode()
        if self.rank == 0:
            store.set(f"{prefix}/secret", secrets.token_hex(32))
        return store.get(f"{prefix}/secret")

    def _connect(self, store, host: str, secret: bytes, prefix: str) -> None:
        listener = socket.create_server((host, 0))
        listener.settimeout(CONNECT_TIMEOUT_S)
        try:
            store.set(f"{prefix}/addr/{self.rank}", f"{host}:{listener.getsockname()[1]}")
            # The higher rank of each pair connects; the lower one accepts.
            for peer in range(self.rank):
                peer_host, port = store.get(f"{prefix}/addr/{peer}").decode().rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(port)), timeout=CONNECT_TIMEOUT_S)
                self._handshake(sock, secret, expected_peer=peer)
                self._sockets[peer] = sock
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while len(self._sockets) < self.world_size - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(self.rank + 1, self.world_size)) - set(self._sockets))
                    raise DeadlineError(f"rank {self.rank}: ranks {missing} did not connect") from None
                try:
                    peer = self._handshake(sock, secret, expected_peer=None)
                except (ConnectionError, OSError, LabError):
                    sock.close()  # a stranger, or a garbled hello: drop it and keep listening
                    continue
                self._sockets[peer] = sock
        finally:
            listener.close()

    def _handshake(self, sock: socket.socket, secret: bytes, expected_peer: int | None) -> int:
        """Both sides send a challenge and answer the other's with an HMAC; returns the peer's rank."""
        sock.settimeout(10.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mine = secrets.token_bytes(32)
        sock.sendall(_HELLO.pack(MAGIC, VERSION, self.rank, mine, b"\0" * 32))
        magic, version, peer, theirs, _ = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
        if magic != MAGIC or version != VERSION or not 0 <= peer < self.world_size or peer == self.rank:
            raise LabError(f"rank {self.rank}: rejected a connection that is not a lab rank of this job")
        if expected_peer is not None and peer != expected_peer:
            raise LabError(f"rank {self.rank}: expected rank {expected_peer}, got rank {peer}")
        # The connecting side proves itself first; the accepting side answers only a proven peer,
        # so a stranger never obtains a proof it could replay elsewhere.
        accepting = expected_peer is None
        if not accepting:
            sock.sendall(_proof(secret, theirs, self.rank))
        if not hmac.compare_digest(_recv_exactly(sock, 32), _proof(secret, mine, peer)):
            raise LabError(f"rank {self.rank}: a connection claiming rank {peer} failed authentication")
        if accepting:
            sock.sendall(_proof(secret, theirs, self.rank))
        sock.settimeout(None)
        return peer

    # -- the exchange loop -------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, deadline: float, where: object
    ) -> None:
        tag = tag.ljust(TAG_BYTES, b"\0")
        sending = {s.dst: _Job(s.dst, s.data) for s in sends}
        receiving = {r.src: _Job(r.src, r.out, r.combine) for r in recvs}
        for job in sending.values():
            job.header[:] = _HEADER.pack(MAGIC, VERSION, _DATA, tag, job.bytes.nbytes)
        self._run(sending, receiving, tag, deadline, where)

    def _run(self, sending: dict, receiving: dict, tag: bytes, deadline: float, where: object) -> None:
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
            timeout = deadline - time.monotonic()
            ready = self._selector.select(timeout) if timeout > 0 else []
            if not ready:
                names = ", ".join(str(p) for p in sorted(pending))
                raise DeadlineError(f"rank {self.rank} timed out waiting for rank {names} in {where}")
            for key, events in ready:
                peer = self._peer_of[key.fileobj.fileno()]
                try:
                    if events & selectors.EVENT_WRITE and peer in sending:
                        self._send_some(sending[peer])
                    if events & selectors.EVENT_READ and peer in receiving:
                        self._recv_some(receiving[peer], tag, where)
                except (ConnectionError, BrokenPipeError) as exc:
                    raise PeerLostError(f"rank {self.rank}: rank {peer} is gone ({exc}) in {where}") from None

    def _watch(self, wanted: dict[int, int]) -> None:
        """Make the selector watch exactly ``wanted`` (peer -> events), changing only what differs."""
        for peer in [p for p in self._watched if p not in wanted]:
            self._selector.unregister(self._sockets[peer])
            del self._watched[peer]
        for peer, events in wanted.items():
            if peer not in self._watched:
                self._selector.register(self._sockets[peer], events)
            elif self._watched[peer] != events:
                self._selector.modify(self._sockets[peer], events)
            self._watched[peer] = events

    def _send_some(self, job: _Job) -> None:
        sock = self._sockets[job.peer]
        with contextlib.suppress(BlockingIOError):
            while job.header_done < _HEADER.size:
                job.header_done += sock.send(memoryview(job.header)[job.header_done:])
            while job.offset < job.bytes.nbytes:
                job.offset += sock.send(job.bytes[job.offset:job.offset + (4 << 20)])

    def _recv_some(self, job: _Job, tag: bytes, where: object) -> None:
        sock = self._sockets[job.peer]
        try:
            while job.header_done < _HEADER.size:
                got = sock.recv_into(memoryview(job.header)[job.header_done:])
                if not got:
                    raise ConnectionError("connection closed")
                job.header_done += got
                if job.header_done == _HEADER.size:
                    self._check_header(job, tag, where)
            while job.offset < job.bytes.nbytes:
                if job.combine is None:  # straight into the output
                    got = sock.recv_into(job.bytes[job.offset:])
                    if not got:
                        raise ConnectionError("connection closed")
                    job.offset += got
                    continue
                # Reduce: fill a bounded segment, then fold it into the output in one kernel call.
                if job.scratch is None:
                    job.scratch = np.empty(SCRATCH_BYTES, np.uint8)
                segment = min(SCRATCH_BYTES, job.bytes.nbytes - job.offset)  # whole elements
                got = sock.recv_into(memoryview(job.scratch)[job.filled:segment])
                if not got:
                    raise ConnectionError("connection closed")
                job.filled += got
                if job.filled == segment:
                    start, count = job.offset // job.array.itemsize, segment // job.array.itemsize
                    job.combine(job.array[start:start + count], job.scratch[:segment].view(job.array.dtype))
                    job.offset += segment
                    job.filled = 0
        except BlockingIOError:
            return

    def _check_header(self, job: _Job, tag: bytes, where: object) -> None:
        magic, version, kind, got_tag, nbytes = _HEADER.unpack(job.header)
        if magic != MAGIC or version != VERSION or kind != _DATA or nbytes > MAX_FRAME_BYTES:
            self._sockets[job.peer].close()
            raise PeerLostError(f"rank {self.rank}: rejected a malformed frame from rank {job.peer} "
                                f"(magic {magic!r}, version {version}, length {nbytes}); connection closed")
        if got_tag != tag:
            raise TagMismatch(job.peer, tag, got_tag)
        if nbytes != job.bytes.nbytes:
            raise CollectiveMismatchError(
                f"rank {self.rank} expected {job.bytes.nbytes} bytes from rank {job.peer} in {where}, got {nbytes}")

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        tags = {}
        for peer, sock in self._sockets.items():
            with contextlib.suppress(OSError):
                header = sock.recv(_HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if len(header) == _HEADER.size and header[:4] == MAGIC:
                    tags[peer] = [_HEADER.unpack(header)[3]]
        return tags

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._selector.close()
        for sock in self._sockets.values():
            sock.close()
