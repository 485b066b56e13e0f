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

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lab.errors import DeadlineError, LabError
from lab.transport import shm as shm_transport
from lab.transport.base import Recv, Send, SharedFd, Transport
from lab.transport.shm import ShmEndpoints, ShmTransport
from lab.transport.tcp import TcpTransport

#: How long local rank 0 waits for the other ranks of its host to take their shm endpoints.
SHARE_TIMEOUT_S = 60.0
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid


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


def share_host_endpoints(store, prefix: str, host: int, local_rank: int, local_world_size: int,
                         secret: bytes) -> ShmTransport:
    """A shm mesh for the ranks of one host that share no parent process (torchrun's).

    Local rank 0 builds the host's pipes and segments, listens on an abstract Unix socket (named
    in the store) and hands each local rank its descriptors (``SCM_RIGHTS``) once the rank proves
    it is of this job (an HMAC of the job's secret over the socket's name and its local rank) and of
    this user (``SO_PEERCRED``). Everyone else connects and receives. Returns this rank's transport.
    """
    key = f"{prefix}/shm/{host}"
    if local_rank == 0:
        endpoints = shm_transport.create_endpoints(local_world_size, shm_transport.DEFAULT_SEGMENT_BYTES,
                                                   shm_transport.DEFAULT_SLOTS)
        name = b"\0lab-shm-" + secrets.token_hex(16).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(name)
                listener.listen(local_world_size)
                store.set(key, name[1:].decode())
                _hand_out(listener, endpoints, name, secret)
            return ShmTransport(endpoints[0])  # maps the segments before the others' copies go
        finally:
            for ep in endpoints[1:]:
                ep.close_in_parent()
    name = b"\0" + store.get(key)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(SHARE_TIMEOUT_S)
        sock.connect(name)
        # Abstract names are open to every user of this network namespace, and the store that
        # named it is unauthenticated: take descriptors only from a process of this user.
        _, uid, _ = _SO_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _SO_PEERCRED.size))
        if uid != os.getuid():
            raise LabError(f"local rank {local_rank}: the shm hand-out socket named in the store belongs to uid "
                           f"{uid}, not this user; refusing its descriptors")
        sock.sendall(struct.pack("<I", local_rank) + _proof(secret, name, local_rank))
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 253)
    layout = json.loads(message)
    shared = [SharedFd(fd) for fd in fds]
    return ShmTransport(ShmEndpoints(
        rank=local_rank, world_size=local_world_size, segment_bytes=layout["segment_bytes"], slots=layout["slots"],
        inbox={int(p): shared[i] for p, i in layout["inbox"].items()},
        outbox={int(p): shared[i] for p, i in layout["outbox"].items()},
        segments=[shared[i] for i in layout["segments"]], **layout["extra"]))


def _proof(secret: bytes, name: bytes, local_rank: int) -> bytes:
    return hmac.new(secret, b"lab-shm" + name + struct.pack("<I", local_rank), hashlib.sha256).digest()


def _hand_out(listener: socket.socket, endpoints: list[ShmEndpoints], name: bytes, secret: bytes) -> None:
    """Give each proven local rank its descriptors; strangers are dropped."""
    waiting = set(range(1, len(endpoints)))
    deadline = time.monotonic() + SHARE_TIMEOUT_S
    while waiting:
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            raise DeadlineError(f"local ranks {sorted(waiting)} did not take their shm endpoints within "
                                f"{SHARE_TIMEOUT_S:g} s", peers=sorted(waiting)) from None
        with sock:
            sock.settimeout(5.0)
            try:
                hello = sock.recv(4 + 32, socket.MSG_WAITALL)
                _, uid, _ = _SO_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                _SO_PEERCRED.size))
            except OSError:
                continue
            if len(hello) != 36 or uid != os.getuid():
                continue
            rank = struct.unpack_from("<I", hello)[0]
            if rank not in waiting or not hmac.compare_digest(hello[4:], _proof(secret, name, rank)):
                continue
            ep = endpoints[rank]
            fds = [*(f.fd for f in ep.inbox.values()), *(f.fd for f in ep.outbox.values()), *(f.fd for f in ep.segments)]
            n_in, n_out = len(ep.inbox), len(ep.outbox)
            layout = {"segment_bytes": ep.segment_bytes, "slots": ep.slots,
                      "inbox": {p: i for i, p in enumerate(ep.inbox)},
                      "outbox": {p: n_in + i for i, p in enumerate(ep.outbox)},
                      "segments": list(range(n_in + n_out, n_in + n_out + len(ep.segments))),
                      "extra": {k: getattr(ep, k) for k in ("eager_bytes",) if hasattr(ep, k)}}
            socket.send_fds(sock, [json.dumps(layout).encode()], fds)
            waiting.discard(rank)
