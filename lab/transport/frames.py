"""The ``"tcp"`` transport's frames: what goes on the wire, and how a receiver judges it.

One TCP connection per pair of ranks. Every message is a frame: a fixed 48-byte
header (magic ``LABT``, version, kind, the 32-byte tag, payload length) and its own 32-byte MAC,
the raw tensor bytes, and a 32-byte MAC of the whole frame. Both MACs are keyed BLAKE3 under a key
that only this connection's two ranks hold, over a per-direction sequence number and what precedes
them. Nothing received from a socket is ever unpickled. A receiver believes nothing in a header
before its MAC checks out: a forged, replayed or reordered header is refused before its length
allocates a byte or its tag blames a rank. It checks magic, version and length before reading a
payload byte, the tag before using it, and the frame's MAC before the exchange returns: a frame
that was altered, replayed, reordered or injected by anyone in the middle raises
:class:`lab.PeerLostError` ("failed authentication"; the result is never returned).

Every frame, in order on its connection::

    HEADER (48 bytes: magic, version, kind, tag, length) | its MAC (32) | payload | the frame's MAC (32)

    header_mac, mac = head(link.send_key, link.sent, HEADER.pack(MAGIC, VERSION, DATA, tag, n))
    kind, tag, nbytes, mac = judge(link, rank, peer, received_head, where)   # raises if forged
"""

from __future__ import annotations

import contextlib
import hmac
import select
import socket
import struct
from typing import NoReturn

import blake3
import numpy as np

from lab.errors import PeerLostError
from lab.transport.base import MAX_NOTICE_BYTES, TAG_BYTES, Silence
from lab.transport.handshake import MAGIC, VERSION, Link

DATA, ABORT = 1, 2  # frame kinds: a message; an abort notice (lab.transport.base.AbortNotice) as payload
HEADER = struct.Struct(f"<4sBBxx{TAG_BYTES}sQ")  # magic, version, kind, tag, payload bytes: 48
MAC_BYTES = 32  # keyed BLAKE3: after the header, and after the payload
HEAD_BYTES = HEADER.size + MAC_BYTES  # what a receiver reads and checks before believing a length
#: Frames announcing more payload than this are rejected (a garbled length must not allocate).
MAX_FRAME_BYTES = 1 << 36
SCRATCH_BYTES = 256 * 1024  # what a receive that reduces fills before it folds


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


def recv_some(sock: socket.socket, view: memoryview) -> int:
    """``sock.recv_into(view)``; a closed connection is a ``ConnectionError``."""
    got = sock.recv_into(view)
    if not got:
        raise ConnectionError("connection closed")
    return got


class Job:
    """One frame in flight: header and its MAC, payload, MAC; sent or received a piece at a time.
    A receive's ``mac`` is made when its header arrives (``None`` until then)."""

    __slots__ = ("array", "bytes", "combine", "filled", "header", "header_done", "mac", "offset", "peer",
                 "scratch", "trailer", "trailer_done")

    def __init__(self, peer: int, array: np.ndarray, mac, combine=None) -> None:
        self.peer, self.array, self.combine, self.mac = peer, array, combine, mac
        self.bytes = memoryview(array.view(np.uint8))
        self.header = bytearray(HEAD_BYTES)
        self.header_done = 0
        self.offset = 0  # payload bytes done
        self.scratch = None
        self.filled = 0
        self.trailer = bytearray(MAC_BYTES)
        self.trailer_done = 0

    @property
    def done(self) -> bool:
        return self.trailer_done == MAC_BYTES

    def send_some(self, sock: socket.socket) -> None:
        """Send what ``sock`` takes now of the header, payload and trailer (a full socket raises
        BlockingIOError: the rest goes when it is writable again)."""
        while self.header_done < HEAD_BYTES:
            self.header_done += sock.send(memoryview(self.header)[self.header_done:])
        while self.offset < self.bytes.nbytes:
            sent = sock.send(self.bytes[self.offset:self.offset + (4 << 20)])
            self.mac.update(self.bytes[self.offset:self.offset + sent])
            self.offset += sent
        if self.trailer_done == 0:
            self.trailer[:] = self.mac.digest()
        while self.trailer_done < MAC_BYTES:
            self.trailer_done += sock.send(memoryview(self.trailer)[self.trailer_done:])

    def recv_payload(self, sock: socket.socket) -> bool:
        """Receive payload from ``sock`` (its header taken): True once it is whole, False after
        each reduced segment (the caller's sends to this peer go on between segments, so a
        backlog being reduced does not look like silence there); BlockingIOError when it has
        nothing more now. A reduction fills a bounded scratch segment, then folds it into the
        output in one kernel call (a frame whose MAC then fails raises: the half-reduced output
        is never returned)."""
        while self.offset < self.bytes.nbytes:
            if self.combine is None:  # straight into the output
                got = recv_some(sock, self.bytes[self.offset:])
                self.mac.update(self.bytes[self.offset:self.offset + got])
                self.offset += got
                continue
            if self.scratch is None:
                self.scratch = np.empty(SCRATCH_BYTES, np.uint8)
            segment = min(SCRATCH_BYTES, self.bytes.nbytes - self.offset)  # whole elements
            view = memoryview(self.scratch)
            got = recv_some(sock, view[self.filled:segment])
            self.mac.update(view[self.filled:self.filled + got])
            self.filled += got
            if self.filled == segment:
                start, count = self.offset // self.array.itemsize, segment // self.array.itemsize
                self.combine(self.array[start:start + count], self.scratch[:segment].view(self.array.dtype))
                self.offset += segment
                self.filled = 0
                if self.offset < self.bytes.nbytes:
                    return False
        return True


def judge(link: Link, rank: int, peer: int, head_bytes: bytes,
          where: object) -> tuple[int, bytes, int, blake3.blake3]:
    """(kind, tag, payload bytes, the frame's running MAC) of the next frame's header from
    ``peer`` on ``link`` (``head_bytes``: header and MAC), MAC first: nothing in it is believed
    before. A forged or malformed header closes the connection and raises PeerLostError."""
    header, header_mac = head_bytes[:HEADER.size], head_bytes[HEADER.size:]
    expected, mac = head(link.recv_key, link.received, header)
    if not hmac.compare_digest(header_mac, expected):
        forged(link, rank, peer, "frame header", where)
    magic, version, kind, got_tag, nbytes = HEADER.unpack(header)
    longest = {DATA: MAX_FRAME_BYTES, ABORT: MAX_NOTICE_BYTES}.get(kind, -1)  # (-1: no such kind)
    if magic != MAGIC or version != VERSION or nbytes > longest:
        link.sock.close()
        raise PeerLostError(f"rank {rank}: rejected a malformed frame from rank {peer} "
                            f"(magic {magic!r}, version {version}, kind {kind}, length {nbytes}); "
                            "connection closed")
    return kind, got_tag, nbytes, mac


def forged(link: Link, rank: int, peer: int, what: str, where: object) -> NoReturn:
    """A MAC did not check out: close the connection (nothing after it can be trusted) and raise."""
    link.sock.close()
    raise PeerLostError(f"rank {rank}: a {what} from rank {peer} failed authentication in {where} "
                        "(altered, replayed, reordered or injected in transit); connection closed")


def peek_header(link: Link) -> tuple[int, bytes, int, blake3.blake3] | None:
    """(kind, tag, payload bytes, running MAC) of the next frame on ``link``, peeked (not taken),
    if its header has come whole and its MAC checks out (else None: a header an attacker slipped
    in must not blame a rank). Socket errors propagate."""
    data = link.sock.recv(HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    if len(data) < HEAD_BYTES:
        return None
    header, header_mac = data[:HEADER.size], data[HEADER.size:]
    expected, mac = head(link.recv_key, link.received, header)
    if not hmac.compare_digest(header_mac, expected):
        return None
    _, _, kind, tag, nbytes = HEADER.unpack(header)
    return kind, tag, nbytes, mac


def read_rest(link: Link, nbytes: int, mac: blake3.blake3, timeout_s: float) -> np.ndarray | None:
    """The ``nbytes`` of payload of a frame whose authentic header was just taken, read as it
    comes (at most ``timeout_s`` of silence: TimeoutError), then its trailer; None if the frame's
    MAC does not check out. The frame's sender streams it whole, so the wait cannot deadlock. The
    socket stays non-blocking: another thread may send on it meanwhile."""
    payload, trailer = np.empty(nbytes, np.uint8), bytearray(MAC_BYTES)
    silence, readable = Silence(timeout_s), select.poll()
    readable.register(link.sock, select.POLLIN)
    for buffer in (memoryview(payload), memoryview(trailer)):
        done = 0
        while done < len(buffer):
            try:
                done += recv_some(link.sock, buffer[done:])
                silence.progress()
            except (BlockingIOError, InterruptedError):
                if silence.expired():
                    raise TimeoutError(f"no byte of the frame's rest came in {timeout_s:g} s") from None
                readable.poll(silence.wait_s() * 1000)
    mac.update(payload)
    return payload if hmac.compare_digest(bytes(trailer), mac.digest()) else None


def send_whole(link: Link, kind: int, payload: bytes, timeout_s: float) -> bool:
    """Send one frame of ``kind`` (no tag) whole within ``timeout_s``, sequenced and MACed as any;
    False if it did not go out (perhaps in part: the connection carries no more)."""
    header = HEADER.pack(MAGIC, VERSION, kind, bytes(TAG_BYTES), len(payload))
    header_mac, mac = head(link.send_key, link.sent, header)
    mac.update(payload)
    link.sent += 1
    link.sock.settimeout(timeout_s)
    try:
        link.sock.sendall(header + header_mac + payload + mac.digest())
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            link.sock.setblocking(False)
