"""What a closed mesh leaves mapped and open in its rank's process: nothing of its shared memory,
whoever still holds views of it (a plan, a lane), while a registered tensor keeps its contents."""

from __future__ import annotations

import os

import pytest
import torch

import lab

MEMFDS = ("memfd:lab-mailboxes", "memfd:lab-rank")


def shared_memory_held() -> list[str]:
    """This process's mappings and descriptors of the lab's memfds."""
    with open("/proc/self/maps") as maps:
        mapped = [line.split()[-1] for line in maps if any(name in line for name in MEMFDS)]
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if any(name.split(":")[1] in target for name in MEMFDS):
            opened.append(target)
    return mapped + opened


def close_with_views_alive(mesh: lab.Mesh) -> dict:
    x = torch.arange(256, dtype=torch.float32) * 3 + mesh.rank
    plan = lab.allreduce_init(mesh, x)  # holds its compiled call's views of the mailboxes
    plan()
    lab.allreduce(mesh, x)
    lab.allreduce(mesh, x)  # the lane's call, kept with the template
    registered = lab.empty(mesh, (1000,))
    registered.copy_(torch.arange(1000.0) * 7 + mesh.rank)
    lab.barrier(mesh)
    before = shared_memory_held()
    mesh.close()
    after = shared_memory_held()
    kept = bool(torch.equal(registered, torch.arange(1000.0) * 7 + mesh.rank))
    registered += 1  # plain memory now: writable, no fault
    return {"before": len(before), "after": after, "kept": kept, "plan_alive": plan is not None}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_closed_mesh_unmaps_its_shared_memory_though_views_live(world_size):
    for result in lab.spawn(close_with_views_alive, world_size, transport="shm"):
        assert result["before"] > 0, "the mesh mapped no memfd: the check sees nothing"
        assert result["after"] == [], f"still mapped or open after close: {result['after']}"
        assert result["kept"] and result["plan_alive"]
