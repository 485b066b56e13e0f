"""NCCL's own cost model for a cluster: its tuner's closed forms, fitted to the cluster's logs.

    topology = ClusterTopology(gpus_per_node=4, nics_per_node=2, nic_gbit=200, cpu="amd", nic_path="phb")
    report = fit(topology, [read_nccl_tests("n2.log", collective="allreduce"), ...])
    report.model.predict("allreduce", nodes=540, nbytes=1 << 30)   # time_us, algorithm, protocol
    lab.sim.predict(report.model, "allreduce", hosts=540, nbytes=1 << 30)   # the same (predict_nccl)
    shipped(topology).predict("allreduce", nodes=540, nbytes=1 << 30)  # what NCCL itself estimates
    tuner_file.write("nccl_tuner.conf", tuner_file.rules(report.model, nodes=[256, 540]))

:mod:`~lab.sim.nccl.constants` NCCL 2.21's shipped numbers (and 2.18's where they differ);
:mod:`~lab.sim.nccl.topology` the cluster stated once; :mod:`~lab.sim.nccl.model` the closed forms;
:mod:`~lab.sim.nccl.fitting` the fit and its report; :mod:`~lab.sim.nccl.validation` a fit scored
on logs it never saw; :mod:`~lab.sim.nccl.tuner_file` NCCL's example tuner plugin's file;
:mod:`~lab.sim.nccl.known` clusters as built. No simulation: a prediction is a few hundred
arithmetic operations, at any node count.
"""

from lab.sim.nccl import (
    tuner_file,  # (validation: imported by name; it reads lab.sim.cluster, which imports this)
)
from lab.sim.nccl.fitting import NcclFitReport, fit
from lab.sim.nccl.model import (
    COLLECTIVES,
    PAIRS,
    NcclModel,
    NcclPrediction,
    PairTerms,
    predict_nccl,
    shipped,
    tree_depth,
)
from lab.sim.nccl.topology import ClusterTopology, Dragonfly, FatTree, Graph, nominal_graph

__all__ = [
    "COLLECTIVES", "PAIRS", "ClusterTopology", "Dragonfly", "FatTree", "Graph", "NcclFitReport", "NcclModel",
    "NcclPrediction", "PairTerms", "fit", "nominal_graph", "predict_nccl", "shipped", "tree_depth",
    "tuner_file"]
