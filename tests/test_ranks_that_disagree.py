"""What ranks must agree on, and what a failure leaves behind (found from outside, issue 33).

2. ranks that disagree on a rooted collective's root: every "root" only sent and returned (the
   message left unread is an error at the next collective or at the end: tests/test_unread_messages.py);
3. a plan's agreement taken for a user's allgather of int64[4] (and ``describe`` crashing on it);
6. a failure the program already had raised again by the next collective, the ranks out of step;
16. a lane found by ``src=True`` (or ``1.0``, ``1+0j``) after a call with ``src=1``;
18. an asynchronous collective running at ``mesh.close()``: a raw ``OSError`` after the deadline.

Every rank checks its own output; inputs are ``index * stride + rank``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import enter_together, pool, rooted, wait_until

import lab
from lab import fingerprint

STRIDE = 3
ROOTED = ("broadcast", "scatter", "reduce", "gather")
TRANSPORTS = ("shm", "tcp", "queue")
#: Small enough for the compiled path on shm, and large enough for the pipes (256 KB).
COUNTS = (8, 65536)


@pytest.fixture(scope="module", params=[(t, n) for t in TRANSPORTS for n in (2, 3)],
                ids=lambda param: f"{param[0]}-{param[1]}")
def cluster(request):
    transport, world_size = request.param
    with pool(world_size, transport) as c:
        yield c


def pattern(count: int, rank: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) * STRIDE + rank


# -- 2. ranks that disagree on the root ---------------------------------------------------------


def disagreeing_root(mesh: lab.Mesh, collective: str, count: int, how: str, flags: str) -> None:
    """One rooted collective whose root differs between ranks: ``split``, rank 0 says 0 and the
    others 1; ``cycle``, each rank names the next one. The ranks enter it together (``flags``)."""
    n, rank = mesh.world_size, mesh.rank
    enter_together(mesh, flags)
    root = (0 if rank == 0 else 1) if how == "split" else (rank + 1) % n
    rooted(mesh, collective, pattern(count, rank), root)


@pytest.mark.slow  # the ranks that all wait for a root wait out their deadlines
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_on_the_root_never_end_silently(transport, world_size, tmp_path):
    # Catching it at the call itself takes a wait of every rank, which deadlocks sub-meshes entered
    # in different orders (tests/test_silent_results.py's contexts, round 2). Where every rank only
    # sends, the message one left unread is found by the next collective, or at the end of the
    # run (tests/test_unread_messages.py); where every rank waits, the deadline ends it.
    for count in COUNTS:
        for collective in ROOTED:
            for how in ("split", "cycle"):
                case = (collective, count, how)
                flags = tmp_path / "-".join(map(str, case))
                flags.mkdir()
                with pytest.raises(lab.RankError) as info:
                    lab.spawn(disagreeing_root, world_size, args=(*case, str(flags)), transport=transport,
                              recv_timeout_ms=1000)
                error = info.value
                assert error.exc_type in ("CollectiveMismatchError", "DeadlineError"), (case, str(error))
                if error.exc_type == "CollectiveMismatchError":
                    assert f"{collective} #1 float32[{count}]" in error.exc_message, (case, str(error))


def unread_message(mesh: lab.Mesh, count: int) -> str:
    """Two broadcasts whose roots every rank agreed on before, now called with rank 0 as root on
    rank 0 and rank 1 on rank 1: both only send. The message each left unread must surface as a
    mismatch at the next collective, not pass."""
    x = pattern(count, mesh.rank)
    for src in (0, 1):
        lab.broadcast(mesh, x, src=src)
    lab.broadcast(mesh, x, src=mesh.rank)
    try:
        lab.allreduce(mesh, torch.zeros(COUNTS[1]))  # the pipes on every transport
    except lab.CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_message_left_unread_surfaces_at_the_next_collective(transport):
    # N = 2 only: at N = 3 the third rank's next receive need not be from a rank that left one.
    # On shm a small broadcast leaves its message in a mailbox (the compiled path's), which the
    # large allreduce's first look finds though it runs on the pipes.
    for count in COUNTS:
        for rank, got in enumerate(lab.spawn(unread_message, 2, args=(count,), transport=transport)):
            assert got.startswith("mismatch: ") and "broadcast #3" in got, (count, rank, got)


# -- 3. internal agreements cannot be taken for a user's call -----------------------------------


def plan_against_allgather(mesh: lab.Mesh) -> None:
    if mesh.rank == 0:
        lab.allreduce_init(mesh, pattern(4, 0))
    else:
        lab.allgather(mesh, torch.arange(4, dtype=torch.int64) * STRIDE + mesh.rank)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_plans_agreement_is_no_users_allgather(transport, world_size):
    with pytest.raises(lab.RankError) as info:
        lab.spawn(plan_against_allgather, world_size, transport=transport, recv_timeout_ms=5_000)
    error = info.value
    assert error.exc_type == "CollectiveMismatchError", str(error)
    assert "agree #" in error.exc_message and "allgather #" in error.exc_message, str(error)
    assert "IndexError" not in str(error), str(error)


def test_describe_names_any_32_bytes():
    chance = random.Random(33)
    for _ in range(2000):
        assert fingerprint.describe(chance.randbytes(32))
    assert "agree" not in fingerprint.PUBLIC_COLLECTIVES and "split" not in fingerprint.PUBLIC_COLLECTIVES


# -- 6. a failure the program had is consumed; a refused collective keeps the ranks in step -------


def failed_receive_then_allreduces(mesh: lab.Mesh, consume: bool, flags: str) -> list[str]:
    """Rank 1's asynchronous receive from rank 0 fails (rank 0 sends nothing until it has: rank 1
    leaves the file ``gave_up`` in ``flags`` once it has seen the receive fail), then every rank runs
    two allreduces. ``consume``: rank 1 had the failure from ``wait()``; both allreduces must be
    right. Otherwise rank 1's first allreduce raises it in its place; every allreduce must then
    raise or be right."""
    rank, n, seen = mesh.rank, mesh.world_size, []
    gave_up = Path(flags) / "gave_up"
    if rank == 1:
        work = mesh.issue(lambda: mesh.recv(0, timeout_ms=200), async_op=True, p2p="recv")
        if consume:
            with pytest.raises(lab.DeadlineError):
                work.wait()
        else:  # failed, its failure not yet had by the program
            wait_until(work.is_completed, "rank 1's receive to give up")
        gave_up.touch()
    else:
        wait_until(gave_up.exists, "rank 1's receive to give up")
    for call in range(2):
        x = pattern(4, rank) + 100 * call
        try:
            lab.allreduce(mesh, x)
        except lab.LabError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
            if "timeout_ms=200" not in str(exc):  # (the receive's failure is raised in place of the first)
                break
            continue
        right = sum(pattern(4, r) + 100 * call for r in range(n))
        seen.append("right" if torch.equal(x, right) else f"WRONG {x.tolist()}, want {right.tolist()}")
    return seen


def test_a_failure_the_program_had_is_not_raised_again(cluster, tmp_path):
    for rank, seen in enumerate(cluster.run(failed_receive_then_allreduces, True, str(tmp_path))):
        assert seen == ["right", "right"], (rank, seen)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size",
                         [2, pytest.param(3, marks=pytest.mark.slow)])  # (3: CI, not the fast loop)
def test_a_collective_refused_for_an_earlier_failure_keeps_its_number(transport, world_size, tmp_path):
    outputs = lab.spawn(failed_receive_then_allreduces, world_size, args=(False, str(tmp_path)),
                        transport=transport, recv_timeout_ms=3_000)
    for rank, seen in enumerate(outputs):
        assert not any(s.startswith("WRONG") for s in seen), (rank, seen)
    assert outputs[1][0].startswith("DeadlineError") and "recv #1" in outputs[1][0], outputs
    assert outputs[1][1].startswith("CollectiveMismatchError"), outputs  # #2 against the peers' #1


# -- 16. a lane is keyed by its arguments' types ------------------------------------------------


def lane_with_equal_arguments(mesh: lab.Mesh) -> list[str]:
    rank, wrong = mesh.rank, []
    x = pattern(8, rank)
    lab.broadcast(mesh, x, src=1)  # makes the lane of src=1
    for src in (True, 1.0, np.float64(1.0), 1 + 0j):
        try:
            lab.broadcast(mesh, pattern(8, rank), src=src)
            wrong.append(f"rank {rank}: src={src!r} ran")
        except ValueError as exc:
            if "src must be a rank" not in str(exc):
                wrong.append(f"rank {rank}: src={src!r}: {exc}")
    x = pattern(8, rank)
    lab.broadcast(mesh, x, src=1)  # the lane itself still runs
    if not torch.equal(x, pattern(8, 1)):
        wrong.append(f"rank {rank}: the lane's broadcast gave {x.tolist()}")
    return wrong


def test_a_lane_is_not_found_by_an_argument_that_only_hashes_equal(cluster):
    for wrong in cluster.run(lane_with_equal_arguments):
        assert not wrong, wrong


# -- 18. an asynchronous collective running at mesh.close() -------------------------------------


def close_while_running(mesh: lab.Mesh, count: int) -> str:
    if mesh.rank != 0:
        time.sleep(1.5)  # never joins: rank 0's allreduce is still waiting when it closes
        return ""
    work = lab.allreduce(mesh, pattern(count, 0), async_op=True)
    time.sleep(0.2)
    start = time.monotonic()
    mesh.close()
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", ["shm", "queue", "tcp"])
@pytest.mark.parametrize("world_size",
                         [2, pytest.param(3, marks=pytest.mark.slow)])  # (3: CI, not the fast loop)
def test_a_collective_running_at_close_fails_at_once_with_a_lab_error(transport, world_size):
    for count in COUNTS:  # (on shm the small ones wait in the compiled path, the large on the pipes)
        got = lab.spawn(close_while_running, world_size, args=(count,), transport=transport,
                        recv_timeout_ms=10_000)[0]
        assert got.startswith("LabError after ") and "the mesh was closed" in got, (count, got)
        assert float(got.split()[2]) < 5, (count, got)  # at once, not at the 10 s deadline
