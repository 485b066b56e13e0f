"""Fault injection: killed, stalled and disagreeing ranks, an interrupted parent, a long soak.

Every case must end with the right exception, naming the right rank, and leave no rank process
and no /dev/shm segment behind (checked per case here, and for the whole session by conftest).
Faults are injected from the test side only: a rank's transport is wrapped so that it dies or
stalls at its k-th transfer (seeded, so a failing case can be replayed by its id).

Timing is asserted as an order of events, so that it holds on a busy machine: the victim writes
the moment of its fault to a file, and the error must reach the caller before a deadline could
have produced it (a death: the peers learned of it from a closed pipe or connection, not from
a 30 s deadline) or before the stalled rank would have woken (a stall: the peers' deadlines
fired and the pool ended the stalled rank, instead of waiting for it).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import (
    DEADLINE_MS,
    DEATH_DEADLINE_MS,
    EXIT_GUARD_S,
    assert_death_reported_without_a_deadline,
    assert_stall_ended_by_the_pool,
    enter_together,
    faulty_job,
    inject,
    run_collective,
    shm_entries,
    sigint_as_ctrl_c,
)

import lab
import lab.transport.shm

# Slow, the whole module: killed, stopped and interrupted ranks, a soak.
pytestmark = pytest.mark.slow

COLLECTIVES = [
    "allreduce-ring", "allreduce-tree", "allreduce-naive", "broadcast", "allgather", "reduce_scatter"]


@pytest.fixture(scope="module", autouse=True)
def python_path_only():
    """Faults are injected at the transport's ``exchange``, which the compiled data plane does not
    call: these ranks take the Python path (``LAB_COMPILED_MAX_BYTES=0``; ranks take the caller's
    environment). Deaths, stalls and mismatches inside compiled collectives: tests/test_compiled.py."""
    saved = os.environ.get("LAB_COMPILED_MAX_BYTES")
    os.environ["LAB_COMPILED_MAX_BYTES"] = "0"
    yield
    if saved is None:
        del os.environ["LAB_COMPILED_MAX_BYTES"]
    else:
        os.environ["LAB_COMPILED_MAX_BYTES"] = saved


def fault_case(seed: int) -> dict:
    rng = random.Random(seed)
    world_size = rng.randint(2, 5)
    return {
        "transport": rng.choice(["shm", "queue"]), "world_size": world_size, "which": rng.choice(COLLECTIVES),
        "numel": rng.choice([1, 7, 1000, 300_001]), "victim": rng.randrange(world_size),
        "at_transfer": rng.randint(1, 12)}


def run_faulty(job, case: dict, fault: str, stamp, **options) -> tuple[lab.RankError, float]:
    """Spawn ``job`` with ``case``'s fault; return the error and the seconds from the fault to it."""
    deadline_ms = DEADLINE_MS if fault == "stall" else DEATH_DEADLINE_MS
    with pytest.raises(lab.RankError) as info:
        lab.spawn(job, case["world_size"], transport=case["transport"], recv_timeout_ms=deadline_ms,
                  **options,
                  args=(case["which"], case["numel"], case["victim"], case["at_transfer"], fault, str(stamp)))
    caught = time.time()
    return info.value, caught - float(stamp.read_text())


def no_rank_left() -> None:
    deadline = time.monotonic() + EXIT_GUARD_S  # a hang guard: a loaded machine reaps late
    while [p for p in multiprocessing.active_children() if p.name.startswith("lab-rank")]:
        assert time.monotonic() < deadline, "rank processes left running"
        time.sleep(0.05)


def noop(mesh: lab.Mesh) -> None:
    return None


@pytest.fixture(scope="module", autouse=True)
def forkserver_started():
    """Start the forkserver (it imports torch once) before timing anything."""
    lab.spawn(noop, 1)


@pytest.fixture
def shm_unchanged():
    before = shm_entries()
    yield
    assert shm_entries() - before == set(), "a /dev/shm segment was left behind"


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("fault", ["sigkill", "exit"])
def test_a_rank_dying_at_a_random_step_is_named_promptly(seed, fault, shm_unchanged, tmp_path):
    case = fault_case(seed)
    error, since_fault = run_faulty(faulty_job, case, fault, tmp_path / "fault")
    assert error.rank == case["victim"] and error.exc_type == "ProcessDied", (case, str(error))
    assert ("SIGKILL" if fault == "sigkill" else "exited with code 3") in error.exc_message
    assert error.exitcode == (-signal.SIGKILL if fault == "sigkill" else 3)
    # peers learn from the closed pipe (shm) or the alive pipe (queue), not from a deadline
    assert_death_reported_without_a_deadline(error, since_fault, case)
    no_rank_left()


EAGER_COLLECTIVES = [
    "allreduce-recursive_doubling", "allreduce-ring", "allreduce-tree", "broadcast", "allgather"]


@pytest.mark.parametrize("seed", range(8))
def test_a_rank_dying_during_eager_traffic_is_named_promptly(seed, shm_unchanged, tmp_path):
    """shm, every message eager (4 to 1,000 bytes under the default threshold; or a 16-byte forced
    threshold, so eager and rendezvous messages mix): peers may have run ahead by their eager
    credits, and still learn of the death from the closed pipe."""
    rng = random.Random(500 + seed)
    world_size = rng.randint(2, 5)
    which, numel = rng.choice(EAGER_COLLECTIVES), rng.choice([1, 7, 250])
    victim, at_transfer = rng.randrange(world_size), rng.randint(1, 12)
    eager_bytes = 16 if seed % 4 == 3 else lab.transport.shm.DEFAULT_EAGER_BYTES
    fault = "sigkill" if seed % 2 else "exit"
    case = {
        "transport": "shm", "world_size": world_size, "which": which, "numel": numel, "victim": victim,
        "at_transfer": at_transfer}
    error, since_fault = run_faulty(faulty_job, case, fault, tmp_path / "fault", eager_bytes=eager_bytes)
    assert error.rank == victim and error.exc_type == "ProcessDied", (seed, str(error))
    assert_death_reported_without_a_deadline(error, since_fault, case)
    no_rank_left()


@pytest.mark.parametrize("seed", range(8))
def test_a_stalled_rank_is_named_over_the_deadlines_it_caused(seed, shm_unchanged, tmp_path):
    case = fault_case(100 + seed)
    if case["which"] == "broadcast":  # only the root's stall holds others up: nobody waits on a leaf
        case["victim"] = case["world_size"] - 1
    error, since_fault = run_faulty(faulty_job, case, "stall", tmp_path / "fault")
    # The headline is the stalled rank everyone waited for; the deadlines it caused come below it.
    assert (error.rank, error.exc_type) == (case["victim"], "Unresponsive"), (case, str(error))
    assert "timed out waiting for it" in error.exc_message
    assert "DeadlineError" in error.others and "timed out waiting for rank" in error.others
    assert f"recv_timeout_ms={DEADLINE_MS}" in error.others
    collective = case["which"].split("-")[0]
    assert collective in error.others and "step" in error.others
    assert "flight recorder" in str(error)
    assert_stall_ended_by_the_pool(error, since_fault, case)
    no_rank_left()


def disagree(mesh: lab.Mesh, how: str, stamp: str) -> None:
    odd = mesh.rank == 1
    x = torch.arange(1000, dtype=torch.float32) + mesh.rank
    enter_together(mesh, os.path.dirname(stamp))  # (a rank started late is not the silent one)
    lab.allreduce(mesh, x.clone())  # one good collective first: the seq numbers agree
    if mesh.rank == 0:
        with open(stamp, "w") as file:
            file.write(repr(time.time()))
    if how == "collective":
        lab.allgather(mesh, x) if odd else lab.allreduce(mesh, x, algorithm="ring")
    elif how == "dtype":
        lab.allreduce(mesh, x.double() if odd else x, algorithm="ring")
    elif how == "size":
        lab.allreduce(mesh, x[:999] if odd else x, algorithm="ring")
    elif how == "op":
        lab.allreduce(mesh, x, op="max" if odd else "sum", algorithm="tree")
    elif how == "root":
        lab.broadcast(mesh, x, src=mesh.world_size - 1 if odd else 0)
    lab.allreduce(mesh, x.clone())  # a disagreement that went unnoticed is caught here


@pytest.mark.parametrize("transport", ["shm", "queue"])
@pytest.mark.parametrize("how, world_size", [("collective", 3), ("dtype", 4), ("size", 3), ("op", 2),
                                             ("root", 3)])
def test_disagreeing_ranks_raise_a_mismatch_naming_both_sides(how, world_size, transport, shm_unchanged,
                                                              tmp_path):
    if how == "root" and transport == "queue":
        # A queue cannot be peeked after a deadline; with two ranks both "roots" send and nobody
        # waits, and the stray message is caught by the next collective.
        world_size = 2
    with pytest.raises(lab.RankError) as info:
        lab.spawn(disagree, world_size, args=(how, str(tmp_path / "agreed")), transport=transport,
                  recv_timeout_ms=DEADLINE_MS)
    since_disagreement = time.time() - float((tmp_path / "agreed").read_text())
    error = info.value
    assert error.exc_type == "CollectiveMismatchError", str(error)
    # "rank 0 is in allreduce #2 float32[1000] sum (ring); rank 1 sent allgather #2 float32[1000] (ring)"
    assert " is in " in error.exc_message and " sent " in error.exc_message and "#2" in error.exc_message
    # caught at the first message, or by the deadline at worst: never a hang (10 deadlines: load)
    assert since_disagreement < 10 * DEADLINE_MS / 1000
    no_rank_left()


PARENT_SCRIPT = textwrap.dedent(r"""
    import os, sys, time, torch, lab

    def busy(mesh):
        os.write(1, f"{os.getpid()}\n".encode())  # one write: ranks' lines never interleave
        while True:
            lab.allreduce(mesh, torch.ones(100_000))

    if __name__ == "__main__":
        lab.spawn(busy, 3, transport=sys.argv[1])
""")


@pytest.mark.parametrize("transport", ["shm", "queue"])
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_an_interrupted_parent_takes_its_ranks_with_it(how, transport, tmp_path, shm_unchanged):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script), transport], stdout=subprocess.PIPE, env=env,
                              preexec_fn=sigint_as_ctrl_c)
    try:
        output = b""
        while output.count(b"\n") < 3:  # the ranks are running once each has printed its pid
            ready, _, _ = select.select([parent.stdout], [], [], EXIT_GUARD_S)  # a hang guard too
            assert ready, f"the ranks did not start within {EXIT_GUARD_S} s"
            chunk = os.read(parent.stdout.fileno(), 4096)
            assert chunk, "the parent exited before its ranks started"
            output += chunk
        pids = [int(line) for line in output.split()]
        time.sleep(0.3)
        parent.send_signal(how)
        # It exits (a hang guard, not a speed bound: its teardown gives busy ranks seconds of
        # grace, and a loaded machine stretches them); what matters is checked below, that no
        # rank outlives it.
        parent.wait(timeout=EXIT_GUARD_S)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30  # a rank that outlives its parent stays: a loaded machine gets time
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid)]
    assert not alive, f"ranks {alive} outlived their parent"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def soak(mesh: lab.Mesh, collectives: int, seed: int) -> dict:
    """Random collectives of random sizes; resource use after a warm-up and at the end."""
    rng = random.Random(seed)  # the same sequence on every rank
    fds = rss = None
    for i in range(collectives):
        if i == collectives // 10:
            fds, rss = len(os.listdir("/proc/self/fd")), _rss_kib()
        which = rng.choice(COLLECTIVES)
        run_collective(mesh, which, rng.choice([0, 1, 3, 64, 1000, 4097, 65_536, 200_003]))
    return {"fds": (fds, len(os.listdir("/proc/self/fd"))), "rss_kib": (rss, _rss_kib())}


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


SOAK_COLLECTIVES = int(os.environ.get("LAB_SOAK_COLLECTIVES", "1500"))


@pytest.mark.parametrize("transport", ["shm", "queue"])
def test_soak_resources_stay_flat(transport, shm_unchanged):
    """A short soak in CI; LAB_SOAK_COLLECTIVES=100000 runs the long one."""
    with lab.launch(4, transport=transport, segment_bytes=4096) as cluster:
        per_rank = cluster.run(soak, SOAK_COLLECTIVES, 11)
    for rank, usage in enumerate(per_rank):
        assert usage["fds"][0] == usage["fds"][1], f"rank {rank} leaks file descriptors: {usage}"
        assert usage["rss_kib"][1] - usage["rss_kib"][0] < 32 * 1024, f"rank {rank} memory grows: {usage}"
    no_rank_left()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fault", ["sigkill", "stall"])
def test_tcp_ranks_dying_or_stalling(seed, fault, shm_unchanged, tmp_path):
    """Over sockets: a dead peer is a closed connection (prompt PeerLost), a stall a deadline."""
    case = {**fault_case(200 + seed), "transport": "tcp"}
    if case["which"] == "broadcast":
        case["victim"] = case["world_size"] - 1
    error, since_fault = run_faulty(faulty_job, case, fault, tmp_path / "fault")
    if fault == "sigkill":
        assert error.rank == case["victim"] and error.exc_type == "ProcessDied", str(error)
        assert_death_reported_without_a_deadline(error, since_fault, case)
    else:  # the stalled rank is named; the deadlines it caused come below
        assert (error.rank, error.exc_type) == (case["victim"], "Unresponsive"), str(error)
        assert "DeadlineError" in error.others, str(error)
        assert_stall_ended_by_the_pool(error, since_fault, case)
    no_rank_left()


# -- the algorithms and collectives of issue 11 -------------------------------------------------------

NEW_COLLECTIVES = [
    "allreduce-recursive_doubling", "allreduce-halving_doubling", "allreduce-double_tree",
    "broadcast-scatter_allgather", "allgather-recursive_doubling", "reduce_scatter-recursive_halving",
    "reduce", "all_to_all-pairwise", "all_to_all-bruck", "barrier", "allgather-pat", "reduce_scatter-pat"]


def run_new_collective(mesh: lab.Mesh, which: str, numel: int) -> None:
    name, _, algorithm = which.partition("-")
    x = torch.arange(numel, dtype=torch.float32) + mesh.rank
    if name == "barrier":
        lab.barrier(mesh)
    elif name == "reduce":
        lab.reduce(mesh, x, dst=mesh.world_size - 1)
    elif name == "broadcast":
        lab.broadcast(mesh, x, src=mesh.world_size - 1, algorithm=algorithm)
    else:
        getattr(lab, name)(mesh, x, algorithm=algorithm)


def faulty_new_job(mesh: lab.Mesh, which: str, numel: int, victim: int, at_transfer: int, fault: str,
                   stamp: str) -> None:
    inject(mesh, victim, at_transfer, fault, stamp)
    for _ in range(100):  # every rank transfers at least once per call: the fault always fires
        run_new_collective(mesh, which, numel)


def new_fault_case(index: int) -> dict:
    """Collective ``index`` of NEW_COLLECTIVES on a seeded world of 2-7 ranks (folds included)."""
    rng = random.Random(300 + index)
    world_size = rng.randint(2, 7)
    return {
        "transport": ["shm", "queue", "tcp"][index % 3], "world_size": world_size,
        "which": NEW_COLLECTIVES[index], "numel": rng.choice([1, 7, 1000, 300_001]),
        "victim": rng.randrange(world_size), "at_transfer": rng.randint(1, 12)}


@pytest.mark.parametrize("index", range(len(NEW_COLLECTIVES)), ids=NEW_COLLECTIVES)
def test_a_rank_dying_inside_the_new_algorithms_is_named_promptly(index, shm_unchanged, tmp_path):
    case = new_fault_case(index)
    fault = ["sigkill", "exit"][index % 2]
    error, since_fault = run_faulty(faulty_new_job, case, fault, tmp_path / "fault")
    assert error.rank == case["victim"] and error.exc_type == "ProcessDied", (case, str(error))
    assert error.exitcode == (-signal.SIGKILL if fault == "sigkill" else 3)
    assert_death_reported_without_a_deadline(error, since_fault, case)
    no_rank_left()


@pytest.mark.parametrize("index", range(3), ids=NEW_COLLECTIVES[:3])
def test_a_stalled_rank_inside_the_new_allreduces_is_named(index, shm_unchanged, tmp_path):
    case = new_fault_case(index)
    error, since_fault = run_faulty(faulty_new_job, case, "stall", tmp_path / "fault")
    # the stalled rank is named; the deadlines it caused, with the algorithm, below
    assert (error.rank, error.exc_type) == (case["victim"], "Unresponsive"), (case, str(error))
    assert f"recv_timeout_ms={DEADLINE_MS}" in error.others and "allreduce" in error.others
    assert case["which"].split("-")[1] in error.others, error.others  # the algorithm is named
    assert_stall_ended_by_the_pool(error, since_fault, case)
    no_rank_left()
