"""Handing a host's shm endpoints to ranks that share no parent process (torchrun's, ``"auto"``).

Local rank 0 builds the host's pipes and segments and listens on an abstract Unix socket whose
name it puts in the store; every other local rank connects, proves it is of this job (an HMAC of
the job's secret over the socket's name and its local rank) and of this user (``SO_PEERCRED``),
and receives its descriptors (``SCM_RIGHTS``). Strangers are dropped at once, slow ones after
``HELLO_TIMEOUT_S``; a rank with another secret is told so (``LabError``), never left waiting.

    transport = share_host_endpoints(store, prefix, host, local_rank, local_world_size, secret)
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import selectors
import socket
import struct
import time

from lab.errors import DeadlineError, LabError
from lab.transport import shm_endpoints
from lab.transport.base import SharedFd, recv_available
from lab.transport.shm import ShmTransport
from lab.transport.shm_endpoints import ShmEndpoints

#: How long local rank 0 waits for the other ranks of its host to take their shm endpoints.
SHARE_TIMEOUT_S = 60.0
#: How long a connection of this user may take to send its hello before the hand-out drops it.
HELLO_TIMEOUT_S = 5.0
#: Connections of this user the hand-out holds at once (more are closed as they come).
MAX_PENDING = 64
#: The hand-out socket's listen queue.
HAND_OUT_BACKLOG = 128
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_HELLO = struct.Struct("<I32s")  # local rank, proof


def share_host_endpoints(store, prefix: str, host: int, local_rank: int, local_world_size: int,
                         secret: bytes) -> ShmTransport:
    """A shm mesh for the ranks of one host that share no parent process (torchrun's).

    Local rank 0 builds the host's pipes and segments, listens on an abstract Unix socket (named
    in the store) and hands each local rank its descriptors (``SCM_RIGHTS``) once the rank proves
    it is of this job (an HMAC of the job's secret over the socket's name and its local rank) and of
    this user (``SO_PEERCRED``). Everyone else connects and receives. Returns this rank's transport.
    A rank whose proof fails, and every rank still waiting, is told why (``LabError``): a
    different ``LAB_TCP_SECRET`` is named as such, never a hang or an undecodable reply.
    """
    key = f"{prefix}/shm/{host}"
    if local_rank == 0:
        return _serve_host(store, key, host, local_world_size, secret)
    return _take_endpoints(store.get(key), local_rank, local_world_size, secret)


def _serve_host(store, key: str, host: int, local_world_size: int, secret: bytes) -> ShmTransport:
    """Local rank 0: build the host's shm mesh, hand it out, keep its own end."""
    endpoints = shm_endpoints.create_endpoints(local_world_size, shm_endpoints.DEFAULT_SEGMENT_BYTES,
                                               shm_endpoints.DEFAULT_SLOTS)
    name = b"\0lab-shm-" + secrets.token_hex(16).encode()
    transport = None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(name)
            # Strangers are accepted and dropped at once, so the queue only absorbs a burst; a
            # short one would refuse the real ranks behind a few silent connections.
            listener.listen(HAND_OUT_BACKLOG)
            store.set(key, name[1:].decode())
            _HandOut(listener, endpoints, name, secret, host).run()
        transport = ShmTransport(endpoints[0])  # maps the segments before the others' copies go
        return transport
    finally:
        for ep in endpoints[1:] if transport is not None else endpoints:
            ep.close_in_parent()


def _take_endpoints(stored_name: bytes, local_rank: int, local_world_size: int,
                    secret: bytes) -> ShmTransport:
    """Any other local rank: connect to local rank 0's hand-out, prove itself, receive its end."""
    name = b"\0" + stored_name
    deadline = time.monotonic() + SHARE_TIMEOUT_S
    with connect_hand_out(name, deadline, local_rank) as sock:
        # Abstract names are open to every user of this network namespace, and the store that
        # named it is unauthenticated: take descriptors only from a process of this user.
        pid, uid = _peer(sock)
        if uid != os.getuid():
            raise LabError(
                f"local rank {local_rank}: the shm hand-out socket named in the store belongs to uid "
                f"{uid}, not this user; refusing its descriptors")
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # Closed already (local rank 0 gave up): the reason it sent, if any, is still to be read.
            sock.sendall(_HELLO.pack(local_rank, _proof(secret, name, local_rank)))
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 253)
        except TimeoutError:
            raise DeadlineError(
                f"local rank {local_rank}: local rank 0 (pid {pid}) did not hand out this rank's "
                f"shm endpoints within {SHARE_TIMEOUT_S:g} s") from None
        except OSError:
            message, fds = b"", []
    try:
        reply = json.loads(message) if message else {
            "error": f"local rank 0 (pid {pid}) closed the shm hand-out "
            "without this rank's descriptors: it failed or "
            "ended (see its error)"}
        if "error" in reply:
            raise LabError(f"local rank {local_rank}: {reply['error']}")
        shared, fds = [SharedFd(fd) for fd in fds], []
        try:
            return ShmTransport(
                ShmEndpoints(rank=local_rank, world_size=local_world_size,
                             segment_bytes=reply["segment_bytes"], slots=reply["slots"],
                             inbox={int(p): shared[i]
                                    for p, i in reply["inbox"].items()
                                    }, outbox={int(p): shared[i]
                                               for p, i in reply["outbox"].items()
                                               }, segments=[shared[i] for i in reply["segments"]],
                             mailbox=None if reply["mailbox"] is None else shared[reply["mailbox"]],
                             **reply["extra"]))
        except BaseException:
            for descriptor in shared:  # (a segment the transport has mapped is closed already: no-op)
                descriptor.close()
            raise
    finally:
        for fd in fds:  # received with an error reply, or before the reply failed to parse
            os.close(fd)


def connect_hand_out(name: bytes, deadline: float, local_rank: int) -> socket.socket:
    """Connect to a hand-out socket, waiting while its queue is full.

    A full queue of a Unix stream socket answers ``EAGAIN`` (a socket with a timeout is
    non-blocking), which is a burst of other connections, not a failure: retry until
    ``deadline``. A name nobody listens on any more means local rank 0 has ended.
    """
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)  # a Unix stream connect either queues at once or says EAGAIN
        try:
            sock.connect(name)
        except BlockingIOError:
            sock.close()
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            raise LabError(
                f"local rank {local_rank}: nothing listens at local rank 0's shm hand-out socket any "
                "more: local rank 0 failed or ended (see its error)") from None
        except BaseException:
            sock.close()
            raise
        else:
            sock.setblocking(True)
            return sock
        if time.monotonic() + pause > deadline:
            raise DeadlineError(f"local rank {local_rank}: local rank 0's shm hand-out queue stayed full for "
                                f"{SHARE_TIMEOUT_S:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _proof(secret: bytes, name: bytes, local_rank: int) -> bytes:
    return hmac.new(secret, b"lab-shm" + name + struct.pack("<I", local_rank), hashlib.sha256).digest()


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = _SO_PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _SO_PEERCRED.size))
    return pid, uid


class _HandOut:
    """Local rank 0's side: give each proven local rank its descriptors.

    Every connection is served at once through one selector, so none can hold up another: a
    connection from another user is dropped as it is accepted, before a byte is read; one of
    this user that does not send its hello within ``HELLO_TIMEOUT_S`` is dropped then, and at most
    ``MAX_PENDING`` are held at a time. A proof under another secret from a rank this host waits
    for ends the hand-out: that rank is told the secrets differ, every other waiting connection is
    told why it ends, and the ``LabError`` is raised here.
    """
    def __init__(self, listener: socket.socket, endpoints: list[ShmEndpoints], name: bytes, secret: bytes,
                 host: int) -> None:
        self._listener, self._endpoints, self._name, self._secret = listener, endpoints, name, secret
        self._host = host
        self._waiting = set(range(1, len(endpoints)))
        self._pending: dict[socket.socket, tuple[float,
                                                 bytearray]] = {}  # connection -> (accepted at, hello so far)
        self._selector = selectors.DefaultSelector()

    def run(self) -> None:
        deadline = time.monotonic() + SHARE_TIMEOUT_S
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        try:
            while self._waiting:
                now = time.monotonic()
                for sock in [s for s, (at, _) in self._pending.items() if now - at > HELLO_TIMEOUT_S]:
                    self._drop(sock)
                if now >= deadline:
                    raise DeadlineError(
                        f"local ranks {sorted(self._waiting)} did not take their shm endpoints "
                        f"within {SHARE_TIMEOUT_S:g} s", peers=sorted(self._waiting))
                wake = min([deadline, *(at + HELLO_TIMEOUT_S for at, _ in self._pending.values())])
                for key, _ in self._selector.select(max(wake - now, 0.001)):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)
        except LabError as exc:
            for sock in list(self._pending):  # all of this user's: tell them why instead of a bare close
                self._reply(sock,
                            {"error": f"local rank 0 of host {self._host} gave up the shm hand-out: {exc}"})
            raise
        finally:
            for sock in list(self._pending):
                self._drop(sock)
            self._selector.close()

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                sock, _ = self._listener.accept()
                try:
                    _, uid = _peer(sock)
                except OSError:
                    uid = -1
                if uid != os.getuid() or len(self._pending) >= MAX_PENDING:
                    sock.close()  # another user's (or too many of ours): dropped before a byte is read
                    continue
                sock.setblocking(False)
                self._pending[sock] = (time.monotonic(), bytearray())
                self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        """Take what a connection sent; once its hello is whole, serve it or drop it."""
        hello = self._pending[sock][1]
        data = recv_available(sock, _HELLO.size - len(hello))
        if data is None:
            return
        if not data:
            self._drop(sock)
            return
        hello += data
        if len(hello) < _HELLO.size:
            return
        rank, proof = _HELLO.unpack(hello)
        if rank not in self._waiting:
            self._drop(sock)  # a rank already served, or none of this host's
            return
        if not hmac.compare_digest(proof, _proof(self._secret, self._name, rank)):
            pid, _ = _peer(sock)
            self._reply(
                sock, {
                    "error": f"local rank 0 (pid {os.getpid()}) refused this rank's proof: the job "
                    "secret does not match between them (LAB_TCP_SECRET differs; set the same "
                    "value on every rank)"})
            self._drop(sock)
            raise LabError(
                f"local rank 0: local rank {rank} (pid {pid}) proved another job secret: the secret does "
                "not match between them (LAB_TCP_SECRET differs; set the same value on every rank)")
        self._give(sock, rank)

    def _give(self, sock: socket.socket, rank: int) -> None:
        ep = self._endpoints[rank]
        fds = [
            *(f.fd for f in ep.inbox.values()), *(f.fd for f in ep.outbox.values()),
            *(f.fd for f in ep.segments)]
        n_in, n_out = len(ep.inbox), len(ep.outbox)
        layout = {
            "segment_bytes": ep.segment_bytes, "slots": ep.slots,
            "inbox": {p: i
                      for i, p in enumerate(ep.inbox)},
            "outbox": {p: n_in + i
                       for i, p in enumerate(ep.outbox)},
            "segments": list(range(n_in + n_out,
                                   n_in + n_out + len(ep.segments))), "mailbox": None, "extra": {
                                       k: getattr(ep, k)
                                       for k in ("eager_bytes", "mailbox_slot_bytes", "mailbox_depth",
                                                 "scratch_slot_bytes", "scratch_arena_bytes")}}
        if ep.mailbox is not None:  # the compiled plane's mailboxes (lab.compiled.plane), shared by the host's ranks
            layout["mailbox"] = len(fds)
            fds.append(ep.mailbox.fd)
        try:
            sock.settimeout(
                HELLO_TIMEOUT_S)  # a few KB into an empty buffer: only a stopped peer could block it
            socket.send_fds(sock, [json.dumps(layout).encode()], fds)
        except OSError:
            self._drop(sock)  # that rank fails on its side (end of file); the others go on
            return
        self._drop(sock)
        self._waiting.discard(rank)

    @staticmethod
    def _reply(sock: socket.socket, message: dict) -> None:
        with contextlib.suppress(OSError):
            sock.send(json.dumps(message).encode())  # small, into an empty buffer: never blocks

    def _drop(self, sock: socket.socket) -> None:
        if self._pending.pop(sock, None) is not None:
            self._selector.unregister(sock)
        sock.close()
