"""Two-shot allreduce (lab.algorithms.allreduce_two_shot): on shm it reads the peers' memory in
place (lab.transport.peer_memory); elsewhere, and on sub-meshes, the same schedule over messages.

Every rank checks its own output against a fold of ``index * stride + rank`` in rank order (the
order the owner reduces in), at every world size 1-8 (a pool each), every reducing dtype (from N = 5
float32, int64 and bfloat16: helpers.matrix_dtypes) and op,
counts 0, 1, fewer than the ranks, not divisible, and over the scratch slot (several rounds:
the pools run with ``LAB_SHM_SCRATCH_BYTES=4096``). ``lab.empty`` tensors go in and come out.
Failures name the rank: another size or op, a stopped rank, a killed one.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import enter_together, matrix_dtypes, pool, slow_from_five

import lab
from lab.ops import REDUCE_DTYPES

STRIDE = 3
SLOT_BYTES = 4096  # the pools' two-shot slot: a few thousand elements take several rounds
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
TORCH_OPS = {
    "sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum,
    "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


@pytest.fixture(scope="module", params=slow_from_five(range(1, 9)), ids=lambda n: f"N{n}")
def cluster(request):
    with pool(request.param, "shm", env={"LAB_SHM_SCRATCH_BYTES": str(SLOT_BYTES)}) as running:
        yield running


def pattern(count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * STRIDE + rank).to(dtype)


def takes(op: str, dtype) -> bool:
    if op == "avg":
        return dtype.is_floating
    return op not in ("band", "bor", "bxor") or dtype.name in ("int32", "int64")


def expected(op: str, count: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The owner's fold in rank order 0..N-1, in the dtype (torch rounds half types per step, as the kernels)."""
    if op == "avg":  # checked against the message schedule and within rounding, not bit for bit
        return sum(pattern(count, r, torch.float64) for r in range(n)) / n
    return functools.reduce(TORCH_OPS[op], (pattern(count, r, dtype) for r in range(n)))


def counts(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 1), 2 * n + 1, 3 * SLOT_BYTES // 2 + 7})  # the last: 2-4 rounds


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes() if \
        a.dtype not in (torch.float16, torch.bfloat16) else torch.equal(a.view(torch.int16), b.view(torch.int16))


def exact_everywhere(mesh: lab.Mesh) -> list[str]:
    """Every dtype, op and count: the shm path (root mesh) against the formula and against the
    message schedule (a sub-mesh of every rank), bit for bit."""
    everyone = mesh.split(color=0)
    n, wrong = mesh.world_size, []
    assert n == 1 or mesh.exchange.scratch is not None
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in counts(n):
            for op in OPS:
                if not takes(op, dtype):
                    continue
                x = pattern(count, mesh.rank, dtype.torch_dtype)
                got = lab.allreduce(mesh, x.clone(), op=op, algorithm="two_shot")
                sent = lab.allreduce(everyone, x.clone(), op=op, algorithm="two_shot")
                want = expected(op, count, n, dtype.torch_dtype)
                # avg: one rounding per contribution and per step, each within the dtype's epsilon
                exact = same_bits(got, want) if op != "avg" else torch.allclose(
                    got.double(), want, rtol=(n + 1) * torch.finfo(dtype.torch_dtype).eps, atol=0)
                if not (exact and same_bits(got, sent)):
                    wrong.append(
                        f"rank {mesh.rank} {name}[{count}] {op}: formula {'ok' if exact else 'WRONG'}, "
                        f"messages {'same' if same_bits(got, sent) else 'DIFFER'}; got {got[-4:].tolist()} "
                        f"want {want[-4:].tolist()} messages {sent[-4:].tolist()}")
    return wrong


def test_exact_on_every_rank_for_every_dtype_op_and_count(cluster):
    assert cluster.run(exact_everywhere) == [[]] * cluster.world_size


def random_floats(mesh: lab.Mesh, count: int, registered: bool) -> bytes:
    data = torch.from_numpy(np.random.default_rng([11, mesh.rank]).normal(size=count).astype(np.float32))
    x = lab.empty(mesh, (count,)) if registered else torch.empty(count)
    x.copy_(data)
    lab.allreduce(mesh, x, algorithm="two_shot")
    return x.numpy().tobytes()


@pytest.mark.parametrize("registered", [False, True], ids=["copied", "registered"])
def test_random_floats_give_the_same_bits_on_every_rank(cluster, registered):
    outputs = cluster.run(random_floats, 3 * SLOT_BYTES + 5, registered)
    assert len(set(outputs)) == 1
    # and the same bits whether the tensors were registered or not, on any transport
    assert outputs[0] == cluster.run(random_floats, 3 * SLOT_BYTES + 5, not registered)[0]


def registered_in_and_out(mesh: lab.Mesh) -> list[str]:
    """lab.empty tensors (on some ranks only, then on all), several rounds, reused: exact results,
    and the tensors really lie in the mesh's shared memory."""
    n, wrong = mesh.world_size, []
    for count in (0, 5, 3 * SLOT_BYTES // 4 + 1):  # the last: 4 rounds of float32
        for everywhere in (False, True):
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                mine = everywhere or mesh.rank % 2 == 0
                x = lab.empty(mesh, (count,), dtype) if mine else torch.empty(count, dtype=dtype)
                if mine and n > 1 and count and mesh.exchange.scratch.registered_offset(
                        x.view(-1).view(torch.uint8).numpy()) < 0:
                    wrong.append(f"rank {mesh.rank}: lab.empty's tensor is not in the scratch")
                for repeat in range(2):
                    x.copy_(pattern(count, mesh.rank + repeat, dtype))
                    got = lab.allreduce(mesh, x, algorithm="two_shot")
                    want = functools.reduce(torch.add, (pattern(count, r + repeat, dtype) for r in range(n)))
                    if got is not x or not torch.equal(x, want):
                        wrong.append(f"rank {mesh.rank} {dtype}[{count}] registered={mine} #{repeat}: "
                                     f"{x[:4].tolist()} != {want[:4].tolist()}")
    return wrong


def test_registered_tensors_in_and_out(cluster):
    assert cluster.run(registered_in_and_out) == [[]] * cluster.world_size


def arena(mesh: lab.Mesh) -> str:
    """A full arena is a LabError; freed tensors go back to it."""
    first = lab.empty(mesh, (1024,))
    address = first.data_ptr()
    del first
    again = lab.empty(mesh, (1024,))
    if again.data_ptr() != address:
        return "freed memory not reused"
    try:
        lab.empty(mesh, (mesh.exchange.scratch.arena_bytes,), torch.uint8)
    except lab.LabError as exc:
        return str(exc)
    return "no error"


def test_a_full_arena_is_an_error_and_freed_tensors_return_to_it():
    for message in lab.spawn(arena, 2):
        assert "lab.empty cannot place" in message and "LAB_SHM_REGISTERED_BYTES" in message, message


def after_close(mesh: lab.Mesh) -> list[str]:
    x = lab.empty(mesh, (8,))
    x.copy_(torch.arange(8.0) + mesh.rank)
    lab.allreduce(mesh, x, algorithm="two_shot")
    mesh.close()
    seen = [str(float(x.sum()))]  # still memory: reading it after close is no crash
    for call in (lambda: lab.allreduce(mesh, x, algorithm="two_shot"), lambda: lab.empty(mesh, (8,))):
        try:
            call()
            seen.append("no error")
        except lab.LabError as exc:
            seen.append(type(exc).__name__)
    return seen


def test_a_registered_tensor_after_close_is_an_error_not_a_crash():
    for seen in lab.spawn(after_close, 2):
        assert seen[0] == str(float(sum(2 * torch.arange(8.0) + 1))) and "no error" not in seen[1:], seen


def other_transports(mesh: lab.Mesh) -> bytes:
    x = lab.empty(mesh, (1001,))  # an ordinary tensor where there is no shared scratch
    x.copy_(torch.from_numpy(np.random.default_rng([5, mesh.rank]).normal(size=1001).astype(np.float32)))
    lab.allreduce(mesh, x, algorithm="two_shot")
    return x.numpy().tobytes()


def test_the_message_schedule_on_other_transports_gives_the_shm_bits():
    shm = lab.spawn(other_transports, 3, transport="shm")
    for transport in ("queue", "tcp"):
        assert lab.spawn(other_transports, 3, transport=transport) == shm, transport


def mismatched(mesh: lab.Mesh, what: str) -> str:
    odd = mesh.rank == 2
    try:
        if what == "size":
            lab.allreduce(mesh, torch.ones(5000 if odd else 4000), algorithm="two_shot")
        elif what == "op":
            lab.allreduce(mesh, torch.ones(5000), op="max" if odd else "sum", algorithm="two_shot")
        else:  # another algorithm: rank 2 waits in the ring, the others in the shared memory
            lab.allreduce(mesh, torch.ones(5000), algorithm="ring" if odd else "two_shot")
    except lab.CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    except lab.LabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("what", ["size", "op", "algorithm"])
def test_a_rank_in_another_collective_is_a_mismatch_naming_it(what):
    outputs = lab.spawn(mismatched, 3, args=(what,), recv_timeout_ms=3000)
    mismatches = [message for message in outputs if message.startswith("mismatch")]
    # Another size or op: every rank compares every header. Another algorithm: rank 2's ring
    # message reaches rank 0's pipe, the others' two-shot rounds wait in rank 2's shared memory.
    assert len(mismatches) == 3, outputs
    for message in outputs:
        assert "rank 2" in message and (" sent " in message or message.startswith("DeadlineError")), outputs


def stalled(mesh: lab.Mesh, how: str, out: str) -> str:
    enter_together(mesh, out)  # (the first allreduce, under the 1 s deadline, is not the fault)
    lab.allreduce(mesh, torch.ones(10), algorithm="two_shot")  # one round through, then rank 1 stops
    if mesh.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.5)  # silent past the others' deadline (1 s), then gone quietly
        return "slept"
    start = time.monotonic()
    try:
        lab.allreduce(mesh, torch.ones(3 * SLOT_BYTES), algorithm="two_shot")
        message = "no error"
    except (lab.DeadlineError, lab.PeerLostError) as exc:
        message = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    with open(os.path.join(out, f"rank{mesh.rank}"), "w") as file:  # the pool may fail on rank 1's death
        file.write(message)
    return message


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_silent_or_dead_peer_is_named(how, tmp_path):
    deadline_ms = 1000 if how == "stopped" else 60_000  # a death is seen at once, not at the deadline
    gc.collect()  # (an earlier test's objects, freed during this one, would close their descriptors)
    fds = len(os.listdir("/proc/self/fd"))
    with lab.launch(3, recv_timeout_ms=deadline_ms) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(stalled, how, str(tmp_path))
        else:
            cluster.run(stalled, how, str(tmp_path))
    for rank in (0, 2):
        message = (tmp_path / f"rank{rank}").read_text()
        expected_error = "DeadlineError" if how == "stopped" else "PeerLostError"
        assert message.startswith(expected_error) and "rank 1" in message, message
        assert float(message.split(" after ")[1].split(" s")[0]) < 30, message  # the deadline or the death
    assert len(os.listdir("/proc/self/fd")) == fds  # no memfd or pipe left open here
