"""How the ranks of the ``"tcp"`` transport connect: one authenticated connection per pair.

Ranks meet through a ``torch.distributed.TCPStore``: each publishes ``host:port`` of a listener,
the lower rank of each pair accepts and the higher one connects. The handshake is mutual and bound
to the connection: both send a fresh nonce, and each proves it holds the job's secret with an HMAC
over both nonces, both ranks and the direction, so a proof seen on one connection is worthless on
any other (a relay between two real ranks gains nothing: it cannot read the frame keys, derived
the same way). The connecting side proves itself first; the accepting side answers only a proven
peer. The secret itself never travels: it is handed to the ranks by their launcher (see
:mod:`lab.hosts.rendezvous`).

Strangers. The listener handshakes every connection at once, drops one that has not proven itself
within ``HANDSHAKE_TIMEOUT_S``, and is closed once the mesh is complete. It holds at most
``MAX_PENDING_HANDSHAKES`` unproven connections: a new one evicts the oldest of those that have not
even sent a hello of a rank still awaited (else the oldest), so strangers cannot fill it; a
connecting rank whose handshake is dropped that way tries again until ``CONNECT_TIMEOUT_S``. A
wrong secret is answered with an explicit refusal, so it fails at once instead of being retried.

What comes out is a :class:`Link` per peer: the connected socket and the two frame keys, which
:mod:`lab.transport.tcp` then uses to frame and authenticate every message.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass

from lab.errors import DeadlineError, LabError, PeerLostError
from lab.transport.base import recv_available

#: What a hello and every frame header start with: a rank of another protocol version is turned
#: away in the hello, so frames of another version never reach the exchange.
MAGIC = b"LABT"
VERSION = 3  # 3: the frame header has a MAC of its own
_HELLO = struct.Struct("<4sBxxxI32s")  # magic, version, rank, nonce: 44 bytes
_PROOF_BYTES = 32
#: How long a rank waits for the whole mesh to form.
CONNECT_TIMEOUT_S = 60.0
#: A connection to a listener that has not proven itself within this is dropped.
HANDSHAKE_TIMEOUT_S = 5.0
#: Unproven connections a listener holds at once; a new one beyond this evicts one of them.
MAX_PENDING_HANDSHAKES = 64
#: The connecting side's first pause before it tries again after a dropped handshake (it doubles,
#: up to 1 s).
RETRY_PAUSE_S = 0.05

# Labels that bind every derived value to its role and direction.
_CONNECTOR_PROOF, _ACCEPTOR_PROOF = b"proof: connector to acceptor", b"proof: acceptor to connector"
_CONNECTOR_KEY, _ACCEPTOR_KEY = b"frames: connector to acceptor", b"frames: acceptor to connector"
# What an acceptor sends instead of its proof when it refuses a connector (never a valid proof:
# that would be an HMAC output equal to a fixed string). They tell a real rank to stop trying.
_REFUSED_PROOF = b"lab-tcp: proof refused".ljust(_PROOF_BYTES, b"\0")
_REFUSED_RANK = b"lab-tcp: rank not expected".ljust(_PROOF_BYTES, b"\0")


def transcript(acceptor: int, connector: int, acceptor_nonce: bytes, connector_nonce: bytes) -> bytes:
    """What a handshake's proofs and keys are bound to: both ranks and both fresh nonces."""
    return b"lab-tcp-v3" + struct.pack("<II", acceptor, connector) + acceptor_nonce + connector_nonce


def derive(secret: bytes, label: bytes, handshake: bytes) -> bytes:
    """HMAC-SHA256 of ``label + handshake`` under the job's secret (proofs and frame keys)."""
    return hmac.new(secret, label + handshake, hashlib.sha256).digest()


@dataclass
class Link:
    """An authenticated connection to one peer: its socket, frame keys and sequence numbers."""

    sock: socket.socket
    send_key: bytes
    recv_key: bytes
    sent: int = 0
    received: int = 0


def connect_mesh(rank: int, world_size: int, store, host: str, secret: bytes, prefix: str) -> dict[int, Link]:
    """A proven link to every other rank, or raise (closing whatever was connected so far)."""
    links: dict[int, Link] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        # The kernel's queue is long so that a burst of strangers does not make a real rank's
        # SYN wait for a retransmission: they are accepted at once, and evicted (_Listener).
        with socket.create_server((host, 0), backlog=socket.SOMAXCONN) as listener:
            store.set(f"{prefix}/addr/{rank}", f"{host}:{listener.getsockname()[1]}")
            # The higher rank of each pair connects; the lower one accepts.
            for peer in range(rank):
                address = store.get(f"{prefix}/addr/{peer}").decode()
                links[peer] = _connect_to(rank, peer, address, secret, deadline)
            _Listener(listener, rank, set(range(rank + 1, world_size)), secret, links).accept_all(deadline)
    except BaseException:
        for link in links.values():
            link.sock.close()
        raise
    return links


# -- the connecting side -----------------------------------------------------------------------


class _Dropped(Exception):
    """The listener closed a handshake before answering (evicted, or gone)."""


def _connect_to(rank: int, peer: int, address: str, secret: bytes, deadline: float) -> Link:
    """Connect to ``peer`` and run the connecting side of the handshake, again (after a pause
    that doubles) whenever the listener drops it unanswered: a listener under a storm of
    strangers evicts unproven connections, and this one may have been among them."""
    pause, attempts = RETRY_PAUSE_S, 0
    while True:
        attempts += 1
        try:
            return _handshake_with(rank, peer, address, secret, deadline)
        except _Dropped as dropped:
            if time.monotonic() + pause >= deadline:
                raise PeerLostError(
                    f"rank {rank}: rank {peer} at {address} dropped the handshake unanswered "
                    f"{attempts} times in {CONNECT_TIMEOUT_S:g} s (last: {dropped}); is something "
                    "flooding its listener with connections, or is it not a lab rank?") from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def _handshake_with(rank: int, peer: int, address: str, secret: bytes, deadline: float) -> Link:
    """One attempt: raises ``_Dropped`` if the listener closes it before answering."""
    peer_host, port = address.rsplit(":", 1)
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        sock = socket.create_connection((peer_host, int(port)), timeout=remaining)
    except OSError as exc:
        raise PeerLostError(f"rank {rank}: cannot connect to rank {peer} at {address}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mine = secrets.token_bytes(32)
        sock.sendall(_HELLO.pack(MAGIC, VERSION, rank, mine))
        magic, version, got, theirs = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
        if (magic, version, got) != (MAGIC, VERSION, peer):
            raise LabError(f"rank {rank}: {address} is not rank {peer} of this job")
        handshake = transcript(peer, rank, theirs, mine)
        sock.sendall(derive(secret, _CONNECTOR_PROOF, handshake))
        answer = _recv_exactly(sock, _PROOF_BYTES)
        if answer == _REFUSED_PROOF:
            raise LabError(f"rank {rank}: rank {peer} at {address} refused this rank's proof: "
                           "failed authentication (a different job secret?)")
        if answer == _REFUSED_RANK:
            raise LabError(f"rank {rank}: rank {peer} at {address} does not expect rank {rank} "
                           "(it has joined already: two processes with the same RANK?)")
        if not hmac.compare_digest(answer, derive(secret, _ACCEPTOR_PROOF, handshake)):
            raise LabError(f"rank {rank}: the listener at {address} claiming rank {peer} failed "
                           "authentication (a different job secret?)")
    except TimeoutError:
        sock.close()
        raise DeadlineError(
            f"rank {rank}: rank {peer} at {address} did not complete the handshake "
            f"within {CONNECT_TIMEOUT_S:g} s", peers=(peer,)) from None
    except (ConnectionError, OSError) as exc:
        sock.close()
        raise _Dropped(str(exc)) from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Link(sock, derive(secret, _CONNECTOR_KEY, handshake), derive(secret, _ACCEPTOR_KEY, handshake))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return bytes(data)


# -- the accepting side ------------------------------------------------------------------------


class _Handshake:
    """An accepted connection not yet proven: what it sent so far, when it arrived, and whether
    its hello named a rank still awaited (what a real rank sends at once, a silent stranger never)."""

    __slots__ = ("nonce", "promising", "received", "started")

    def __init__(self) -> None:
        self.nonce = secrets.token_bytes(32)
        self.received = bytearray()
        self.started = time.monotonic()
        self.promising = False

    def eviction_order(self) -> tuple[bool, float]:
        """Evicted first: no awaited rank's hello yet, then the oldest."""
        return self.promising, self.started


class _Listener:
    """The accepting side of one rank: handshakes every connection to ``listener`` at once, and
    adds a :class:`Link` to ``links`` for each awaited (``expected``) rank that proves itself."""
    def __init__(self, listener: socket.socket, rank: int, expected: set[int], secret: bytes,
                 links: dict[int, Link]) -> None:
        self.listener, self.rank, self.expected = listener, rank, expected
        self.secret, self.links = secret, links
        self.pending: dict[socket.socket, _Handshake] = {}
        self.selector = selectors.DefaultSelector()

    def accept_all(self, deadline: float) -> None:
        """Accept the awaited ranks: a stranger that stalls costs at most ``HANDSHAKE_TIMEOUT_S``
        of its own slot, never the real peers' time."""
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        try:
            while self._missing():
                now = time.monotonic()
                for sock in [s for s, h in self.pending.items() if now - h.started > HANDSHAKE_TIMEOUT_S]:
                    self._drop(sock)
                if now >= deadline:
                    missing = sorted(self._missing())
                    raise DeadlineError(
                        f"rank {self.rank}: ranks {missing} did not connect within "
                        f"{CONNECT_TIMEOUT_S:g} s", peers=missing)
                wake = min([deadline, *(h.started + HANDSHAKE_TIMEOUT_S for h in self.pending.values())])
                for key, _ in self.selector.select(max(wake - now, 0.001)):
                    if key.fileobj is self.listener:
                        self._take_new()
                    elif key.fileobj in self.pending:  # (not evicted earlier in this round)
                        self._advance(key.fileobj, self.pending[key.fileobj])
        finally:
            for sock in list(self.pending):
                self._drop(sock)
            self.selector.close()

    def _missing(self) -> set[int]:
        return self.expected - self.links.keys()

    def _admit(self, sock: socket.socket) -> None:
        """Out of the pending set, socket kept."""
        self.selector.unregister(sock)
        del self.pending[sock]

    def _drop(self, sock: socket.socket) -> None:
        self._admit(sock)
        sock.close()

    def _take_new(self) -> None:
        """Accept what is queued (a bounded batch, so pending connections are read in between),
        evicting an unproven connection for each one beyond ``MAX_PENDING_HANDSHAKES``: refusing
        new ones instead would let strangers that got there first turn the real peers away."""
        pending = self.pending
        for _ in range(MAX_PENDING_HANDSHAKES // 2):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # e.g. out of descriptors for a moment, or the connection reset already
            if len(pending) >= MAX_PENDING_HANDSHAKES:
                self._drop(min(pending, key=lambda s: pending[s].eviction_order()))
            handshake = _Handshake()
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.send(_HELLO.pack(MAGIC, VERSION, self.rank, handshake.nonce))  # fits an empty buffer
            except OSError:
                sock.close()
                continue
            pending[sock] = handshake
            self.selector.register(sock, selectors.EVENT_READ)
            # A real rank sends its hello as soon as it connects: read it now, so it counts as
            # promising before the next burst of strangers is accepted.
            self._advance(sock, handshake)
            if not self._missing():
                return

    def _advance(self, sock: socket.socket, handshake: _Handshake) -> None:
        """Take what a pending connection sent; admit it once its hello and proof check out."""
        data = recv_available(sock, _HELLO.size + _PROOF_BYTES - len(handshake.received))
        if data is None:
            return
        if not data:
            self._drop(sock)
            return
        handshake.received += data
        if len(handshake.received) < _HELLO.size:
            return
        magic, version, peer, theirs = _HELLO.unpack_from(handshake.received)
        if (magic, version) != (MAGIC, VERSION):
            self._drop(sock)  # not a lab rank (of this version)
            return
        awaited = peer in self._missing()
        handshake.promising = awaited
        if len(handshake.received) < _HELLO.size + _PROOF_BYTES:
            return
        if not awaited:  # told, so that a real rank stops trying (nothing secret in it)
            self._refuse(sock, _REFUSED_RANK)
            return
        bound = transcript(self.rank, peer, handshake.nonce, theirs)
        proof = bytes(handshake.received[_HELLO.size:])
        if not hmac.compare_digest(proof, derive(self.secret, _CONNECTOR_PROOF, bound)):
            self._refuse(sock, _REFUSED_PROOF)  # a wrong secret, or a proof replayed from elsewhere
            return
        try:
            sock.send(derive(self.secret, _ACCEPTOR_PROOF, bound))  # 32 bytes into an empty send buffer
        except OSError:
            self._drop(sock)
            return
        self._admit(sock)
        sock.setblocking(True)
        self.links[peer] = Link(sock, derive(self.secret, _ACCEPTOR_KEY, bound),
                                derive(self.secret, _CONNECTOR_KEY, bound))

    def _refuse(self, sock: socket.socket, answer: bytes) -> None:
        """Answer a refusal instead of a proof, then close (everything it sent was read, so the
        close is orderly and the answer arrives)."""
        with contextlib.suppress(OSError):
            sock.send(answer)
        self._drop(sock)
