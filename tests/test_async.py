"""async_op=True: a Work handle at once, completion in issue order, errors at wait()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import wait_until

import lab


def async_in_order(mesh: lab.Mesh) -> list[str]:
    failures = []
    n = mesh.world_size
    tensors = [torch.full((1000 + i,), float(mesh.rank + i)) for i in range(8)]
    works = [
        lab.allreduce(mesh, t, async_op=True, algorithm="ring" if i % 2 else "tree")
        for i, t in enumerate(tensors)]
    gathered = lab.allgather(mesh, torch.tensor([mesh.rank]), async_op=True)
    scattered = lab.reduce_scatter(mesh, torch.arange(2.0 * n) + mesh.rank, async_op=True)
    root = lab.broadcast(mesh, torch.full((3,), float(mesh.rank)), src=n - 1, async_op=True)
    for i, (work, t) in enumerate(zip(works, tensors)):
        if not isinstance(work, lab.Work) or not work.wait() or not work.is_completed():
            failures.append(f"rank {mesh.rank} work {i} handle")
        if not torch.equal(t, torch.full_like(t, sum(r + i for r in range(n)))):
            failures.append(f"rank {mesh.rank} work {i} value")
    if not torch.equal(gathered.result(), torch.arange(n)):
        failures.append(f"rank {mesh.rank} allgather")
    block = torch.tensor_split(sum(torch.arange(2.0 * n) + r for r in range(n)), n)[mesh.rank]
    if not torch.equal(scattered.result(), block):
        failures.append(f"rank {mesh.rank} reduce_scatter")
    if not torch.equal(root.result(), torch.full((3,), float(n - 1))):
        failures.append(f"rank {mesh.rank} broadcast")
    # the issue order is the completion order: a later synchronous call sees every async one done
    seqs = [r.seq for r in mesh.flight_records()]
    if seqs != sorted(seqs):
        failures.append(f"rank {mesh.rank} completion order {seqs}")
    return failures


def overlap_compute(mesh: lab.Mesh, flags: str) -> tuple[bool, bool]:
    """An async allreduce waiting on a slow peer does not block this rank's computation (rank 1
    joins once rank 0 has its handle, and has looked at it: the file ``handed`` in ``flags``)."""
    x, handed = torch.ones(10), Path(flags) / "handed"
    if mesh.rank == 1:
        wait_until(handed.exists, "rank 0's handle")
    work = lab.allreduce(mesh, x, async_op=True)
    done_before_compute = work.is_completed()
    if mesh.rank == 0:
        handed.touch()
    torch.randn(200, 200) @ torch.randn(200, 200)
    work.wait()
    return done_before_compute, bool(torch.equal(x, torch.full((10,), float(mesh.world_size))))


def bad_async(mesh: lab.Mesh) -> str:
    try:
        lab.allreduce(mesh, torch.ones(2), op="mean", async_op=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("transport", ["shm", "queue"])
def test_async_collectives_complete_in_issue_order(transport):
    outputs = lab.spawn(async_in_order, 3, transport=transport)
    assert not [f for per_rank in outputs for f in per_rank]


def test_async_returns_before_the_collective_completes(tmp_path):
    outputs = lab.spawn(overlap_compute, 2, args=(str(tmp_path),))
    assert outputs[0] == (False, True)  # rank 0 got its handle while rank 1 was still waiting
    assert all(ok for _, ok in outputs)


def test_bad_arguments_raise_at_the_call_not_at_wait():
    assert all("op" in message for message in lab.spawn(bad_async, 2))
