"""The ``"auto"`` transport: shared memory to the ranks of this host, TCP to the others.

A rank holds two transports: a ``"shm"`` mesh over the L ranks of its host (numbered by local
rank) and a ``"tcp"`` mesh over the ranks of the other hosts. :meth:`MixedTransport.exchange`
hands each send and receive to the transport of its peer. When one exchange has peers of both
kinds (a ring step at a host boundary: receive from a local rank, send to the next host), the TCP
part runs on a helper thread while this thread drives the shm part, so neither waits for the other
to finish (a helper per calling thread: several threads may drive the transports at once, each
in its own context, :mod:`lab.transport.base`'s Threads). Counters, fingerprints and
deadlines are the mesh's, as with any transport; the mesh counts the bytes that cross hosts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lab.transport.base import AbortNotice, Recv, Send, Transport
from lab.transport.shm import ShmTransport
from lab.transport.shm_endpoints import ShmEndpoints
from lab.transport.tcp import TcpTransport

#: A receive from any source with peers on this host and on others waits on the other hosts'
#: sockets this long at a time, looking at this host's pipes in between.
READY_SLICE_S = 0.001


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
        self._helpers: dict[int, ThreadPoolExecutor] = {}  # by calling thread: each one's TCP half

    def _is_local(self, peer: int) -> bool:
        return 0 <= peer - self._first < self._count

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float,
                 where: object) -> None:
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
        helper = self._helpers.get(threading.get_ident())
        if helper is None:
            alive = {thread.ident for thread in threading.enumerate()}
            for gone in [ident for ident in list(self._helpers) if ident not in alive]:  # (its thread ended)
                ended = self._helpers.pop(gone, None)  # (another thread may be at it too)
                if ended is not None:
                    ended.shutdown(wait=False)
            helper = self._helpers[threading.get_ident()] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"lab-tcp-{self.rank}")
        remote = helper.submit(self._remote.exchange, remote_sends, remote_recvs, tag, timeout_s, where)
        try:
            self._local.exchange(local_sends, local_recvs, tag, timeout_s, where)
        except BaseException:
            self._remote.close()  # the TCP half fails at once instead of waiting out its deadline
            raise
        remote.result()

    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """Ask the transport of each peer; with peers of both kinds, look at this host's at once
        and wait on the other hosts' in slices of ``READY_SLICE_S``, in turn (one thread drives both)."""
        first = self._first
        local = {peer - first: prefix for peer, prefix in expected.items() if self._is_local(peer)}
        remote = {peer: prefix for peer, prefix in expected.items() if not self._is_local(peer)}
        if not remote:
            src = self._local.ready_source(local, timeout_s, where)
            return None if src is None else src + first
        if not local:
            return self._remote.ready_source(remote, timeout_s, where)
        deadline = time.monotonic() + timeout_s
        while True:
            src = self._local.ready_source(local, 0.0, where)
            if src is not None:
                return src + first
            left = deadline - time.monotonic()
            src = self._remote.ready_source(remote, min(max(left, 0.0), READY_SLICE_S), where)
            if src is not None or left <= 0:
                return src

    def stray(self, tag: bytes) -> tuple[int, bytes] | None:
        found = self._local.stray(tag)
        if found is not None:
            return found[0] + self._first, found[1]
        return None if self._remote is None else self._remote.stray(tag)

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        tags = {peer + self._first: t for peer, t in self._local.unconsumed_tags().items()}
        if self._remote is not None:
            tags.update(self._remote.unconsumed_tags())
        return tags

    def send_notice(self, notice: AbortNotice) -> None:
        """To this host's ranks through the pipes, to the others' on TCP."""
        self._local.send_notice(notice)
        if self._remote is not None:
            self._remote.send_notice(notice, [p for p in range(self.world_size) if not self._is_local(p)])

    def notices(self, awaited: Iterable[int], grace_s: float) -> list[AbortNotice]:
        """This host's ranks' (their ``via`` made global), then the other hosts'; the grace is
        spent on whichever side the awaited ranks are."""
        awaited = list(awaited)
        local_awaited = [peer - self._first for peer in awaited if self._is_local(peer)]
        heard = [
            dataclasses.replace(notice, via=notice.via + self._first)
            for notice in self._local.notices(local_awaited, grace_s if local_awaited else 0.0)]
        if self._remote is not None:
            remote_awaited = [peer for peer in awaited if not self._is_local(peer)]
            heard += self._remote.notices(remote_awaited, grace_s if remote_awaited and not heard else 0.0)
        return heard

    def close(self) -> None:
        self._local.close()
        if self._remote is not None:
            self._remote.close()
        for helper in list(self._helpers.values()):
            helper.shutdown(wait=False, cancel_futures=True)
        self._helpers.clear()
