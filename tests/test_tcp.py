"""The TCP transport on its own: torchrun, a real network interface, strangers and bad frames."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_job.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


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
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lab.errors import LabError  # noqa: E402
from lab.transport.base import TAG_BYTES, Recv, TagMismatch  # noqa: E402
from lab.transport.tcp import _HEADER, _HELLO, MAGIC, VERSION, TcpTransport, _proof  # noqa: E402

SECRET = b"test-job-secret"
TAG = b"fingerprint".ljust(TAG_BYTES, b"\0")


class RankZero:
    """Rank 0 of a 2-rank TCP mesh, built in a thread while the test plays rank 1 by hand."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.transport: TcpTransport | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._build, daemon=True)
        self.thread.start()

    def _build(self) -> None:
        try:
            self.transport = TcpTransport(0, 2, self.store, secret=SECRET, prefix="fuzz")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def address(self) -> tuple[str, int]:
        # A client of its own: a store object blocked in get() from one thread would hold up the
        # set() of another.
        client = dist.TCPStore("127.0.0.1", self.store.port, is_master=False)
        host, port = client.get("fuzz/addr/0").decode().rsplit(":", 1)
        return host, int(port)


def hello(sock: socket.socket, secret: bytes = SECRET, rank: int = 1) -> None:
    """Rank 1's side of the handshake (with a chosen secret)."""
    sock.settimeout(5)
    sock.sendall(_HELLO.pack(MAGIC, VERSION, rank, b"c" * 32, b"\0" * 32))
    _, _, _, challenge, _ = _HELLO.unpack(_read(sock, _HELLO.size))
    sock.sendall(_proof(secret, challenge, rank))
    _read(sock, 32)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def connected_pair() -> tuple[TcpTransport, socket.socket]:
    rank_zero = RankZero()
    peer = socket.create_connection(rank_zero.address(), timeout=5)
    hello(peer)
    rank_zero.thread.join(10)
    assert rank_zero.transport is not None, rank_zero.error
    return rank_zero.transport, peer


def test_strangers_are_rejected_and_the_real_peer_still_joins():
    rank_zero = RankZero()
    address = rank_zero.address()
    socket.create_connection(address).close()                         # connects and leaves
    with socket.create_connection(address) as garbage:                # not a lab hello
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
    with socket.create_connection(address) as impostor:               # a lab hello, wrong secret
        with pytest.raises(ConnectionError):
            hello(impostor, secret=b"guessed")  # rank 0 closes without answering the bad proof
    with socket.create_connection(address) as real:
        hello(real)
        rank_zero.thread.join(10)
    assert rank_zero.error is None and rank_zero.transport is not None
    rank_zero.transport.close()
    with pytest.raises(ConnectionRefusedError):                       # the listener is gone
        socket.create_connection(address, timeout=2)


def receive(transport: TcpTransport, nbytes: int, timeout_s: float = 3.0) -> BaseException | None:
    out = np.zeros(nbytes // 4, np.float32)
    try:
        transport.exchange([], [Recv(1, out)], TAG, time.monotonic() + timeout_s, "fuzz")
    except (LabError, TagMismatch) as exc:
        return exc
    return None


def test_a_good_frame_is_received():
    transport, peer = connected_pair()
    payload = np.arange(4, dtype=np.float32)
    peer.sendall(_HEADER.pack(MAGIC, VERSION, 1, TAG, payload.nbytes) + payload.tobytes())
    assert receive(transport, 16) is None
    transport.close()
    peer.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(magic=st.sampled_from([MAGIC, b"LABX", b"\0\0\0\0"]), version=st.sampled_from([VERSION, 0, 2, 255]),
       kind=st.sampled_from([1, 0, 7]), length=st.sampled_from([16, 15, 0, 1 << 40, 2**64 - 1]),
       tag=st.sampled_from([TAG, b"other".ljust(TAG_BYTES, b"\0")]), cut=st.integers(0, _HEADER.size + 16),
       tail=st.binary(max_size=64))
def test_malformed_and_truncated_frames_are_rejected_cleanly(magic, version, kind, length, tag, cut, tail):
    """Whatever arrives, the receive ends with a lab error (or succeeds on a valid frame) before its
    deadline: no hang, no crash, no allocation from a garbled length."""
    transport, peer = connected_pair()
    frame = struct.pack("<4sBBxx", magic, version, kind) + tag + struct.pack("<Q", length) + b"\1" * 16 + tail
    peer.sendall(frame[:cut] if cut < len(frame) else frame)
    if cut < _HEADER.size + 16:
        peer.close()  # truncated: the peer goes away mid-frame
    started = time.monotonic()
    error = receive(transport, 16)
    assert time.monotonic() - started < 4
    valid = (magic, version, kind, length, tag) == (MAGIC, VERSION, 1, 16, TAG) and cut >= _HEADER.size + 16
    assert (error is None) == valid, (error, magic, version, kind, length, cut)
    transport.close()
    peer.close()


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
