"""NCCL's closed forms (lab.sim.nccl) and the event simulator (lab.sim.simulate) agree where both
apply, and ``lab.sim.predict`` answers from either cluster model with one call.

Where both apply: a ring on one GPU a node, one channel, Simple, no protocol or plateau
adjustments. NCCL's closed form is then ``2(n-1) α + 2(n-1)/n · S / β`` for allreduce (its
latency ``(steps - net steps) α + net steps α`` counts 2n network steps less the 2 it takes back
inside the node: 2(n-1) in all) and ``(n-1) α + (n-1)/n · S / β`` for allgather; the simulator
replays the lab's ring, 2(n-1) (n-1) steps of S/n bytes, on a Network of α and β. Tolerance 0.1 %:
the simulator's chunks are whole float32 elements. A fitted model's ring is pipelined (its steps
and its bytes overlap): there it is the longer of the simulated ring's two parts.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import lab.sim
from lab.sim.nccl import ClusterTopology, NcclModel, PairTerms, predict_nccl, shipped
from lab.sim.nccl.known import POLARIS

pytestmark = pytest.mark.no_ranks

ALPHA_US, GBIT = 5.0, 100.0


def ring_only(nodes_gbyte: float, alpha_us: float) -> NcclModel:
    """A one-GPU-a-node cluster whose only term is a step's α and a channel's bandwidth."""
    topology = ClusterTopology(gpus_per_node=1, nics_per_node=1, nic_gbit=GBIT)
    nccl = shipped(topology)
    ring = PairTerms(base_us=0.0, intra_hop_us=alpha_us, net_hop_us=alpha_us, overhead_us=alpha_us,
                     channel_hop_us=0.0, efficiency=(1.0, 1.0, 1.0), cap_gbyte=(math.inf,) * 3)
    return NcclModel(topology=topology, pairs={
        ("ring", "simple"): ring}, channels=(1, 1, 1), channel_gbyte=(nodes_gbyte,) * 3, ring_plateau=1.0,
                     tree_correction=False, chooser=None, name=f"ring of {nccl.name}")


@pytest.mark.parametrize("collective", ["allreduce", "allgather"])
@pytest.mark.parametrize("hosts", [2, 5, 8])
def test_ring_simple_closed_form_is_the_simulated_ring(collective, hosts):
    model = ring_only(GBIT / 8, ALPHA_US)
    network = lab.sim.Network(alpha_us=ALPHA_US, gbit=GBIT, eager_bytes=None)
    for size in (1 << 20, 64 << 20):
        closed = lab.sim.predict(model, collective, hosts=hosts, nbytes=size)
        assert (closed.algorithm, closed.protocol) == ("ring", "simple")
        simulated = lab.sim.predict(network, collective, hosts=hosts, nbytes=size, candidates=["ring"])
        assert closed.time_us == pytest.approx(simulated.time_us, rel=1e-3), (collective, hosts, size)
        # a fitted model's pipelined ring overlaps the simulated ring's two parts: the longer of them
        piped = lab.sim.predict(replace(model, pipelined_ring=True), collective, hosts=hosts, nbytes=size)
        steps_us = (2 if collective == "allreduce" else 1) * (hosts - 1) * ALPHA_US
        assert piped.time_us == pytest.approx(max(steps_us, simulated.time_us - steps_us), rel=1e-3)


def test_predict_answers_nccls_pick_with_its_protocol():
    nccl = shipped(POLARIS)
    small = lab.sim.predict(nccl, "allreduce", hosts=2, nbytes=4096)
    large = lab.sim.predict(nccl, "all_reduce", hosts=540, nbytes=1 << 30)
    assert (small.algorithm, small.protocol) == ("tree", "ll")
    assert (large.protocol, large.nodes, large.collective) == ("simple", 540, "allreduce")
    assert large == nccl.predict("allreduce", 540, 1 << 30)
    assert predict_nccl(nccl, "allgather", hosts=8, nbytes=1 << 20).time_us > 0


@pytest.mark.parametrize("arguments, name", [({"hosts": 0, "nbytes": 1}, "hosts"),
                                             ({"hosts": -3, "nbytes": 1}, "hosts"),
                                             ({"hosts": 1.5, "nbytes": 1}, "hosts"),
                                             ({"hosts": True, "nbytes": 1}, "hosts"),
                                             ({"hosts": 2, "nbytes": 0}, "nbytes"),
                                             ({"hosts": 2, "nbytes": math.nan}, "nbytes"),
                                             ({"hosts": 2, "nbytes": 1, "choose": "best"}, "choose")])
def test_predict_nccl_names_a_bad_argument(arguments, name):
    with pytest.raises(ValueError, match=name):
        lab.sim.predict(shipped(POLARIS), "allreduce", **arguments)


def test_predict_nccl_refuses_what_is_no_model():
    with pytest.raises(TypeError, match="model must be an NcclModel"):
        predict_nccl(lab.sim.Network(), "allreduce", hosts=2, nbytes=4)
    with pytest.raises(ValueError, match="collective"):
        lab.sim.predict(shipped(POLARIS), "alltoall", hosts=2, nbytes=4)
