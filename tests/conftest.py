"""Shared fixtures: rank pools started once per test module, and a leak check after the session."""

from __future__ import annotations

import multiprocessing

import pytest

import lab
from helpers import shm_entries


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
    from lab.plane import DEFAULT_MAX_BYTES
    from lab.warmup import compile_all

    ran = lab.spawn(compile_all, 2, transport="shm", env={"LAB_COMPILED_MAX_BYTES": str(DEFAULT_MAX_BYTES)})
    # one call per compilable algorithm, and allreduce's and broadcast's twice more (a torch tensor: the lane's call)
    expected = sum(len(registry.compiled(collective)) for collective in registry.ALGORITHMS) \
        + 2 * (len(registry.compiled("allreduce")) + len(registry.compiled("broadcast")))
    assert ran == [expected] * 2, f"the compiled plane's warm-up ran {ran} compiled collectives, expected {expected}"


