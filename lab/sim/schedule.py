"""Record what each rank sends and receives by running the real collectives on a mesh that moves nothing.

The algorithms only ever call ``mesh.send_buffer``/``recv_buffer``/``sendrecv_buffer``, and what
they send (peer, chunk bounds) depends on the rank, the world size and the element count, never
on the values. So :class:`RecordingMesh` runs the public call (``lab.allreduce(mesh, x,
algorithm=...)``) once per rank, one rank after the other: every send returns at once, every
receive returns at once without touching its buffer (no reduction kernel runs), and each call
is written down as one *step*: (destination, bytes sent, source, bytes received, reduces?, bytes
of local passes before it). Local passes are the copies and writes a rank makes between its
messages (reduce_scatter's work copy, Bruck's rotations, a result filled from the input): CPU
work on its core that moves no message; those after its last message are a step of their own.

Data is never touched, copied or allocated at full size. The input is an anonymous mapping that
is never written (reading it maps the kernel's zero page: no memory), viewed as a
:class:`VirtualArray`, whose copies (reduce_scatter's work buffer, reduce's scratch) are stride-0
arrays of one element and whose writes do nothing; outputs the public call allocates
(allgather's N·T bytes) are such arrays too (the recorder's ``new_flat``), and its reduction
kernels do nothing (the recorder's ``kernels``): nothing global is changed, so recordings in
several threads at once are independent.

Limits (:mod:`lab.sim.limits`): before recording, :func:`estimate` refuses a case whose
algorithm's fewest steps (the registry's ``fewest_steps``) pass ``max_steps``, then records a
sample of ranks and refuses one past ``max_steps`` or ``max_seconds``; :func:`record` also stops
at ``max_steps`` while it records, should the sample have guessed low. The arrays that hold no
data are in :mod:`lab.sim.virtual`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.ops import DType, Reduction
from lab.sim.limits import (
    STEP_FIELDS,
    Estimate,
    Meter,
    SimulationTooLarge,
    SimulationUnsupported,
    at_least_one_step_per_rank,
    describe,
    sample_ranks,
    too_many_steps,
)
from lab.sim.virtual import counting_passes, mapped_input, virtual

#: Every collective the lab may have, in the order tables and reports list them.
COLLECTIVES = registry.COLLECTIVES
#: Collectives whose call takes a root (broadcast's and scatter's ``src``, reduce's and gather's ``dst``).
ROOTED = {name: record.root for name, record in CATALOG.items() if record.root}
#: Collectives whose call takes a reduction op (recorded with "sum": the op changes no message).
REDUCING = tuple(name for name, record in CATALOG.items() if record.reduces)


class RecordingMesh:
    """What the public collectives and the algorithms use of a :class:`lab.Mesh`
    (:class:`lab.comm.protocols.CallMesh` and :class:`lab.algorithms.peers.Peers`), with no
    transport: it records each transfer as a step and moves nothing. Its kernels do nothing and
    its outputs are virtual, so no data is touched; each instance is its own, so recordings in
    several threads at once do not meet. Plans and compiled calls are not simulated: it has no
    compiled path, and it never records a workload.

    ``rank`` can be set, so one instance records every rank in turn. ``host``, ``local_rank`` and
    ``local_world_size`` follow ``ranks_per_host``, as on emulated hosts.
    """

    transport = "sim"
    host_count = 1  # auto never weighs hierarchical here: the algorithm is always given
    closed = False
    recording = False  # (so no call describes itself)
    compiled_max_bytes = 0  # no compiled path: every algorithm records as Python

    def __init__(self, world_size: int, ranks_per_host: int = 1) -> None:
        self._world_size, self._ranks_per_host = world_size, ranks_per_host
        self.steps = array("q")  # STEP_FIELDS int64 per step, every rank's steps one after the other
        self.passes = 0  # bytes of local passes since the rank's last step
        self.ran: list[tuple[str, str]] = []  # (collective, algorithm) of each collective() entered
        self.rank = 0
        # The limits: once len(steps) reaches check_at, check() runs (it raises, or moves check_at on).
        self.check_at = sys.maxsize
        self.check: Callable[[], None] = lambda: None
        self.templates: dict = {
        }  # the public calls' checks and choices (lab.collectives.prepared.remembered)

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

    def issue(self, run: Callable[[], Any], async_op: bool, *, what: Any = None) -> Any:
        return run()  # nothing is in flight, ever: run it now

    @property
    def issue_queue(self) -> Any:
        raise SimulationUnsupported(
            "a recording mesh has no issue order: plans and compiled calls are not simulated")

    def refused(self) -> None:
        pass  # nothing is in flight, so nothing is ever refused

    def wait_all(self) -> None:
        pass

    def describe(self, op: str, dtype: DType, count: int, out_count: int, **rest: Any) -> Any:
        raise SimulationUnsupported("a recording mesh records steps, not a workload's calls")

    @contextlib.contextmanager
    def collective(self, name: str, algorithm: str, dtype: DType, count: int, op: str = "", root: int = -1,
                   compiled: bool = True) -> Iterator[None]:
        self.ran.append((name, algorithm))
        yield

    def compiled_call(self, signature: Any, algorithm: Any, args: tuple, at: bool = False) -> None:
        return None  # no compiled path: every algorithm records as Python

    def agree(self, signature: Any) -> list[bytes]:
        raise SimulationUnsupported("a recording mesh runs one rank at a time: plans are not simulated")

    def run(self, algorithm: Callable[..., None], *args: Any, **options: Any) -> None:
        """Run the algorithm on this recorder, as Python (what :meth:`lab.Mesh.run` does off shm)."""
        algorithm(self, *args, **options)

    def _step(self, step: tuple[int, int, int, int, int]) -> None:
        self.steps.extend(step)
        self.steps.append(self.passes)
        self.passes = 0
        if len(self.steps) >= self.check_at:  # one comparison per step until a limit is near
            self.check()

    def _passed(self, nbytes: int) -> None:
        self.passes += nbytes

    def call(self, rank: int, collective: str, x: np.ndarray, algorithm: str | None, root: int) -> None:
        """Record ``rank``'s call: its steps, then a step for the local passes after its last message."""
        self.rank, self.passes = rank, 0
        with counting_passes(self._passed):
            _call(collective, self, x, algorithm, root)
        if self.passes:
            self._step((-1, 0, -1, 0, 0))

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        self._step((dst, data.nbytes, -1, 0, 0))

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Any = None) -> None:
        self._step((-1, 0, src, out.nbytes, reduction is not None))

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray,
                        reduction: Any = None) -> None:
        self._step((dst, data.nbytes, src, out.nbytes, reduction is not None))

    def host_of(self, rank: int) -> int:
        return rank // self._ranks_per_host  # what lab.algorithms.peers.hierarchy groups by (hierarchical allreduce)

    @staticmethod
    def kernels(op: Any, dtype: DType) -> Reduction:
        """Kernels that do nothing: values do not matter, and touching them costs (recursive
        doubling reduces into a local buffer: at 1,024 ranks of 256 MB, terabytes of traffic)."""
        return Reduction(op, dtype, _skip, None)

    @staticmethod
    def new_flat(numel: int, dtype: DType) -> np.ndarray:
        """Outputs the public collectives allocate (allgather's N·T bytes): virtual."""
        return virtual(numel, dtype.storage)

    def split(self, *args: Any, **kwargs: Any) -> RecordingMesh:
        raise SimulationUnsupported(
            "this algorithm calls mesh.split, which needs every rank's colour at once; the recording "
            "mesh runs one rank at a time (simulate the flat algorithms with Network(ranks_per_host=...))")

    def stats(self) -> dict[str, int]:
        raise SimulationUnsupported(
            "a recording mesh has no counters: read them from lab.sim.simulate's result")

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
    passes: np.ndarray | None = None  # int64 per step: bytes of local passes before it (None: none)
    calls: int = 1  # how many calls of the collective the steps are (:meth:`repeated`)

    @functools.cached_property
    def working_set_bytes(self) -> float:
        """The bytes one call touches: every rank's input and every byte it receives (kept: a
        calibration replays one schedule thousands of times)."""
        return self.world_size * self.nbytes + float(self.recv_bytes.sum(dtype=np.float64)) / self.calls

    @functools.cached_property
    def pass_bytes(self) -> np.ndarray:
        """Bytes of local passes before each step (zeros when none were recorded)."""
        return np.zeros(self.steps, np.int64) if self.passes is None else self.passes

    @property
    def steps(self) -> int:
        return len(self.send_peer)

    def repeated(self, calls: int) -> Schedule:
        """The calls of a back-to-back loop as one schedule: each rank's steps ``calls`` times over
        (a rank starts its next call once it has finished its last; each channel keeps its order).

            record("gather", "linear", 4, 4096).repeated(3).steps    # 3 × 6
        """
        spans = [np.tile(np.arange(a, b), calls) for a, b in zip(self.step_ptr[:-1], self.step_ptr[1:])]
        index = np.concatenate([np.zeros(0, np.int64), *spans])
        return Schedule(self.collective, self.algorithm, self.world_size, self.nbytes,
                        np.concatenate(
                            ([0], np.cumsum(np.diff(self.step_ptr) * calls))), self.send_peer[index],
                        self.send_bytes[index], self.recv_peer[index], self.recv_bytes[index],
                        self.reduces[index], self.record_s, self.pass_bytes[index], self.calls * calls)

    def per_rank(self, values: np.ndarray) -> np.ndarray:
        """Sum a per-step integer array over each rank's steps (exact)."""
        sums = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        return sums[self.step_ptr[1:]] - sums[self.step_ptr[:-1]]


def _skip(dst: np.ndarray, src: np.ndarray) -> None:
    """The reduction kernel while recording."""


def _public(collective: str) -> Callable[..., Any]:
    from lab.collectives import calls

    return getattr(calls, collective)


def algorithm_choices(collective: str) -> list[str] | None:
    """The algorithm names the public call takes for ``collective``; None if it takes none."""
    return list(registry.names(collective)) if registry.choosable(collective) else None


def algorithms() -> dict[str, tuple[str, ...]]:
    """Each collective, with the algorithms it can run (no ``auto``): the registry's, read every
    time (a program may register more)."""
    return {collective: registry.names(collective) for collective in registry.ALGORITHMS}


def _call(collective: str, mesh: RecordingMesh, x: np.ndarray, algorithm: str | None, root: int) -> None:
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


def estimate(collective: str, algorithm: str | None, world_size: int, nbytes: int, root: int = 0,
             ranks_per_host: int = 1, max_steps: int | None = None,
             max_seconds: float | None = None) -> Estimate:
    """The steps, time and memory of simulating a case, from recording a sample of its ranks
    (arguments already validated; :func:`lab.sim.estimate` is the checked call).

    With ``max_steps``/``max_seconds``, raises :class:`SimulationTooLarge` as soon as the sample
    shows the case past them: a 20,000-rank ring allreduce (800 million steps) after its first
    sampled rank (40,000 steps). Up to 19 ranks are all recorded: the count is then exact.

        estimate("allreduce", "ring", 2000, 4096).steps      # 7,996,000 = 2000 · 2 · 1999
    """
    case = describe(collective, algorithm, world_size, nbytes)
    at_least_one_step_per_rank(case, world_size, max_steps)
    mesh = RecordingMesh(world_size, ranks_per_host)
    entry = registry.ALGORITHMS[collective].get(algorithm or "")
    if max_steps is not None and entry is not None and entry.fewest_steps is not None:
        options = entry.options(mesh) if entry.options else {}
        fewest = entry.fewest_steps(world_size, nbytes // 4, 4, **options)
        if fewest > max_steps:
            raise too_many_steps(case, fewest, max_steps, "its schedule's messages, counted before recording",
                                 at_least=True)
    ranks = sample_ranks(world_size, root)
    meter = Meter(mesh, case, ranks, max_steps, max_seconds)
    x = mapped_input(nbytes // 4)
    for rank, special in ranks:
        meter.begin(special)
        mesh.call(rank, collective, x, algorithm, root)
        meter.end()
    return meter.finish()


def _record(collective: str, algorithm: str | None, world_size: int, nbytes: int, root: int,
            ranks_per_host: int, max_steps: int | None = None) -> tuple[RecordingMesh, str, np.ndarray]:
    """Run ``collective`` on every rank of a recording mesh; (mesh, algorithm that ran, step_ptr).

    Stops with :class:`SimulationTooLarge` at step ``max_steps + 1``, wherever it is."""
    case = describe(collective, algorithm, world_size, nbytes)
    at_least_one_step_per_rank(case, world_size, max_steps)
    mesh = RecordingMesh(world_size, ranks_per_host)
    if max_steps is not None:
        mesh.check_at = (max_steps + 1) * STEP_FIELDS

        def passed() -> None:
            raise too_many_steps(case, max_steps + 1, max_steps,
                                 f"reached while recording rank {mesh.rank:,} "
                                 f"of {world_size:,}", at_least=True)

        mesh.check = passed
    x = mapped_input(nbytes // 4)  # never written: the same input serves every rank
    step_ptr = np.zeros(world_size + 1, dtype=np.int64)
    for rank in range(world_size):
        mesh.call(rank, collective, x, algorithm, root)
        step_ptr[rank + 1] = len(mesh.steps) // STEP_FIELDS
    ran = {a for _, a in mesh.ran}
    if len(ran) > 1:
        raise RuntimeError(f"ranks ran different algorithms for one {collective}: {sorted(ran)}")
    return mesh, (ran.pop() if ran else algorithm or ""), step_ptr


def _check_counters(case: str, steps: np.ndarray) -> None:
    """The per-rank byte counts are int64 sums: refuse a case whose bytes would overflow them."""
    for column, what in [(1, "sent"), (3, "received")]:
        total = float(steps[:, column].sum(dtype=np.float64))
        if total >= 2.0**62:
            raise SimulationTooLarge(
                f"too large to simulate: {case} has its ranks {what} {total:,.0f} bytes in all, "
                "more than int64 byte counters hold; use a smaller nbytes")


def record(collective: str, algorithm: str, world_size: int, nbytes: int, root: int = 0,
           ranks_per_host: int = 1, max_steps: int | None = None) -> Schedule:
    """Every rank's steps for one call of ``collective`` with ``algorithm`` (already validated).

    ``nbytes``: each rank's input tensor (float32 elements), as the real call takes it.
    ``max_steps``: stop with :class:`SimulationTooLarge` once the steps recorded pass it (a
    1,024-rank ring allreduce is 2.1 million steps). :func:`estimate` first refuses most cases
    too large before recording; this is the limit should its sample have guessed low.
    """
    started = time.perf_counter()
    table = algorithm_choices(collective)
    mesh, ran, step_ptr = _record(collective, algorithm if table is not None else None, world_size, nbytes,
                                  root, ranks_per_host, max_steps)
    steps = np.frombuffer(mesh.steps, dtype=np.int64).reshape(-1, STEP_FIELDS)
    _check_counters(describe(collective, ran or algorithm, world_size, nbytes), steps)
    return Schedule(collective=collective, algorithm=ran or algorithm, world_size=world_size, nbytes=nbytes,
                    step_ptr=step_ptr, send_peer=steps[:, 0].copy(), send_bytes=steps[:, 1].copy(),
                    recv_peer=steps[:, 2].copy(), recv_bytes=steps[:,
                                                                   3].copy(), reduces=steps[:,
                                                                                            4].astype(bool),
                    record_s=time.perf_counter() - started, passes=steps[:, 5].copy())
