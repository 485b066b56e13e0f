"""lab.symm_mem: buffers every rank maps, signals between ranks, and the out-of-place one-shot.

Every rank checks its own view of every peer's buffer (inputs ``index * STRIDE + rank``), data a
peer wrote into its buffer before a signal, its signal pad's counters, and
``one_shot_all_reduce``'s output against the formula and against ``lab.allreduce`` with
``algorithm="one_shot"`` bit for bit, at every world size 1-8 (every reducing dtype at N = 1-4,
float32, int64 and bfloat16 from 5: helpers.matrix_dtypes). Faults: a silent peer and a dead
one are named; ranks that rendezvous with different tensors get a mismatch naming the rank; bad
arguments are errors naming the parameter, raised before any communication.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from helpers import matrix_dtypes, pool, slow_from_five, wait_until
from test_two_shot import OPS, SLOT_BYTES, expected, pattern, same_bits, takes

import lab
from lab.ops import REDUCE_DTYPES


@pytest.fixture(scope="module", params=slow_from_five(range(1, 9)), ids=lambda n: f"N{n}")
def cluster(request):
    with pool(request.param, "shm", env={"LAB_SHM_SCRATCH_BYTES": str(SLOT_BYTES)}) as running:
        yield running


def views_and_signals(mesh: lab.Mesh) -> list[str]:
    """Each rank sees every peer's buffer; a rank's writes into a peer's buffer before put_signal
    are there after that peer's wait_signal; the pads count what went through."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    buf = lab.symm_mem.empty(mesh, (3, 5), torch.float64)
    buf.copy_(pattern(15, rank, torch.float64).view(3, 5))
    handle = lab.symm_mem.rendezvous(buf, mesh)
    if (handle.rank, handle.world_size, handle.buffer_size) != (rank, n, 15 * 8):
        wrong.append(f"rank {rank}: handle says {handle.rank}, {handle.world_size}, {handle.buffer_size}")
    handle.barrier()
    for peer in range(n):
        seen = handle.get_buffer(peer, (15,), torch.float64)
        if not torch.equal(seen, pattern(15, peer, torch.float64)):
            wrong.append(f"rank {rank}: rank {peer}'s buffer reads {seen[:4].tolist()}")
        tail = handle.get_buffer(peer, (2,), torch.float64, storage_offset=13)
        if tail.tolist() != pattern(15, peer, torch.float64)[13:].tolist():
            wrong.append(f"rank {rank}: rank {peer}'s buffer from element 13 reads {tail.tolist()}")
    if handle.get_buffer(rank, (15,), torch.float64).data_ptr() != buf.data_ptr():
        wrong.append(f"rank {rank}: its own get_buffer is not its tensor")
    handle.barrier(channel=3)  # every rank has read every buffer
    # A second buffer, rounds of a ring on channel 1: write into the next rank's, signal it, check ours.
    ring = lab.symm_mem.empty(mesh, (3, 8), torch.float64)
    ring.fill_(-1)
    ring_handle = lab.symm_mem.rendezvous(ring, mesh)
    ring_handle.barrier()
    after, before = (rank + 1) % n, (rank - 1) % n
    for round_ in range(3):
        ring_handle.get_buffer(after, (3, 8), torch.float64)[round_, rank] = 1000 * round_ + rank
        ring_handle.put_signal(after, channel=1)
        ring_handle.wait_signal(before, channel=1)
        if ring[round_, before] != 1000 * round_ + before:
            wrong.append(f"rank {rank} round {round_}: rank {before} wrote {ring[round_, before]}")
    pad = ring_handle.get_signal_pad(rank)
    if pad[0, 1].tolist() != [3 if p == before else 0
                              for p in range(n)] or pad[1, 1].tolist() != pad[0, 1].tolist():
        wrong.append(f"rank {rank}: channel 1's pad {pad[:, 1].tolist()}")
    counts = handle.get_signal_pad(rank)[0].sum(0).tolist()  # two barriers: one signal from each peer on each
    if counts != [0 if p == rank else 2 for p in range(n)]:
        wrong.append(f"rank {rank}: the first pad counts {counts}")
    return wrong


def test_every_rank_sees_every_peers_buffer_and_signals_carry_writes(cluster):
    assert cluster.run(views_and_signals) == [[]] * cluster.world_size


def out_of_place(mesh: lab.Mesh) -> list[str]:
    """one_shot_all_reduce on symm_mem, lab.empty and ordinary tensors, every dtype, op and count:
    the formula, the in-place call's bits, the input untouched; repeated with the input rewritten
    right after each call (the end wait keeps the peers' reads safe)."""
    n, wrong = mesh.world_size, []
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in sorted({0, 1, max(n - 1, 1), 2 * n + 1, 3 * SLOT_BYTES // 2 + 7}):
            for where in ("symm_mem", "lab.empty", "torch"):
                make = {
                    "symm_mem": lab.symm_mem.empty, "lab.empty": lab.empty,
                    "torch": lambda _, shape, dtype: torch.empty(shape, dtype=dtype)}[where]
                x = make(mesh, (count,), dtype.torch_dtype)
                for op in OPS:
                    if not takes(op, dtype):
                        continue
                    x.copy_(pattern(count, mesh.rank, dtype.torch_dtype))
                    got = lab.symm_mem.one_shot_all_reduce(x, op, mesh)
                    in_place = lab.allreduce(mesh, x.clone(), op=op, algorithm="one_shot")
                    untouched = same_bits(x, pattern(count, mesh.rank, dtype.torch_dtype))
                    x.fill_(0)  # at once: no peer may still read it
                    want = expected(op, count, n, dtype.torch_dtype)
                    exact = same_bits(got, want) if op != "avg" else torch.allclose(
                        got.double(), want, rtol=(n + 1) * torch.finfo(dtype.torch_dtype).eps, atol=0)
                    if not (exact and same_bits(got, in_place) and untouched):
                        wrong.append(
                            f"rank {mesh.rank} {name}[{count}] {op} {where}: formula "
                            f"{'ok' if exact else 'WRONG'}, in place {same_bits(got, in_place)}, "
                            f"input untouched {untouched}; got {got[-3:].tolist()} want {want[-3:].tolist()}")
    return wrong


def test_one_shot_all_reduce_out_of_place_is_exact_everywhere(cluster):
    assert cluster.run(out_of_place) == [[]] * cluster.world_size


def out_variants(mesh: lab.Mesh) -> list[bool]:
    x = lab.symm_mem.empty(mesh, (6,), torch.int64)
    x.copy_(pattern(6, mesh.rank, torch.int64))
    out = torch.full((6,), -1, dtype=torch.int64)
    returned = lab.symm_mem.one_shot_all_reduce_out(x, "max", mesh, out)
    same = lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, x)  # in place
    return [
        returned is out,
        torch.equal(out, pattern(6, mesh.world_size - 1, torch.int64)), same is x,
        torch.equal(x, expected("sum", 6, mesh.world_size, torch.int64))]


def test_one_shot_all_reduce_out_writes_out_or_in_place(cluster):
    assert cluster.run(out_variants) == [[True] * 4] * cluster.world_size


def again_and_again(mesh: lab.Mesh) -> list[str]:
    """one_shot_all_reduce_out on the same registered input again and again (from its second call
    it takes the lane the first made): each call reduces the input as it is then; what the lane
    does not check is still refused or sent the full way on every call (out overlapping the input,
    out not contiguous, in place, an input outside the arena); the buffers return to the arena."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    y = lab.symm_mem.empty(mesh, (10,), torch.float32)
    x, out = y[:5], torch.empty(5)
    for i in range(4):
        x.copy_(pattern(5, rank, torch.float32) + i)
        lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, out)
        if not same_bits(out, expected("sum", 5, n, torch.float32) + n * i):
            wrong.append(f"rank {rank} call {i}: {out.tolist()}")
    # Each twice: the first call's checks remember out's memory as writable, so the second comes
    # as far as the lane's own.
    for name, (bad_out, error) in [("overlapping", (y[2:7], "overlaps")),
                                   ("strided", (torch.empty(10)[::2], "contiguous"))] * 2:
        try:
            lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, bad_out)
            wrong.append(f"rank {rank}: out {name}: no error")
        except ValueError as exc:
            if error not in str(exc):
                wrong.append(f"rank {rank}: out {name}: {exc}")
    plain = pattern(5, rank, torch.float32)
    for name, tensor, target in (("in place", x, x), ("an ordinary input", plain, out)):
        x.copy_(pattern(5, rank, torch.float32))
        got = lab.symm_mem.one_shot_all_reduce_out(tensor, "sum", mesh, target)
        if not same_bits(got, expected("sum", 5, n, torch.float32)):
            wrong.append(f"rank {rank} {name}: {got.tolist()}")
    scratch = mesh.exchange.scratch
    del x, y
    # Every block returns: at once, or moments later where an asynchronous call just completed
    # (an earlier test's): the communication thread (a ThreadPoolExecutor) drops its work item, and
    # the tensors in it, after it sets the Work's Future. A block still held after 30 s is a leak.
    try:
        wait_until(lambda: scratch is None or not scratch.in_use(), "every block back in the arena", 30)
    except TimeoutError:
        wrong.append(f"rank {rank}: the arena still holds {scratch.in_use()}")
    return wrong


def behind_another_threads_call(mesh: lab.Mesh) -> list[str]:
    """Another thread's asynchronous allreduce of the registered input, still in flight (the other
    ranks join it late), then the same one-shot as before from this thread: from its lane too, it
    runs in issue order, so it reduces the summed input."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    x, out = lab.symm_mem.empty(mesh, (5,), torch.float32), torch.empty(5)
    for _ in range(2):  # (the second call takes the lane the first made)
        x.copy_(pattern(5, rank, torch.float32))
        lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, out)
    x.copy_(pattern(5, rank, torch.float32))
    works = []
    if rank:
        time.sleep(0.05)
    thread = threading.Thread(target=lambda: works.append(lab.allreduce(mesh, x, async_op=True)))
    thread.start()
    thread.join()  # (issued: its Work returned)
    lab.symm_mem.one_shot_all_reduce_out(x, "sum", mesh, out)
    works[0].wait()
    if not same_bits(out, n * expected("sum", 5, n, torch.float32)):
        wrong.append(f"rank {rank}: {out.tolist()}, not n times the sum")
    return wrong


def test_a_call_behind_another_threads_async_allreduce_of_its_input_reads_the_sum(cluster):
    assert cluster.run(behind_another_threads_call) == [[]] * cluster.world_size


def test_the_same_registered_call_again_and_again(cluster):
    assert cluster.run(again_and_again) == [[]] * cluster.world_size


def other_transport(mesh: lab.Mesh) -> tuple[str, bytes]:
    try:
        lab.symm_mem.empty(mesh, (4,))
        refused = "no error"
    except lab.LabError as exc:
        refused = str(exc)
    x = torch.randn(1001, generator=torch.Generator().manual_seed(mesh.rank))
    return refused, lab.symm_mem.one_shot_all_reduce(x, "sum", mesh).numpy().tobytes()


def test_other_transports_refuse_the_buffer_and_run_the_message_form():
    shm = lab.spawn(other_transport, 3)
    assert {refused for refused, _ in shm} == {"no error"}
    for transport in ("queue", "tcp"):
        outputs = lab.spawn(other_transport, 3, transport=transport)
        for refused, data in outputs:
            assert "needs memory every rank maps" in refused and transport in refused, refused
            assert data == shm[0][1]  # the same bits as the shared memory's


def mismatched_rendezvous(mesh: lab.Mesh) -> str:
    shape = (5,) if mesh.rank == 1 else (4,)
    try:
        lab.symm_mem.rendezvous(lab.symm_mem.empty(mesh, shape), mesh)
    except lab.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_rendezvous_with_different_tensors_are_told_which():
    for message in lab.spawn(mismatched_rendezvous, 3):
        assert "rank 1 with a (5,) float32" in message or "rank 1 called" in message, message


def silent_or_dead(mesh: lab.Mesh, how: str, out: str) -> str:
    handle = lab.symm_mem.rendezvous(lab.symm_mem.empty(mesh, (4,)), mesh)
    handle.barrier()
    if mesh.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.5)
        return "slept"
    start = time.monotonic()
    try:
        if mesh.rank == 0:
            handle.wait_signal(1, timeout_ms=1000 if how == "stopped" else 0)  # no signal ever comes
        else:
            handle.put_signal(1)  # the first goes through (nothing outstanding) ...
            handle.put_signal(1,
                              timeout_ms=1000 if how == "stopped" else 0)  # ... the second waits for rank 1
        message = "no error"
    except (lab.DeadlineError, lab.PeerLostError) as exc:
        message = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    with open(os.path.join(out, f"rank{mesh.rank}"), "w") as file:
        file.write(message)
    return message


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_silent_or_dead_peer_is_named_by_a_signal_wait(how, tmp_path):
    fds = len(os.listdir("/proc/self/fd"))
    with lab.launch(3, recv_timeout_ms=60_000) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(silent_or_dead, how, str(tmp_path))
        else:
            cluster.run(silent_or_dead, how, str(tmp_path))
    for rank in (0, 2):
        message = (tmp_path / f"rank{rank}").read_text()
        assert message.startswith("DeadlineError" if how == "stopped" else "PeerLostError"), message
        assert "rank 1" in message and float(message.split(" after ")[1].split(" s")[0]) < 30, message
    assert len(os.listdir("/proc/self/fd")) == fds


def bad_arguments(mesh: lab.Mesh) -> list[str]:
    handle = lab.symm_mem.rendezvous(lab.symm_mem.empty(mesh, (4,)), mesh)
    calls = {
        "shape": lambda: lab.symm_mem.empty(mesh, (-1,)),
        "dtype": lambda: lab.symm_mem.empty(mesh, (4,), "float32"),
        "dst_rank": lambda: handle.put_signal(mesh.world_size), "src_rank": lambda: handle.wait_signal(-1),
        "channel": lambda: handle.put_signal(0, channel=lab.symm_mem.CHANNELS),
        "timeout_ms": lambda: handle.wait_signal(0, timeout_ms=-5),
        "sizes": lambda: handle.get_buffer(0, (5,), torch.float32),
        "storage_offset": lambda: handle.get_buffer(0, (1,), torch.float32, storage_offset=-1),
        "rank": lambda: handle.get_buffer(mesh.world_size, (1,), torch.float32),
        "lab.symm_mem.empty": lambda: lab.symm_mem.rendezvous(torch.zeros(4), mesh),
        "out": lambda: lab.symm_mem.one_shot_all_reduce_out(torch.zeros(4), "sum", mesh, torch.zeros(5)),
        "op": lambda: lab.symm_mem.one_shot_all_reduce(torch.zeros(4), "median", mesh),
        "tensor": lambda: lab.symm_mem.one_shot_all_reduce([1.0, 2.0], "sum", mesh)}
    missing = []
    for name, call in calls.items():
        try:
            call()
            missing.append(f"{name}: no error")
        except (ValueError, TypeError) as exc:
            if name not in str(exc):
                missing.append(f"{name}: {exc}")
    # Nothing above communicated: the mesh still works, in step.
    if not torch.equal(lab.allreduce(mesh, torch.ones(3), algorithm="one_shot"),
                       torch.full((3,), float(mesh.world_size))):
        missing.append("the mesh is out of step")
    mesh.close()
    try:
        handle.put_signal(0)
        missing.append("closed: no error")
    except lab.LabError as exc:
        if "closed" not in str(exc):
            missing.append(f"closed: {exc}")
    return missing


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_arguments_name_the_parameter(world_size):
    assert lab.spawn(bad_arguments, world_size) == [[]] * world_size
