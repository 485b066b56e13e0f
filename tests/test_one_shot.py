"""One-shot allreduce (lab.algorithms.allreduce_one_shot): on shm every rank reads every rank's
input from the two-shot's slots (lab.transport.peer_memory) and folds them itself; elsewhere, and
on sub-meshes, the same fold over messages.

Every rank checks its own output against a fold of ``index * stride + rank`` in rank order, and
against the message form and two-shot (the same order, so the same bits), at every world size
1-8 (a pool each), every reducing dtype (from N = 5 float32, int64 and bfloat16:
helpers.matrix_dtypes) and op, counts 0, 1, fewer than the ranks, not divisible,
and over the scratch slot (several rounds: the pools run with ``LAB_SHM_SCRATCH_BYTES=4096``).
Failures name the rank: another size, op or algorithm, a stopped rank, a killed one; on the
compiled path (tests/test_one_shot_compiled.py) and the Python one alike.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import matrix_dtypes, pool, slow_from_five
from test_two_shot import OPS, SLOT_BYTES, expected, pattern, same_bits, takes

import lab
from lab.ops import REDUCE_DTYPES


@pytest.fixture(scope="module", params=slow_from_five(range(1, 9)), ids=lambda n: f"N{n}")
def cluster(request):
    with pool(request.param, "shm", env={"LAB_SHM_SCRATCH_BYTES": str(SLOT_BYTES)}) as running:
        yield running


def counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 1), 2 * n + 1, 3 * SLOT_BYTES // 2 + 7})  # the last: 2-6 rounds


def exact_everywhere(mesh: lab.Mesh) -> list[str]:
    """Every dtype, op and count: the shm path (root mesh) against the formula, the message form
    (a sub-mesh of every rank) and two-shot, bit for bit."""
    everyone = mesh.split(color=0)
    n, wrong = mesh.world_size, []
    assert n == 1 or mesh.exchange.scratch is not None
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in counts(n):
            for op in OPS:
                if not takes(op, dtype):
                    continue
                x = pattern(count, mesh.rank, dtype.torch_dtype)
                got = lab.allreduce(mesh, x.clone(), op=op, algorithm="one_shot")
                sent = lab.allreduce(everyone, x.clone(), op=op, algorithm="one_shot")
                two = lab.allreduce(mesh, x.clone(), op=op, algorithm="two_shot")
                want = expected(op, count, n, dtype.torch_dtype)
                exact = same_bits(got, want) if op != "avg" else torch.allclose(
                    got.double(), want, rtol=(n + 1) * torch.finfo(dtype.torch_dtype).eps, atol=0)
                if not (exact and same_bits(got, sent) and same_bits(got, two)):
                    wrong.append(
                        f"rank {mesh.rank} {name}[{count}] {op}: formula {'ok' if exact else 'WRONG'}, "
                        f"messages {'same' if same_bits(got, sent) else 'DIFFER'}, two-shot "
                        f"{'same' if same_bits(got, two) else 'DIFFERS'}; got {got[-4:].tolist()} "
                        f"want {want[-4:].tolist()}")
    return wrong


def test_exact_on_every_rank_for_every_dtype_op_and_count(cluster):
    assert cluster.run(exact_everywhere) == [[]] * cluster.world_size


def random_floats(mesh: lab.Mesh, count: int, registered: bool) -> bytes:
    data = torch.from_numpy(np.random.default_rng([11, mesh.rank]).normal(size=count).astype(np.float32))
    x = lab.empty(mesh, (count,)) if registered else torch.empty(count)
    x.copy_(data)
    assert lab.allreduce(mesh, x, algorithm="one_shot") is x
    return x.numpy().tobytes()


@pytest.mark.parametrize("registered", [False, True], ids=["copied", "registered"])
def test_random_floats_give_the_same_bits_on_every_rank(cluster, registered):
    outputs = cluster.run(random_floats, 3 * SLOT_BYTES + 5, registered)
    assert len(set(outputs)) == 1
    assert outputs[0] == cluster.run(random_floats, 3 * SLOT_BYTES + 5, not registered)[0]


def large(mesh: lab.Mesh, count: int) -> bytes:
    x = torch.arange(count, dtype=torch.float64) * 3 + mesh.rank
    lab.allreduce(mesh, x, algorithm="one_shot")
    if not torch.equal(
            x,
            torch.arange(count, dtype=torch.float64) * 3 * mesh.world_size + sum(range(mesh.world_size))):
        return f"rank {mesh.rank}: wrong"
    return x.numpy().tobytes()


def test_a_large_tensor_in_many_rounds(cluster):
    """128 Ki + 5 float64 (1 MB: 257 rounds of the pools' 4 KiB slot, past any byte-wide count, the
    last one short), exact and the same on every rank."""
    outputs = cluster.run(large, (1 << 17) + 5)
    assert len(set(outputs)) == 1 and not outputs[0].startswith(b"rank")


def counted(mesh: lab.Mesh, count: int) -> dict:
    mesh.reset_stats()
    lab.allreduce(mesh, torch.ones(count), algorithm="one_shot")
    return mesh.stats()


def test_the_counters_show_what_the_message_form_moves(cluster):
    """(N-1)·T each way, N-1 messages: the docstring's bytes_sent, on shm as on the message form."""
    n = cluster.world_size
    for stats in cluster.run(counted, 1001):
        assert stats["bytes_sent"] == stats["bytes_received"] == (n - 1) * 4004
        assert stats["messages_sent"] == stats["messages_received"] == n - 1


def other_transports(mesh: lab.Mesh) -> bytes:
    x = torch.from_numpy(np.random.default_rng([5, mesh.rank]).normal(size=1001).astype(np.float32))
    lab.allreduce(mesh, x, algorithm="one_shot")
    return x.numpy().tobytes()


def test_the_message_form_on_other_transports_gives_the_shm_bits():
    shm = lab.spawn(other_transports, 3, transport="shm")
    assert len(set(shm)) == 1
    for transport in ("queue", "tcp"):
        assert lab.spawn(other_transports, 3, transport=transport) == shm, transport


def misnamed(mesh: lab.Mesh) -> str:
    try:
        lab.allreduce(mesh, torch.ones(2), algorithm="one-shot")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_misspelt_algorithm_is_an_error_listing_one_shot():
    for message in lab.spawn(misnamed, 2):
        assert message.startswith("algorithm must be one of") and "'one_shot'" in message, message


#: Elements of float32 that one-shot runs compiled (20 KB: kernels.one_shot) and in Python (100 KB,
#: over LAB_COMPILED_MAX_BYTES: lab.transport.peer_memory).
PATHS = {"compiled": 5000, "python": 25_000}


def mismatched(mesh: lab.Mesh, what: str, count: int) -> str:
    odd = mesh.rank == 2
    try:
        if what == "size":
            lab.allreduce(mesh, torch.ones(count if odd else count * 4 // 5), algorithm="one_shot")
        elif what == "op":
            lab.allreduce(mesh, torch.ones(count), op="max" if odd else "sum", algorithm="one_shot")
        elif what == "two_shot":  # both wait in the shared memory: the headers disagree
            lab.allreduce(mesh, torch.ones(count), algorithm="two_shot" if odd else "one_shot")
        else:  # rank 2 waits in the ring, the others in the shared memory
            lab.allreduce(mesh, torch.ones(count), algorithm="ring" if odd else "one_shot")
    except lab.CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    except lab.LabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("what", ["size", "op", "two_shot", "ring"])
def test_a_rank_in_another_collective_is_a_mismatch_naming_it(what, path):
    # The deadline only bounds a rank that starts late on a loaded machine: the mismatch is seen at once.
    outputs = lab.spawn(mismatched, 3, args=(what, PATHS[path]), recv_timeout_ms=30_000)
    mismatches = [message for message in outputs if message.startswith("mismatch")]
    assert len(mismatches) == 3, outputs
    for message in outputs:
        assert "rank 2" in message and (" sent " in message or message.startswith("DeadlineError")), outputs


def stalled(mesh: lab.Mesh, how: str, count: int, out: str) -> str:
    lab.allreduce(mesh, torch.ones(10), algorithm="one_shot")  # one round through, then rank 1 stops
    if mesh.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.5)  # silent past the others' deadline (1 s), then gone quietly
        return "slept"
    start = time.monotonic()
    try:
        lab.allreduce(mesh, torch.ones(count), algorithm="one_shot")
        message = "no error"
    except (lab.DeadlineError, lab.PeerLostError) as exc:
        message = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    with open(os.path.join(out, f"rank{mesh.rank}"), "w") as file:  # the pool may fail on rank 1's death
        file.write(message)
    return message


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_silent_or_dead_peer_is_named(how, path, tmp_path):
    deadline_ms = 1000 if how == "stopped" else 60_000  # a death is seen at once, not at the deadline
    fds = len(os.listdir("/proc/self/fd"))
    with lab.launch(3, recv_timeout_ms=deadline_ms) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(stalled, how, PATHS[path], str(tmp_path))
        else:
            cluster.run(stalled, how, PATHS[path], str(tmp_path))
    for rank in (0, 2):
        message = (tmp_path / f"rank{rank}").read_text()
        expected_error = "DeadlineError" if how == "stopped" else "PeerLostError"
        assert message.startswith(expected_error) and "rank 1" in message, message
        assert float(message.split(" after ")[1].split(" s")[0]) < 30, message  # the deadline or the death
    assert len(os.listdir("/proc/self/fd")) == fds  # no memfd or pipe left open here
