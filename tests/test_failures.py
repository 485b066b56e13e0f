"""What a user sees when something goes wrong: clear errors, no hang, nothing left behind."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import pool

import lab
import lab.lesson


def raise_on_rank_two(mesh: lab.Mesh) -> None:
    if mesh.rank == 2:
        raise KeyError("rank two's bad day")
    lab.allreduce(mesh, torch.ones(4))  # the others wait for rank 2, which never comes


def bad_arguments(mesh: lab.Mesh) -> list[tuple[str, str]]:
    """Each bad call on every rank: (exception type, message)."""
    x = torch.ones(4)
    calls = [
        lambda: lab.broadcast(mesh, x, src=mesh.world_size), lambda: lab.broadcast(mesh, x, src=-1),
        lambda: lab.allreduce(mesh, x, op="mean"), lambda: lab.allreduce(mesh, x, algorithm="butterfly"),
        lambda: lab.allreduce(mesh, x.to(torch.complex64)),
        lambda: lab.allreduce(mesh, torch.ones(3, dtype=torch.int32), op="avg"),
        lambda: lab.allreduce(mesh, [1.0, 2.0]), lambda: lab.allreduce(mesh, np.ones(3, np.uint8)),
        lambda: lab.reduce_scatter(mesh, torch.tensor(1.0)),
        lambda: lab.lesson.ring_allreduce(mesh, mesh.rank + 1, mesh.world_size, x),
        lambda: lab.lesson.broadcast(mesh, mesh.rank, mesh.world_size + 1, x, 0),
        lambda: lab.allgather(mesh, torch.empty(3, device="meta")),
        lambda: lab.reduce_scatter(mesh, x, op="median"), lambda: mesh.send(
            (mesh.rank + 1) % mesh.world_size, "not a tensor"), lambda: mesh.recv(
                (mesh.rank + 1) % mesh.world_size, timeout_ms=0),
        lambda: lab.allreduce(mesh, x, algorithm="auto", op=None)]
    seen = []
    for call in calls:
        try:
            call()
            seen.append(("no error", ""))
        except (ValueError, TypeError) as exc:
            seen.append((type(exc).__name__, str(exc)))
    # the mesh is still usable afterwards
    y = torch.arange(3.0) + mesh.rank
    lab.allreduce(mesh, y)
    seen.append(("result", str(y.tolist())))
    return seen


STALL_S = 60  # far past the deadline: the pool ends the stalled rank long before it wakes


def stall(mesh: lab.Mesh) -> None:
    if mesh.rank == 0:
        time.sleep(STALL_S)
    lab.allreduce(mesh, torch.ones(8), algorithm="ring")


def die(mesh: lab.Mesh) -> None:
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    lab.allreduce(mesh, torch.ones(8))


def lesson_api(mesh: lab.Mesh) -> list[list[float]]:
    x = torch.arange(4.0) + mesh.rank
    out = [
        lab.lesson.ring_allreduce(mesh, mesh.rank, mesh.world_size, x.clone()).tolist(),
        lab.lesson.tree_allreduce(mesh, mesh.rank, mesh.world_size, x.clone()).tolist(),
        lab.lesson.broadcast(mesh, mesh.rank, mesh.world_size, x.clone(), 1).tolist(),
        lab.lesson.allgather(mesh, mesh.rank, mesh.world_size, x[:1].clone()).tolist(),
        lab.lesson.reduce_scatter(mesh, mesh.rank, mesh.world_size, x.clone()).tolist()]
    return out


@pytest.fixture(scope="module")
def cluster():
    with pool(3, "shm") as c:
        yield c


def test_a_raising_rank_is_named_with_its_exception_and_traceback():
    started = time.monotonic()
    with pytest.raises(lab.RankError) as info:
        lab.spawn(raise_on_rank_two, 3, recv_timeout_ms=60_000)
    error = info.value
    assert error.rank == 2 and error.exc_type == "KeyError" and "bad day" in error.exc_message
    assert "raise_on_rank_two" in error.remote_traceback
    assert "rank 2 failed: KeyError" in str(error)
    # the waiting ranks are ended when rank 2 fails, not when their deadline passes
    assert "DeadlineError" not in error.others and time.monotonic() - started < 60, "the waiting ranks hung"


def test_bad_arguments_raise_before_communication_and_leave_the_mesh_usable(cluster):
    for per_rank in cluster.run(bad_arguments):
        *errors, result = per_rank
        names = [
            "src", "src", "op", "algorithm", "complex64", "avg", "tensor", "uint8", "0-d", "rank",
            "world_size", "CPU", "op", "tensor", "timeout_ms", "op"]
        assert len(errors) == len(names)
        for (kind, message), name in zip(errors, names):
            assert kind in ("ValueError", "TypeError") and name in message, (kind, message, name)
        assert result == ("result", "[3.0, 6.0, 9.0]")


def test_lesson_signatures(cluster):
    for rank, out in enumerate(cluster.run(lesson_api)):
        assert out[0] == out[1] == [3.0, 6.0, 9.0, 12.0]
        assert out[2] == [1.0, 2.0, 3.0, 4.0]
        assert out[3] == [0.0, 1.0, 2.0]
        assert out[4] == [[3.0, 6.0], [9.0], [12.0]][rank]


@pytest.mark.parametrize("transport", ["shm", "queue"])
def test_a_stalled_peer_raises_a_deadline_error_naming_rank_peer_and_collective(transport):
    started = time.monotonic()
    with pytest.raises(lab.RankError) as info:
        lab.spawn(stall, 3, transport=transport, recv_timeout_ms=500)
    # The headline is the rank the others waited for (rank 0, asleep in fn), not a rank that timed out.
    assert (info.value.rank, info.value.exc_type) == (0, "Unresponsive"), info.value
    assert "timed out waiting for it" in info.value.exc_message and "still running" in info.value.exc_message
    others = info.value.others
    assert "DeadlineError" in others and "allreduce #1 (ring) step 1" in others and "waiting for rank" in others
    assert time.monotonic() - started < STALL_S, "the pool waited for the stalled rank instead of ending it"


def test_a_killed_rank_is_reported_with_its_signal():
    started = time.monotonic()
    with pytest.raises(lab.RankError) as info:
        lab.spawn(die, 3, recv_timeout_ms=30_000)
    assert info.value.rank == 1 and "SIGKILL" in info.value.exc_message
    # peers learn of the death from the closed pipe, not from the 30 s deadline
    assert "DeadlineError" not in info.value.others and time.monotonic() - started < 30


def test_fn_must_be_picklable():
    with pytest.raises(TypeError, match="picklable"):
        lab.spawn(lambda mesh: None, 2)


@pytest.mark.parametrize("options, name", [({"segment_bytes": 100}, "segment_bytes"),
                                           ({"slots": 0}, "slots")])
def test_bad_buffer_options_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=name):
        lab.launch(2, **options)


def test_a_closed_cluster_refuses_work():
    with lab.launch(2) as cluster:
        pass
    with pytest.raises(lab.LabError, match="closed"):
        cluster.run(lesson_api)


@pytest.mark.parametrize("kwargs, name", [({"world_size": 0}, "world_size"),
                                          ({"transport": "carrier-pigeon"}, "transport"),
                                          ({"recv_timeout_ms": -5}, "recv_timeout_ms")])
def test_bad_launch_options_name_the_parameter(kwargs, name):
    options = {"world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        lab.spawn(lesson_api, options.pop("world_size"), **options)
