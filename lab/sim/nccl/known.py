"""Clusters whose public nccl-tests logs the lab validates against, stated as built.

``POLARIS``: ALCF Polaris (docs.alcf.anl.gov/polaris/hardware-overview/machine-overview): per node
4 NVIDIA A100-SXM4-40GB joined by NVLink (NV4 between every pair: 4 links of 25 GB/s), one AMD
EPYC 7543P, two HPE Slingshot 11 NICs of 200 Gbit/s, each PCIe-attached through the host bridge
of one GPU's NUMA node (PHB; SYS to the other three GPUs); 560 nodes, 14 a rack, on a Slingshot
dragonfly. Its group size is in no source found; the fabric given is a Rosetta group at its
largest (32 switches of 16 endpoint ports: 512 NICs, 256 nodes of 2 NICs; 17 global ports a
switch against 16 endpoint ports: a share of 17/16) and a path between groups two Rosetta
traversals longer (at most three switch-to-switch hops, about 350 ns a switch: 0.7 µs).
"""

from __future__ import annotations

from lab.sim.nccl.topology import ClusterTopology, Dragonfly

POLARIS = ClusterTopology(gpus_per_node=4, nics_per_node=2, nic_gbit=200.0, intra_link="nvlink",
                          intra_gbyte=100.0, nic_path="phb", gpu="ampere", cpu="amd",
                          fabric=Dragonfly(nodes_per_group=256, global_link_share=17 / 16, global_hop_us=0.7))
