"""A cluster as its user knows it, stated once: GPUs and NICs a node, the NIC's speed, the link
inside a node, and the fabric above the nodes (a fat tree with its oversubscription, or a dragonfly
with its groups and the share of a group's bandwidth its global links carry).

    polaris = ClusterTopology(gpus_per_node=4, nics_per_node=2, nic_gbit=200, cpu="amd", nic_path="phb",
                              fabric=Dragonfly(nodes_per_group=..., global_link_share=..., global_hop_us=...))

The fabric's terms are given as built, never fitted: logs of a few nodes, inside one leaf or one
group, cannot see what crossing the fabric costs. :func:`nominal_graph` is what NCCL's topology
search would give the cluster (its channels and each channel's bandwidth), from the nominal speeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lab import checks
from lab.sim.nccl import constants as C

CPUS = ("amd", "intel", "other")
INTRA_LINKS = ("nvlink", "pci")
#: NCCL's path types from a GPU to its NIC, nearest first; LL128 runs across nodes only up to PXB.
NIC_PATHS = ("pix", "pxb", "phb", "sys")


def positive(value: Any, name: str) -> float:
    """A finite real number > 0 (not a bool, not NaN)."""
    if not checks.is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    return float(value)


def count(value: Any, name: str) -> int:
    """An int >= 1 (not a bool)."""
    if not checks.is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return int(value)


def non_negative(value: Any, name: str) -> float:
    """A finite real number >= 0."""
    if not checks.is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return float(value)


def choice(value: Any, name: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(options)}; got {value!r}")
    return value


@dataclass(frozen=True)
class FatTree:
    """Leaves of ``nodes_per_leaf`` nodes under a spine: ``oversubscription`` is the leaf's downlink
    to uplink bandwidth (2.0 for 2:1); ``spine_hop_us`` what a path through the spine adds."""

    nodes_per_leaf: int
    oversubscription: float = 1.0
    spine_hop_us: float = 0.0
    leaves: int | None = None

    def __post_init__(self) -> None:
        count(self.nodes_per_leaf, "nodes_per_leaf")
        if positive(self.oversubscription, "oversubscription") < 1:
            raise ValueError("oversubscription must be >= 1 (downlinks : uplinks); "
                             f"got {self.oversubscription!r}")
        non_negative(self.spine_hop_us, "spine_hop_us")
        if self.leaves is not None:
            count(self.leaves, "leaves")

    @property
    def nodes_per_group(self) -> int:
        return self.nodes_per_leaf

    @property
    def uplink_share(self) -> float:
        return 1.0 / self.oversubscription

    @property
    def crossing_hop_us(self) -> float:
        return self.spine_hop_us

    @property
    def capacity(self) -> int | None:
        return None if self.leaves is None else self.leaves * self.nodes_per_leaf


@dataclass(frozen=True)
class Dragonfly:
    """Groups of ``nodes_per_group`` nodes joined by global links: ``global_link_share`` is the
    bandwidth of a group's global links over its nodes' injection bandwidth; ``global_hop_us``
    what a path between groups adds (its extra switch traversals)."""

    nodes_per_group: int
    global_link_share: float
    global_hop_us: float = 0.0
    groups: int | None = None

    def __post_init__(self) -> None:
        count(self.nodes_per_group, "nodes_per_group")
        positive(self.global_link_share, "global_link_share")
        non_negative(self.global_hop_us, "global_hop_us")
        if self.groups is not None:
            count(self.groups, "groups")

    @property
    def uplink_share(self) -> float:
        return self.global_link_share

    @property
    def crossing_hop_us(self) -> float:
        return self.global_hop_us

    @property
    def capacity(self) -> int | None:
        return None if self.groups is None else self.groups * self.nodes_per_group


@dataclass(frozen=True)
class ClusterTopology:
    """The nodes and the fabric. ``intra_gbyte`` is one GPU's bandwidth to its peers inside a node
    (NVLink or PCIe), ``pci_gbyte`` the GPU-NIC path's (PCIe Gen4 x16: NCCL's 24 GB/s);
    ``nic_path`` how far a NIC is from its GPUs (NCCL's PIX/PXB/PHB/SYS: LL128 runs across nodes
    only up to PXB); ``gpu`` the generation and ``cpu`` the vendor NCCL's tables are indexed by.
    No CollNet (in-network reduction) and no NVLS (NVSwitch multicast): the model prices rings and
    trees alone, NCCL's only algorithms on a cluster without either."""

    gpus_per_node: int
    nics_per_node: int
    nic_gbit: float
    intra_link: str = "nvlink"
    intra_gbyte: float = 100.0
    pci_gbyte: float = C.PCI_GBYTE
    nic_path: str = "pxb"
    gpu: str = "ampere"
    cpu: str = "intel"
    fabric: FatTree | Dragonfly | None = None

    def __post_init__(self) -> None:
        count(self.gpus_per_node, "gpus_per_node")
        count(self.nics_per_node, "nics_per_node")
        positive(self.nic_gbit, "nic_gbit")
        choice(self.intra_link, "intra_link", INTRA_LINKS)
        positive(self.intra_gbyte, "intra_gbyte")
        positive(self.pci_gbyte, "pci_gbyte")
        choice(self.nic_path, "nic_path", NIC_PATHS)
        choice(self.gpu, "gpu", C.GENERATIONS)
        choice(self.cpu, "cpu", CPUS)
        if self.fabric is not None and not isinstance(self.fabric, (FatTree, Dragonfly)):
            raise TypeError(f"fabric must be a FatTree, a Dragonfly or None; got {self.fabric!r}")

    @property
    def nic_gbyte(self) -> float:
        return self.nic_gbit / 8.0

    def nodes(self, nodes: Any, name: str = "nodes") -> int:
        """``nodes`` checked against the cluster: an int >= 1 the fabric has room for."""
        nodes = count(nodes, name)
        capacity = None if self.fabric is None else self.fabric.capacity
        if capacity is not None and nodes > capacity:
            raise ValueError(f"{name}={nodes} does not fit the fabric: it has {capacity} nodes")
        return nodes

    def nodes_of_ranks(self, ranks: Any, name: str = "ranks") -> int:
        """The node count ``ranks`` fill at ``gpus_per_node`` a node (a rank a GPU)."""
        ranks = count(ranks, name)
        if ranks % self.gpus_per_node:
            raise ValueError(f"{name}={ranks} is not a whole number of nodes of gpus_per_node="
                             f"{self.gpus_per_node}")
        return self.nodes(ranks // self.gpus_per_node, name)

    def groups_spanned(self, nodes: int) -> int:
        """Leaves or groups a job of ``nodes`` nodes placed in order spans (1 without a fabric)."""
        return 1 if self.fabric is None else -(-nodes // self.fabric.nodes_per_group)

    def crossing_us(self, nodes: int) -> float:
        """What a path between groups adds, for a job that spans several (0 inside one)."""
        return self.fabric.crossing_hop_us if self.groups_spanned(nodes) > 1 else 0.0

    def crossing_share(self, nodes: int, flow_gbyte: float) -> float:
        """What is left of a flow of ``flow_gbyte`` out of a group (every channel of a ring or a
        tree leaving it) on the group's uplinks: min(1, uplink bandwidth / flow), or 1 inside one."""
        if self.groups_spanned(nodes) < 2:
            return 1.0
        per_group = min(nodes, self.fabric.nodes_per_group)
        uplinks = self.fabric.uplink_share * per_group * self.nics_per_node * self.nic_gbyte
        return min(1.0, uplinks / flow_gbyte)

    @property
    def ll128_across_nodes(self) -> bool:
        """NCCL 2.21 enables LL128 by default only on NVLink nodes whose NIC is at most PXB away."""
        return self.intra_link == "nvlink" and NIC_PATHS.index(self.nic_path) <= NIC_PATHS.index("pxb")


@dataclass(frozen=True)
class Graph:
    """NCCL's ring/tree graph for a job: its channels and each one's bandwidth (GB/s) on one node
    and across nodes; ``comm_channels`` is what a call may run on (connect.cc doubles the graph's)."""

    channels: int
    intra_gbyte: float
    inter_gbyte: float

    def __post_init__(self) -> None:
        count(self.channels, "channels")
        positive(self.intra_gbyte, "intra_gbyte")
        positive(self.inter_gbyte, "inter_gbyte")

    @property
    def comm_channels(self) -> int:
        return min(C.MAX_CHANNELS, 2 * self.channels)


def _speed(limit: float, speeds: tuple[float, ...]) -> float:
    """search.cc's first speed of its list at most ``limit`` (its slowest where none is)."""
    return next((speed for speed in speeds if speed <= limit), speeds[-1])


def nominal_graph(topology: ClusterTopology, nodes: int) -> Graph:
    """What NCCL's search finds from the nominal speeds, in its simplest case: across nodes a
    channel a NIC (more where a NIC holds several at the speed), at the fastest speed of NCCL's list
    the GPU-NIC path carries; on one node at the speed of NCCL's list the GPU's link carries. A
    graph of >= 25 GB/s a channel is doubled at half the speed (``ncclTopoDupChannels``)."""
    if not isinstance(topology, ClusterTopology):
        raise TypeError(f"topology must be a ClusterTopology; got {topology!r}")
    nodes = topology.nodes(nodes)
    if nodes > 1:
        path = min(topology.nic_gbyte, topology.pci_gbyte)
        speed = _speed(path, C.SPEEDS_INTER)
        channels = topology.nics_per_node * max(1, int(topology.nic_gbyte // speed))
    else:
        link = topology.intra_gbyte if topology.intra_link == "nvlink" else min(
            topology.intra_gbyte, topology.pci_gbyte)
        speed = _speed(link, C.SPEEDS_INTRA)
        channels = max(1, int(link // speed))
    if speed >= C.DUPLICATE_CHANNELS_GBYTE:
        channels, speed = channels * 2, speed / 2
    return Graph(channels=min(channels, C.MAX_CHANNELS), intra_gbyte=speed, inter_gbyte=speed)
