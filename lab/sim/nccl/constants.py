"""NCCL 2.21's tuner constants, as shipped, and where NCCL 2.18's differ: the numbers behind every
estimate of :mod:`lab.sim.nccl`.

From NVIDIA/nccl at tag v2.21.5-1 (commit ab2b89c4c339bd7f816fbc114a4b05d386b66290):
``src/graph/tuning.cc`` (``baseLat``, ``hwLat``, ``llMaxBws``, ``perChMax*Bws``, ``getNetOverhead``,
``treeCorrectionFactor``, the ring plateau in ``ncclTopoGetAlgoTime``), ``src/graph/search.cc``
(``speedArrayIntra/Inter``, ``ncclTopoDupChannels``), ``src/include/comm.h`` and ``device.h``
(thread thresholds, threads per block), ``src/enqueue.cc`` (``getChannnelThreadInfo``: how many
channels a call of a given size runs on). Latencies are µs, bandwidths GB/s (10**9 bytes a second).
"""

from __future__ import annotations

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree")
PROTOCOLS = ("ll", "ll128", "simple")
LINKS = ("nvlink", "pci", "net")

#: baseLat[algorithm][protocol]: what every call of the pair pays once.
BASE_LATENCY_US = {
    "tree": {"ll": 6.8, "ll128": 14.0, "simple": 0.0}, "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
    "collnet_direct": {"ll": 0.0, "ll128": 0.0,
                       "simple": 0.0}, "collnet_chain": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0}, "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0}}

#: hwLat[link][algorithm][protocol]: one hop over NVLink, PCI or the network.
HOP_LATENCY_US = {
    "nvlink": {
        "tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0.0, 0.0, 3.7),
        "collnet_chain": (0.0, 0.0, 2.8), "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0)}, "pci": {
            "tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0.0, 0.0, 3.7),
            "collnet_chain": (0.0, 0.0, 2.8), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)}, "net": {
                "tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0.0, 0.0, 31.0),
                "collnet_chain": (0.0, 0.0, 30.0), "nvls": (0.0, 0.0, 18.0), "nvls_tree": (0.0, 0.0, 14.0)}}

#: GPU generations the per-channel tables are indexed by (compute capability 70, 80, 90).
GENERATIONS = ("volta", "ampere", "hopper")

#: llMaxBws[index1][index2]: LL's ceiling. index1 is the GPU generation on one node and the CPU
#: vendor across nodes (0 Intel, 1 AMD; Hopper's row only on one node); index2 is 1, 2, >2 nodes.
LL_MAX_GBYTE = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0)}
#: perChMaxRingLL128Bws, perChMaxTreeLL128Bws, perChMaxTreeBws: per-channel ceilings (1, 2, >2 nodes).
RING_LL128_MAX_GBYTE = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3}
TREE_LL128_MAX_GBYTE = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0)}
TREE_MAX_GBYTE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}

#: getNetOverhead: the proxy's cost to post one network step (µs), by CPU vendor; Simple pays it 3x.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "other": 1.0}
SIMPLE_NET_OVERHEAD_FACTOR = 3.0

#: The ring's "plateau effect": Simple allreduce across nodes multiplies its latency by this once
#: each rank's share of a channel reaches 64 bytes (1.9 before Ampere).
RING_PLATEAU = 1.4
RING_PLATEAU_BEFORE_AMPERE = 1.9

#: treeCorrectionFactor[protocol][log2(bytes / 64)] for 64 B .. 256 MiB: the tree's bandwidth scaled
#: where NCCL found trees slower than their model at medium sizes.
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0,
           1.0), "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
                           .9, .9, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)}

#: Bus bandwidth efficiencies of the protocols (tuning.cc's "model refinements"): LL moves 8 bytes
#: of data in 16 on the wire; LL128 120 in 128; trees reach 92 % of the graph's bandwidth, LL on a
#: tree 1/3.8 of that; LL128 on one node 7/9.
RING_LL_EFFICIENCY = 0.5
LL128_EFFICIENCY = 0.92
LL128_EFFICIENCY_ONE_GPU_A_NODE = 0.7
TREE_EFFICIENCY = 0.92
TREE_LL_EFFICIENCY = 1.0 / 3.8
TREE_LL128_EFFICIENCY = 120.0 / 128.0
TREE_LL128_EFFICIENCY_ONE_NODE = 7.0 / 9.0
NVLS_ALGORITHM_RATIO = 5.0 / 6.0

#: search.cc's bandwidths a channel may be given (GB/s), inside a node and across nodes (Ampere);
#: a graph of >= 25 GB/s a channel gets its channels doubled at half the bandwidth each.
SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SPEEDS_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                0.24, 0.12)
DUPLICATE_CHANNELS_GBYTE = 25.0
#: PCI_BW: what NCCL's topology gives a PCIe Gen4 x16 link (GB/s).
PCI_GBYTE = 24.0
MAX_CHANNELS = 32

#: Threads a block runs (the most) and the bytes a thread must have before a call takes more
#: channels (ring LL's threshold is multiplied by the rank count).
MAX_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
THREAD_THRESHOLD = {"ll": 8, "ll128": 8, "simple": 64}

#: The releases whose tuner the model knows. NCCL 2.18 (v2.18.3-1 to v2.18.6-1 share tuning.cc and
#: enqueue.cc; the NVIDIA HPC SDK 23.9 ships 2.18.5) differs from 2.21 for rings and trees in two
#: places (``git diff v2.18.5-1 v2.21.5-1 -- src/graph/tuning.cc``; search.cc's speeds, the thread
#: thresholds, getNetOverhead, llMaxBws for Ampere, the plateau and the tree correction are the same):
VERSIONS = ("2.21", "2.18")
#: hwLat[link]["tree"]'s Simple hop in 2.18: 4 µs on NVLink, 6 on PCI, 14 on the network (2.21: 28 each).
TREE_SIMPLE_HOP_LATENCY_US_2_18 = {"nvlink": 4.0, "pci": 6.0, "net": 14.0}
#: The ring LL's share of the graph's bandwidth in 2.18: 1/4 across nodes and for allreduce (1/3 for
#: other collectives on one node, which the model, pricing a pair alike for every collective, leaves
#: at 1/4); 2.21: 1/2.
RING_LL_EFFICIENCY_2_18 = 0.25
