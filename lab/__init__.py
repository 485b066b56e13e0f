"""The collectives lab: allreduce, broadcast, allgather and reduce_scatter from scratch.

    import lab, torch

    def step(mesh, scale):                 # runs once in every rank's own process
        x = torch.arange(8, dtype=torch.float32) * scale + mesh.rank
        lab.allreduce(mesh, x, op="sum", algorithm="auto")   # in place; returns x
        return x

    outs = lab.spawn(step, world_size=4, args=(2.0,))         # one result per rank, rank order
"""

import importlib

# The guard of Numba's cache first, before any import compiles or loads compiled code: a first
# run's kernels would otherwise be cleared once compiled, and compiled again by the next process.
from lab.compiled import sources as compiled_sources  # noqa: F401

# isort: split
from lab import backend, bucketing, ddp, symm_mem, tuning
from lab.collectives.calls import (
    all_to_all,
    allgather,
    allreduce,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from lab.collectives.plans import (
    Plan,
    all_to_all_init,
    allgather_init,
    allreduce_init,
    barrier_init,
    broadcast_init,
    gather_init,
    reduce_init,
    reduce_scatter_init,
    scatter_init,
)
from lab.comm import operations as recording
from lab.comm.issue import Work
from lab.comm.mesh import Mesh
from lab.compiled.registered import empty
from lab.errors import (
    CollectiveMismatchError,
    DeadlineError,
    EmulationUnavailable,
    LabError,
    PeerLostError,
    RankError,
)
from lab.hosts.launchers import launcher_env
from lab.launch import Cluster, launch, spawn
from lab.ops import ReduceOp
from lab.reference import gloo_reference

#: Loaded on first use (``lab.sim.simulate``, ``lab.workload.load``): a rank that only runs
#: collectives never imports the simulator, the cluster fitter or pandas.
_ON_FIRST_USE = ("sim", "workload")


def __getattr__(name: str) -> object:
    if name in _ON_FIRST_USE:
        return importlib.import_module(f"lab.{name}")
    raise AttributeError(f"module 'lab' has no attribute {name!r}")


def _simulator_advice(*args: object) -> object:
    """``auto``'s advice at a world size never measured: the simulator's (:mod:`lab.sim.advisor`),
    loaded when first asked."""
    from lab.sim.advisor import advise

    return advise(*args)


def _workload_header(*args: object, **kwargs: object) -> None:
    from lab.workload.record import write_header

    write_header(*args, **kwargs)


def _workload_recorder(*args: object) -> recording.Recording:
    from lab.workload.record import Recorder

    return Recorder(*args)


backend.register()  # torch.distributed.init_process_group("lab")
tuning.register_advisor("simulator", _simulator_advice)
recording.register(_workload_header, _workload_recorder)  # lab.workload loads when a rank records

__all__ = [
    "Cluster", "CollectiveMismatchError", "DeadlineError", "EmulationUnavailable", "LabError", "Mesh",
    "PeerLostError", "Plan", "RankError", "ReduceOp", "Work", "all_to_all", "all_to_all_init", "allgather",
    "allgather_init", "allreduce", "allreduce_init", "backend", "barrier", "barrier_init", "broadcast",
    "broadcast_init", "bucketing", "ddp", "empty", "gather", "gather_init", "gloo_reference", "launch",
    "launcher_env", "reduce", "reduce_init", "reduce_scatter", "reduce_scatter_init", "scatter",
    "scatter_init", "sim", "spawn", "symm_mem", "workload"]
