"""A message that a call left unread is an error, at the next collective or at the end (issue 40, item 7).

Ranks that disagree on a rooted collective's root may each only send, and return: nothing they
received tells them. The message each left unread must surface as a ``CollectiveMismatchError``
naming the call that sent it: at the next collective, in whichever medium it waits (on shm a
small call's in a mailbox, a large one's on the pipes), and, where the disagreement was the
program's last call, at the end of the pool's run, at ``mesh.close()`` and at torch's
``destroy_process_group()``. A message of another live mesh waiting aside is no such message.

The disagreements below are those that return without an error on every rank: broadcast and
scatter with rank 0 its own root and the others rank 1's (every "root" only sends), reduce and
gather with each rank naming the next one (every rank only sends to its "root").
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import enter_together, rooted, wait_until

import lab
from lab.launch.forkserver import start_context

STRIDE = 3
TRANSPORTS = ("shm", "tcp", "queue")
#: Small enough for the compiled path on shm (its mailboxes), and large enough for the pipes (256 KB).
COUNTS = (8, 65536)
#: (collective, how the ranks name its root) that return everywhere without an error.
SILENT = (("broadcast", "split"), ("scatter", "split"), ("reduce", "cycle"), ("gather", "cycle"))
WORLD_SIZES = (2, pytest.param(3, marks=pytest.mark.slow))  # (3: CI, not the fast loop)


def pattern(count: int, rank: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) * STRIDE + rank


def root_of(mesh: lab.Mesh, how: str) -> int:
    """``split``: rank 0 names itself, the others rank 1; ``cycle``: each rank the next one."""
    if how == "split":
        return 0 if mesh.rank == 0 else 1
    return (mesh.rank + 1) % mesh.world_size


def disagree(mesh: lab.Mesh, collective: str, count: int, how: str, then: int) -> None:
    """The disagreement, then (``then`` > 0) an allreduce of ``then`` elements, then return."""
    rooted(mesh, collective, pattern(count, mesh.rank), root_of(mesh, how))
    if then:
        lab.allreduce(mesh, pattern(then, mesh.rank))


def raised(world_size: int, transport: str, *args) -> lab.RankError:
    with pytest.raises(lab.RankError) as info:
        lab.spawn(disagree, world_size, args=args, transport=transport, recv_timeout_ms=5_000)
    return info.value


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_disagreement_in_the_last_call_is_raised_at_the_end_of_the_run(transport, world_size):
    for count in COUNTS:
        for collective, how in SILENT:
            error = raised(world_size, transport, collective, count, how, 0)
            case = (collective, count, str(error))
            assert error.exc_type == "CollectiveMismatchError", case
            assert "with a message it never received" in error.exc_message, case
            assert f"{collective} #1 float32[{count}]" in error.exc_message, case


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_next_collective_finds_it_in_either_medium(transport, world_size):
    # On shm the small call's message waits in a mailbox, where the large allreduce's pipes never
    # look, and the large call's on a pipe, which the small allreduce's compiled call never reads.
    for count, then in zip(COUNTS, reversed(COUNTS)):
        for collective, how in SILENT:
            error = raised(world_size, transport, collective, count, how, then)
            case = (collective, count, str(error))
            assert error.exc_type == "CollectiveMismatchError", case
            assert f"is in allreduce #2 float32[{then}]" in str(error), case  # (some rank, at the call)
            assert f"{collective} #1 float32[{count}]" in str(error), case


# -- close ------------------------------------------------------------------------------------


def in_step(mesh: lab.Mesh, flags: str | None = None) -> None:
    """Ranks 0 and 1 each send the other a point-to-point token, then receive the other's: each
    then has every message the other sent before (a close with unread data must not cut the
    other's receive short: on tcp it resets the connection). With ``flags`` (a folder), each
    receives only once both tokens are sent: a receive that waits looks for unread collectives and
    would find the one the test leaves for the close (a loaded machine delays the token)."""
    peer = 1 - mesh.rank
    mesh.send(peer, pattern(1, mesh.rank), tag=7)
    if flags is not None:
        enter_together(mesh, flags)
    mesh.recv(peer, tag=7)


def closed(mesh: lab.Mesh) -> str:
    try:
        mesh.close()
    except lab.LabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "closed"


def close_after_a_disagreement(mesh: lab.Mesh, count: int, flags: str) -> str:
    """A broadcast whose root each rank takes for itself (each only sends), then close."""
    lab.broadcast(mesh, pattern(count, mesh.rank), src=mesh.rank)
    in_step(mesh, flags)
    return closed(mesh)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_raises_for_a_message_never_received(transport, tmp_path):
    for count in COUNTS:
        (flags := tmp_path / str(count)).mkdir()
        outputs = lab.spawn(close_after_a_disagreement, 2, args=(count, str(flags)), transport=transport)
        for rank, got in enumerate(outputs):
            assert got.startswith(f"CollectiveMismatchError: rank {rank} closed the mesh with a message it "
                                  f"never received: rank {1 - rank} sent broadcast #1 float32[{count}] "
                                  f"root={1 - rank}"), (count, got)


def point_to_point_never_received(mesh: lab.Mesh) -> str:
    if mesh.rank == 0:
        mesh.send(1, pattern(4, 0), tag=5)
    in_step(mesh)
    return closed(mesh)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_raises_for_a_point_to_point_message_never_received(transport):
    assert lab.spawn(point_to_point_never_received, 2, transport=transport) == [
        "closed", "LabError: rank 1 closed the mesh with a message it never received: rank 0 sent "
        "point-to-point message #1 of tag 5"]


def destroy_rank(rank: int, init: str, output: str) -> None:
    """One torch rank of the lab backend, in a process forked from lab's forkserver (torch and lab
    imported): a broadcast each rank roots itself, then ``destroy_process_group``; what it raised
    goes to the file ``output``."""
    dist.init_process_group("lab", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    dist.broadcast(torch.arange(8.0) + rank, src=rank)  # every rank its own root: each only sends
    dist.send(torch.zeros(1), 1 - rank, tag=7)  # each then has every message the other sent before
    sent = [Path(output).parent / f"sent{r}" for r in range(2)]  # (received once both are sent: see in_step)
    sent[rank].touch()
    wait_until(lambda: all(path.exists() for path in sent), "both tokens sent")
    dist.recv(torch.zeros(1), 1 - rank, tag=7)
    try:
        dist.destroy_process_group()
        result = "no error"
    except lab.LabError as exc:
        result = f"{type(exc).__name__}: {exc}"
    with open(output, "w") as file:
        file.write(result)


@pytest.mark.slow  # two torch processes
def test_destroy_process_group_raises_for_a_message_never_received(tmp_path):
    init, context = f"file://{tmp_path / 'store'}", start_context()
    processes = [
        context.Process(target=destroy_rank, args=(rank, init, str(tmp_path / f"result{rank}")),
                        name=f"torch-rank-{rank}") for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(300)
        if process.exitcode is None:
            process.kill()
            process.join()
    results = [(tmp_path / f"result{rank}").read_text() if
               (tmp_path / f"result{rank}").exists() else f"exit {process.exitcode}"
               for rank, process in enumerate(processes)]
    for rank, result in enumerate(results):
        assert result.startswith(f"CollectiveMismatchError: rank {rank} closed the mesh with a message it "
                                 f"never received: rank {1 - rank} sent broadcast #1 float32[8] "
                                 f"root={1 - rank}"), results


# -- another mesh's messages wait aside; this mesh's earlier ones are strays ---------------------


def disagreement_on_a_sub_mesh(mesh: lab.Mesh, count: int) -> list[str]:
    """A broadcast on a sub-mesh of every rank whose root each rank takes for itself, then
    allreduces on the root mesh (each meets the sub-mesh's message first on its channel, and holds
    it aside), then the sub-mesh's next collective, which finds that message: what each call gave."""
    sub = mesh.split(color=0)
    lab.broadcast(sub, pattern(count, sub.rank), src=sub.rank)
    seen = []
    try:
        for size in COUNTS:
            x = pattern(size, mesh.rank)
            lab.allreduce(mesh, x)
            right = torch.equal(x, sum(pattern(size, r) for r in range(mesh.world_size)))
            seen.append("right" if right else f"allreduce of {size}: WRONG")
        lab.barrier(sub)
        seen.append("barrier passed")
    except lab.CollectiveMismatchError as exc:  # (found here, or told by the rank that found it)
        seen.append(str(exc))
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sub_meshs_unread_message_waits_aside_until_that_sub_mesh_looks(transport):
    for count in COUNTS:
        outputs = lab.spawn(disagreement_on_a_sub_mesh, 2, args=(count,), transport=transport)
        for rank, seen in enumerate(outputs):
            *allreduces, error = seen
            case = (count, rank, seen)
            assert all(got == "right" for got in allreduces), case
            assert "is in allreduce" not in error and "is in barrier #2" in error, case
            assert f"sent broadcast #1 float32[{count}]" in error and "on sub-mesh" in error, case
