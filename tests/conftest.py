"""Shared fixtures: rank pools started once per test module, and a leak check after the session."""

from __future__ import annotations

import os
import signal
import socket
import sys

import multiprocessing
import pytest

import lab


def shm_entries() -> set[str]:
    """What /dev/shm holds, less multiprocessing's semaphores (another test process may be making
    them; the lab's own memory is memfds, which never appear here)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After all tests: no rank process alive and no new /dev/shm segment."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    ranks = [p for p in multiprocessing.active_children() if p.name.startswith("lab-rank")]
    assert not ranks, f"rank processes left running: {ranks}"
    assert not leaked, f"/dev/shm segments left behind: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _compiled_before_ranks(request):
    """The compiled plane's warm-up, once, before the first test of a module that starts ranks
    (a module marked ``no_ranks`` starts none and never pays for it)."""
    if request.node.get_closest_marker("no_ranks") is None:
        request.getfixturevalue("compiled_plane_warm")


@pytest.fixture(scope="session")
def compiled_plane_warm():
    """Compile the compiled data plane once (two ranks), before any test's pool: on a clean clone
    Numba's disk cache is empty, and every rank of every pool would compile it at once."""
    from lab.collectives import registry
    from lab.warmup import compile_all

    ran = lab.spawn(compile_all, 2, transport="shm")
    # one call per compilable algorithm, and allreduce's and broadcast's twice more (a torch tensor: the lane's call)
    expected = sum(len(registry.compiled(collective)) for collective in registry.ALGORITHMS) \
        + 2 * (len(registry.compiled("allreduce")) + len(registry.compiled("broadcast")))
    assert ran == [expected] * 2, f"the compiled plane's warm-up ran {ran} compiled collectives, expected {expected}"


def pool(world_size: int, transport: str, **options) -> lab.Cluster:
    """A rank pool for one test module (the caller closes it)."""
    return lab.launch(world_size, transport=transport, recv_timeout_ms=60_000, **options)


def sigint_as_ctrl_c() -> None:
    """A ``preexec_fn`` for a child a test interrupts with SIGINT: a shell without job control
    starts background jobs with SIGINT ignored, children inherit that, and Python then never
    raises KeyboardInterrupt; the child gets the default back, as a terminal's program has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a Python subprocess that imports this checkout's lab and tests."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
