"""Waits in the shm transport's shared memory (the compiled path's mailboxes, the two-shot's flags)
against everything else a rank must keep doing meanwhile: drain the pipes for another mesh's
messages, notice a peer that took the other path, honour any deadline, let signal handlers run.

These concern the shm transport alone (the only one with mailboxes and a two-shot); each test
runs at N = 2 and 3, every rank checks its own output, inputs are ``index * STRIDE + rank``.
"""

from __future__ import annotations

import gc
import math
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import wait_until

import lab
from lab.compiled.plane import MAX_DEADLINE_NS, deadline_ns

STRIDE = 3
SMALL = 256  # float32 elements: 1 KB, on the compiled path
TIMEOUT_MS = 30_000  # what a deadlock would wait out (a cold Numba cache compiles for seconds)


def pattern(count: int, rank: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) * STRIDE + rank


def summed(count: int, world_size: int) -> torch.Tensor:
    return sum(pattern(count, rank) for rank in range(world_size))


# -- another mesh's messages while a rank waits in the shared memory -------------------------------


def parent_and_sub_mesh_in_different_orders(mesh: lab.Mesh, big: int, algorithm: str) -> list[str]:
    """Rank 0 broadcasts ``big`` elements on a sub-mesh of every rank, then allreduces 1 KB on the
    parent; the others the other way round (the broadcast's sender needs the receivers' credits
    while they wait in the parent's allreduce)."""
    sub = mesh.split(0)
    x = pattern(big, mesh.rank)
    lab.broadcast(sub, x.clone(), src=0)  # once in step: the ranks agree on its root
    y = pattern(SMALL, mesh.rank)
    start = time.monotonic()
    if mesh.rank == 0:
        lab.broadcast(sub, x, src=0)
        lab.allreduce(mesh, y, algorithm=algorithm)
    else:
        lab.allreduce(mesh, y, algorithm=algorithm)
        lab.broadcast(sub, x, src=0)
    took = time.monotonic() - start
    failures = []
    if not torch.equal(x, pattern(big, 0)):
        failures.append(f"rank {mesh.rank}: the sub-mesh broadcast's result is wrong")
    if not torch.equal(y, summed(SMALL, mesh.world_size)):
        failures.append(f"rank {mesh.rank}: the parent allreduce's result is wrong")
    if took > 5:
        failures.append(f"rank {mesh.rank}: took {took:.1f} s (a wait that does not drain the pipes)")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "two_shot", "one_shot"])  # auto: 1 KB on the compiled path
def test_a_wait_in_shared_memory_drains_the_pipes_for_another_mesh(world_size, algorithm):
    outs = lab.spawn(parent_and_sub_mesh_in_different_orders, world_size, args=(1 << 20, algorithm),
                     recv_timeout_ms=TIMEOUT_MS)
    assert [f for rank in outs for f in rank] == []


# -- ranks on different paths for one collective ----------------------------------------------------


def allreduce_with_thresholds_that_disagree(mesh: lab.Mesh, catch: bool) -> tuple[str, float]:
    """The last rank keeps every collective off the compiled path (as LAB_COMPILED_MAX_BYTES=0
    would): its 1 KB allreduce goes through the pipes while the others' wait in the mailboxes."""
    if mesh.rank == mesh.world_size - 1:
        mesh.exchange.plane.max_bytes = 0
    y = pattern(SMALL, mesh.rank)
    start = time.monotonic()
    try:
        lab.allreduce(mesh, y)
    except lab.LabError as exc:
        if not catch:
            raise
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "returned", time.monotonic() - start


def test_ranks_on_either_side_of_the_compiled_threshold_are_a_mismatch_at_once():
    """At 2 ranks each finds the other's message on the other queue."""
    outs = lab.spawn(allreduce_with_thresholds_that_disagree, 2, args=(True,), recv_timeout_ms=TIMEOUT_MS)
    for rank, (error, took) in enumerate(outs):
        assert error.startswith("CollectiveMismatchError"), (rank, error)
        assert "allreduce #" in error and "LAB_COMPILED_MAX_BYTES" in error, (rank, error)
        assert took < 5, (rank, took)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_threshold_disagreement_is_the_error_of_the_job(world_size):
    """At 3 ranks a rank may hear only from one that took its path: the job still fails at once,
    with the mismatch as its error."""
    start = time.monotonic()
    with pytest.raises(lab.RankError, match="CollectiveMismatchError.*LAB_COMPILED_MAX_BYTES"):
        lab.spawn(allreduce_with_thresholds_that_disagree, world_size, args=(False,),
                  recv_timeout_ms=TIMEOUT_MS)
    assert time.monotonic() - start < 10


# -- deadlines ---------------------------------------------------------------------------------------


def test_a_deadline_is_clamped_never_rounded_to_none():
    assert deadline_ns(math.inf) == 0
    assert deadline_ns(sys.float_info.max) == deadline_ns(1e300) == deadline_ns(1e13) == 0
    assert deadline_ns(1e-7) == 1 and deadline_ns(5e-324) == 1
    assert deadline_ns(2.5) == 2_500_000
    assert deadline_ns(MAX_DEADLINE_NS / 1e6 * 0.999) > 0


def small_collectives(mesh: lab.Mesh) -> list[str]:
    """A 1 KB allreduce (plain, then its lane), a broadcast from the last rank, a barrier and a
    1 KB two-shot allreduce."""
    failures = []
    for _ in range(2):
        y = pattern(SMALL, mesh.rank)
        lab.allreduce(mesh, y)
        if not torch.equal(y, summed(SMALL, mesh.world_size)):
            failures.append(f"rank {mesh.rank}: allreduce")
    x = pattern(SMALL, mesh.rank)
    lab.broadcast(mesh, x, src=mesh.world_size - 1)
    if not torch.equal(x, pattern(SMALL, mesh.world_size - 1)):
        failures.append(f"rank {mesh.rank}: broadcast")
    lab.barrier(mesh)
    y = pattern(SMALL, mesh.rank)
    lab.allreduce(mesh, y, algorithm="two_shot")
    if not torch.equal(y, summed(SMALL, mesh.world_size)):
        failures.append(f"rank {mesh.rank}: two-shot allreduce")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("timeout_ms", [1e13, 1e300, sys.float_info.max, math.inf], ids=str)
def test_huge_deadlines_are_no_deadline(world_size, timeout_ms):
    outs = lab.spawn(small_collectives, world_size, recv_timeout_ms=timeout_ms)
    assert [f for rank in outs for f in rank] == []


def allreduce_with_a_late_peer(mesh: lab.Mesh, algorithm: str, flags: str) -> tuple[str, float]:
    """Every rank but the last enters at once; the last only once the others have left the
    allreduce (each leaves the file ``left<rank>`` in ``flags``), or after a minute: a deadline
    that never expires makes them return with its data instead."""
    last = mesh.world_size - 1
    if mesh.rank == last:
        others = [Path(flags) / f"left{rank}" for rank in range(last)]
        try:
            wait_until(lambda: all(path.exists() for path in others), "the others to leave", limit_s=60)
        except TimeoutError:
            pass  # (they still wait: join, and they return instead of raising)
    start = time.monotonic()
    try:
        lab.allreduce(mesh, pattern(SMALL, mesh.rank), algorithm=algorithm)
        outcome = "returned"
    except lab.LabError as exc:
        outcome = type(exc).__name__
    (Path(flags) / f"left{mesh.rank}").touch()
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "two_shot", "one_shot"])
def test_a_deadline_under_a_nanosecond_still_expires(world_size, algorithm, tmp_path):
    outs = lab.spawn(allreduce_with_a_late_peer, world_size, args=(algorithm, str(tmp_path)),
                     recv_timeout_ms=1e-7)
    for rank, (error, took) in enumerate(outs[:-1]):  # (the late rank finds its peers gone or late)
        assert error == "DeadlineError", (rank, error, took)  # expired before the late rank came


# -- signal handlers ----------------------------------------------------------------------------------


class Preempted(Exception):
    pass


def allreduce_while_an_alarm_goes_off(mesh: lab.Mesh, algorithm: str, raising: bool,
                                      flags: str) -> tuple[str, float]:
    """Rank 0 sets a SIGALRM for 50 ms into a 1 KB allreduce whose last rank comes only once rank
    0's handler has run (the handler leaves the file ``handled`` in ``flags``); the handler notes
    when it ran (and raises, where ``raising``). A handler held up by the wait would hold up the
    last rank with it, until the deadline. Rank 0 returns how the allreduce ended and how long
    after the alarm its handler ran; the others whether their result is right.

    One allreduce first, then a full collection: a process's first compiled call loads its code
    from Numba's cache, and a collection that frees llvmlite's objects in the timed call would run
    their finalizers there, and a handler that runs inside a finalizer has what it raises ignored
    by Python ("Exception ignored in ObjectRef.__del__"), which is no failure of the wait."""
    lab.allreduce(mesh, pattern(SMALL, mesh.rank), algorithm=algorithm)
    gc.collect()
    y, handled = pattern(SMALL, mesh.rank), Path(flags) / "handled"
    if mesh.rank == mesh.world_size - 1 and mesh.rank != 0:
        wait_until(handled.exists, "rank 0's alarm handler", limit_s=4 * TIMEOUT_MS / 1000)
    if mesh.rank != 0:
        try:
            lab.allreduce(mesh, y, algorithm=algorithm)
        except lab.LabError as exc:
            return type(exc).__name__, 0.0
        return "right" if torch.equal(y, summed(SMALL, mesh.world_size)) else "wrong", 0.0
    ran = []

    def on_alarm(signum, frame):
        ran.append(time.monotonic())
        handled.touch()
        if raising:
            raise Preempted("checkpoint now")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        alarm = time.monotonic() + 0.05
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            lab.allreduce(mesh, y, algorithm=algorithm)
            outcome = "right" if torch.equal(y, summed(SMALL, mesh.world_size)) else "wrong"
        except Preempted:
            outcome = "Preempted"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return outcome, (ran[0] - alarm) if ran else math.inf


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "two_shot", "one_shot"])
def test_a_signal_handler_runs_while_a_compiled_wait_lasts_and_the_wait_resumes(
        world_size, algorithm, tmp_path):
    outs = lab.spawn(allreduce_while_an_alarm_goes_off, world_size, args=(algorithm, False, str(tmp_path)),
                     recv_timeout_ms=TIMEOUT_MS)
    # right on every rank: the last rank came only after the handler ran, so it ran inside the wait
    # (one held up by the wait would have held the last rank up, until the deadline failed them)
    assert [outcome for outcome, _ in outs] == ["right"] * world_size


@pytest.mark.slow  # its peers wait out a 3 s deadline for the rank that left
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "two_shot", "one_shot"])
def test_what_a_signal_handler_raises_ends_the_wait(world_size, algorithm, tmp_path):
    # Rank 0 leaves the allreduce: its peers wait for it until their deadline (the plane is compiled
    # by then: the session's warm-up), so a short one. A handler held up by the wait would run only
    # once rank 0's own deadline ended it (its last peer stays away until the handler has run):
    # 3 s after the alarm, against a handler that runs at once.
    deadline_ms = 3_000
    outs = lab.spawn(allreduce_while_an_alarm_goes_off, world_size, args=(algorithm, True, str(tmp_path)),
                     recv_timeout_ms=deadline_ms)
    assert outs[0][0] == "Preempted" and outs[0][1] < deadline_ms / 2 / 1000, outs[0]


# -- 21: the barrier's lane --------------------------------------------------------------------------


def barriers_made(mesh: lab.Mesh, calls: int) -> tuple[int, int]:
    """How often ``calls`` barriers prepared a barrier (checks, signature, compiled-call lookup),
    and how many ran compiled."""
    from lab.collectives import calls as collectives

    made, real = [], collectives.prepare_barrier
    collectives.prepare_barrier = lambda m: made.append(1) or real(m)
    try:
        before = mesh.stats()["collectives_compiled"]
        for _ in range(calls):
            lab.barrier(mesh)
        return len(made), mesh.stats()["collectives_compiled"] - before
    finally:
        collectives.prepare_barrier = real


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_barrier_like_one_before_takes_its_lane(world_size):
    """The plain barrier, the cheapest collective, is prepared once and then runs its compiled call
    straight from the caller, as an allreduce's lane does (the figures: bench/, not here)."""
    assert lab.spawn(barriers_made, world_size, args=(50,)) == [(1, 50)] * world_size
