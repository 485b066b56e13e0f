"""The ``"queue"`` transport: the lesson's baseline, the payload itself pickled through queues.

One ``multiprocessing.Queue`` per directed edge. A send snapshots the bytes and puts
``(tag, payload)``; the queue's feeder thread pickles it into a pipe in the background, so a send
never blocks and a ring step cannot deadlock. A receive unpickles a copy and then copies or
reduces it into the output. Every byte therefore crosses two extra copies and a pickle, which is
exactly the cost the ``"shm"`` transport exists to remove.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lab.errors import CollectiveMismatchError, DeadlineError
from lab.transport.base import Recv, Send, TagMismatch, Transport


@dataclass
class QueueEndpoints:
    """What one rank needs to join the queue mesh; pickled into the rank's process at start."""

    rank: int
    world_size: int
    inbox: dict[int, object]  # src -> multiprocessing.Queue src -> rank
    outbox: dict[int, object]  # dst -> multiprocessing.Queue rank -> dst

    def close_in_parent(self) -> None:
        """The parent never uses the queues; drop its handles (it has no feeder thread to join)."""
        for q in self.inbox.values():
            q.close()


def create_endpoints(context, world_size: int) -> list[QueueEndpoints]:
    """Build the full mesh in the parent: N(N-1) queues."""
    endpoints = [QueueEndpoints(r, world_size, {}, {}) for r in range(world_size)]
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                edge = context.Queue()
                endpoints[dst].inbox[src] = edge
                endpoints[src].outbox[dst] = edge
    return endpoints


class QueueTransport(Transport):
    """A rank's end of the queue mesh."""

    def __init__(self, endpoints: QueueEndpoints) -> None:
        self.rank = endpoints.rank
        self.world_size = endpoints.world_size
        self._inbox = endpoints.inbox
        self._outbox = endpoints.outbox

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, deadline: float, where: object
    ) -> None:
        # Post every send first (they never block), then take each receive in turn.
        for send in sends:
            self._outbox[send.dst].put((tag, send.data.copy()))  # snapshot: pickled later
        for recv in recvs:
            got_tag, payload = self._get(recv.src, deadline, where)
            if got_tag != tag:
                raise TagMismatch(recv.src, tag, got_tag)
            if payload.nbytes != recv.out.nbytes:
                raise CollectiveMismatchError(
                    f"rank {self.rank} expected {recv.out.nbytes} bytes from rank {recv.src} "
                    f"in {where}, got {payload.nbytes}"
                )
            if recv.combine is None:
                recv.out[:] = payload
            else:
                recv.combine(recv.out, payload)

    def _get(self, src: int, deadline: float, where: object) -> tuple[bytes, np.ndarray]:
        try:
            return self._inbox[src].get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise DeadlineError(f"rank {self.rank} timed out waiting for rank {src} in {where}") from None

    def close(self) -> None:
        # Queued data nobody will read must not keep this process alive at exit.
        for q in (*self._inbox.values(), *self._outbox.values()):
            q.cancel_join_thread()
            q.close()
