"""Shared fixtures: the compiled plane warmed before the first rank pool, and the leak checks (rank
processes per worker; /dev/shm once the whole session, every pytest-xdist worker, is done)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from pathlib import Path

import pytest
from helpers import shm_entries

import lab
from lab.launch.forkserver import start_context

_SHM_BEFORE = pytest.StashKey[set]()


@pytest.fixture(scope="session", autouse=True)
def no_rank_left_behind():
    """After this process's tests (each pytest-xdist worker's): no rank process of its alive."""
    yield
    ranks = [p for p in multiprocessing.active_children() if p.name.startswith("lab-rank")]
    assert not ranks, f"rank processes left running: {ranks}"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the process that runs the session, not a worker of it
        config.stash[_SHM_BEFORE] = shm_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every test, every worker gone: no new /dev/shm segment (a whole-machine check, so it
    runs once, where no worker's test can be making one meanwhile); a leak fails the run."""
    if hasattr(session.config, "workerinput") or _SHM_BEFORE not in session.config.stash:
        return
    leaked = shm_entries() - session.config.stash[_SHM_BEFORE]
    if leaked:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"/dev/shm segments left behind: {sorted(leaked)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before the first test of a session that starts ranks: the forkserver that starts them, with
    this module's ``helpers`` imported besides ``lab``. Every rank unpickles functions of helpers
    (and of the test modules, which import it); a forkserver that imported only ``lab`` left each
    rank to import helpers and pytest itself (0.3 CPU s a rank). The lab's own forkserver stays as it
    is for users: this one is started first, so the lab's ``start_context`` finds it running (one
    that dies is restarted by the lab, with ``lab`` alone)."""
    if session.config.option.collectonly or all(
            item.get_closest_marker("no_ranks") for item in session.items):
        return
    if start_context().get_start_method() != "forkserver":
        return
    # Python 3.11's forkserver imports its preload on the environment's path, not the one it is
    # handed: this folder goes on PYTHONPATH while it starts
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [path])])
    try:
        multiprocessing.forkserver.set_forkserver_preload(["lab", "helpers"])
        multiprocessing.forkserver.ensure_running()
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


@pytest.fixture(autouse=True)
def _compiled_before_ranks(request):
    """The compiled plane's warm-up, once, before the first test of a module that starts ranks
    (a module marked ``no_ranks`` starts none and never pays for it)."""
    if request.node.get_closest_marker("no_ranks") is None:
        request.getfixturevalue("compiled_plane_warm")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With workers (pytest-xdist), the session's own process fills Numba's disk cache before it
    starts them (xdist starts them after this hook): otherwise every worker's warm-up compiles the
    same code at once, on cores the ranks share."""
    if not hasattr(session.config, "workerinput") and session.config.getoption("numprocesses", None):
        warm_compiled_plane()


@pytest.fixture(scope="session")
def compiled_plane_warm():
    """Compile the compiled data plane once (two ranks), before any test's pool: on a clean clone
    Numba's disk cache is empty, and every rank of every pool would compile it at once (with
    workers, each one loads what the session's process compiled)."""
    warm_compiled_plane()


def warm_compiled_plane() -> None:
    """Run every compilable algorithm once in two ranks (compiling it, or loading it from Numba's
    disk cache), and check each ran."""
    from lab.algorithms import registry
    from lab.compiled.plane import DEFAULT_MAX_BYTES
    from lab.warmup import compile_all

    ran = lab.spawn(compile_all, 2, transport="shm", env={"LAB_COMPILED_MAX_BYTES": str(DEFAULT_MAX_BYTES)})
    # one call per compilable algorithm, and those of the four with lanes twice more (a torch tensor: the lane's call)
    expected = sum(len(registry.compiled(collective)) for collective in registry.ALGORITHMS) \
        + 2 * sum(len(registry.compiled(c)) for c in ("allreduce", "broadcast", "allgather", "reduce_scatter"))
    assert ran == [expected
                   ] * 2, f"the compiled plane's warm-up ran {ran} compiled collectives, expected {expected}"
