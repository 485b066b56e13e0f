"""The registry: every list of algorithms in the lab comes from it, so a new algorithm is one file
and one ``register`` call. Proof: ``tests/extra_algorithm.py`` adds an allreduce the lab does not
ship, inside the rank processes only, and it runs through the public call, ``LAB_ALGO``, gloo, the
validation table and byte counters of ``python -m lab``, ``auto``'s model and the simulator with
no other edit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import pool

import lab
from lab.algorithms import registry

STRIDE = 3


@pytest.fixture(scope="module")
def cluster():
    with pool(5, "shm") as c:
        yield c


def new_algorithm_everywhere(mesh: lab.Mesh) -> list[str]:
    import extra_algorithm  # registers it in this rank's process

    from lab import tuning, validate
    from lab.collectives.choice import forced_algorithm
    from lab.reference import gloo_collective

    name, wrong = extra_algorithm.NAME, []
    # the public call, on every world size 1-5 (sub-meshes), every count shape, two dtypes
    for world in range(1, mesh.world_size + 1):
        sub = mesh.split(color=0 if mesh.rank < world else None)
        if sub is None:
            continue
        for count in sorted({0, 1, max(world - 1, 0), 2 * world + 1, 1000}):
            for dtype in (torch.float32, torch.int64):
                x = (torch.arange(count) * STRIDE + sub.rank).to(dtype)
                want = sum((torch.arange(count) * STRIDE + r).to(dtype) for r in range(world))
                sub.reset_stats()
                got = lab.allreduce(sub, x, algorithm=name)
                if got is not x or not torch.equal(x, want):
                    wrong.append(f"rank {mesh.rank} N={world} {dtype}[{count}]: {x[:4].tolist()}")
                total = count * x.element_size()
                if count % (2 * world) == 0:  # the formula's condition
                    model, formula = registry.ALGORITHMS["allreduce"][name].bytes_sent(sub.rank, world, total)
                    if sub.stats()["bytes_sent"] != model:
                        wrong.append(
                            f"rank {mesh.rank} N={world}: sent {sub.stats()['bytes_sent']} != {formula}")
    # gloo on random data
    data = torch.from_numpy(np.random.default_rng([7, mesh.rank]).normal(size=4099).astype(np.float32))
    ref = gloo_collective(mesh, "allreduce", data.clone())
    got = lab.allreduce(mesh, data.clone(), algorithm=name)
    if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
        wrong.append(f"rank {mesh.rank}: differs from gloo by {float((got - ref).abs().max())}")
    # python -m lab's rank-side functions: the validation table and the byte counters
    rows = [r for r in validate.validate_rank(mesh, 97, 1) if r["algorithm"] == name]
    if len(rows) != len(validate.DTYPES) or not all(r["within"] for r in rows):
        wrong.append(f"rank {mesh.rank}: validation rows {rows}")
    counted = [r for r in validate.byte_counters_rank(mesh, 4 * mesh.world_size) if r["algorithm"] == name]
    if len(counted) != 1:
        wrong.append(f"rank {mesh.rank}: byte counter rows {counted}")
    # LAB_ALGO, auto's model, the simulator (with the real call's byte counts)
    os.environ["LAB_ALGO"] = f"allreduce={name}"
    try:
        if forced_algorithm("allreduce") != name:
            wrong.append("LAB_ALGO does not force it")
    finally:
        del os.environ["LAB_ALGO"]
    if name not in registry.auto_candidates("allreduce") or tuning.algorithm_shape(name, 5) != (6, 6):
        wrong.append("auto's model does not know it")
    simulated = lab.sim.simulate("allreduce", name, mesh.world_size, 4000,
                                 lab.sim.Network(alpha_us=10, gbit=10))
    mesh.reset_stats()
    lab.allreduce(mesh, torch.zeros(1000), algorithm=name)
    if simulated.bytes_sent[mesh.rank] != mesh.stats()["bytes_sent"]:
        wrong.append(f"rank {mesh.rank}: simulated {simulated.bytes_sent[mesh.rank]} bytes, sent "
                     f"{mesh.stats()['bytes_sent']}")
    return wrong


def test_a_registered_algorithm_runs_everywhere_without_further_edits(cluster):
    assert cluster.run(new_algorithm_everywhere) == [[]] * 5


def test_the_test_session_registry_is_the_shipped_one():
    """(extra_algorithm was imported in the ranks only.)"""
    assert "reduce_broadcast" not in registry.ALGORITHMS["allreduce"]


def test_every_list_of_names_comes_from_the_registry():
    from lab import benchmark, validate
    from lab.collectives import calls

    assert calls.ALGORITHMS is registry.ALGORITHMS and benchmark.ALGORITHMS is registry.ALGORITHMS
    assert {a for c, a in validate.cases()} - {"auto"} == {a for e in registry.ALGORITHMS.values() for a in e}
    assert set(lab.sim.algorithms()) == set(registry.ALGORITHMS)
    for collective, entries in registry.ALGORITHMS.items():
        assert set(lab.sim.algorithms()[collective]) == set(entries), collective


@pytest.mark.parametrize("entry, message", [
    (registry.Algorithm("allreduce", "ring", print, print, 99), "already has an algorithm named 'ring'"),
    (registry.Algorithm("allreduce", "auto", print, print, 99), "already has an algorithm named 'auto'"),
    (registry.Algorithm("allreduce", "new", print, print, 1), "wire code 1 is out of range or taken"),
    (registry.Algorithm("allreduce", "new", print, print, 256), "wire code 256"),
    (registry.Algorithm("gossip", "new", print, print, 99), "collective must be one of")])
def test_a_bad_registration_is_refused(entry, message):
    with pytest.raises(ValueError, match=message):
        registry.register(entry)
    assert "new" not in registry.ALGORITHMS.get("allreduce", {})
