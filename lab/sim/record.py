"""Record what each rank sends and receives by running the real collectives on a mesh that moves nothing.

The algorithms only ever call ``mesh.send_buffer``/``recv_buffer``/``sendrecv_buffer``, and what
they send (peer, chunk bounds) depends on the rank, the world size and the element count, never
on the values. So :class:`RecordingMesh` runs the public call (``lab.allreduce(mesh, x,
algorithm=...)``) once per rank, one rank after the other: every send returns at once, every
receive returns at once without touching its buffer (no reduction kernel runs), and each call
is written down as one *step*: (destination, bytes sent, source, bytes received, reduces?).

Data is never touched, and never allocated at full size where the public call would allocate
an output (allgather's N·T bytes): while recording, ``new_flat`` in ``lab.buffers`` and
``lab.collectives*`` hands out stride-0 arrays of one element, whatever their length.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.buffers import new_flat
from lab.errors import LabError
from lab.mesh import DEFAULT_RECV_TIMEOUT_MS, Mesh
from lab.ops import DType, Reduction

#: Every collective the lab may have, in the order tables and reports list them.
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "all_to_all", "barrier")
#: Collectives whose call takes a root (broadcast's ``src``, reduce's ``dst``).
ROOTED = {"broadcast": "src", "reduce": "dst"}
#: Collectives whose call takes a reduction op (recorded with "sum": the op changes no message).
REDUCING = ("allreduce", "reduce_scatter", "reduce")

_STEP_FIELDS = 5  # dst, bytes sent, src, bytes received, reduces (-1 / 0 where there is none)


class SimulationUnsupported(LabError, NotImplementedError):
    """The algorithm uses something the recording mesh cannot replay without running ranks together
    (``mesh.split``: the sub-mesh depends on every rank's colour)."""


class SimulationTooLarge(SimulationUnsupported):
    """The recording passed ``max_steps`` steps."""


class RecordingMesh(Mesh):
    """A :class:`lab.Mesh` with no transport: it records each transfer as a step and moves nothing.

    ``rank`` can be set, so one instance records every rank in turn. ``host``, ``local_rank`` and
    ``local_world_size`` follow ``ranks_per_host``, as on emulated hosts.
    """

    def __init__(self, world_size: int, ranks_per_host: int = 1) -> None:
        # No Mesh.__init__: there are no channels, counters or trace file to set up.
        self._world_size, self._ranks_per_host = world_size, ranks_per_host
        self._root = self  # what a mesh's `clean` and issue order refer to
        self.transport = "sim"
        self.recv_timeout_ms = DEFAULT_RECV_TIMEOUT_MS
        self.clean = True
        self.steps = array("q")  # _STEP_FIELDS int64 per step, every rank's steps one after the other
        self.ran: list[tuple[str, str]] = []  # (collective, algorithm) of each collective() entered
        self.rank = 0

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self._rank = rank
        per_host = self._ranks_per_host
        self.host, self.local_rank = divmod(rank, per_host)
        self.local_world_size = min(per_host, self._world_size - self.host * per_host)

    @property
    def world_size(self) -> int:
        return self._world_size

    def issue(self, run: Callable[[], Any], async_op: bool) -> Any:
        return run()  # nothing is in flight, ever: run it now

    def wait_all(self) -> None:
        pass

    @contextlib.contextmanager
    def collective(self, name: str, algorithm: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        self.ran.append((name, algorithm))
        yield

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        self.steps.extend((dst, data.nbytes, -1, 0, 0))

    def recv_buffer(self, src: int, out: np.ndarray, combine: Any = None) -> None:
        self.steps.extend((-1, 0, src, out.nbytes, combine is not None))

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray, combine: Any = None) -> None:
        self.steps.extend((dst, data.nbytes, src, out.nbytes, combine is not None))

    def host_of(self, rank: int) -> int:
        return rank // self._ranks_per_host  # what lab.peers.hierarchy groups by (hierarchical allreduce)

    def split(self, *args: Any, **kwargs: Any) -> Mesh:
        raise SimulationUnsupported(
            "this algorithm calls mesh.split, which needs every rank's colour at once; the recording "
            "mesh runs one rank at a time (simulate the flat algorithms with Network(ranks_per_host=...))")

    def stats(self) -> dict[str, int]:
        raise SimulationUnsupported("a recording mesh has no counters: read them from lab.sim.simulate's result")

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Schedule:
    """Every rank's steps: rank r's are ``step_ptr[r]:step_ptr[r+1]`` of the per-step arrays."""

    collective: str
    algorithm: str
    world_size: int
    nbytes: int
    step_ptr: np.ndarray  # int64 [N+1]
    send_peer: np.ndarray  # int64 per step, -1: no send
    send_bytes: np.ndarray
    recv_peer: np.ndarray  # int64 per step, -1: no receive
    recv_bytes: np.ndarray
    reduces: np.ndarray  # bool per step: the receive is folded into the buffer (combine)
    record_s: float  # wall time spent recording

    @property
    def steps(self) -> int:
        return len(self.send_peer)

    def per_rank(self, values: np.ndarray) -> np.ndarray:
        """Sum a per-step integer array over each rank's steps (exact)."""
        sums = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        return sums[self.step_ptr[1:]] - sums[self.step_ptr[:-1]]


def _virtual_flat(numel: int, dtype: DType) -> np.ndarray:
    """A writable array of ``numel`` elements that occupies one: every index aliases element 0."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype.storage), (numel,), (0,))


def _skip(dst: np.ndarray, src: np.ndarray) -> None:
    """The reduction kernel while recording: values do not matter, and touching them costs."""


def _no_reduction(op: Any, dtype: DType) -> Reduction:
    return Reduction(op, dtype, _skip, None)


@contextlib.contextmanager
def _no_allocation() -> Iterator[None]:
    """Outputs the public collectives allocate become :func:`_virtual_flat`, and the reduction
    kernels they hand the algorithms do nothing, while recording (an algorithm that reduces into a
    local buffer, as recursive doubling does, would otherwise run its kernels: at 1,024 ranks of
    256 MB, terabytes of memory traffic).

    (Module globals are swapped for the duration: record in a process that is not running
    collectives on other threads at the same time.)
    """
    import lab.collectives

    modules = [m for name, m in list(sys.modules.items())
               if (name == "lab.buffers" or name.startswith("lab.collectives")) and getattr(m, "new_flat", None) is new_flat]
    for module in modules:
        module.new_flat = _virtual_flat
    kernels, lab.collectives._reduction = lab.collectives._reduction, _no_reduction
    try:
        yield
    finally:
        lab.collectives._reduction = kernels
        for module in modules:
            module.new_flat = new_flat


def _public(collective: str) -> Callable[..., Any]:
    import lab.collectives

    return getattr(lab.collectives, collective)


@functools.cache
def _takes_algorithm(collective: str) -> bool:
    return "algorithm" in inspect.signature(_public(collective)).parameters


def _table(collective: str) -> list[str] | None:
    """The algorithm names the public call takes for ``collective``, if it takes any."""
    import lab.collectives as c

    if not _takes_algorithm(collective):
        return None
    table = getattr(c, f"{collective.upper()}_ALGORITHMS", None)
    if table is None and isinstance(getattr(c, "ALGORITHMS", None), dict):
        table = c.ALGORITHMS.get(collective)
    return None if table is None else [name for name in table if name != "auto"]


def algorithms() -> dict[str, tuple[str, ...]]:
    """Each collective this checkout of the lab has, with the algorithms it can run (no ``auto``).

    Read from ``lab.collectives`` every time (its tables grow): ``{collective}_ALGORITHMS`` or
    ``ALGORITHMS[collective]``; a collective whose call takes no ``algorithm`` (or has no table)
    runs one, named as it reports itself to ``mesh.collective`` (found by recording 2 ranks).
    """
    import lab.collectives as c

    found = {}
    for collective in COLLECTIVES:
        if not callable(getattr(c, collective, None)):
            continue
        names = _table(collective)
        if names is None:
            names = [_record(collective, None, 2, 8, 0, 1)[1]]
        found[collective] = tuple(names)
    return found


def _call(collective: str, mesh: Mesh, x: np.ndarray, algorithm: str | None, root: int) -> None:
    fn = _public(collective)
    if collective == "barrier":
        fn(mesh)
        return
    kwargs: dict[str, Any] = {}
    if algorithm is not None:
        kwargs["algorithm"] = algorithm
    if collective in REDUCING:
        kwargs["op"] = "sum"
    if collective in ROOTED:
        kwargs[ROOTED[collective]] = root
    fn(mesh, x, **kwargs)


def _record(collective: str, algorithm: str | None, world_size: int, nbytes: int, root: int,
            ranks_per_host: int, max_steps: int | None = None) -> tuple[RecordingMesh, str, np.ndarray]:
    """Run ``collective`` on every rank of a recording mesh; (mesh, algorithm that ran, step_ptr)."""
    mesh = RecordingMesh(world_size, ranks_per_host)
    x = np.empty(nbytes // 4, dtype=np.float32)  # never written: the same input serves every rank
    step_ptr = np.zeros(world_size + 1, dtype=np.int64)
    with _no_allocation():
        for rank in range(world_size):
            mesh.rank = rank
            _call(collective, mesh, x, algorithm, root)
            step_ptr[rank + 1] = len(mesh.steps) // _STEP_FIELDS
            if max_steps is not None and step_ptr[rank + 1] > max_steps:
                raise SimulationTooLarge(f"too large: {collective} ({algorithm}) on {world_size} ranks of {nbytes} "
                                         f"bytes passed max_steps={max_steps:,} after {rank + 1} ranks")
    ran = {a for _, a in mesh.ran}
    if len(ran) > 1:
        raise RuntimeError(f"ranks ran different algorithms for one {collective}: {sorted(ran)}")
    return mesh, (ran.pop() if ran else algorithm or ""), step_ptr


def record(collective: str, algorithm: str, world_size: int, nbytes: int, root: int = 0,
           ranks_per_host: int = 1, max_steps: int | None = None) -> Schedule:
    """Every rank's steps for one call of ``collective`` with ``algorithm`` (already validated).

    ``nbytes``: each rank's input tensor (float32 elements), as the real call takes it.
    ``max_steps``: stop with :class:`SimulationTooLarge` once the steps recorded pass it
    (checked after each rank; a 1,024-rank ring allreduce is 2.1 million steps).
    """
    started = time.perf_counter()
    table = _table(collective)
    mesh, ran, step_ptr = _record(collective, algorithm if table is not None else None, world_size, nbytes, root,
                                  ranks_per_host, max_steps)
    steps = np.frombuffer(mesh.steps, dtype=np.int64).reshape(-1, _STEP_FIELDS)
    return Schedule(
        collective=collective, algorithm=ran or algorithm, world_size=world_size, nbytes=nbytes,
        step_ptr=step_ptr, send_peer=steps[:, 0].copy(), send_bytes=steps[:, 1].copy(),
        recv_peer=steps[:, 2].copy(), recv_bytes=steps[:, 3].copy(), reduces=steps[:, 4].astype(bool),
        record_s=time.perf_counter() - started)

