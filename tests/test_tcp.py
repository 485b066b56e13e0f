"""The TCP transport on its own: torchrun, a real network interface, strangers and bad frames."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env, free_port

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_job.py"


@pytest.mark.slow
def test_torchrun_three_local_processes():
    """Mesh.from_env() under torchrun: every collective matches gloo on every rank."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([
        torchrun, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()),
        str(SCRIPT)], capture_output=True, text=True, timeout=180, env=child_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert sorted(line.split(" of ")[0] for line in done.stdout.splitlines()
                  if line.startswith("OK")) == ["OK rank 0", "OK rank 1", "OK rank 2"]


# -- a listening rank against strangers and bad frames (in this process: rank 0 in a thread) -------

import struct
import threading
import time
import tracemalloc

import numpy as np
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lab
from lab.errors import LabError, PeerLostError
from lab.transport.base import CONTEXT_BYTES, TAG_BYTES, Recv, Send, TagMismatch
from lab.transport.frames import HEAD_BYTES, HEADER, MAC_BYTES, head
from lab.transport.handshake import (
    _ACCEPTOR_KEY,
    _ACCEPTOR_PROOF,
    _CONNECTOR_KEY,
    _CONNECTOR_PROOF,
    _HELLO,
    _REFUSED_PROOF,
    _REFUSED_RANK,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    MAX_PENDING_HANDSHAKES,
    VERSION,
    derive,
    transcript,
)
from lab.transport.tcp import TcpTransport

SECRET = b"test-job-secret"
TAG = b"fingerprint".ljust(TAG_BYTES, b"\0")
TAG2 = b"fingerprint 2".ljust(TAG_BYTES, b"\0")  # the same mesh (context), the next collective
OTHER = b"othr: another mesh".ljust(TAG_BYTES, b"\0")  # another mesh's (context)
RELAY = Path(__file__).parent / "scripts" / "tcp_relay.py"


class RankZero:
    """Rank 0 of a 2-rank TCP mesh, built in a thread while the test plays rank 1 by hand."""
    def __init__(self, world_size: int = 2) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.transport: TcpTransport | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._build, args=(world_size,), daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _build(self, world_size: int) -> None:
        try:
            self.transport = TcpTransport(0, world_size, self.store, secret=SECRET, prefix="fuzz")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def address(self) -> tuple[str, int]:
        # A client of its own: a store object blocked in get() from one thread would hold up the
        # set() of another.
        client = dist.TCPStore("127.0.0.1", self.store.port, is_master=False)
        host, port = client.get("fuzz/addr/0").decode().rsplit(":", 1)
        return host, int(port)


class Played:
    """Rank 1 played by hand: the connecting side of the handshake, then frames with their MACs."""
    def __init__(self, sock: socket.socket, secret: bytes = SECRET, rank: int = 1) -> None:
        sock.settimeout(5)
        self.sock, mine = sock, b"c" * 32
        sock.sendall(_HELLO.pack(MAGIC, VERSION, rank, mine))
        _, _, acceptor, theirs = _HELLO.unpack(_read(sock, _HELLO.size))
        bound = transcript(acceptor, rank, theirs, mine)
        sock.sendall(derive(secret, _CONNECTOR_PROOF, bound))
        if _read(sock, 32) != derive(secret, _ACCEPTOR_PROOF, bound):
            raise AssertionError("rank 0 answered with a wrong proof")
        self.send_key, self.recv_key, self.sent = derive(secret, _CONNECTOR_KEY,
                                                         bound), derive(secret, _ACCEPTOR_KEY, bound), 0

    def frame(self, header: bytes, payload: bytes) -> bytes:
        """A frame as a real rank sends it: header, header MAC, payload, frame MAC."""
        header_mac, mac = head(self.send_key, self.sent, header)
        self.sent += 1
        mac.update(payload)
        return header + header_mac + payload + mac.digest()

    def data(self, tag: bytes, payload: bytes) -> bytes:
        return self.frame(HEADER.pack(MAGIC, VERSION, 1, tag, len(payload)), payload)

    def header_only(self, tag: bytes, nbytes: int) -> bytes:
        """An authentic header (and its MAC) announcing ``nbytes``, whose payload never comes."""
        header = HEADER.pack(MAGIC, VERSION, 1, tag, nbytes)
        header_mac, _ = head(self.send_key, self.sent, header)
        self.sent += 1
        return header + header_mac

    def send_in_background(self, data: bytes) -> threading.Thread:
        """Send without blocking the test (a frame larger than the socket buffers waits for rank 0)."""
        def send() -> None:
            with contextlib.suppress(OSError):  # rank 0 may close the connection part-way
                self.sock.sendall(data)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def connected_pair() -> tuple[TcpTransport, Played]:
    rank_zero = RankZero()
    played = Played(socket.create_connection(rank_zero.address(), timeout=5))
    rank_zero.thread.join(10)
    assert rank_zero.transport is not None, rank_zero.error
    return rank_zero.transport, played


def test_strangers_are_rejected_and_the_real_peer_still_joins():
    rank_zero = RankZero()
    address = rank_zero.address()
    socket.create_connection(address).close()  # connects and leaves
    with socket.create_connection(address) as garbage:  # not a lab hello
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
    with socket.create_connection(address) as impostor:  # a lab hello, wrong secret
        assert refusal(impostor, 1, b"guessed") == _REFUSED_PROOF  # told so, then closed
    with socket.create_connection(address) as stranger:  # a rank not in this job
        assert refusal(stranger, 7, SECRET) == _REFUSED_RANK
    with socket.create_connection(address) as real:
        Played(real)
        rank_zero.thread.join(10)
    assert rank_zero.error is None and rank_zero.transport is not None
    rank_zero.transport.close()
    with pytest.raises(ConnectionRefusedError):  # the listener is gone
        socket.create_connection(address, timeout=2)


def refusal(sock: socket.socket, rank: int, secret: bytes) -> bytes:
    """Play the connecting side with ``rank`` and ``secret``; return rank 0's answer (a refusal),
    after checking that rank 0 closed the connection behind it."""
    sock.settimeout(5)
    mine = b"i" * 32
    sock.sendall(_HELLO.pack(MAGIC, VERSION, rank, mine))
    _, _, acceptor, theirs = _HELLO.unpack(_read(sock, _HELLO.size))
    sock.sendall(derive(secret, _CONNECTOR_PROOF, transcript(acceptor, rank, theirs, mine)))
    answer = _read(sock, 32)
    assert sock.recv(1) == b""
    return answer


def test_idle_and_trickling_strangers_cost_the_real_peers_nothing():
    """Handshakes run at once: silent connections and a 1-byte-per-second sender do not delay the
    real peer (formerly each held the listener for 10 s, and three made the pool fail)."""
    rank_zero = RankZero()
    address = rank_zero.address()
    idle = [socket.create_connection(address) for _ in range(3)]
    trickle = socket.create_connection(address)
    trickle.sendall(MAGIC[:1])
    started = time.monotonic()
    with socket.create_connection(address) as real:
        Played(real)
        rank_zero.thread.join(10)
    assert rank_zero.transport is not None, rank_zero.error
    assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S / 2
    for sock in (*idle, trickle):
        sock.close()
    rank_zero.transport.close()


def test_a_listener_names_the_ranks_that_never_came(monkeypatch):
    monkeypatch.setattr("lab.transport.handshake.CONNECT_TIMEOUT_S", 1.0)
    rank_zero = RankZero(world_size=3)
    rank_zero.thread.join(10)
    assert isinstance(rank_zero.error, lab.DeadlineError) and "ranks [1, 2] did not connect" in str(
        rank_zero.error)
    assert rank_zero.error.peers == (1, 2)


def test_a_full_pending_set_evicts_the_oldest_stranger(monkeypatch):
    """With the pending set full of silent strangers, a new connection evicts the oldest of them
    instead of being turned away (formerly the real peer was closed on arrival)."""
    monkeypatch.setattr("lab.transport.handshake.MAX_PENDING_HANDSHAKES", 2)
    rank_zero = RankZero()
    address = rank_zero.address()
    oldest, newer = socket.create_connection(address,
                                             timeout=10), socket.create_connection(address, timeout=10)
    for sock in (oldest, newer):
        _read(sock, _HELLO.size)  # rank 0 has accepted it
    with socket.create_connection(address) as real:
        Played(real)
        rank_zero.thread.join(10)
        assert rank_zero.transport is not None, rank_zero.error
        assert oldest.recv(1) == b"" and newer.recv(1) == b""  # evicted; dropped when the listener closed
    oldest.close()
    newer.close()
    rank_zero.transport.close()


def acceptor_side(conn: socket.socket, secret: bytes = SECRET) -> None:
    """Play rank 0 accepting a connector: hellos, check its proof, answer with ours."""
    conn.settimeout(5)
    _, _, connector, theirs = _HELLO.unpack(_read(conn, _HELLO.size))
    mine = b"a" * 32
    conn.sendall(_HELLO.pack(MAGIC, VERSION, 0, mine))
    bound = transcript(0, connector, mine, theirs)
    assert _read(conn, 32) == derive(secret, _CONNECTOR_PROOF, bound)
    conn.sendall(derive(secret, _ACCEPTOR_PROOF, bound))


def connector_thread(port: int, secret: bytes = SECRET) -> tuple[threading.Thread, list]:
    """Rank 1 connecting, in a thread, to a listener the test plays at ``port``."""
    lied = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lied.set("fuzz/addr/0", f"127.0.0.1:{port}")
    outcome: list = []
    thread = threading.Thread(
        target=lambda: outcome.append(_try(lambda: TcpTransport(1, 2, lied, secret, prefix="fuzz"))),
        daemon=True)
    thread.start()
    return thread, outcome


def test_a_handshake_dropped_unanswered_is_tried_again():
    """A listener under a storm may evict the real rank's connection before answering: the
    connecting rank tries again (here: closed after its hello, closed at once, then answered)."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        thread, outcome = connector_thread(fake.getsockname()[1])
        fake.settimeout(10)
        first, _ = fake.accept()
        _read(first, _HELLO.size)
        first.close()
        fake.accept()[0].close()
        third, _ = fake.accept()
        acceptor_side(third)
        thread.join(10)
    assert isinstance(outcome[0], TcpTransport), outcome
    outcome[0].close()
    third.close()


def test_a_handshake_dropped_until_the_deadline_says_so(monkeypatch):
    monkeypatch.setattr("lab.transport.handshake.CONNECT_TIMEOUT_S", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as fake:
        thread, outcome = connector_thread(fake.getsockname()[1])
        fake.settimeout(0.2)
        while thread.is_alive():
            with contextlib.suppress(TimeoutError):
                fake.accept()[0].close()
    assert isinstance(outcome[0], PeerLostError), outcome
    assert "dropped the handshake unanswered" in str(outcome[0]) and "flooding its listener" in str(
        outcome[0])


def test_a_wrong_secret_is_refused_at_once_not_tried_again():
    """The listener answers a wrong proof with an explicit refusal, so the connecting rank fails
    with an authentication error at once instead of retrying until the connection timeout."""
    rank_zero = RankZero()
    host, port = rank_zero.address()
    thread, outcome = connector_thread(port, secret=b"another job's secret")
    thread.join(30)  # the connection timeout is 60 s: a retried attempt could not end by now
    assert outcome and isinstance(outcome[0], LabError) and "refused this rank's proof" in str(
        outcome[0]), outcome
    with socket.create_connection((host, port)) as real:  # rank 0 still waits, and the real rank 1 joins
        Played(real)
        rank_zero.thread.join(10)
    assert rank_zero.transport is not None, rank_zero.error
    rank_zero.transport.close()


def receive(transport: TcpTransport, nbytes: int, timeout_s: float = 3.0) -> BaseException | None:
    out = np.zeros(nbytes // 4, np.float32)
    try:
        transport.exchange([], [Recv(1, out)], TAG, timeout_s, "fuzz")
    except (LabError, TagMismatch) as exc:
        return exc
    return None


def test_a_good_frame_is_received():
    transport, played = connected_pair()
    payload = np.arange(4, dtype=np.float32)
    played.sock.sendall(played.frame(HEADER.pack(MAGIC, VERSION, 1, TAG, payload.nbytes), payload.tobytes()))
    assert receive(transport, 16) is None
    transport.close()
    played.sock.close()


@pytest.mark.parametrize("forgery",
                         ["payload", "header", "header mac", "mac", "replayed", "reordered", "no key"])
def test_a_frame_without_the_right_mac_is_refused(forgery):
    """Frames are authenticated per connection and per sequence number: an altered byte, a
    replayed or reordered frame or a frame MAC'd without the connection's key raises an
    authentication error, never returns, and never blames the peer with a mismatch (a header is
    checked before its tag or length is believed)."""
    transport, played = connected_pair()
    payload = np.arange(4, dtype=np.float32).tobytes()
    header = HEADER.pack(MAGIC, VERSION, 1, TAG, len(payload))
    good = played.frame(header, payload)
    if forgery == "replayed":  # the first frame is fine; the same bytes again are not
        played.sock.sendall(good)
        assert receive(transport, 16) is None
        bad = good
    elif forgery == "reordered":  # the second frame (the next collective's) before the first
        bad = played.frame(HEADER.pack(MAGIC, VERSION, 1, TAG2, len(payload)), payload) + good
    elif forgery == "no key":
        header_mac, mac = head(b"k" * 32, 0, header)
        mac.update(payload)
        bad = header + header_mac + payload + mac.digest()
    else:
        where = {"payload": HEAD_BYTES + 3, "header": 44, "header mac": HEADER.size + 5, "mac": len(good) - 1}
        bad = bytearray(good)
        bad[where[forgery]] ^= 0x40
        bad = bytes(bad)
    played.sock.sendall(bad)
    error = receive(transport, 16)
    assert isinstance(error, PeerLostError) and "failed authentication" in str(error), error
    transport.close()
    played.sock.close()


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(magic=st.sampled_from([MAGIC, b"LABX", b"\0\0\0\0"]), version=st.sampled_from([VERSION, 0, 1, 255]),
       kind=st.sampled_from([1, 0, 7]), length=st.sampled_from([16, 15, 0, 1 << 40, 2**64 - 1]),
       tag=st.sampled_from([TAG, (TAG[:CONTEXT_BYTES] + b"other").ljust(TAG_BYTES, b"\0")]),
       cut=st.integers(0, HEAD_BYTES + 16 + MAC_BYTES), tail=st.binary(max_size=64))
def test_malformed_and_truncated_frames_are_rejected_cleanly(magic, version, kind, length, tag, cut, tail):
    """Whatever arrives, the receive ends with a lab error (or succeeds on a valid frame) before its
    deadline: no hang, no crash, no allocation from a garbled length."""
    transport, played = connected_pair()
    header = struct.pack("<4sBBxx", magic, version, kind) + tag + struct.pack("<Q", length)
    whole = HEAD_BYTES + 16 + MAC_BYTES
    frame = played.frame(header, b"\1" * 16) + tail
    played.sock.sendall(frame[:cut] if cut < whole else frame)
    if cut < whole:
        played.sock.close()  # truncated: the peer goes away mid-frame
    started = time.monotonic()
    error = receive(transport, 16)
    assert time.monotonic() - started < 4
    valid = (magic, version, kind, length, tag) == (MAGIC, VERSION, 1, 16, TAG) and cut >= whole
    assert (error is None) == valid, (error, magic, version, kind, length, cut)
    transport.close()
    played.sock.close()


@contextlib.contextmanager
def peak_allocation():
    """Yields a list that receives the peak of traced allocations (numpy's included) in the block."""
    peak: list = []
    tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield peak
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        if not tracing:
            tracemalloc.stop()


def test_a_frame_of_another_mesh_waits_aside_until_its_receive():
    """A legitimate 4 MiB frame of another mesh arriving first is parked, this mesh's frame is
    received behind it, and the parked one serves the other mesh's receive later."""
    transport, played = connected_pair()
    theirs, ours = np.arange(1 << 20, dtype=np.float32), np.arange(4, dtype=np.float32)
    sender = played.send_in_background(
        played.data(OTHER, theirs.tobytes()) + played.data(TAG, ours.tobytes()))
    out = np.zeros(4, np.float32)
    transport.exchange([], [Recv(1, out)], TAG, 10.0, "parking")
    assert (out == ours).all() and transport.parking.held_bytes(1) == theirs.nbytes
    later = np.zeros(1 << 20, np.float32)
    transport.exchange([], [Recv(1, later)], OTHER, 10.0, "parking")
    assert (later == theirs).all() and transport.parking.held_bytes(1) == 0
    sender.join(5)
    transport.close()
    played.sock.close()


@pytest.mark.slow
def test_parking_beyond_the_per_peer_bound_is_a_clear_error(monkeypatch):
    """A peer (the real one: its headers are authentic) that sends more of another mesh's traffic
    ahead than one peer may park gets a LabError naming the bound, raised before the frame is
    allocated (here it announces 8 GiB), and the connection is closed."""
    monkeypatch.setattr("lab.transport.parking.MAX_PARKED_BYTES_PER_PEER", 1 << 20)
    transport, played = connected_pair()
    sender = played.send_in_background(
        played.data(OTHER, b"\1" * (512 << 10)) + played.header_only(OTHER, 8 << 30))
    with peak_allocation() as peak:
        error = receive(transport, 16, timeout_s=10.0)
    assert isinstance(error,
                      LabError) and "MAX_PARKED_BYTES_PER_PEER (1 MiB; 512 KiB held" in str(error), error
    assert peak[0] < 8 << 20, peak  # the 512 KiB parked, not the 8 GiB announced
    sender.join(5)
    played.sock.settimeout(5)
    assert played.sock.recv(1) == b""
    transport.close()
    played.sock.close()


def test_parking_beyond_the_total_bound_is_a_clear_error(monkeypatch):
    """Two peers each within their bound, together beyond the total: a LabError naming it."""
    monkeypatch.setattr("lab.transport.parking.MAX_PARKED_BYTES_PER_PEER", 1 << 20)
    monkeypatch.setattr("lab.transport.parking.MAX_PARKED_BYTES",
                        5 << 18)  # 1.25 MiB: one 768 KiB frame, not two
    rank_zero = RankZero(world_size=3)
    address = rank_zero.address()
    peers = [Played(socket.create_connection(address, timeout=5), rank=rank) for rank in (1, 2)]
    rank_zero.thread.join(10)
    assert rank_zero.transport is not None, rank_zero.error
    senders = [
        p.send_in_background(p.data(OTHER, b"\1" * (768 << 10)) + p.data(TAG, b"\0" * 16)) for p in peers]
    outs = [np.zeros(4, np.float32) for _ in peers]
    with pytest.raises(LabError, match=r"MAX_PARKED_BYTES \(1.25 MiB from all peers; 768 KiB held"):
        rank_zero.transport.exchange([], [Recv(1, outs[0]), Recv(2, outs[1])], TAG, 10.0, "parking")
    for sender, played in zip(senders, peers):
        sender.join(5)
        played.sock.close()
    rank_zero.transport.close()


# -- a second process as the attacker --------------------------------------------------------------


def _pair_through(relay_mode: str, *relay_args: int):
    """Rank 0 in a thread; rank 1 in a thread whose store says rank 0 is at the attacker's address
    (as if the attacker had rewritten it); the attacker, a separate process, relays to rank 0."""
    rank_zero = RankZero()
    real = rank_zero.address()
    attacker = subprocess.Popen(
        [sys.executable, str(RELAY), relay_mode, real[0],
         str(real[1]), *map(str, relay_args)], stdout=subprocess.PIPE, text=True, env=child_env())
    relay_port = int(attacker.stdout.readline())
    lied = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lied.set("fuzz/addr/0", f"127.0.0.1:{relay_port}")
    rank_one: list = []

    def connect() -> None:
        try:
            rank_one.append(TcpTransport(1, 2, lied, secret=SECRET, prefix="fuzz"))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            rank_one.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(15)
    rank_zero.thread.join(15)
    return rank_zero, rank_one[0], attacker


def send_in_background(transport: TcpTransport, *tags: bytes) -> threading.Thread:
    """Rank 1 sends one 4 KiB frame per tag (a later one may find the connection closed)."""
    def send() -> None:
        with contextlib.suppress(LabError):
            for tag in tags:
                transport.exchange([Send(0, np.arange(1024, dtype=np.float32))], [], tag, 5.0, "attack")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def relayed(mode: str, *relay_args: int):
    rank_zero, rank_one, attacker = _pair_through(mode, *relay_args)
    try:
        assert isinstance(rank_one, TcpTransport), rank_one
        yield rank_zero.transport, rank_one, attacker
    finally:
        attacker.kill()
        attacker.wait()
        for transport in (rank_zero.transport, rank_one):
            if isinstance(transport, TcpTransport):
                transport.close()


def reduce_from_one(transport: TcpTransport, tag: bytes = TAG) -> np.ndarray:
    out = np.ones(1024, np.float32)
    transport.exchange([], [Recv(1, out, lambda o, i: np.add(o, i, out=o))], tag, 5.0, "attack")
    return out


@pytest.mark.parametrize(
    "mode", ["flip", "inject", pytest.param("forge-tag", marks=pytest.mark.slow)])  # (waits 5 s)
def test_an_attacker_in_the_middle_is_detected(mode):
    """The attacker relays a real handshake (it cannot forge one), then alters a payload byte,
    injects a frame of its own, or one claiming another collective of the same mesh: the receiver
    raises an authentication error instead of returning the wrong sum or blaming rank 1."""
    with relayed(mode) as (rank_zero, rank_one, _):
        sender = send_in_background(rank_one, TAG)
        with pytest.raises(PeerLostError, match="failed authentication"):
            reduce_from_one(rank_zero)
        sender.join(5)


@pytest.mark.parametrize("mode", ["replay", "reorder"])
def test_a_replayed_or_reordered_frame_is_detected(mode):
    """Rank 1 sends two frames (two collectives); the attacker replays the first or swaps them.
    Formerly the receiver blamed rank 1 with a mismatch (the tags differ); the header's MAC, bound
    to its sequence number, now says what happened."""
    with relayed(mode) as (rank_zero, rank_one, _):
        sender = send_in_background(rank_one, TAG, TAG2)
        if mode == "replay":
            assert (reduce_from_one(rank_zero) == np.arange(1024) + 1).all()  # the real first frame
        with pytest.raises(PeerLostError, match="failed authentication"):
            reduce_from_one(rank_zero, TAG2 if mode == "replay" else TAG)
        sender.join(5)


@pytest.mark.parametrize("length", [8 << 30, 1 << 36])
def test_a_forged_header_allocates_nothing(length):
    """The attacker injects a header claiming another mesh's context (which would be parked) and
    8 GiB or 64 GiB of payload, then streams junk (up to 64 MiB). Formerly rank 0 allocated the
    claimed length and read the junk into it (8 GiB: +1.5 GB resident for 1.5 GB of junk, no
    error; 64 GiB: MemoryError). Now the header fails authentication before its length is
    believed: nothing of that size is allocated, and rank 0 stops reading."""
    cap = 64 << 20
    with relayed("forge-other", length, cap) as (rank_zero, rank_one, attacker):
        sender = send_in_background(rank_one, TAG)
        tracing = tracemalloc.is_tracing()
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            with pytest.raises(PeerLostError, match="frame header from rank 1 failed authentication"):
                reduce_from_one(rank_zero)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            if not tracing:
                tracemalloc.stop()
        accepted = json.loads(attacker.stdout.readline())["accepted"]
        sender.join(5)
    assert peak < 8 << 20, f"{peak} bytes allocated while receiving"  # numpy's allocations are traced too
    assert accepted < cap, accepted  # only what the sockets' buffers hold: rank 0 read no junk


def test_a_proof_is_bound_to_the_pair_and_the_direction():
    """A connector's proof obtained by posing as one rank is refused by another (ranks and nonces
    are bound); an acceptor that reflects the connector's own proof back is refused (direction)."""
    # Pose as rank 0 to a real connecting rank 1, and reflect its proof back as ours.
    lied = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.create_server(("127.0.0.1", 0)) as fake:
        lied.set("fuzz/addr/0", f"127.0.0.1:{fake.getsockname()[1]}")
        outcome: list = []
        thread = threading.Thread(
            target=lambda: outcome.append(_try(lambda: TcpTransport(1, 2, lied, SECRET, prefix="fuzz"))),
            daemon=True)
        thread.start()
        conn, _ = fake.accept()
        conn.settimeout(5)
        _, _, _, their_nonce = _HELLO.unpack(_read(conn, _HELLO.size))
        conn.sendall(_HELLO.pack(MAGIC, VERSION, 0, b"n" * 32))
        stolen = _read(conn, 32)  # rank 1's proof for (acceptor 0, connector 1, these nonces)
        conn.sendall(stolen)  # reflected as the acceptor's proof
        thread.join(10)
        conn.close()
    assert isinstance(outcome[0], LabError) and "failed authentication" in str(outcome[0])
    # The stolen proof, presented to a real rank 0 with the same claimed nonce: rank 0's own nonce
    # is fresh, so the transcript differs and the proof is refused (no proof of rank 0's in answer).
    rank_zero = RankZero()
    with socket.create_connection(rank_zero.address()) as sock:
        sock.settimeout(5)
        sock.sendall(_HELLO.pack(MAGIC, VERSION, 1, their_nonce) + stolen)
        _read(sock, _HELLO.size)
        assert _read(sock, 32) == _REFUSED_PROOF
        assert sock.recv(1) == b""
    rank_zero.store.set("fuzz/addr/never", "")  # rank 0 is still waiting for a real rank 1
    assert rank_zero.transport is None and rank_zero.thread.is_alive()


def _try(make):
    try:
        return make()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc


def test_the_pool_store_listens_on_loopback_only_and_holds_no_secret():
    """For every transport: the pool's store binds 127.0.0.1 only; a second process that connects
    to it finds the rank addresses but no secret."""
    import psutil

    def listening() -> set:
        return {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"}

    for transport in ("tcp", "shm"):
        before = listening()  # (this module's hand-made stores listen everywhere: not the pool's)
        with lab.launch(2, transport=transport) as cluster:
            new = listening() - before
            assert [a.ip for a in new] == ["127.0.0.1"], new
            port = new.pop().port
            assert port == cluster._store.port
            probe = subprocess.run([
                sys.executable, "-c",
                "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]),"
                " is_master=False); print(s.check(['lab/tcp/secret']), s.check(['lab/tcp/secret-file']),"
                " s.check(['lab/tcp/addr/0']))",
                str(port)], capture_output=True, text=True, timeout=60, env=child_env())
            assert probe.stdout.split() == ["False", "False", str(transport == "tcp")], probe.stderr[-2000:]


# -- across a real network interface: two network namespaces joined by a veth pair ----------------


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.77.x.1) and B (10.77.x.2) on a veth pair; skipped, saying why, without root."""
    tag = os.getpid() % 200 + 20
    names = (f"labA{tag}", f"labB{tag}")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    made = run("ip", "netns", "add", names[0])
    if made.returncode:
        pytest.skip(f"cannot create network namespaces here (needs root): {made.stderr.strip()}")
    try:
        steps = [
            ("ip", "netns", "add", names[1]),
            ("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("ip", "link", "set", f"va{tag}", "netns", names[0]),
            ("ip", "link", "set", f"vb{tag}", "netns", names[1]),
            ("ip", "-n", names[0], "addr", "add", f"10.77.{tag}.1/24", "dev", f"va{tag}"),
            ("ip", "-n", names[1], "addr", "add", f"10.77.{tag}.2/24", "dev", f"vb{tag}"),
            ("ip", "-n", names[0], "link", "set", f"va{tag}", "up"),
            ("ip", "-n", names[1], "link", "set", f"vb{tag}", "up"),
            ("ip", "-n", names[0], "link", "set", "lo", "up"),
            ("ip", "-n", names[1], "link", "set", "lo", "up"),]
        for step in steps:
            done = run(*step)
            assert done.returncode == 0, f"{' '.join(step)}: {done.stderr}"
        yield [(names[0], f"va{tag}", f"10.77.{tag}.1"), (names[1], f"vb{tag}", f"10.77.{tag}.2")]
    finally:
        for name in names:
            run("ip", "netns", "del", name)


def tx_bytes(namespace: str, device: str) -> int:
    return int(
        run("ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{device}/statistics/tx_bytes").stdout)


@pytest.mark.slow
def test_two_ranks_in_two_network_namespaces(two_hosts):
    """Rank 0 and rank 1 each in its own namespace: the collectives cross a real interface."""
    master = two_hosts[0][2]
    before = [tx_bytes(ns, dev) for ns, dev, _ in two_hosts]
    ranks = []
    for rank, (namespace, device, address) in enumerate(two_hosts):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                        GROUP_RANK=str(rank), MASTER_ADDR=master, MASTER_PORT="29611", LAB_TCP_HOST=address,
                        GLOO_SOCKET_IFNAME=device, LAB_TCP_SECRET="netns-test")
        ranks.append(
            subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable,
                              str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env))
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        assert out.startswith("OK rank"), out
    sent = [tx_bytes(ns, dev) - b for (ns, dev, _), b in zip(two_hosts, before)]
    # each rank's payload (as the lab counts it) went out through its veth, headers on top
    payload = [int(out.split("sent ")[1].split(" B")[0]) for out, _ in outputs]
    assert all(s >= p for s, p in zip(sent, payload)), (sent, payload)


# -- a connection storm against rank 0's listener, from a process of its own ---------------------

STORM = Path(__file__).parent / "scripts" / "tcp_storm.py"
JOB = Path(__file__).parent / "scripts" / "tcp_job.py"


@pytest.mark.slow
def test_a_connection_storm_does_not_stop_the_job():
    """An attacker reads rank 0's listener address from the unauthenticated store and keeps 200
    idle and 8 trickling connections open to it (reopening each one closed); ranks 1 and 2 connect
    only once it is on. The job forms, computes the right results, and rank 0 keeps no stranger's
    socket (formerly 70 idle connections filled the pending set and ranks 1 and 2 were turned
    away: "PeerLostError: ... closed the handshake; a different job secret?")."""
    port = free_port()
    env = {
        "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "LAB_TCP_SECRET": "storm-test", "TCP_JOB_HOLD": "storm/on"}
    ranks = [
        subprocess.Popen([sys.executable, str(JOB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=child_env(RANK=str(rank), **env)) for rank in range(3)]
    storm = subprocess.Popen(
        [sys.executable,
         str(STORM), "127.0.0.1",
         str(port), "lab/tcp/addr/0", "200", "8", "storm/on"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=child_env())
    try:
        outputs = [rank.communicate(timeout=240) for rank in ranks]
        said = storm.communicate(timeout=60)[0].splitlines()  # closing its stdin: report
    finally:
        for process in (*ranks, storm):
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, (out, err)) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank}: {err[-3000:]}"
        assert out.strip() == f"OK rank {rank}", out
    assert said[0] == "ready" and storm.returncode == 0, said
    report = json.loads(said[-1])
    # The storm was on before the real ranks came (all 208 connections open, far more than rank 0
    # holds pending) and still on when they had joined (a reopening was refused: the listener had
    # closed); every one of its connections was closed by rank 0, and rank 0 checked itself that
    # only its real peers' sockets remain.
    assert report["opened"] >= 208 > MAX_PENDING_HANDSHAKES and report["refused"] >= 1, report
    assert report["still_open"] == 0 and report["closed_by_listener"] == report["opened"], report
