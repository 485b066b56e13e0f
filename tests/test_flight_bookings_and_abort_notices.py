"""Issue 33, found from outside: what a rank books for its compiled calls, and what a failing rank
tells its peers under a launcher.

14. the flight recorder's bookings (one per compiled call that keeps its own books) are bounded
    when a program cycles through more call shapes than the templates remember, and a freed
    plan's is released;
15. under a launcher (ranks started as torchrun starts them, meeting through ``Mesh.from_env``)
    a size mismatch that one rank finds reaches every rank as that mismatch, not as "rank 0 is
    gone" (the abort notice, :class:`lab.transport.base.AbortNotice`);
23. a rank that waits on a stopped rank only through another names the stopped rank, not the
    innocent one in between.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import tracemalloc
from multiprocessing.process import BaseProcess as Process
from pathlib import Path

import pytest
import torch
from helpers import child_env, free_port
from torch_ranks import start_forked

import lab
from lab.collectives.prepared import MAX_REMEMBERED
from lab.flight import FLIGHT_RECORDER_SIZE

# -- 14: the flight recorder's bookings -----------------------------------------------------------

#: Compiled calls a plain call's shape keeps at most: its template's and its lane's.
CALLS_PER_SHAPE = 2
#: What the books may hold: the remembered shapes' calls, the plans alive, and the released numbers
#: the ring still shows.
BOOKED_BOUND = CALLS_PER_SHAPE * MAX_REMEMBERED + FLIGHT_RECORDER_SIZE + 8


def cycle_shapes(mesh: lab.Mesh, shapes: int, passes: int) -> list[str]:
    """Allreduce ``passes`` times over ``shapes`` sizes (more than the templates remember), each
    checked; the books' size and this rank's traced memory after each pass."""
    failures, sizes = [], []
    tracemalloc.start()
    for run in range(passes):
        for count in range(1, shapes + 1):
            x = torch.arange(count, dtype=torch.float32) * 7 + mesh.rank + run
            lab.allreduce(mesh, x)
            n = mesh.world_size
            want = (torch.arange(count, dtype=torch.float32) * 7 + run) * n + n * (n - 1) // 2
            if not torch.equal(x, want):
                failures.append(
                    f"rank {mesh.rank} pass {run} count {count}: {x[:4].tolist()} != {want[:4].tolist()}")
        sizes.append((len(mesh.exchange.recorder._booked), tracemalloc.get_traced_memory()[0]))
    tracemalloc.stop()
    booked = [b for b, _ in sizes]
    if max(booked) > BOOKED_BOUND:
        failures.append(f"rank {mesh.rank}: the books grow past {BOOKED_BOUND}: {booked} after each pass")
    grown = sizes[-1][1] - sizes[1][1]
    if grown > 64 * 1024:  # (where nothing is released, each pass books 2 x shapes numbers: ~60 KiB a pass)
        failures.append(f"rank {mesh.rank}: traced memory grows {grown} B from pass 2 to pass {passes}")
    return failures


def plans_made_and_freed(mesh: lab.Mesh, plans: int) -> list[str]:
    """``plans`` plans of one shape, each run once (checked) and freed: the books hold no more
    than the ring shows."""
    failures = []
    for run in range(plans):
        x = torch.arange(10, dtype=torch.float32) * 5 + mesh.rank + run
        with lab.allreduce_init(mesh, x) as plan:
            plan()
        n = mesh.world_size
        want = (torch.arange(10, dtype=torch.float32) * 5 + run) * n + n * (n - 1) // 2
        if not torch.equal(x, want):
            failures.append(f"rank {mesh.rank} plan {run}: {x[:4].tolist()} != {want[:4].tolist()}")
    booked = len(mesh.exchange.recorder._booked)
    if booked > CALLS_PER_SHAPE + FLIGHT_RECORDER_SIZE + 2:
        failures.append(f"rank {mesh.rank}: {plans} plans made and freed leave {booked} numbers booked")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_cycling_more_shapes_than_remembered_keeps_the_books_bounded(world_size):
    """Only the shm transport has the compiled plane, whose calls book numbers (tcp and queue book none)."""
    outputs = lab.spawn(cycle_shapes, world_size, args=(MAX_REMEMBERED + 64, 4), transport="shm")
    assert outputs == [[]] * world_size, outputs


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_freed_plan_releases_its_booking(world_size):
    """Only the shm transport has the compiled plane, whose calls book numbers (tcp and queue book none)."""
    outputs = lab.spawn(plans_made_and_freed, world_size, args=(300,), transport="shm")
    assert outputs == [[]] * world_size, outputs


# -- 15, 23: what a failing rank tells its peers under a launcher --------------------------------

#: The transports a launcher's ranks take: TCP, and shared memory on one host (its compiled plane too).
LAUNCHER_TRANSPORTS = ["tcp", "auto"]
#: The silent rank's peers' deadline (item 23: 2 s).
STOPPED_DEADLINE_MS = 2000


def rank_program() -> None:
    """One rank of a job started as torchrun starts it (``LAB_TEST_SCENARIO``, ``LAB_TEST_TRANSPORT``):

    - ``mismatch``: rank 0 allreduces 4 floats, the others 8;
    - ``stopped``: the last rank stops itself (SIGSTOP) where the others enter a recursive
      doubling allreduce: at N = 3 rank 0 waits on it through rank 1, at N = 4 through rank 2.

    Prints ``OK <result>`` or ``FAILED <type> after <seconds> s: <message>`` and exits 1, as an
    uncaught error ends a rank under torchrun."""
    scenario = os.environ["LAB_TEST_SCENARIO"]
    deadline_ms = STOPPED_DEADLINE_MS if scenario == "stopped" else 60_000
    mesh = lab.Mesh.from_env(recv_timeout_ms=deadline_ms, transport=os.environ["LAB_TEST_TRANSPORT"])
    rank, n = mesh.rank, mesh.world_size
    count = 4 if scenario == "mismatch" and rank == 0 else 8
    x = torch.arange(count, dtype=torch.float32) * n + rank
    if scenario == "stopped" and rank == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        lab.allreduce(mesh, x, algorithm="recursive_doubling")
    except lab.LabError as exc:
        print(f"FAILED {type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}", flush=True)
        sys.exit(1)
    print(f"OK {x.tolist()}", flush=True)
    mesh.close()


def launched(scenario: str, transport: str, world_size: int, xdg: Path) -> list[tuple[Process, Path]]:
    """The job's ranks, each with torchrun's variables, on one host; its secret files under ``xdg``;
    each rank's process and the file of its output."""
    port, ranks = free_port(), []
    for rank in range(world_size):
        env = child_env(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), XDG_RUNTIME_DIR=str(xdg), LAB_TEST_SCENARIO=scenario,
                        LAB_TEST_TRANSPORT=transport)
        env.pop("LAB_TCP_SECRET", None)
        output = xdg / f"rank{rank}.out"
        # forked from the forkserver that imported torch and lab (a fresh interpreter imports them again)
        ranks.append((start_forked(rank_program, (), env, output, f"launched-rank-{rank}"), output))
    return ranks


def outcomes(ranks: list[tuple[Process, Path]], timeout: float = 120) -> list[str]:
    """Each rank's last line of output (a rank still running at ``timeout`` is a hang: killed)."""
    lines = []
    for rank, (process, output) in enumerate(ranks):
        process.join(timeout)
        if process.exitcode is None:
            for other, _ in ranks:
                other.kill()
                other.join()
            raise AssertionError(f"rank {rank} hung")
        text = output.read_text()
        last = [line for line in text.strip().splitlines() if line.startswith(("OK ", "FAILED "))][-1:]
        lines.append(last[0] if last else f"exit {process.exitcode}: {text[-2000:]}")
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("transport", LAUNCHER_TRANSPORTS)
@pytest.mark.parametrize("world_size", [3, 4])  # a rank between (2 has none); each rank a process of its own
def test_a_mismatch_one_rank_finds_reaches_every_rank_as_that_mismatch(transport, world_size, tmp_path):
    """Rank 0 passes 4 floats, the others 8: every rank raises CollectiveMismatchError naming both
    sizes (the ranks that did not see rank 0's message were told by a peer), none "rank 0 is gone"."""
    lines = outcomes(launched("mismatch", transport, world_size, tmp_path))
    for line in lines:
        assert line.startswith("FAILED CollectiveMismatchError"), lines
        assert "float32[4]" in line and "float32[8]" in line, lines


@pytest.mark.slow
@pytest.mark.parametrize("transport", LAUNCHER_TRANSPORTS)
@pytest.mark.parametrize("world_size", [3, 4])  # a rank between (2 has none); each rank a process of its own
def test_every_survivor_names_the_stopped_rank_not_the_one_between(transport, world_size, tmp_path):
    """The last rank stops; every other rank raises DeadlineError about its deadline (not a hang),
    and every rank it names as waited for is the stopped one, also where it waited through another."""
    ranks = launched("stopped", transport, world_size, tmp_path)
    try:
        lines = outcomes(ranks[:-1])
    finally:
        ranks[-1][0].kill()  # (stopped: SIGKILL ends it all the same)
        ranks[-1][0].join()
    stopped = world_size - 1
    for line in lines:
        assert line.startswith("FAILED DeadlineError"), lines
        assert float(line.split(" after ")[1].split(" s")[0]) < 10 * STOPPED_DEADLINE_MS / 1000, lines
        waited_for = re.findall(r"waiting for ranks? ([\d, ]+)", line)
        assert waited_for and all(ranks_named.strip() == str(stopped) for ranks_named in waited_for), lines
