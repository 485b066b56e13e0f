"""The ``"queue"`` transport: the lesson's baseline, the payload itself pickled through queues.

One ``multiprocessing.Queue`` per directed edge, plus one "alive" pipe per rank whose write end
only that rank holds: when it dies the pipe reads as end-of-file for everyone else, so a rank
waiting on a queue learns within ``LIVENESS_CHECK_S`` that its peer is gone (a queue alone
would wait for the deadline). A send puts ``(tag, a copy of the array)``; the queue's feeder
thread pickles it into a pipe in the background, so a send never blocks and a ring step cannot
deadlock. A receive unpickles a copy and then copies or
reduces it into the output. Every byte therefore crosses two extra copies and a pickle, which is
exactly the cost the ``"shm"`` transport exists to remove.

Counts. A message put reaches its queue a little later (its feeder thread writes it), so a
receiver that looks for messages it will never receive (:meth:`QueueTransport.unconsumed_tags`, at
the end of a run or at close) could miss one still on its way: every rank counts, in memory the
ranks share, the messages it puts to each peer (before the put) and those it takes from each,
and the receiver waits for those counted but not arrived yet.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab import fingerprint
from lab.errors import PeerLostError
from lab.transport.base import Recv, Send, SharedFd, Silence, Transport, locked, same_context, silence_error
from lab.transport.parking import Parking, check_arrival

#: How often a rank waiting on a queue checks that the peer is still alive.
LIVENESS_CHECK_S = 0.1
#: How often a receive from any source looks at the queues again.
READY_POLL_S = 0.0005
#: How long a look for unread messages waits at most for one that was put but has not arrived.
UNREAD_ARRIVAL_S = 1.0


@dataclass
class QueueEndpoints:
    """What one rank needs to join the queue mesh; pickled into the rank's process at start."""

    rank: int
    world_size: int
    inbox: dict[int, object]  # src -> multiprocessing.Queue src -> rank
    outbox: dict[int, object]  # dst -> multiprocessing.Queue rank -> dst
    alive: SharedFd | None = None  # write end of this rank's alive pipe
    peers_alive: dict[int, SharedFd] = field(default_factory=dict)  # read ends of the others'
    counts: Any = None  # int64 [2, N, N], shared: messages put src -> dst, and taken by dst (see Counts)

    def close_in_parent(self) -> None:
        """The parent never uses the queues; drop its handles (it has no feeder thread to join)."""
        for q in self.inbox.values():
            q.close()
        for shared in (self.alive, *self.peers_alive.values()):
            shared.close()


def create_endpoints(context, world_size: int) -> list[QueueEndpoints]:
    """Build the full mesh in the parent: N(N-1) queues."""
    counts = context.RawArray("q", 2 * world_size * world_size)
    endpoints = [QueueEndpoints(r, world_size, {}, {}, counts=counts) for r in range(world_size)]
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                edge = context.Queue()
                endpoints[dst].inbox[src] = edge
                endpoints[src].outbox[dst] = edge
    for ep in endpoints:
        read_end, write_end = os.pipe()
        ep.alive = SharedFd(write_end)
        shared_read_end = SharedFd(read_end)
        for other in endpoints:
            if other is not ep:
                other.peers_alive[ep.rank] = shared_read_end
    return endpoints


class QueueTransport(Transport):
    """A rank's end of the queue mesh."""
    def __init__(self, endpoints: QueueEndpoints) -> None:
        self.rank = endpoints.rank
        self.world_size = endpoints.world_size
        self._inbox = endpoints.inbox
        self._outbox = endpoints.outbox
        self._alive_fd = endpoints.alive.fd
        self._peer_alive_fd = {peer: shared.fd for peer, shared in endpoints.peers_alive.items()}
        self._peer_of_fd = {fd: peer for peer, fd in self._peer_alive_fd.items()}
        # Messages taken off a queue but not yet received, per source: other contexts' (parked by a
        # receive), and any a receive from any source looked at; a receive takes its context's first.
        self.parking = Parking(self.rank, self._inbox)
        n = self.world_size
        self._counts = np.frombuffer(endpoints.counts, np.int64).reshape(2, n, n)  # put, taken: [src, dst]
        self._gone_since: dict[int, float] = {}  # peer -> when its liveness pipe was first seen closed
        self._liveness = select.poll()
        for fd in self._peer_alive_fd.values():
            self._liveness.register(fd, select.POLLIN)
        self._closed = False
        self._lock = threading.RLock()  # (several threads' calls: lab.transport.base's Threads)
        self._reading = {src: threading.Lock() for src in self._inbox}  # (one taker a queue: _get)

    @locked
    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float,
                 where: object) -> None:
        # Post every send first (they never block), then take each receive in turn.
        for send in sends:
            self._counts[0, self.rank, send.dst] += 1  # (first: counted before it can arrive)
            self._outbox[send.dst].put((tag, send.data.copy()))  # snapshot: pickled later
        for recv in recvs:
            got_tag, payload = self._take(recv.src, tag, timeout_s, where)
            self._counts[1, recv.src, self.rank] += 1
            check_arrival(self.rank, recv.src, tag, got_tag, recv.out.nbytes, payload.nbytes, where)
            if recv.combine is None:
                recv.out[:] = payload
            else:
                recv.combine(recv.out, payload)

    def _take(self, src: int, tag: bytes, timeout_s: float, where: object) -> tuple[bytes, np.ndarray]:
        """The next message from ``src`` in ``tag``'s context: a parked one first, else from the
        queue, parking whatever belongs to another context on the way (and looking at the parked
        ones again between waits: another thread's receive may have parked one for this one)."""
        silence = Silence(timeout_s)
        while True:
            held = self.parking.take(src, tag)
            if held is not None:
                return held
            got_tag, payload = self._get(src, silence, where)
            if got_tag is None:
                continue  # (nothing in a slice)
            if same_context(got_tag, tag):
                earlier = self.parking.take(src, tag)  # (parked by another thread while this one waited)
                if earlier is None:
                    return got_tag, payload
                self.parking.park(src, got_tag, payload.nbytes, payload, where)
                return earlier
            self.parking.park(src, got_tag, payload.nbytes, payload, where)
            silence.progress()  # the peer sent something, if not for this receive

    def _get(self, src: int, silence: Silence, where: object) -> tuple[bytes | None, np.ndarray | None]:
        """The next message from ``src``, or ``(None, None)`` if none came within
        ``LIVENESS_CHECK_S`` (and no peer died meanwhile). It waits with the lock released (other
        threads' calls go on), and one thread at a time takes from a queue, until it holds the
        lock again: what it took is parked or returned before another thread's next message is."""
        if silence.expired():
            raise silence_error(self.rank, (src,), where)
        wait_s, reading = min(silence.wait_s(), LIVENESS_CHECK_S), self._reading[src]
        self._lock.release()
        taking = False
        try:
            taking = reading.acquire(timeout=wait_s)
            if taking:
                return self._inbox[src].get(timeout=wait_s)
        except queue.Empty:
            pass
        finally:
            self._lock.acquire()
            if taking:
                reading.release()
        self._check_peers_alive(where)
        return None, None

    @locked
    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """Take whatever the queues of ``expected``'s peers hold into their parked lists (in
        arrival order, where :meth:`_take` looks first), until one's first message of its context
        starts with its prefix; poll every ``READY_POLL_S`` (a queue cannot be waited on with others)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for src, prefix in expected.items():
                if self._reading[src].acquire(False):  # (else another thread takes from it now: see _get)
                    try:
                        with contextlib.suppress(queue.Empty):
                            while True:
                                got_tag, payload = self._inbox[src].get_nowait()
                                self.parking.park(src, got_tag, payload.nbytes, payload, where)
                    finally:
                        self._reading[src].release()
                first = self.parking.first(src, prefix)
                if first is not None and first.startswith(prefix):
                    return src
            self._check_peers_alive(where)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._lock.release()
            try:
                time.sleep(min(left, READY_POLL_S))
            finally:
                self._lock.acquire()

    @locked
    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """Every message a live peer put for this rank and this rank did not take (see Counts),
        moved into the parked lists (where a receive looks first: each peer's order is kept), and
        everything parked. One counted but not arrived is waited for (at most ``UNREAD_ARRIVAL_S``);
        a dead peer's queue is not read (it may hold the start of a message whose rest never
        comes), nor one another thread's receive takes from."""
        gone = {self._peer_of_fd[fd] for fd, _ in self._liveness.poll(0)}
        for src, inbox in self._inbox.items():
            if not self._reading[src].acquire(blocking=False):
                continue
            try:
                coming = self._counts[0, src, self.rank] - self._counts[1, src, self.rank] - \
                    len(self.parking.tags().get(src, ()))
                silence = Silence(UNREAD_ARRIVAL_S)
                while coming > 0 and src not in gone and not silence.expired():
                    with contextlib.suppress(queue.Empty):
                        got_tag, payload = inbox.get(timeout=min(silence.wait_s(), LIVENESS_CHECK_S))
                        self.parking.park(src, got_tag, payload.nbytes, payload, "a look for unread messages")
                        coming -= 1
                    gone |= {self._peer_of_fd[fd] for fd, _ in self._liveness.poll(0)}
            finally:
                self._reading[src].release()
        return self.parking.tags()

    def stray(self, tag: bytes) -> tuple[int, bytes] | None:
        """Among the parked messages only, a glance without the lock nor a wait for one on its way
        (:meth:`unconsumed_tags` waits); one in a queue is met by the next receive from its peer,
        or at the end (:func:`lab.comm.unread.raise_if_unread`)."""
        return fingerprint.earlier(tag, self.parking.tags()) if self.parking.messages else None

    def _check_peers_alive(self, where: object) -> None:
        for fd, _ in self._liveness.poll(0):  # only a closed alive pipe has an event: nobody writes
            peer = self._peer_of_fd[fd]
            # A peer that closed after its last put is gone only once what it put has come (its
            # queue's feeder thread may still be writing it), or after UNREAD_ARRIVAL_S of waiting.
            coming = self._counts[0, peer, self.rank] - self._counts[1, peer, self.rank] - \
                len(self.parking.tags().get(peer, ()))
            first_seen = self._gone_since.setdefault(peer, time.monotonic())
            if coming <= 0 or time.monotonic() - first_seen > UNREAD_ARRIVAL_S:
                raise PeerLostError(f"rank {self.rank}: rank {peer} is gone (waiting in {where})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Queued data nobody will read must not keep this process alive at exit.
        for q in (*self._inbox.values(), *self._outbox.values()):
            q.cancel_join_thread()
            q.close()
        for fd in (self._alive_fd, *self._peer_alive_fd.values()):
            os.close(fd)
