"""The ``"auto"`` transport: shared memory to the ranks of this host, TCP to the others.

A rank holds two transports: a ``"shm"`` mesh over the L ranks of its host (numbered by local
rank) and a ``"tcp"`` mesh over the ranks of the other hosts. :meth:`MixedTransport.exchange`
hands each send and receive to the transport of its peer. When one exchange has peers of both
kinds (a ring step at a host boundary: receive from a local rank, send to the next host), the TCP
part runs on a helper thread while this thread drives the shm part, so neither waits for the other
to finish (each transport is still driven by exactly one thread). Counters, fingerprints and
deadlines are the mesh's, as with any transport; the mesh counts the bytes that cross hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lab.transport.base import Recv, Send, Transport
from lab.transport.shm import ShmEndpoints, ShmTransport
from lab.transport.tcp import TcpTransport


@dataclass
class MixedEndpoints:
    """What one rank of a local pool needs: its place, the job's secret for TCP, and its host's shm
    endpoints (numbered by local rank)."""

    rank: int
    world_size: int
    secret: bytes
    shm: ShmEndpoints

    def close_in_parent(self) -> None:
        self.shm.close_in_parent()


class MixedTransport(Transport):
    """``local``: the shm transport of this host's ranks ``[first, first + L)``; ``remote``: a TCP
    transport over every rank (only its connections to other hosts carry messages)."""

    def __init__(self, rank: int, world_size: int, first_local: int, local: ShmTransport,
                 remote: TcpTransport | None) -> None:
        self.rank, self.world_size = rank, world_size
        self._first, self._local, self._remote = first_local, local, remote
        self._count = local.world_size
        self._helper: ThreadPoolExecutor | None = None

    def _is_local(self, peer: int) -> bool:
        return 0 <= peer - self._first < self._count

    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float, where: object
    ) -> None:
        first = self._first
        local_sends = [Send(s.dst - first, s.data) for s in sends if self._is_local(s.dst)]
        local_recvs = [Recv(r.src - first, r.out, r.combine) for r in recvs if self._is_local(r.src)]
        remote_sends = [s for s in sends if not self._is_local(s.dst)]
        remote_recvs = [r for r in recvs if not self._is_local(r.src)]
        if not (remote_sends or remote_recvs):
            self._local.exchange(local_sends, local_recvs, tag, timeout_s, where)
            return
        if not (local_sends or local_recvs):
            self._remote.exchange(remote_sends, remote_recvs, tag, timeout_s, where)
            return
        # Both kinds at once: TCP on the helper thread, shm here; the first failure is raised.
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lab-tcp-{self.rank}")
        remote = self._helper.submit(self._remote.exchange, remote_sends, remote_recvs, tag, timeout_s, where)
        try:
            self._local.exchange(local_sends, local_recvs, tag, timeout_s, where)
        except BaseException:
            self._remote.close()  # the TCP half fails at once instead of waiting out its deadline
            raise
        remote.result()

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        tags = {peer + self._first: t for peer, t in self._local.unconsumed_tags().items()}
        if self._remote is not None:
            tags.update(self._remote.unconsumed_tags())
        return tags

    def close(self) -> None:
        self._local.close()
        if self._remote is not None:
            self._remote.close()
        if self._helper is not None:
            self._helper.shutdown(wait=False, cancel_futures=True)
            self._helper = None
