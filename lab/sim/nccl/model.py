"""NCCL's cost structure as closed forms: every (algorithm, protocol) pair a latency plus bytes over
a bandwidth, each term a named field, and the pick the cheapest pair.

For a collective of ``S`` bytes on ``nodes`` nodes of ``g`` GPUs (``n = nodes * g`` ranks), a pair
``(a, p)`` running on ``c`` channels (NCCL's choice for that size, :meth:`NcclModel.channels_used`):

    ring latency = base + (steps - net_steps) * max(intra_hop, overhead) + net_steps * net_hop
                   + steps * (c - 1) * channel_hop                      (across nodes)
        steps: allreduce 2(n-1), allgather and reducescatter n-1; net_steps: 2*nodes, nodes-1
    tree latency = base + 2 * ((g - 1) * intra_hop + depth * (net_hop + (c - 1) * channel_hop))
        depth = log2(nodes), rounded down: a chain inside a node, a double binary tree across
    bus bandwidth = min(cap, efficiency * channels * channel_bandwidth)   (per node class: 1, 2, >2)
    algorithm bandwidth = bus bandwidth * (ring: n / steps, tree: 1/2)
    time = latency + S / algorithm bandwidth                            (NCCL's tuner)
    ring time = base + max(latency - base, S / algorithm bandwidth)     (pipelined_ring: the fit's)

as in ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` (NCCL 2.21, :mod:`lab.sim.nccl.constants`),
with NCCL's two adjustments of its estimate (the ring's plateau factor on Simple allreduce latency,
the tree's medium-size bandwidth correction) as switches (a fitted model keeps the tree's and drops
the plateau, which its pipelined ring replaces). ``pipelined_ring`` is the lab's structure,
not NCCL's: the ring's steps overlap its transfers, so a ring call takes its chain of steps or its
bytes on the wire, whichever is longer, not their sum (on Polaris' 8-node allgather, Simple's steps
cost about 50 µs each when latency-bound, 1.6 ms for 31 steps, yet from 128 MiB up the times sit
only about 0.3 ms above the wire time; at 256 nodes 1,023 steps of it take 45 ms from 256 MiB to
1 GiB, flat, while the wire time grows from 6 to 25 ms). ``channel_hop`` is the lab's term, not
NCCL's: what each channel past the first adds to a network step (the proxy posts every channel's
sends in turn); NCCL's tuner has it 0. The fabric's terms (:mod:`lab.sim.nccl.topology`) are added
as given: a job spanning several groups or leaves pays ``crossing_hop_us`` on every ring step (the
ring moves in lockstep, and some step always crosses) and on each tree level above a group, and its
bandwidth is capped by the group's uplinks.

:func:`shipped` is NCCL's own estimate for a cluster: the shipped constants and the nominal graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from lab import checks
from lab.sim.nccl import constants as C
from lab.sim.nccl.topology import ClusterTopology, Graph, nominal_graph

Pair = tuple[str, str]
COLLECTIVES = ("allreduce", "allgather", "reducescatter")
#: The names nccl-tests and NCCL use for them.
ALIASES = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}
#: NCCL 2.21's algorithms for each collective on a cluster without CollNet and NVLS (tuning.cc skips
#: every other pair; allgather's PAT arrived in 2.23).
ALGORITHMS = {"allreduce": ("tree", "ring"), "allgather": ("ring",), "reducescatter": ("ring",)}
PAIRS = tuple((a, p) for a in ("tree", "ring") for p in C.PROTOCOLS)
#: Node classes NCCL's tables are indexed by: 1 node, 2 nodes, more.
NODE_CLASSES = ("1 node", "2 nodes", ">2 nodes")
MAX_NBYTES = 1 << 50
CHOICES = ("nccl", "fastest")


def node_class(nodes: int) -> int:
    return min(nodes, 3) - 1


def log2i(value: int) -> int:
    """NCCL's ``log2i``: the floor of log2, and 0 for 0 and 1."""
    return max(int(value).bit_length() - 1, 0)


def tree_depth(nodes: int) -> int:
    """Network levels of NCCL's double binary tree over ``nodes`` nodes."""
    return log2i(nodes)


def steps(collective: str, ranks: int, nodes: int) -> tuple[int, int]:
    """A ring's steps and how many of them NCCL's model counts as network steps."""
    if collective == "allreduce":
        return 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    return ranks - 1, nodes - 1


def collective_name(collective: Any) -> str:
    name = ALIASES.get(collective, collective)
    if name not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
    return name


def byte_count(nbytes: Any, name: str = "nbytes") -> int:
    if not checks.is_int(nbytes) or not 1 <= nbytes <= MAX_NBYTES:
        raise ValueError(f"{name} must be an int in [1, 2**50]; got {nbytes!r}")
    return int(nbytes)


@dataclass(frozen=True)
class PairTerms:
    """One (algorithm, protocol) pair's terms: latencies in µs (``overhead_us``: what a ring step
    inside a node costs at least in a job across nodes, the proxy's post of a network step, NCCL's
    ``getNetOverhead``, 3x for Simple), ``efficiency`` the share of the graph's bandwidth the pair
    reaches and ``cap_gbyte`` NCCL's ceiling on its bus bandwidth, each per node class (1 node, 2
    nodes, more)."""

    base_us: float
    intra_hop_us: float
    net_hop_us: float
    overhead_us: float
    channel_hop_us: float
    efficiency: tuple[float, float, float]
    cap_gbyte: tuple[float, float, float]


@dataclass(frozen=True)
class NcclPrediction:
    collective: str
    nodes: int
    nbytes: int
    time_us: float
    algorithm: str
    protocol: str
    channels: int


@dataclass(frozen=True)
class NcclModel:
    """A cluster's collectives priced NCCL's way. ``channels`` and ``channel_gbyte`` are the
    graph's, per node class; ``chooser`` the model whose cheapest pair NCCL runs (its own
    tuner's, :func:`shipped`), None for this model's own."""

    topology: ClusterTopology
    pairs: Mapping[Pair, PairTerms]
    channels: tuple[int, int, int]
    channel_gbyte: tuple[float, float, float]
    ring_plateau: float = C.RING_PLATEAU
    tree_correction: bool = True
    pipelined_ring: bool = False
    chooser: NcclModel | None = field(default=None, repr=False)
    name: str = "NCCL 2.21 tuner"

    def enabled(self, pair: Pair, collective: str, nodes: int) -> bool:
        if pair not in self.pairs or pair[0] not in ALGORITHMS[collective]:
            return False
        return pair[1] != "ll128" or self.topology.intra_link == "nvlink" and (
            nodes == 1 or self.topology.ll128_across_nodes)

    def comm_channels(self, nodes: int) -> int:
        return min(C.MAX_CHANNELS, 2 * self.channels[node_class(nodes)])

    def channels_used(self, pair: Pair, nbytes: int, nodes: int) -> int:
        """NCCL's channels for a call (``getChannnelThreadInfo``): fewer while each thread of each
        channel would have less than its threshold of bytes (ring LL's threshold times the ranks)."""
        _, protocol = pair
        ranks = nodes * self.topology.gpus_per_node
        threads = C.MAX_THREADS[protocol]
        if pair == (
                "ring", "simple"
        ) and self.channels[node_class(nodes)] * self.channel_gbyte[node_class(nodes)] <= C.PCI_GBYTE:
            threads = 256
        threshold = C.THREAD_THRESHOLD[protocol] * (ranks if pair == ("ring", "ll") else 1)
        used = self.comm_channels(nodes)
        while used >= 2 and nbytes < used * threads * threshold:
            used -= 1
        return used

    def latency_us(self, collective: str, pair: Pair, nodes: int, channels_used: int) -> float:
        terms = self.pairs[pair]
        gpus = self.topology.gpus_per_node
        ranks = nodes * gpus
        extra_channels = channels_used - 1 if nodes > 1 else 0
        crossing = self.topology.crossing_us(nodes)
        if pair[0] == "ring":
            total, net = steps(collective, ranks, nodes)
            inside = max(terms.intra_hop_us, terms.overhead_us) if nodes > 1 else terms.intra_hop_us
            return (terms.base_us + (total - net) * inside + net * terms.net_hop_us + total *
                    (extra_channels * terms.channel_hop_us + crossing))
        depth = tree_depth(nodes)
        group = nodes if crossing == 0 else min(nodes, self.topology.fabric.nodes_per_group)
        levels_across = depth - tree_depth(group)
        return terms.base_us + 2 * (
            (gpus - 1) * terms.intra_hop_us + depth *
            (terms.net_hop_us + extra_channels * terms.channel_hop_us) + levels_across * crossing)

    def bus_gbyte(self, pair: Pair, nodes: int) -> float:
        """The pair's bus bandwidth (GB/s): its share of the graph's, under NCCL's ceiling and the
        fabric's uplinks where the job spans several groups."""
        k = node_class(nodes)
        terms = self.pairs[pair]
        bus = min(terms.cap_gbyte[k], terms.efficiency[k] * self.channels[k] * self.channel_gbyte[k])
        return bus * self.topology.crossing_share(nodes, bus)

    def algorithm_gbyte(self, collective: str, pair: Pair, nodes: int) -> float:
        ranks = nodes * self.topology.gpus_per_node
        ratio = ranks / steps(collective, ranks, nodes)[0] if pair[0] == "ring" else 0.5
        return self.bus_gbyte(pair, nodes) * ratio

    def tree_factor(self, pair: Pair, nbytes: int) -> float:
        """NCCL's medium-size correction of a tree's bandwidth (1 for rings, or where switched off)."""
        size_index = log2i(nbytes >> 6)
        if self.tree_correction and pair[0] == "tree" and size_index < 23:
            return C.TREE_CORRECTION[pair[1]][size_index]
        return 1.0

    def time_us(self, collective: str, pair: Pair, nodes: int, nbytes: int) -> float:
        """The closed form for one pair, with NCCL's adjustments where this model has them: the
        latency plus the wire time, or for a pipelined ring its base plus the longer of the two."""
        latency, wire = self.parts_us(collective, pair, nodes, nbytes)
        if self.pipelined_ring and pair[0] == "ring":
            base = self.pairs[pair].base_us
            return base + max(latency - base, wire)
        return latency + wire

    def wire_bound(self, collective: str, pair: Pair, nodes: int, nbytes: int) -> bool:
        """Whether a pipelined ring's call takes its wire time (not its chain of steps)."""
        latency, wire = self.parts_us(collective, pair, nodes, nbytes)
        return bool(wire > latency - self.pairs[pair].base_us)

    def parts_us(self, collective: str, pair: Pair, nodes: int, nbytes: int) -> tuple[float, float]:
        """The pair's latency and its bytes' time on the wire (µs)."""
        used = self.channels_used(pair, nbytes, nodes)
        latency = self.latency_us(collective, pair, nodes, used)
        bandwidth = self.algorithm_gbyte(collective, pair, nodes)
        bandwidth *= self.tree_factor(pair, nbytes)
        ranks = nodes * self.topology.gpus_per_node
        if (pair == ("ring", "simple") and collective == "allreduce" and nodes > 1 and
                nbytes // (self.comm_channels(nodes) * ranks) >= 64):
            latency *= self.ring_plateau
        return latency, nbytes / (1000.0 * bandwidth)

    def times(self, collective: Any, nodes: Any, nbytes: Any) -> dict[Pair, float]:
        """Every enabled pair's time (µs) for the call."""
        collective = collective_name(collective)
        nodes = self.topology.nodes(nodes)
        nbytes = byte_count(nbytes)
        return {
            pair: self.time_us(collective, pair, nodes, nbytes)
            for pair in PAIRS if self.enabled(pair, collective, nodes)}

    def pick(self, collective: Any, nodes: Any, nbytes: Any) -> Pair:
        """The pair this model finds cheapest (NCCL: the first of equal times, in its order)."""
        times = self.times(collective, nodes, nbytes)
        return min(times, key=times.__getitem__)

    def predict(self, collective: Any, nodes: Any, nbytes: Any, choose: str = "nccl") -> NcclPrediction:
        """The time of the pair NCCL runs (``choose="nccl"``: its tuner's cheapest) or of this
        model's cheapest (``"fastest"``: what a tuner plugin could make NCCL run)."""
        if choose not in CHOICES:
            raise ValueError(f"choose must be one of {', '.join(CHOICES)}; got {choose!r}")
        times = self.times(collective, nodes, nbytes)
        chooser = self if choose == "fastest" or self.chooser is None else self.chooser
        pair = chooser.pick(collective, nodes, nbytes)
        if pair not in times:
            raise ValueError(f"the chooser's pick {pair} has no terms in {self.name}")
        name = collective_name(collective)
        return NcclPrediction(name, int(nodes), int(nbytes), float(times[pair]), pair[0], pair[1],
                              self.channels_used(pair, int(nbytes), int(nodes)))

    def table(self, collective: Any, nodes: Any, sizes: Iterable[Any], choose: str = "nccl") -> pd.DataFrame:
        """A row per size: bytes, time_us, algorithm, protocol, channels, algbw and busbw (GB/s,
        nccl-tests' definitions)."""
        rows = [self.predict(collective, nodes, size, choose) for size in sizes]
        frame = pd.DataFrame([{
            "bytes": r.nbytes, "time_us": r.time_us, "algorithm": r.algorithm, "protocol": r.protocol,
            "channels": r.channels} for r in rows])
        if rows:
            ranks = rows[0].nodes * self.topology.gpus_per_node
            factor = 2 * (ranks - 1) / ranks if rows[0].collective == "allreduce" else (ranks - 1) / ranks
            frame["algbw"] = frame["bytes"] / frame["time_us"] / 1e3
            frame["busbw"] = frame["algbw"] * factor
        return frame


def predict_nccl(model: NcclModel, collective: Any, *, hosts: Any, nbytes: Any,
                 choose: str = "nccl") -> NcclPrediction:
    """``lab.sim.predict(model, collective, hosts=H, nbytes=B)`` for a model of NCCL's closed forms
    (``lab.sim.nccl.fit(...).model``, or :func:`shipped`): the time (µs) of the pair NCCL runs on
    ``hosts`` nodes, which algorithm and protocol, on how many channels; ``nbytes`` as nccl-tests
    counts a size (allgather's is the whole output).

        predict_nccl(report.model, "allreduce", hosts=540, nbytes=1 << 30).protocol   # "simple"
    """
    if not isinstance(model, NcclModel):
        raise TypeError(f"model must be an NcclModel (lab.sim.nccl.fit(...).model); "
                        f"got {type(model).__name__}")
    return model.predict(collective, model.topology.nodes(hosts, "hosts"), byte_count(nbytes), choose)


def _shipped_pair(topology: ClusterTopology, pair: Pair, channels: tuple[int, int, int],
                  version: str = "2.21") -> PairTerms:
    """NCCL's terms for a pair (its release ``version``'s): tuning.cc's latencies and its
    bandwidth refinements written as an efficiency under a ceiling, per node class."""
    algorithm, protocol = pair
    index = C.PROTOCOLS.index(protocol)
    gpu = topology.gpu
    across = "ampere" if topology.cpu == "amd" else "volta"  # llMaxBws' rows across nodes: the CPU's
    ll_max = tuple(C.LL_MAX_GBYTE[gpu if k == 0 else across][k] for k in range(3))
    efficiency, cap = [], []
    for k in range(3):
        c = channels[k]
        tree_cap = c * C.TREE_MAX_GBYTE[gpu][k]
        if pair == ("ring", "ll"):
            e = C.RING_LL_EFFICIENCY_2_18 if version == "2.18" else C.RING_LL_EFFICIENCY
            m = ll_max[k]
        elif pair == ("ring", "ll128"):
            e = C.LL128_EFFICIENCY if topology.gpus_per_node >= 2 else C.LL128_EFFICIENCY_ONE_GPU_A_NODE
            m = c * C.RING_LL128_MAX_GBYTE[gpu][k]
        elif pair == ("ring", "simple"):
            e, m = 1.0, math.inf
        elif pair == ("tree", "simple"):
            e, m = C.TREE_EFFICIENCY, tree_cap
        elif pair == ("tree", "ll"):
            e, m = C.TREE_EFFICIENCY * C.TREE_LL_EFFICIENCY, min(tree_cap * C.TREE_LL_EFFICIENCY, ll_max[k])
        else:
            f = C.TREE_LL128_EFFICIENCY_ONE_NODE if k == 0 else C.TREE_LL128_EFFICIENCY
            e, m = C.TREE_EFFICIENCY * f, min(tree_cap * f, c * C.TREE_LL128_MAX_GBYTE[gpu][k])
        efficiency.append(e)
        cap.append(m)
    overhead = C.NET_OVERHEAD_US[topology.cpu] * (C.SIMPLE_NET_OVERHEAD_FACTOR if protocol == "simple" else 1)
    hops = {link: C.HOP_LATENCY_US[link][algorithm][index] for link in C.LINKS}
    if version == "2.18" and pair == ("tree", "simple"):
        hops = C.TREE_SIMPLE_HOP_LATENCY_US_2_18
    return PairTerms(base_us=C.BASE_LATENCY_US[algorithm][protocol], intra_hop_us=hops[topology.intra_link],
                     net_hop_us=hops["net"], overhead_us=overhead if algorithm == "ring" else 0.0,
                     channel_hop_us=0.0, efficiency=tuple(efficiency), cap_gbyte=tuple(cap))


def graphs_by_class(topology: ClusterTopology) -> tuple[Graph, Graph, Graph]:
    return nominal_graph(topology, 1), nominal_graph(topology, 2), nominal_graph(topology, 3)


def shipped(topology: ClusterTopology, graphs: tuple[Graph, Graph, Graph] | None = None,
            version: str = "2.21") -> NcclModel:
    """NCCL's estimate for the cluster: the constants of its release ``version`` (2.21 or 2.18,
    :data:`~lab.sim.nccl.constants.VERSIONS`), and the graph of each node class (``graphs``; by
    default what its search finds from the nominal speeds, :func:`nominal_graph`). Jobs of 1 and 2
    nodes use a graph's bandwidth inside a node (``bwIntra``), larger ones across."""
    if not isinstance(topology, ClusterTopology):
        raise TypeError(f"topology must be a ClusterTopology; got {topology!r}")
    if version not in C.VERSIONS:
        raise ValueError(f"version must be one of {', '.join(C.VERSIONS)}; got {version!r}")
    graphs = graphs_by_class(topology) if graphs is None else graphs
    if len(graphs) != 3 or not all(isinstance(graph, Graph) for graph in graphs):
        raise TypeError(f"graphs must be three Graphs (1 node, 2 nodes, more); got {graphs!r}")
    channels = tuple(graph.channels for graph in graphs)
    bandwidth = (graphs[0].intra_gbyte, graphs[1].intra_gbyte, graphs[2].inter_gbyte)
    pairs = {pair: _shipped_pair(topology, pair, channels, version) for pair in PAIRS}
    return NcclModel(topology=topology, pairs=pairs, channels=channels, channel_gbyte=bandwidth,
                     ring_plateau=C.RING_PLATEAU if topology.gpu != "volta" else C.RING_PLATEAU_BEFORE_AMPERE,
                     name=f"NCCL {version} tuner")


__all__ = [
    "COLLECTIVES", "PAIRS", "NcclModel", "NcclPrediction", "PairTerms", "predict_nccl", "shipped",
    "tree_depth"]
