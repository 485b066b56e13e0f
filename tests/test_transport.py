"""Point-to-point through both transports: ordering, sizes, dtypes, shapes, segments, counters;
the shm eager protocol at its threshold, its framing, and the bound on what a sender can queue.

The shm pools here force tiny segments (64 bytes, one or two slots), as gloo's tests force
small segment sizes, so every rendezvous message of more than 8 doubles crosses several segments
and the sender must wait for credits; one pool sends everything by rendezvous (``eager_bytes=0``),
one uses the default eager threshold and one a tiny forced threshold (16 bytes).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from helpers import pool

import lab
from lab.errors import CollectiveMismatchError, DeadlineError
from lab.transport import shm
from lab.transport.base import CONTEXT_BYTES, Recv, Send, SharedFd, TagMismatch

SIZES = [0, 1, 15, 16, 17, 1000, 40_001]


def message(size: int, index: int, src: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float64) * 7 + 1000 * index + src


def ordered_stream(mesh: lab.Mesh) -> list[str]:
    """Every rank sends a stream of varied messages to every other rank, then receives theirs."""
    failures = []
    peers = [p for p in range(mesh.world_size) if p != mesh.rank]
    mesh.reset_stats()
    # Send to higher ranks first, then receive from lower ones, and the reverse: no cycle of
    # blocking sends even when a large message waits for credits.
    for step in range(2):
        for peer in peers:
            sending = (mesh.rank < peer) == (step == 0)
            for index, size in enumerate(SIZES):
                if sending:
                    mesh.send(peer, message(size, index, mesh.rank))
                else:
                    got = mesh.recv(peer)
                    want = message(size, index, peer)
                    if not torch.equal(got, want):
                        failures.append(f"rank {mesh.rank} from {peer} message {index}: wrong data")
    stats = mesh.stats()
    payload = sum(SIZES) * 8 * len(peers)
    if (stats["bytes_sent"], stats["bytes_received"]) != (payload, payload):
        failures.append(f"rank {mesh.rank} counted {stats}, want {payload} bytes each way")
    if stats["messages_sent"] != len(SIZES) * len(peers):
        failures.append(f"rank {mesh.rank} counted {stats['messages_sent']} messages")
    return failures


def kinds_and_shapes(mesh: lab.Mesh) -> list[str]:
    """Type, dtype and shape survive the trip; numpy stays numpy."""
    cases = [
        torch.arange(12, dtype=torch.int32).reshape(3, 4),
        torch.tensor(3.5, dtype=torch.bfloat16),
        (torch.arange(6.0, dtype=torch.float16) - 2).reshape(1, 2, 3),
        np.arange(10, dtype=np.int64)[::2],  # non-contiguous
        np.zeros((2, 0, 3), np.float32)]
    failures = []
    if mesh.rank == 0:
        for case in cases:
            mesh.send(1, case)
    elif mesh.rank == 1:
        for case in cases:
            got = mesh.recv(0, timeout_ms=30_000)
            if type(got) is not type(case) or got.dtype != case.dtype or tuple(got.shape) != tuple(
                    case.shape):
                failures.append(f"{type(case).__name__} {case.dtype}{tuple(case.shape)} became "
                                f"{type(got).__name__} {got.dtype}{tuple(got.shape)}")
            elif not (torch.equal(got, case)
                      if isinstance(case, torch.Tensor) else np.array_equal(got, case)):
                failures.append(f"{case.dtype}{tuple(case.shape)}: wrong values")
    return failures


def bad_peers(mesh: lab.Mesh) -> list[str]:
    """send/recv reject themselves and out-of-range peers, naming the parameter."""
    failures = []
    for call, name in [(lambda: mesh.send(mesh.rank, torch.ones(1)), "dst"),
                       (lambda: mesh.recv(mesh.world_size), "src"),
                       (lambda: mesh.send(-1, torch.ones(1)), "dst")]:
        try:
            call()
            failures.append(f"rank {mesh.rank}: bad {name} accepted")
        except ValueError as exc:
            if name not in str(exc):
                failures.append(f"rank {mesh.rank}: message does not name {name}: {exc}")
    return failures


@pytest.fixture(scope="module", params=[("shm", 1, 0), ("shm", 2, shm.DEFAULT_EAGER_BYTES), ("shm", 2, 16),
                                        ("queue", 1, 0)],
                ids=["shm-1slot-rendezvous", "shm-2slots", "shm-2slots-eager16", "queue"])
def cluster(request):
    transport, slots, eager_bytes = request.param
    options = {"eager_bytes": eager_bytes} if transport == "shm" else {}
    with pool(3, transport, segment_bytes=64, slots=slots, **options) as c:
        yield c


def test_messages_arrive_in_order_with_exact_payload_counts(cluster):
    outputs = cluster.run(ordered_stream)
    assert not [f for per_rank in outputs for f in per_rank]


def test_type_dtype_and_shape_survive(cluster):
    outputs = cluster.run(kinds_and_shapes)
    assert not [f for per_rank in outputs for f in per_rank]


def test_bad_peer_is_a_value_error_naming_it(cluster):
    outputs = cluster.run(bad_peers)
    assert not [f for per_rank in outputs for f in per_rank]


@pytest.mark.parametrize("segment_bytes", [0, 100, 63])
def test_segment_size_must_be_a_multiple_of_64(segment_bytes):
    with pytest.raises(ValueError, match="segment_bytes"):
        lab.launch(2, segment_bytes=segment_bytes)


def two_rank_exchanges(mesh: lab.Mesh) -> list[str]:
    """With two ranks, left and right neighbour are the same peer: its pipe carries our data and
    the credits for our sends. Reading it for data must not strand a send that just got credit."""
    failures = []
    for size in [1, 17, 100, 1001, 4099]:
        for _ in range(20):
            x = torch.arange(size, dtype=torch.float32) + mesh.rank
            lab.allreduce(mesh, x, algorithm="ring")
            if not torch.equal(x, 2 * torch.arange(size, dtype=torch.float32) + 1):
                failures.append(f"rank {mesh.rank} size {size}")
    return failures


@pytest.mark.parametrize("slots", [1, 2])
def test_two_ranks_exchanging_through_one_pipe_never_stall(slots):
    outputs = lab.spawn(two_rank_exchanges, 2, segment_bytes=64, slots=slots, recv_timeout_ms=10_000)
    assert not [f for per_rank in outputs for f in per_rank]


# -- the eager protocol ----------------------------------------------------------------------------

TAG = b"eager-test".ljust(32, b"\0")


def transport_pair(eager_bytes: int, segment_bytes: int = 8192) -> tuple[shm.ShmTransport, shm.ShmTransport]:
    """Ranks 0 and 1 of a 2-rank shm mesh, both in this process (small messages never block)."""
    endpoints = shm.create_endpoints(2, segment_bytes, 2, eager_bytes)
    endpoints[1].segments = [SharedFd(os.dup(s.fd)) for s in endpoints[0].segments]  # each closes its own
    endpoints[1].mailbox = SharedFd(os.dup(endpoints[0].mailbox.fd))
    return shm.ShmTransport(endpoints[0]), shm.ShmTransport(endpoints[1])


@pytest.mark.parametrize("threshold", [shm.DEFAULT_EAGER_BYTES - 1, shm.DEFAULT_EAGER_BYTES, 16, 0])
def test_messages_up_to_the_threshold_go_eager_and_larger_ones_through_a_slot(threshold, monkeypatch):
    """threshold - 1, threshold and threshold + 1 bytes, copied and reduced, with reads cut
    mid-frame (a 100-byte drain), and the path each took read off the credits it spent."""
    monkeypatch.setattr(shm, "_DRAIN_BYTES", 100)
    a, b = transport_pair(threshold)
    try:
        for nbytes in (max(threshold - 1, 0), threshold, threshold + 1):
            data = (np.arange(nbytes) * 7 + 3).astype(np.uint8)
            for combine in (None, lambda out, incoming: np.add(out, incoming, out=out)):
                credits = (a._eager_credits[1], a._credits[1])
                a.exchange([Send(1, data)], [], TAG, 5.0, "test")
                spent = (credits[0] - a._eager_credits[1], credits[1] - a._credits[1])
                assert spent == ((1, 0) if nbytes <= threshold else (0, 1)), (nbytes, spent)
                out = np.full(nbytes, 5, np.uint8)
                b.exchange([], [Recv(0, out, combine)], TAG, 5.0, "test")
                want = data if combine is None else (data + np.uint8(5))
                assert np.array_equal(out, want), nbytes
                a.exchange([], [], TAG, 5.0, "test")
                a._drain(1, "test")  # take the credits back (eager ones come back in batches)
                assert a._credits[1] == a.slots and a._eager_credits[1] > shm.EAGER_CREDITS // 2
    finally:
        a.close()
        b.close()


def test_a_size_or_tag_disagreement_across_the_threshold_is_caught():
    a, b = transport_pair(64)
    try:
        a.exchange([Send(1, np.zeros(64, np.uint8))], [], TAG, 5.0, "test")  # eager
        with pytest.raises(CollectiveMismatchError, match="expected 65 bytes"):
            b.exchange([], [Recv(0, np.zeros(65, np.uint8))], TAG, 5.0, "test")
        a.exchange([Send(1, np.zeros(65, np.uint8))], [], TAG, 5.0, "test")  # rendezvous
        with pytest.raises(CollectiveMismatchError, match="expected 64 bytes"):
            b.exchange([], [Recv(0, np.zeros(64, np.uint8))], TAG, 5.0, "test")
        other = TAG[:CONTEXT_BYTES] + b"other".ljust(32 - CONTEXT_BYTES, b"\0")  # same context, another tag
        a.exchange([Send(1, np.zeros(8, np.uint8))], [], other, 5.0, "test")
        with pytest.raises(TagMismatch):
            b.exchange([], [Recv(0, np.zeros(8, np.uint8))], TAG, 5.0, "test")
    finally:
        a.close()
        b.close()


def test_a_sender_runs_out_of_eager_credits_and_gets_them_back_in_batches():
    a, b = transport_pair(64)
    try:
        message = np.arange(64, dtype=np.uint8)
        for _ in range(shm.EAGER_CREDITS):
            a.exchange([Send(1, message)], [], TAG, 5.0, "test")
        with pytest.raises(DeadlineError):  # the ninth waits for a receiver that does not read
            a.exchange([Send(1, message)], [], TAG, 0.2, "test")
        assert b.queued_bytes(0) == shm.EAGER_CREDITS * (48 + 64)
        for _ in range(shm.EAGER_CREDITS // 2):
            b.exchange([], [Recv(0, np.empty(64, np.uint8))], TAG, 5.0, "test")
        a.exchange([Send(1, message)], [], TAG, 5.0, "test")  # a batch of credits came back
        assert a._eager_credits[1] == shm.EAGER_CREDITS // 2 - 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("value", [-1, shm.MAX_EAGER_BYTES + 1, True, 1.5, "64"])
def test_eager_bytes_must_fit_one_pipe_write(value):
    with pytest.raises(ValueError, match="eager_bytes"):
        lab.launch(2, eager_bytes=value)


FLOOD_SENDS = 200
FLOOD_BYTES = 1000


def flood(mesh: lab.Mesh) -> dict:
    """Rank 0 sends 200 small tensors as fast as it can; rank 1 sleeps first."""
    if mesh.rank == 0:
        done = []
        for i in range(FLOOD_SENDS):
            mesh.send(1, torch.full((FLOOD_BYTES,), i % 256, dtype=torch.uint8).view(torch.int16).float())
            done.append(time.monotonic())
        return {"done": done}
    # Sleep until the sender has queued all it may (4 sends: 4 header and 4 payload frames),
    # then half a second more: a sender that could queue more would have by then.
    full = shm.EAGER_CREDITS // 2 * (2 * 48 + 8 * 19 + 4 * FLOOD_BYTES // 2)
    deadline = time.monotonic() + 30
    while mesh._transport.queued_bytes(0) < full and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    queued = mesh._transport.queued_bytes(0)
    woke = time.monotonic()
    wrong = [
        i for i in range(FLOOD_SENDS)
        if not torch.equal(mesh.recv(0),
                           torch.full((FLOOD_BYTES,), i % 256, dtype=torch.uint8).view(torch.int16).float())]
    return {"queued": queued, "woke": woke, "wrong": wrong}


def test_a_flood_of_small_messages_at_a_sleeping_rank_stays_within_the_eager_bound():
    """A send is two eager messages (header, payload: 2,000 bytes): at most EAGER_CREDITS // 2
    sends complete before the receiver reads, and what waits for it is at most EAGER_CREDITS
    frames of at most PIPE_BUF bytes (the bound the README states)."""
    with pool(2, "shm") as cluster:
        sender, receiver = cluster.run(flood)
    assert not receiver["wrong"]
    early = sum(t < receiver["woke"] for t in sender["done"])
    assert early == shm.EAGER_CREDITS // 2, early
    assert receiver["queued"] == shm.EAGER_CREDITS // 2 * (2 * 48 + 8 * 19 + 4 * FLOOD_BYTES // 2)
    assert receiver["queued"] <= shm.EAGER_CREDITS * 4096


def send_then_close(mesh: lab.Mesh, numel: int) -> object:
    """Rank 0 sends a tensor of several slots and closes its mesh at once; rank 1 takes it later."""
    data = torch.arange(numel, dtype=torch.float32)
    if mesh.rank == 0:
        mesh.send(1, data)
        mesh.close()  # its channels go: rank 1 still holds segments to hand back
        return "sent"
    time.sleep(0.3)
    return bool(torch.equal(mesh.recv(0), data))


@pytest.mark.parametrize("numel", [1 << 20, 3, 5000])  # slots, eager, and eager in batches
def test_a_sender_that_closes_after_its_last_send_still_delivers_it(numel):
    """Handing a slot back to a sender that has gone is not an error: its data is whole here
    (it used to be a PeerLostError on the receiver, writing the credit into a closed pipe)."""
    assert lab.spawn(send_then_close, 2, args=(numel,)) == ["sent", True]
