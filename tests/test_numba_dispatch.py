"""Once a rank has called each collective, every later call from Python into compiled code takes
Numba's fast dispatch: none reaches ``_compile_for_args``, the slow path a dispatcher takes when
its compiled overloads do not match the call as made (an argument left to its default, a type
that must be converted). That path finds the same machine code in the end, so no result shows it;
it costs about 100 µs a call against 2 (``kernels.two_shot.wait_all``, called with its waiting
limits left to their defaults, cost every Python-path two-shot two of them; tests/test_layout.py
refuses such defaults, this test any other cause).

Each rank counts the slow dispatches of a third round of calls: allreduce by every
algorithm at a size the compiled plane takes and one it does not, two-shot on a registered
tensor, every allgather, reduce_scatter and broadcast algorithm, a barrier, symmetric memory's
signals and one-shot (in place, and out of place from its lane), and a point-to-point message.
"""

from __future__ import annotations

import collections

import torch
from numba.core import dispatcher

import lab
from lab.algorithms import registry


def calls_of_every_kind(mesh: lab.Mesh) -> None:
    n, rank = mesh.world_size, mesh.rank
    for count in (256, 70_000):  # 1 KB (the compiled plane) and 280 KB (over LAB_COMPILED_MAX_BYTES)
        x = torch.arange(count, dtype=torch.float32) * 3 + rank
        for algorithm in registry.ALGORITHMS["allreduce"]:
            lab.allreduce(mesh, x.clone(), algorithm=algorithm)
        lab.allreduce(mesh, lab.empty(mesh, (count,)), algorithm="two_shot")
        for algorithm in registry.ALGORITHMS["allgather"]:
            lab.allgather(mesh, x, algorithm=algorithm)
        for algorithm in registry.ALGORITHMS["reduce_scatter"]:
            lab.reduce_scatter(mesh, torch.arange(count * n, dtype=torch.float32), algorithm=algorithm)
        for algorithm in registry.ALGORITHMS["broadcast"]:
            lab.broadcast(mesh, x.clone(), algorithm=algorithm)
        lab.barrier(mesh)
        buf = lab.symm_mem.empty(mesh, (count,), torch.float32)
        buf.copy_(x)
        handle = lab.symm_mem.rendezvous(buf, mesh)
        handle.put_signal((rank + 1) % n)
        handle.wait_signal((rank - 1) % n)
        lab.symm_mem.one_shot_all_reduce(buf, "sum", mesh)
        lab.symm_mem.one_shot_all_reduce_out(buf, "sum", mesh, torch.empty(count))  # (from its lane)
        if rank == 0:
            mesh.send(1, x)
        elif rank == 1:
            mesh.recv(0)


def slow_dispatches(mesh: lab.Mesh) -> dict[str, int]:
    """The slow dispatches of the third round of :func:`calls_of_every_kind`, by function."""
    counted: collections.Counter = collections.Counter()
    slow_path = dispatcher._DispatcherBase._compile_for_args

    def counting(self, *args, **kwargs):
        counted[self.py_func.__qualname__] += 1
        return slow_path(self, *args, **kwargs)

    for _ in range(2):  # the first call compiles or loads from Numba's cache (the slow path); so
        calls_of_every_kind(mesh)  # does a plain call's lane, made by the first, at the second
    dispatcher._DispatcherBase._compile_for_args = counting
    try:
        calls_of_every_kind(mesh)
    finally:
        dispatcher._DispatcherBase._compile_for_args = slow_path
    return dict(counted)


def test_calls_after_the_first_take_numbas_fast_dispatch():
    assert lab.spawn(slow_dispatches, 2, transport="shm") == [{}, {}]
