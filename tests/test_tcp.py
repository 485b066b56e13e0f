"""The TCP transport on its own: torchrun, a real network interface, strangers and bad frames."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, free_port

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_job.py"


def test_torchrun_three_local_processes():
    """Mesh.from_env() under torchrun: every collective matches gloo on every rank."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(SCRIPT)],
        capture_output=True, text=True, timeout=180, env=child_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert sorted(line.split(" of ")[0] for line in done.stdout.splitlines() if line.startswith("OK")) == [
        "OK rank 0", "OK rank 1", "OK rank 2"]


# -- a listening rank against strangers and bad frames (in this process: rank 0 in a thread) -------

import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import lab  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lab.errors import LabError, PeerLostError  # noqa: E402
from lab.transport.base import TAG_BYTES, Recv, Send, TagMismatch  # noqa: E402
from lab.transport.tcp import (_ACCEPTOR_KEY, _ACCEPTOR_PROOF, _CONNECTOR_KEY, _CONNECTOR_PROOF, _HEADER,  # noqa: E402
                               _HELLO, HANDSHAKE_TIMEOUT_S, MAGIC, VERSION, TcpTransport, derive, frame_mac,
                               transcript)

SECRET = b"test-job-secret"
TAG = b"fingerprint".ljust(TAG_BYTES, b"\0")
ATTACKER = Path(__file__).parent / "scripts" / "tcp_attacker.py"


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
        self.send_key, self.recv_key, self.sent = derive(secret, _CONNECTOR_KEY, bound), derive(secret, _ACCEPTOR_KEY, bound), 0

    def frame(self, header: bytes, payload: bytes) -> bytes:
        mac = frame_mac(self.send_key, self.sent)
        self.sent += 1
        mac.update(header + payload)
        return header + payload + mac.digest()


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
    socket.create_connection(address).close()                         # connects and leaves
    with socket.create_connection(address) as garbage:                # not a lab hello
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
    with socket.create_connection(address) as impostor:               # a lab hello, wrong secret
        with pytest.raises(ConnectionError):
            Played(impostor, secret=b"guessed")  # rank 0 closes without answering the bad proof
    with socket.create_connection(address) as real:
        Played(real)
        rank_zero.thread.join(10)
    assert rank_zero.error is None and rank_zero.transport is not None
    rank_zero.transport.close()
    with pytest.raises(ConnectionRefusedError):                       # the listener is gone
        socket.create_connection(address, timeout=2)


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
    monkeypatch.setattr("lab.transport.tcp.CONNECT_TIMEOUT_S", 1.0)
    rank_zero = RankZero(world_size=3)
    rank_zero.thread.join(10)
    assert isinstance(rank_zero.error, lab.DeadlineError) and "ranks [1, 2] did not connect" in str(rank_zero.error)
    assert rank_zero.error.peers == (1, 2)


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
    played.sock.sendall(played.frame(_HEADER.pack(MAGIC, VERSION, 1, TAG, payload.nbytes), payload.tobytes()))
    assert receive(transport, 16) is None
    transport.close()
    played.sock.close()


@pytest.mark.parametrize("forgery", ["payload", "header", "mac", "replayed", "no key"])
def test_a_frame_without_the_right_mac_is_refused(forgery):
    """Frames are authenticated per connection and per sequence number: an altered byte, a
    replayed frame or a frame MAC'd without the connection's key raises, never returns."""
    transport, played = connected_pair()
    payload = np.arange(4, dtype=np.float32).tobytes()
    header = _HEADER.pack(MAGIC, VERSION, 1, TAG, len(payload))
    good = played.frame(header, payload)
    if forgery == "replayed":  # the first frame is fine; the same bytes again are not
        played.sock.sendall(good)
        assert receive(transport, 16) is None
        bad = good
    elif forgery == "no key":
        mac = frame_mac(b"k" * 32, 0)
        mac.update(header + payload)
        bad = header + payload + mac.digest()
    else:
        where = {"payload": _HEADER.size + 3, "header": 44, "mac": len(good) - 1}[forgery]
        bad = bytearray(good)
        bad[where] ^= 0x40
        bad = bytes(bad)
    played.sock.sendall(bad)
    error = receive(transport, 16)
    assert isinstance(error, (PeerLostError, lab.CollectiveMismatchError)), error
    transport.close()
    played.sock.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(magic=st.sampled_from([MAGIC, b"LABX", b"\0\0\0\0"]), version=st.sampled_from([VERSION, 0, 1, 255]),
       kind=st.sampled_from([1, 0, 7]), length=st.sampled_from([16, 15, 0, 1 << 40, 2**64 - 1]),
       tag=st.sampled_from([TAG, (TAG[:4] + b"other").ljust(TAG_BYTES, b"\0")]), cut=st.integers(0, _HEADER.size + 48),
       tail=st.binary(max_size=64))
def test_malformed_and_truncated_frames_are_rejected_cleanly(magic, version, kind, length, tag, cut, tail):
    """Whatever arrives, the receive ends with a lab error (or succeeds on a valid frame) before its
    deadline: no hang, no crash, no allocation from a garbled length."""
    transport, played = connected_pair()
    header = struct.pack("<4sBBxx", magic, version, kind) + tag + struct.pack("<Q", length)
    frame = played.frame(header, b"\1" * 16) + tail
    played.sock.sendall(frame[:cut] if cut < _HEADER.size + 48 else frame)
    if cut < _HEADER.size + 48:
        played.sock.close()  # truncated: the peer goes away mid-frame
    started = time.monotonic()
    error = receive(transport, 16)
    assert time.monotonic() - started < 4
    valid = (magic, version, kind, length, tag) == (MAGIC, VERSION, 1, 16, TAG) and cut >= _HEADER.size + 48
    assert (error is None) == valid, (error, magic, version, kind, length, cut)
    transport.close()
    played.sock.close()


# -- a second process as the attacker --------------------------------------------------------------


def _pair_through(relay_mode: str):
    """Rank 0 in a thread; rank 1 in a thread whose store says rank 0 is at the attacker's address
    (as if the attacker had rewritten it); the attacker, a separate process, relays to rank 0."""
    rank_zero = RankZero()
    real = rank_zero.address()
    attacker = subprocess.Popen([sys.executable, str(ATTACKER), relay_mode, real[0], str(real[1])],
                                stdout=subprocess.PIPE, text=True, env=child_env())
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


@pytest.mark.parametrize("mode", ["flip", "inject"])
def test_an_attacker_in_the_middle_is_detected(mode):
    """The attacker relays a real handshake (it cannot forge one), then alters a payload byte or
    injects a frame of its own: the receiver raises instead of returning the wrong sum."""
    rank_zero, rank_one, attacker = _pair_through(mode)
    try:
        assert isinstance(rank_one, TcpTransport), rank_one
        data = np.arange(1024, dtype=np.float32)
        sender = threading.Thread(target=rank_one.exchange, args=([Send(0, data)], [], TAG, 5.0, "attack"), daemon=True)
        sender.start()
        out = np.ones(1024, np.float32)
        with pytest.raises(PeerLostError, match="failed authentication"):
            rank_zero.transport.exchange([], [Recv(0 + 1, out, lambda o, i: np.add(o, i, out=o))], TAG, 5.0, "attack")
        sender.join(5)
    finally:
        attacker.kill()
        attacker.wait()
        for transport in (rank_zero.transport, rank_one):
            if isinstance(transport, TcpTransport):
                transport.close()


def test_a_proof_is_bound_to_the_pair_and_the_direction():
    """A connector's proof obtained by posing as one rank is refused by another (ranks and nonces
    are bound); an acceptor that reflects the connector's own proof back is refused (direction)."""
    # Pose as rank 0 to a real connecting rank 1, and reflect its proof back as ours.
    lied = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.create_server(("127.0.0.1", 0)) as fake:
        lied.set("fuzz/addr/0", f"127.0.0.1:{fake.getsockname()[1]}")
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_try(lambda: TcpTransport(1, 2, lied, SECRET, prefix="fuzz"))),
                                  daemon=True)
        thread.start()
        conn, _ = fake.accept()
        conn.settimeout(5)
        _, _, _, their_nonce = _HELLO.unpack(_read(conn, _HELLO.size))
        conn.sendall(_HELLO.pack(MAGIC, VERSION, 0, b"n" * 32))
        stolen = _read(conn, 32)  # rank 1's proof for (acceptor 0, connector 1, these nonces)
        conn.sendall(stolen)      # reflected as the acceptor's proof
        thread.join(10)
        conn.close()
    assert isinstance(outcome[0], LabError) and "failed authentication" in str(outcome[0])
    # The stolen proof, presented to a real rank 0 with the same claimed nonce: rank 0's own nonce
    # is fresh, so the transcript differs and the connection is dropped unanswered.
    rank_zero = RankZero()
    with socket.create_connection(rank_zero.address()) as sock:
        sock.settimeout(5)
        sock.sendall(_HELLO.pack(MAGIC, VERSION, 1, their_nonce) + stolen)
        _read(sock, _HELLO.size)
        with pytest.raises((ConnectionError, TimeoutError)):
            _read(sock, 32)
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
            probe = subprocess.run(
                [sys.executable, "-c", "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]),"
                 " is_master=False); print(s.check(['lab/tcp/secret']), s.check(['lab/tcp/secret-file']),"
                 " s.check(['lab/tcp/addr/0']))", str(port)],
                capture_output=True, text=True, timeout=60, env=child_env())
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
            ("ip", "-n", names[1], "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = run(*step)
            assert done.returncode == 0, f"{' '.join(step)}: {done.stderr}"
        yield [(names[0], f"va{tag}", f"10.77.{tag}.1"), (names[1], f"vb{tag}", f"10.77.{tag}.2")]
    finally:
        for name in names:
            run("ip", "netns", "del", name)


def tx_bytes(namespace: str, device: str) -> int:
    return int(run("ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{device}/statistics/tx_bytes").stdout)


def test_two_ranks_in_two_network_namespaces(two_hosts):
    """Rank 0 and rank 1 each in its own namespace: the collectives cross a real interface."""
    master = two_hosts[0][2]
    before = [tx_bytes(ns, dev) for ns, dev, _ in two_hosts]
    ranks = []
    for rank, (namespace, device, address) in enumerate(two_hosts):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=master, MASTER_PORT="29611",
                        LAB_TCP_HOST=address, GLOO_SOCKET_IFNAME=device, LAB_TCP_SECRET="netns-test")
        ranks.append(subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, str(SCRIPT)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        assert out.startswith("OK rank"), out
    sent = [tx_bytes(ns, dev) - b for (ns, dev, _), b in zip(two_hosts, before)]
    # each rank's payload (as the lab counts it) went out through its veth, headers on top
    payload = [int(out.split("sent ")[1].split(" B")[0]) for out, _ in outputs]
    assert all(s >= p for s, p in zip(sent, payload)), (sent, payload)
