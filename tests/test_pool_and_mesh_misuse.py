"""Pools and meshes used as outsiders use them: async work in flight, threads, forked children, failed
starts, bad options, environments and deadlines (defects found from outside, issue 9, one test or more each).

Each test is named after what a user did. The tcp security items (1, 7) live in test_tcp.py,
the blame of a stopped rank (10) in test_faults.py and test_failures.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import child_env, free_port, pool, wait_until

import lab

SCRIPTS = Path(__file__).parent / "scripts"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module", params=["shm", "queue", "tcp"])
def cluster(request):
    with pool(3, request.param) as c:
        yield c


# -- 2. point-to-point while an async collective runs ---------------------------------------------


def p2p_during_async(mesh: lab.Mesh) -> list[str]:
    n, wrong = mesh.world_size, []
    x = torch.arange(5000, dtype=torch.float32) * 3 + mesh.rank
    work = lab.allreduce(mesh, x, async_op=True)  # in flight while point-to-point runs
    right, left = (mesh.rank + 1) % n, (mesh.rank - 1) % n
    if mesh.rank % 2 == 0:
        mesh.send(right, torch.full((7,), float(mesh.rank)))
        got = mesh.recv(left)
    else:
        got = mesh.recv(left)
        mesh.send(right, torch.full((7,), float(mesh.rank)))
    work.wait()
    if not torch.equal(got, torch.full((7,), float(left))):
        wrong.append(f"rank {mesh.rank} p2p got {got.tolist()}")
    if not torch.equal(x, torch.arange(5000, dtype=torch.float32) * 3 * n + sum(range(n))):
        wrong.append(f"rank {mesh.rank} allreduce")
    return wrong


def test_send_and_recv_while_an_async_collective_is_in_flight(cluster):
    for _ in range(3):
        assert cluster.run(p2p_during_async) == [[]] * 3


# -- 3. Cluster.run from two threads ---------------------------------------------------------------


def echo(mesh: lab.Mesh, token: tuple) -> tuple:
    lab.allreduce(mesh, torch.ones(16))  # some traffic, so runs overlap in time if not serialised
    return token + (mesh.rank,)


def test_two_threads_on_one_pool_each_get_their_own_results(cluster):
    wrong: list = []

    def worker(thread: int) -> None:
        for i in range(15):
            got = cluster.run(echo, (thread, i))
            if got != [(thread, i, r) for r in range(3)]:
                wrong.append((thread, i, got))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not wrong


# -- 4. a rank that raises with async collectives in flight ----------------------------------------


def raise_with_work_in_flight(mesh: lab.Mesh, flags: str) -> None:
    raising = Path(flags) / "raising"
    if mesh.rank == 0:  # joins once rank 1 is raising: its collective cannot complete before that
        wait_until(raising.exists, "rank 1 to raise")
    lab.allreduce(mesh, torch.ones(1000), async_op=True)
    if mesh.rank == 1:
        raising.touch()
        raise RuntimeError("user code failed after issuing an async allreduce")


def sum_ranks(mesh: lab.Mesh) -> float:
    return float(lab.allreduce(mesh, torch.tensor([float(mesh.rank)]))[0])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_failure_with_async_work_in_flight_closes_the_pool_and_says_so(transport, tmp_path):
    with pool(3, transport) as c:
        with pytest.raises(lab.RankError) as info:
            c.run(raise_with_work_in_flight, str(tmp_path))
        assert info.value.rank == 1 and info.value.exc_type == "RuntimeError"
        with pytest.raises(lab.LabError, match="closed.*asynchronous collectives in flight"):
            c.run(sum_ranks)


# -- 5. deadlines measure silence, not the length of a transfer ------------------------------------

SEGMENT_BYTES = 256 * 1024  # both transports combine incoming data one 256 KiB segment at a time
STREAM_DEADLINE_MS = 1000


def slow_stream_allreduce(mesh: lab.Mesh, segments: int, pause_s: float) -> tuple[bool, float]:
    """A 2-rank ring allreduce whose reduce-scatter step exchanges ``segments`` segments each
    way, both peers at once, each incoming segment combined after a ``pause_s`` sleep: both stream
    for ``segments * pause_s`` seconds, never silent for much more than ``pause_s``. Returns
    (result right, seconds the allreduce took)."""
    plain = mesh.kernels

    def slow(op, dtype):
        reduction = plain(op, dtype)

        def combine(dst, src):
            time.sleep(pause_s)
            reduction.combine(dst, src)

        return dataclasses.replace(reduction, combine=combine)

    x = torch.full((2 * segments * SEGMENT_BYTES // 4,), float(mesh.rank + 1))  # two ring chunks
    mesh.kernels = slow  # this mesh's collectives take their kernels from it
    try:
        started = time.monotonic()
        lab.allreduce(mesh, x, algorithm="ring")
        took = time.monotonic() - started
    finally:
        del mesh.kernels
    return bool(torch.all(x == 3.0)), took


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_peer_streaming_a_large_tensor_is_busy_not_silent(transport):
    """A transfer that lasts several deadlines completes, because the peer is never silent for
    one (it used to raise DeadlineError). Each peer pauses 50 ms per segment: 20x under the
    deadline, so a descheduled process on a busy machine does not look silent."""
    results = lab.spawn(slow_stream_allreduce, 2, args=(80, 0.05), transport=transport,
                        recv_timeout_ms=STREAM_DEADLINE_MS)
    for right, took in results:
        assert right
        assert took > 2 * STREAM_DEADLINE_MS / 1000  # it really outlived the deadline, twice


# -- 6. os.fork() inside fn -------------------------------------------------------------------------


def fork_inside(mesh: lab.Mesh, run: int, report: str) -> tuple[int, str]:
    pid = os.fork()
    if pid == 0:  # the child: try the mesh, then fall back into the rank's loop as careless code does
        try:
            lab.allreduce(mesh, torch.ones(2))
            outcome = "used the mesh"
        except lab.LabError as exc:
            outcome = str(exc)
        with open(f"{report}.{mesh.rank}", "w") as file:
            file.write(outcome)
        return (-1, "child")
    os.waitpid(pid, 0)
    lab.allreduce(mesh, torch.ones(2))
    return (run, "parent")


def test_a_child_forked_inside_fn_cannot_answer_for_the_rank(cluster):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "child")
        for run in range(2):
            assert cluster.run(fork_inside, run, report) == [(run, "parent")] * 3
        for rank in range(3):
            text = Path(f"{report}.{rank}").read_text()
            assert "a process forked from it" in text and "cannot use it" in text, text
        assert cluster.run(sum_ranks) == [3.0] * 3


# -- 8. a rank failing during start-up -------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_failing_at_start_ends_the_pool_within_the_grace():
    """Rank 1 dies while the others wait for it in the tcp handshake: spawn fails once the
    failure grace is over, not at the 60 s connection timeout (ranks start with spawn here; the
    time is counted from rank 1's death, so slow imports on a loaded machine do not count)."""
    # (a hang guard only: four processes import torch, which takes minutes on a loaded machine)
    done = subprocess.run([sys.executable, str(SCRIPTS / "startup_failure.py")], capture_output=True,
                          text=True, timeout=400, env=child_env(LAB_START_METHOD="spawn"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    elapsed = float(done.stdout.split("failed after ")[1].split(" s")[0])
    assert "rank 1's process exited with code 3" in done.stdout and elapsed < 45, done.stdout


# -- 9. the forkserver stopped or killed, and LAB_START_METHOD -------------------------------------


@pytest.mark.slow
def test_a_stopped_or_killed_forkserver_is_named():
    done = subprocess.run([sys.executable, str(SCRIPTS / "forkserver_faults.py")], capture_output=True,
                          text=True, timeout=400,
                          env=child_env())  # a hang guard: three pools on a loaded machine
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "stopped: is stopped" in done.stdout and "killed: the forkserver that started it" in done.stdout
    assert "after: [3.0, 3.0, 3.0]" in done.stdout, done.stdout


@pytest.mark.parametrize("method, message", [("fork", "inherits the others' channel ends"),
                                             ("bogus", "got 'bogus'")])
def test_an_unsupported_start_method_is_refused(monkeypatch, method, message):
    monkeypatch.setenv("LAB_START_METHOD", method)
    with pytest.raises(ValueError, match="LAB_START_METHOD") as info:
        lab.spawn(sum_ranks, 2)
    assert message in str(info.value)


# -- 11. limits and descriptors ---------------------------------------------------------------------


@pytest.mark.parametrize("transport, world_size", [("shm", 84), ("queue", 51), ("shm", 101), ("tcp", 1025)])
def test_world_sizes_beyond_the_limits_are_refused_up_front(transport, world_size):
    before = open_fds()
    with pytest.raises(ValueError, match=f"world_size must be at most .* got {world_size}"):
        lab.spawn(sum_ranks, world_size, transport=transport)
    assert open_fds() == before


@pytest.mark.parametrize("options, message", [
    ({"slots": "4"}, "slots must be an int"), ({"slots": 2.5}, "slots must be an int"),
    ({"slots": 0}, "slots must be an int"), ({"segment_bytes": 64.0}, "segment_bytes must be a positive int"),
    ({"segment_bytes": 100}, "segment_bytes must be a positive int"),
    ({"slots": 10**9}, "slots x segment_bytes"), ({"recv_timeout_ms": True}, "recv_timeout_ms"),
    ({"recv_timeout_ms": float("nan")}, "recv_timeout_ms"), ({"recv_timeout_ms": -1}, "recv_timeout_ms"),
    ({"trace": 7}, "trace must be a file path"), ({"trace": "/nonexistent-dir/run.jsonl"}, "does not exist"),
    ({"trace": "/tmp"}, "is a directory"), ({"world_size": True}, "world_size"),
    ({"world_size": 2.0}, "world_size"), ({"env": ["LAB_X=1"]}, "env must be a mapping"),
    ({"env": {"LAB X": "1"}}, "not an environment variable"),
    ({"env": {"LAB_SEGMENT_BYTES": 256}}, r"env\['LAB_SEGMENT_BYTES'\] must be a str")])
def test_bad_pool_options_name_the_parameter_and_leak_nothing(options, message):
    before = open_fds()
    options = {"world_size": 2, **options}
    with pytest.raises((ValueError, TypeError), match=message):
        lab.spawn(sum_ranks, options.pop("world_size"), **options)
    assert open_fds() == before


def ranks_see(mesh: lab.Mesh, name: str) -> str | None:
    return os.environ.get(name)


def test_env_holds_in_the_ranks_of_its_pool_alone():
    assert lab.spawn(ranks_see, 2, args=("LAB_TEST_ENV",), env={"LAB_TEST_ENV": "on"}) == ["on", "on"]
    assert "LAB_TEST_ENV" not in os.environ
    assert lab.spawn(ranks_see, 2, args=("LAB_TEST_ENV",)) == [None, None]


def test_pools_started_from_threads_at_once_each_see_their_own_env():
    seen = {}

    def start(value: str) -> None:
        options = {"env": {"LAB_TEST_ENV": value}} if value else {}
        seen[value] = lab.spawn(ranks_see, 2, args=("LAB_TEST_ENV",), **options)

    threads = [threading.Thread(target=start, args=(value,)) for value in ("a", "b", "")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert seen == {"a": ["a", "a"], "b": ["b", "b"], "": [None, None]}


def test_a_failed_shm_setup_closes_every_descriptor_it_made():
    import resource

    from lab.transport.shm import create_endpoints

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = open_fds()
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 200, hard))
    try:
        with pytest.raises(OSError):
            create_endpoints(40, 4096, 2)  # 3,120 pipes: runs out of descriptors part-way
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert open_fds() == before


def test_bad_trace_environment_is_refused(monkeypatch):
    monkeypatch.setenv("LAB_TRACE_STEPS", "maybe")
    with pytest.raises(ValueError, match="LAB_TRACE_STEPS"):
        lab.spawn(sum_ranks, 2)
    monkeypatch.delenv("LAB_TRACE_STEPS")
    monkeypatch.setenv("LAB_TRACE", "/nonexistent-dir/x.jsonl")
    with pytest.raises(ValueError, match="LAB_TRACE"):
        lab.spawn(sum_ranks, 2)


def traced(mesh: lab.Mesh) -> None:
    lab.allreduce(mesh, torch.ones(4))


def test_lab_trace_steps_zero_means_off(monkeypatch, tmp_path):
    trace = tmp_path / "run.jsonl"
    monkeypatch.setenv("LAB_TRACE_STEPS", "0")
    lab.spawn(traced, 2, trace=str(trace))
    kinds = {line.split('"kind": ')[1].split(",")[0] for line in trace.read_text().splitlines()}
    assert kinds == {'"collective"'}


# -- 12. unbounded deadlines ---------------------------------------------------------------------


def waits_forever_allowed(mesh: lab.Mesh) -> list[float]:
    x = torch.tensor([float(mesh.rank)])
    lab.allreduce(mesh, x)
    if mesh.rank == 0:
        mesh.send(1, x)
    elif mesh.rank == 1:
        x = mesh.recv(0, timeout_ms=math.inf)
    return x.tolist()


@pytest.mark.parametrize("timeout", [math.inf, 2.0**40])
@pytest.mark.parametrize("transport", ["shm", "queue", "tcp"])
def test_an_infinite_or_huge_deadline_waits_instead_of_overflowing(transport, timeout):
    assert lab.spawn(waits_forever_allowed, 2, transport=transport, recv_timeout_ms=timeout) == [[1.0], [1.0]]


# -- 13-15. arguments inside a rank ------------------------------------------------------------------


def argument_checks(mesh: lab.Mesh) -> list[str]:
    """Each case: what happened, so one failure shows them all."""
    warnings.filterwarnings("ignore",
                            message=".*(beta|prototype) state")  # torch's notes on sparse CSR, nested
    t = torch.arange(4.0) + mesh.rank
    other = (mesh.rank + 1) % mesh.world_size
    outcomes = []
    # torch's own op objects are the same ops; near-misses are not
    for op in (dist.ReduceOp.SUM, dist.ReduceOp(dist.ReduceOp.SUM), dist.ReduceOp.MAX, "SUM"):
        y = t.clone()
        lab.allreduce(mesh, y, op=op)
        outcomes.append(f"op {op!r}: {y.tolist()}")
    bad_calls = {
        "op garbage.sum": lambda: lab.allreduce(mesh, t.clone(), op="garbage.sum"),
        "sparse coo": lambda: lab.allreduce(mesh, t.to_sparse()),
        "sparse csr": lambda: lab.allreduce(mesh,
                                            t.reshape(2, 2).to_sparse_csr()),
        "nested": lambda: lab.allreduce(mesh, torch.nested.nested_tensor([torch.ones(
            2), torch.ones(3)])), "expand in place": lambda: lab.allreduce(mesh,
                                                                           torch.ones(1).expand(4)),
        "async_op no": lambda: lab.allreduce(mesh, t.clone(), async_op="no"),
        "send dst True": lambda: mesh.send(True, t),
        "recv timeout True": lambda: mesh.recv(other, timeout_ms=True)}
    for name, call in bad_calls.items():
        try:
            call()
            outcomes.append(f"{name}: accepted")
        except (ValueError, TypeError) as exc:
            outcomes.append(f"{name}: {type(exc).__name__}: {exc}")
    # read-only inputs are fine where nothing is written: an expand() view to allgather, a
    # read-only numpy array to send
    gathered = lab.allgather(mesh, torch.full((1,), float(mesh.rank)).expand(2))
    outcomes.append(f"allgather of an expand view: {gathered.tolist()}")
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    if mesh.rank == 0:
        mesh.send(1, frozen)
    elif mesh.rank == 1:
        outcomes.append(f"recv of a read-only send: {mesh.recv(0).tolist()}")
    return outcomes


def test_arguments_are_checked_with_messages_that_name_them(cluster):
    outcomes = cluster.run(argument_checks)
    for rank, seen in enumerate(outcomes):
        text = "\n".join(seen)
        assert "op <RedOpType.SUM: 0>: [3.0, 6.0, 9.0, 12.0]" in text and "op 'SUM': [3.0, 6.0, 9.0, 12.0]" in text
        assert seen[1].startswith("op <torch.distributed") and seen[1].endswith(": [3.0, 6.0, 9.0, 12.0]")
        assert "op <RedOpType.MAX: 4>: [2.0, 3.0, 4.0, 5.0]" in text
        assert "op garbage.sum: ValueError: op must be one of" in text
        assert "sparse coo: TypeError: tensor has layout torch.sparse_coo" in text
        assert "sparse csr: TypeError: tensor has layout torch.sparse_csr" in text
        assert "nested: TypeError: tensor is a nested tensor" in text
        assert "expand in place: ValueError: tensor has elements that share memory" in text
        assert "async_op no: TypeError: async_op must be True or False" in text
        assert "send dst True: ValueError: dst must be another rank" in text
        assert "recv timeout True: ValueError: timeout_ms must be" in text
        assert "allgather of an expand view: [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]" in text
        assert ("recv of a read-only send: [0.0, 1.0, 2.0]" in text) == (rank == 1)
    assert cluster.run(sum_ranks) == [3.0] * 3  # the mesh is still usable


# -- 16. Mesh.from_env with bad launcher variables ---------------------------------------------------


@pytest.mark.parametrize("variables, message", [
    ({"RANK": "x"}, "RANK must be an integer; got 'x'"),
    ({"MASTER_PORT": "99999"}, r"MASTER_PORT must be in \[1, 65535\]; got 99999"),
    ({"WORLD_SIZE": "-3"}, "WORLD_SIZE must be >= 1; got -3"),
    ({"RANK": "5"}, r"RANK must be in \[0, 1\]; got 5"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"LOCAL_WORLD_SIZE": "3"}, r"LOCAL_WORLD_SIZE must be in \[1, 2\]"),])
def test_from_env_names_the_bad_variable(monkeypatch, variables, message):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **variables}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        lab.Mesh.from_env()
    assert time.monotonic() - started < 1  # before any connection attempt


def test_from_env_across_hosts_without_a_secret_is_a_clear_error(monkeypatch):
    from lab.hosts.rendezvous import env_store

    for name, value in {
            "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LAB_TCP_SECRET", raising=False)
    try:
        with pytest.raises(lab.LabError,
                           match="ranks on several hosts need a shared secret: set LAB_TCP_SECRET"):
            lab.Mesh.from_env()
    finally:
        env_store.cache_clear()


# -- 17. the README's module names after a plain `import lab` ----------------------------------------


def test_lab_bucketing_and_lab_ddp_after_a_plain_import():
    done = subprocess.run(
        [sys.executable, "-c", "import lab; print(lab.bucketing.__name__, lab.ddp.allreduce_hook.__name__)"],
        capture_output=True, text=True, timeout=120, env=child_env())
    assert done.stdout.split() == ["lab.bucketing", "allreduce_hook"], done.stderr
