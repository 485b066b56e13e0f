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

import tracemalloc

import pytest
import torch

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
                failures.append(f"rank {mesh.rank} pass {run} count {count}: {x[:4].tolist()} != {want[:4].tolist()}")
        sizes.append((len(mesh._recorder._booked), tracemalloc.get_traced_memory()[0]))
    tracemalloc.stop()
    booked = [b for b, _ in sizes]
    if max(booked) > BOOKED_BOUND:
        failures.append(f"rank {mesh.rank}: the books grow past {BOOKED_BOUND}: {booked} after each pass")
    grown = sizes[-1][1] - sizes[1][1]
    if grown > 64 * 1024:  # (where nothing is released, each pass books 2 x shapes numbers: ~120 KiB)
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
    booked = len(mesh._recorder._booked)
    if booked > CALLS_PER_SHAPE + FLIGHT_RECORDER_SIZE + 2:
        failures.append(f"rank {mesh.rank}: {plans} plans made and freed leave {booked} numbers booked")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_cycling_more_shapes_than_remembered_keeps_the_books_bounded(world_size):
    """Only the shm transport has the compiled plane, whose calls book numbers (tcp and queue book none)."""
    outputs = lab.spawn(cycle_shapes, world_size, args=(2 * MAX_REMEMBERED + 100, 4), transport="shm")
    assert outputs == [[]] * world_size, outputs


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_freed_plan_releases_its_booking(world_size):
    """Only the shm transport has the compiled plane, whose calls book numbers (tcp and queue book none)."""
    outputs = lab.spawn(plans_made_and_freed, world_size, args=(300,), transport="shm")
    assert outputs == [[]] * world_size, outputs
