"""Numba's compilations paid up front: every compilable collective run once on a mesh.

A process's first compiled collective otherwise pays its compilation (minutes of CPU per machine,
once, into Numba's disk cache; then about a second per process to load), inside a collective
whose peers wait for it. Benchmarks and the test session call :func:`compile_all` before timing.

Per rank, N=2::

    from lab.warmup import compile_all
    compile_all(mesh)                     # every rank; returns how many collectives ran compiled
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import torch

import kernels
from lab.algorithms import registry
from lab.collectives import calls as collectives
from lab.comm.mesh import Mesh


def compile_all(mesh: Mesh) -> int:
    """Run every compilable collective once on ``mesh`` (every rank calls it). Each rank first
    compiles its share of the entries alone (where the cache is cold, N ranks compile N at a time
    instead of each compiling all), then all run. Returns how many ran compiled (0 where the mesh
    has no mailboxes)."""
    plane = mesh.exchange.plane
    if plane is not None:
        with plane.compiling_only():
            try:
                _run_each_compilable(mesh)
            finally:
                mesh.templates.clear()  # plain calls remembered with a compile-only call
        collectives.barrier(mesh)  # every share compiled (and cached) before any rank runs one
    before = mesh.stats()["collectives_compiled"]
    _run_each_compilable(mesh)
    return mesh.stats()["collectives_compiled"] - before


def cache_is_cold() -> bool:
    """Whether Numba's disk cache holds none of the compiled data plane (a machine's first run:
    ``NUMBA_CACHE_DIR``, else ``kernels/__pycache__``)."""
    root = Path(
        numba.config.CACHE_DIR) if numba.config.CACHE_DIR else Path(kernels.__file__).parent / "__pycache__"
    return not any(root.rglob("mailbox.*.nbi"))


def _run_each_compilable(mesh: Mesh) -> None:
    x, rows = np.ones(4, np.float32), np.ones(2 * mesh.world_size, np.float32)
    # Each tensor twice: the second call takes the lane (lab.collectives.prepared.Lane) the first made.
    tensor, tensor_rows = torch.ones(4), torch.ones(2 * mesh.world_size)

    def each(call, inputs):  # the call on every input in turn, with the algorithm
        return lambda a: [call(mesh, t, algorithm=a) for t in inputs]

    calls = {
        "allreduce": each(collectives.allreduce, (x, tensor, tensor)),
        "broadcast": each(collectives.broadcast, (x, tensor, tensor)),
        "allgather": each(collectives.allgather, (x, tensor, tensor)),
        "reduce_scatter": each(collectives.reduce_scatter, (rows, tensor_rows, tensor_rows)),
        "reduce": lambda a: collectives.reduce(mesh, x),
        "all_to_all": each(collectives.all_to_all, (rows,)),
        "barrier": lambda a: collectives.barrier(mesh),
        "gather": each(collectives.gather, (x,)),
        "scatter": each(collectives.scatter, (rows,)),}
    for collective in registry.ALGORITHMS:  # a KeyError here: a new collective needs its call above
        for algorithm in registry.compiled(collective):
            calls[collective](algorithm)
