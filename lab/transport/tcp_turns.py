"""Whose turn it is on each of the ``"tcp"`` transport's connections, where several threads
drive it at once (:mod:`lab.transport.base`'s Threads: a torch group's issue order each).

A frame is written, or read, by one thread from its first byte to its last: that thread's job is
the connection's writer (or reader) until then, and another thread's frame for that connection
waits its turn. A frame takes its sequence number (so its MAC) when its first byte goes, so that
frames go out whole and in their numbers' order, whichever thread sends them. Each thread waits
on a selector of its own, with the transport's lock let go, and is woken when another thread
parks a frame or ends its turn on a connection (:mod:`lab.transport.waiters`). :class:`Turns` is
a part of :class:`lab.transport.tcp.TcpTransport`.

    self._start_turns()                          # in the transport's __init__
    ready = self._wait_ready({peer: selectors.EVENT_READ}, timeout_s)
"""

from __future__ import annotations

import contextlib
import selectors
import threading
import weakref

import numpy as np

from lab.errors import PeerLostError
from lab.transport.frames import HEADER, MAC_BYTES, Job, head, read_rest
from lab.transport.handshake import Link
from lab.transport.parking import Parking, check_arrival
from lab.transport.waiters import Waiters

#: The reader of a connection while a frame of it is read whole outside any receive (a parked
#: frame of ``ready_source``, an abort notice): :meth:`Turns._read_rest`.
READING_WHOLE = object()


class Turns:
    """The connections' writers and readers, and each thread's waits, of a TCP transport."""

    rank: int
    _links: dict[int, Link]
    _torn: set[int]
    parking: Parking

    def _start_turns(self) -> None:
        self._lock = threading.RLock()  # held by every call but while it waits (lab.transport.base.locked)
        # peer -> what writes (a Job), or reads (a Job, or READING_WHOLE), a frame on its connection now
        self._writer: dict[int, object] = {}
        self._reader: dict[int, object] = {}
        self._local = _ThreadWait()  # each thread's selector, what it watches and its silence limit
        self._selectors: weakref.WeakSet = weakref.WeakSet()  # every thread's, closed by _close_selectors
        self._waiters = Waiters()  # (woken when another thread parks a frame or ends a turn)

    def _wait_ready(self, wanted: dict[int, int], timeout_s: float) -> list:
        """This thread's selector made to watch exactly ``wanted`` (peer -> events), then waited
        on for at most ``timeout_s`` with the lock let go: what it found ready (nothing where another
        thread woke it: :meth:`_turn_ends`)."""
        local = self._local
        if local.selector is None:
            local.selector = selectors.DefaultSelector()
            local.selector.register(self._waiters.fd, selectors.EVENT_READ)
            self._selectors.add(local.selector)
        selector, watched = local.selector, local.watched
        for peer in [p for p in watched if p not in wanted]:
            selector.unregister(self._links[peer].sock)
            del watched[peer]
        for peer, events in wanted.items():
            if peer not in watched:
                selector.register(self._links[peer].sock, events)
            elif watched[peer] != events:
                selector.modify(self._links[peer].sock, events)
            watched[peer] = events
        woken_by, ready = self._waiters.wait_begins(), []
        self._lock.release()
        try:
            ready = selector.select(timeout_s)
        finally:
            self._lock.acquire()
            self._waiters.wait_ends(any(key.fd == woken_by for key, _ in ready))
        return [(key, events) for key, events in ready if key.fd != woken_by]

    def _turn_ends(self, turns: dict[int, object], peer: int) -> None:
        """``peer``'s connection has no writer (``turns`` the writers) or reader any more: a thread
        whose frame waited for it goes on."""
        del turns[peer]
        self._waiters.wake_others()

    def _send_some(self, job: Job) -> None:
        """Send what the connection takes now of ``job``'s frame, unless another thread's frame is
        going out on it; a frame starting takes the connection's next sequence number."""
        peer = job.peer
        writer = self._writer.get(peer)
        if writer is None and not job.done:
            if peer in self._torn:
                raise PeerLostError(f"rank {self.rank}: the connection to rank {peer} holds part of a frame "
                                    "of a call that failed; it carries no more")
            link = self._links[peer]
            header_mac, job.mac = head(link.send_key, link.sent, bytes(job.header[:HEADER.size]))
            job.header[HEADER.size:] = header_mac
            link.sent += 1
            self._writer[peer] = writer = job
        if writer is not job:
            return
        with contextlib.suppress(BlockingIOError):
            job.send_some(self._links[peer].sock)
        if job.done:
            self._turn_ends(self._writer, peer)

    def _recv_some(self, job: Job, tag: bytes, where: object) -> None:
        """Read what has come of the receive ``job``'s frame, unless another thread reads a frame
        of that connection (a frame of its context parked meanwhile is taken first)."""
        if self._reader.get(job.peer, job) is not job or self._take_parked(job, tag, where) or job.done:
            return
        self._reader[job.peer] = job
        try:
            self._read_frame(job, tag, where)
        finally:
            if (job.done or job.header_done == 0) and job.peer in self._reader:  # (between frames)
                self._turn_ends(self._reader, job.peer)

    def _take_parked(self, job: Job, tag: bytes, where: object) -> bool:
        """Serve the receive ``job``, none of whose frame it has read yet, from a parked frame of
        its context, if one arrived earlier (perhaps read by another thread)."""
        if job.header_done or job.done:
            return False
        held = self.parking.take(job.peer, tag)
        if held is None:
            return False
        got_tag, payload = held
        check_arrival(self.rank, job.peer, tag, got_tag, job.array.nbytes, payload.nbytes, where)
        if job.combine is None:
            job.array.view(np.uint8)[:] = payload
        else:
            job.combine(job.array, payload.view(job.array.dtype))
        job.trailer_done = MAC_BYTES  # (done: its MAC was checked when it was parked)
        return True

    def _read_rest(self, peer: int, nbytes: int, mac, timeout_s: float):
        """:func:`lab.transport.frames.read_rest` of ``peer``'s frame whose header was just taken,
        with the lock let go (other threads' calls go on): the connection's reader until then."""
        reader = self._reader.setdefault(peer, READING_WHOLE)  # (a receive's own: it reads on after)
        self._lock.release()
        try:
            return read_rest(self._links[peer], nbytes, mac, timeout_s)
        finally:
            self._lock.acquire()
            if reader is READING_WHOLE:
                self._turn_ends(self._reader, peer)

    def _left_unsent(self, sending: dict[int, Job], receiving: dict[int, Job]) -> None:
        """After a failed exchange: the connections its frames held are let go. A frame that took
        its sequence number but sent no byte gives it back (an abort notice may take it); a
        connection left in the middle of a frame carries no more."""
        for peer, job in sending.items():
            if self._writer.get(peer) is job:
                self._turn_ends(self._writer, peer)
                if job.header_done == 0:
                    self._links[peer].sent -= 1
                else:
                    self._torn.add(peer)
        for peer, job in receiving.items():
            if self._reader.get(peer) is job:
                self._turn_ends(self._reader, peer)

    def _close_selectors(self) -> None:
        for selector in list(self._selectors):
            selector.close()


class _ThreadWait(threading.local):
    """What one thread waits with: its selector (made at its first wait), the events it watches
    by peer, and how long parking a frame may wait for its rest (its call's silence limit)."""
    def __init__(self) -> None:
        self.selector: selectors.BaseSelector | None = None
        self.watched: dict[int, int] = {}
        self.silence_s = float("inf")
