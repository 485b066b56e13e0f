"""Point-to-point through both transports: ordering, sizes, dtypes, shapes, segments, counters.

The shm pools here force tiny segments (64 bytes, one or two slots), as gloo's tests force
small segment sizes, so every message of more than 16 floats crosses several segments and the
sender must wait for credits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lab
from conftest import pool

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
        np.zeros((2, 0, 3), np.float32),
    ]
    failures = []
    if mesh.rank == 0:
        for case in cases:
            mesh.send(1, case)
    elif mesh.rank == 1:
        for case in cases:
            got = mesh.recv(0, timeout_ms=30_000)
            if type(got) is not type(case) or got.dtype != case.dtype or tuple(got.shape) != tuple(case.shape):
                failures.append(f"{type(case).__name__} {case.dtype}{tuple(case.shape)} became "
                                f"{type(got).__name__} {got.dtype}{tuple(got.shape)}")
            elif not (torch.equal(got, case) if isinstance(case, torch.Tensor) else np.array_equal(got, case)):
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


@pytest.fixture(scope="module", params=[("shm", 1), ("shm", 2), ("queue", 1)], ids=["shm-1slot", "shm-2slots", "queue"])
def cluster(request):
    transport, slots = request.param
    with pool(3, transport, segment_bytes=64, slots=slots) as c:
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
