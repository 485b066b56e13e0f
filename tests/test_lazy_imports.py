"""What ``import lab`` loads: the simulator, the workload recorder and pandas only when first used.

A rank that runs collectives (the public calls on every transport, ``auto`` at a measured world
size) imports none of them; ``lab.sim.fit_cluster`` and ``lab.workload.load`` still work after
``import lab`` alone, and a recording rank loads the recorder when it starts recording.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import lab

ON_FIRST_USE = ("pandas", "lab.sim", "lab.workload", "matplotlib")


def loaded(names=ON_FIRST_USE) -> list[str]:
    return sorted(name for name in names if name in sys.modules)


def collectives(mesh: lab.Mesh) -> list[str]:
    """Each public call, small (the compiled path on shm) and large (the pipes), ``auto``."""
    for count in (8, 1 << 16):
        x = torch.arange(count, dtype=torch.float32) + mesh.rank
        lab.allreduce(mesh, x)
        lab.broadcast(mesh, x, src=mesh.world_size - 1)
        lab.allgather(mesh, x)
        lab.reduce_scatter(mesh, torch.arange(count * mesh.world_size, dtype=torch.float32))
    return loaded()


@pytest.mark.parametrize("transport", ["shm", "tcp", "queue"])
def test_a_rank_running_collectives_imports_neither_the_simulator_nor_pandas(transport):
    assert lab.spawn(collectives, 2, transport=transport) == [[], []]


def test_import_lab_loads_them_only_when_first_used():
    code = (f"import sys, lab; before = [m for m in {ON_FIRST_USE!r} if m in sys.modules]; "
            "lab.sim.fit_cluster; lab.workload.load; print(before, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr


def test_an_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'simm'"):
        lab.simm  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'fit_clusters'"):
        lab.sim.fit_clusters  # noqa: B018


def records(mesh: lab.Mesh) -> bool:
    lab.allreduce(mesh, torch.ones(4))
    return "lab.workload.record" in sys.modules


def test_a_recording_rank_loads_the_recorder_when_it_starts_recording(tmp_path):
    path = tmp_path / "step.jsonl"
    assert lab.spawn(records, 2, workload=str(path)) == [True, True]
    assert [event.op for event in lab.workload.load(path).events[0] if event.kind == "op"] == ["allreduce"]
