"""``lab.sim``: the lab's own algorithm code on virtual ranks, timed on a network model.

    net = lab.sim.Network(alpha_us=20.0, gbit=10.0)                 # every rank its own host and link
    r = lab.sim.simulate("allreduce", "ring", world_size=1024, nbytes=64 << 20, network=net)
    r.time_us; r.bytes_sent; r.critical_path
    lab.sim.best_algorithm("allreduce", world_size=1024, nbytes=1 << 20, network=net)

Limits: a case whose recording would pass ``max_steps`` (default 10 million steps, about 1.7 GB)
or ``max_seconds`` (default 300 s) raises :class:`SimulationTooLarge` before it is recorded,
saying how to raise the limit; :func:`estimate` says what a case would cost.

How: :mod:`lab.sim.schedule` runs the public collective once per rank on a mesh that records
each send and receive instead of moving data; :mod:`lab.sim.event_loop` times those steps in a
discrete-event loop (Numba). :mod:`lab.sim.calibrate` fits a :class:`Network` to measured
results, :mod:`lab.sim.validation` scores the fit against them, and :mod:`lab.sim.sweep` is
``python -m lab simulate``. :mod:`lab.sim.cluster` fits a cluster to its own nccl-tests logs
(``fit_cluster``) and predicts it at more hosts (``predict(net, "allreduce", hosts=16, nbytes=B)``).
"""

import importlib

from lab.sim.core import SimResult, best_algorithm, compare, estimate, simulate
from lab.sim.event_loop import Message, ScheduleError
from lab.sim.fitted import calibrated
from lab.sim.limits import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    Estimate,
    SimulationTooLarge,
    SimulationUnsupported,
)
from lab.sim.network import Network
from lab.sim.schedule import algorithms

#: What reads and fits clusters' logs, with pandas: loaded on first use (``lab.sim.fit_cluster``).
_ON_FIRST_USE = {
    "FitReport": "lab.sim.cluster", "ClusterPrediction": "lab.sim.cluster", "fit_cluster": "lab.sim.cluster",
    "fit_cluster_report": "lab.sim.cluster", "predict": "lab.sim.cluster", "read_nccl_tests": "lab.sim.logs",
    "read_osu": "lab.sim.logs"}


def __getattr__(name: str) -> object:
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'lab.sim' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_SECONDS", "DEFAULT_MAX_STEPS", "ClusterPrediction", "Estimate", "FitReport", "Message",
    "Network", "ScheduleError", "SimResult", "SimulationTooLarge", "SimulationUnsupported", "algorithms",
    "best_algorithm", "calibrated", "compare", "estimate", "fit_cluster", "fit_cluster_report", "predict",
    "read_nccl_tests", "read_osu", "simulate"]
