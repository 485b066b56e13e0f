"""Record what each rank sends and receives by running the real collectives on a mesh that moves nothing.

The algorithms only ever call ``mesh.send_buffer``/``recv_buffer``/``sendrecv_buffer``, and what
they send (peer, chunk bounds) depends on the rank, the world size and the element count, never
on the values. So :class:`RecordingMesh` runs the public call (``lab.allreduce(mesh, x,
algorithm=...)``) once per rank, one rank after the other: every send returns at once, every
receive returns at once without touching its buffer (no reduction kernel runs), and each call
is written down as one *step*: (destination, bytes sent, source, bytes received, reduces?).

Data is never touched, copied or allocated at full size. The input is an anonymous mapping that
is never written (reading it maps the kernel's zero page: no memory), viewed as a
:class:`VirtualArray`, whose copies (reduce_scatter's work buffer, reduce's scratch) are stride-0
arrays of one element and whose writes do nothing; outputs the public call allocates
(allgather's N·T bytes) are such arrays too (the recorder's ``new_flat``), and its reduction
kernels do nothing (the recorder's ``kernels``): nothing global is changed, so recordings in
several threads at once are independent.

Limits. A recording costs about 170 bytes and a few µs per step, so before recording
:func:`estimate` records a sample of ranks (the root, rank 0, the last rank and 16 others, each
standing for its share of the rest) and :func:`record` refuses with :class:`SimulationTooLarge`
past ``max_steps`` (default 10 million steps: about 1.7 GB) or ``max_seconds`` (default 300 s
of recording), naming the limit and how to raise it; ``record`` also stops at ``max_steps``
while it records, should the sample have guessed low.
"""

from __future__ import annotations

import contextlib
import mmap
import random
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.collectives import registry
from lab.errors import LabError
from lab.ops import DType, Reduction

#: Every collective the lab may have, in the order tables and reports list them.
COLLECTIVES = registry.COLLECTIVES
#: Collectives whose call takes a root (broadcast's ``src``, reduce's ``dst``).
ROOTED = {"broadcast": "src", "reduce": "dst"}
#: Collectives whose call takes a reduction op (recorded with "sum": the op changes no message).
REDUCING = ("allreduce", "reduce_scatter", "reduce")

_STEP_FIELDS = 5  # dst, bytes sent, src, bytes received, reduces (-1 / 0 where there is none)

#: The default limits of ``simulate``, ``predict``, ``best_algorithm`` and ``python -m lab simulate``.
DEFAULT_MAX_STEPS = 10_000_000  # about 1.7 GB at peak, 10-40 s (a 1,024-rank ring is 2.1 million)
DEFAULT_MAX_SECONDS = 300.0  # of recording, estimated from the sampled ranks' own recording time
#: Peak memory per step, recording to replay (measured: 162 bytes on ring allreduce, N = 512 and
#: 1,024), and per rank (the replay's per-rank arrays).
BYTES_PER_STEP, BYTES_PER_RANK = 170, 200
#: The replay's time per step (measured: 0.46 µs, pairing included, on ring allreduce at N = 1,024).
REPLAY_S_PER_STEP = 0.5e-6
#: No larger world is simulated at all (a ValueError, before anything is allocated): 16,777,216
#: ranks, 100 times the largest clusters, and far past any recording's default limits.
MAX_WORLD_SIZE = 1 << 24
#: The largest input per rank: 1 TiB (more than any accelerator's memory; mapped, never touched).
MAX_NBYTES = 1 << 40
#: How many ranks, besides 0, the root and the last, :func:`estimate` records to extrapolate.
SAMPLED_RANKS = 16


class SimulationUnsupported(LabError, NotImplementedError):
    """The algorithm uses something the recording mesh cannot replay without running ranks together
    (``mesh.split``: the sub-mesh depends on every rank's colour)."""


class SimulationTooLarge(SimulationUnsupported):
    """The recording would pass ``max_steps`` steps or take longer than ``max_seconds``; the
    message says how large it is and how to raise the limit."""


def _round_up(value: float) -> int:
    """Two significant digits, rounded up (what to suggest as a new limit): 799,960,000 -> 800,000,000."""
    value = max(int(-(-value // 1)), 1)
    scale = 10 ** max(len(str(value)) - 2, 0)
    return -(-value // scale) * scale


def _memory(nbytes: float) -> str:
    """``136.0 GB``, ``21 MB``, ``under 1 MB``."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:,.1f} GB"
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else "under 1 MB"


def _raise_it(name: str, needed: float, at_least: bool) -> str:
    if at_least:  # only a lower bound is known: no number to suggest
        return (f"Pass a larger {name}= (lab.sim.estimate says how large), or {name}=None for no limit, "
                "to simulate it anyway.")
    return f"Pass {name}={_round_up(needed):_} (or {name}=None for no limit) to simulate it anyway."


def too_many_steps(case: str, steps: float, max_steps: int, basis: str, at_least: bool = False) -> SimulationTooLarge:
    """The refusal of ``case``, which needs ``steps`` steps (``basis``: how we know), past ``max_steps``.

        too_many_steps("allreduce (ring) on 20,000 ranks of 4,096 bytes", 799_960_000, 10_000_000,
                       "estimated from 19 sampled ranks")
        # too large to simulate: allreduce (ring) on 20,000 ranks of 4,096 bytes needs about 799,960,000
        # steps (estimated from 19 sampled ranks; about 136.0 GB of memory), past max_steps=10,000,000.
        # Pass max_steps=800_000_000 (or max_steps=None for no limit) to simulate it anyway.
    """
    amount = "at least" if at_least else "about"
    return SimulationTooLarge(
        f"too large to simulate: {case} needs {amount} {steps:,.0f} steps ({basis}; {amount} "
        f"{_memory(steps * BYTES_PER_STEP)} of memory), past max_steps={max_steps:,}. "
        + _raise_it("max_steps", steps, at_least))


def too_slow(case: str, seconds: float, max_seconds: float, basis: str, at_least: bool = False) -> SimulationTooLarge:
    """The refusal of ``case``, whose recording would take ``seconds``, past ``max_seconds``."""
    amount = "at least" if at_least else "about"
    return SimulationTooLarge(
        f"too large to simulate: {case} would take {amount} {seconds:,.0f} s to record ({basis}), past "
        f"max_seconds={max_seconds:g}. " + _raise_it("max_seconds", seconds, at_least))


def describe(collective: str, algorithm: str | None, world_size: int, nbytes: int) -> str:
    """``allreduce (ring) on 20,000 ranks of 4,096 bytes``: a case, as the errors name it."""
    return f"{collective}{f' ({algorithm})' if algorithm else ''} on {world_size:,} ranks of {nbytes:,} bytes"


class RecordingMesh:
    """What the public collectives and the algorithms use of a :class:`lab.Mesh` (the
    :class:`lab.peers.Peers` interface, ``issue``, ``collective``, ``kernels``, ``new_flat``),
    with no transport: it records each transfer as a step and moves nothing. Its kernels do
    nothing and its outputs are virtual, so no data is touched; each instance is its own, so
    recordings in several threads at once do not meet.

    ``rank`` can be set, so one instance records every rank in turn. ``host``, ``local_rank`` and
    ``local_world_size`` follow ``ranks_per_host``, as on emulated hosts.
    """

    transport = "sim"
    host_count = 1  # auto never weighs hierarchical here: the algorithm is always given

    def __init__(self, world_size: int, ranks_per_host: int = 1) -> None:
        self._world_size, self._ranks_per_host = world_size, ranks_per_host
        self.steps = array("q")  # _STEP_FIELDS int64 per step, every rank's steps one after the other
        self.ran: list[tuple[str, str]] = []  # (collective, algorithm) of each collective() entered
        self.rank = 0
        # The limits: once len(steps) reaches check_at, check() runs (it raises, or moves check_at on).
        self.check_at = sys.maxsize
        self.check: Callable[[], None] = lambda: None

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

    def _step(self, step: tuple[int, int, int, int, int]) -> None:
        self.steps.extend(step)
        if len(self.steps) >= self.check_at:  # one comparison per step until a limit is near
            self.check()

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        self._step((dst, data.nbytes, -1, 0, 0))

    def recv_buffer(self, src: int, out: np.ndarray, combine: Any = None) -> None:
        self._step((-1, 0, src, out.nbytes, combine is not None))

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray, combine: Any = None) -> None:
        self._step((dst, data.nbytes, src, out.nbytes, combine is not None))

    def host_of(self, rank: int) -> int:
        return rank // self._ranks_per_host  # what lab.peers.hierarchy groups by (hierarchical allreduce)

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


class VirtualArray(np.ndarray):
    """An array whose values the recording never needs: writing into it does nothing, and a copy
    of it is a stride-0 array of one element, whatever its length (numpy keeps the class through
    slices, views and reshapes, so every chunk an algorithm takes of it is one too).

        x = virtual(1 << 28, np.float32)     # 1 GiB as the collectives see it, 4 bytes in memory
        x.copy().nbytes, x[5:9].nbytes       # (1073741824, 16)
        x[:] = 1.0                           # nothing happens

    Which is what reduce_scatter's work copy, reduce's scratch copy, Bruck's packed slots and
    allgather's output are while recording. An operation it does not know (``np.array(x)``,
    ``astype``) still works: it reads zeros and allocates a real array.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        pass  # values never matter to a schedule

    def copy(self, order: str = "C") -> VirtualArray:
        return virtual(self.shape, self.dtype)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        make = _VIRTUAL_RESULTS.get(func)
        if make is not None:
            return make(*args, **kwargs)
        return super().__array_function__(func, types, args, kwargs)


def virtual(shape: int | tuple[int, ...], dtype: Any) -> VirtualArray:
    """A :class:`VirtualArray` of ``shape`` that occupies one element: every index aliases it."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    one = np.zeros(1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape)).view(VirtualArray)


def _virtual_like(a: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> VirtualArray:
    return virtual(kwargs.get("shape") or np.shape(a), dtype or a.dtype)


def _virtual_concatenate(arrays: Any, axis: int = 0, *args: Any, **kwargs: Any) -> VirtualArray:
    arrays = list(arrays)
    shape = list(np.shape(arrays[0]))
    shape[axis] = sum(np.shape(a)[axis] for a in arrays)
    return virtual(tuple(shape), kwargs.get("dtype") or arrays[0].dtype)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


#: What numpy's functions return for a VirtualArray (the rest are numpy's own).
_VIRTUAL_RESULTS: dict[Any, Callable[..., Any]] = {
    np.copy: _virtual_like, np.empty_like: _virtual_like, np.zeros_like: _virtual_like,
    np.ones_like: _virtual_like, np.full_like: lambda a, fill_value, dtype=None, *x, **k: _virtual_like(a, dtype),
    np.concatenate: _virtual_concatenate, np.copyto: _nothing,
}

#: MAP_NORESERVE: map the input without reserving memory for it (it is never written).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _mapped_input(numel: int) -> VirtualArray:
    """The float32 input every rank passes: contiguous (so the public call takes it as it is, with
    no copy), an anonymous mapping that is never written, so reading it costs no memory either."""
    if numel == 0:
        return np.empty(0, np.float32).view(VirtualArray)
    try:
        mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except (OSError, OverflowError) as exc:
        raise SimulationTooLarge(f"too large to simulate: cannot map an input of {numel * 4:,} bytes here ({exc}); "
                                 "use a smaller nbytes") from exc
    return np.frombuffer(mapping, np.float32).view(VirtualArray)


def _skip(dst: np.ndarray, src: np.ndarray) -> None:
    """The reduction kernel while recording."""


def _public(collective: str) -> Callable[..., Any]:
    import lab.collectives

    return getattr(lab.collectives, collective)


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


def at_least_one_step_per_rank(case: str, world_size: int, max_steps: int | None) -> None:
    """Every rank sends or receives at least once, so N - 1 > max_steps is refused with no recording."""
    if max_steps is not None and world_size - 1 > max_steps:
        raise too_many_steps(case, world_size - 1, max_steps, "every rank but one sends or receives at least once",
                             at_least=True)


@dataclass(frozen=True)
class Estimate:
    """What recording and replaying a case costs, from a sample of its ranks (:func:`estimate`)."""

    world_size: int
    steps: int  # every rank's steps together (a step sends, receives, or both)
    record_s: float  # wall time to record them all: the sampled ranks' own, extrapolated (this machine, now)
    sampled: int  # how many ranks were recorded to estimate
    exact: bool  # every rank was: steps is the count itself

    @property
    def memory_bytes(self) -> int:
        """Peak memory of recording, pairing and replaying it (170 bytes a step, 200 a rank)."""
        return self.steps * BYTES_PER_STEP + self.world_size * BYTES_PER_RANK

    @property
    def seconds(self) -> float:
        """Wall time of recording and replaying it."""
        return self.record_s + self.steps * REPLAY_S_PER_STEP


def _sample(world_size: int, root: int) -> list[tuple[int, bool]]:
    """The ranks :func:`estimate` records, each with whether it stands for itself only.

    Rank 0, the root and the last rank stand for themselves (they are the ones most often unlike
    the rest: naive's root does N-1 times the others' work); 16 others drawn at random (the same
    every time) stand for all the rest. The random ones come first: each weighs most, so a case
    far past a limit shows it within the first of them. Up to 19 ranks: all, each for itself.

        _sample(4, 0)              # [(0, False), (1, False), (2, False), (3, False)]
        _sample(1000, 0)[-2:]      # [(0, True), (999, True)], after 16 random ranks
    """
    special = sorted({0, root, world_size - 1})
    if world_size - len(special) <= SAMPLED_RANKS:
        return [(rank, False) for rank in range(world_size)]
    drawn = random.Random(world_size).sample(range(world_size), SAMPLED_RANKS + len(special))
    picked = sorted(r for r in drawn if r not in special)[:SAMPLED_RANKS]
    return [(rank, False) for rank in picked] + [(rank, True) for rank in special]


class _Meter:
    """Counts the steps and the recording time of the sampled ranks, and raises
    :class:`SimulationTooLarge` once they show the case past a limit.

    Each random rank stands for ``weight`` = (N - specials) / (random ranks sampled) ranks, so the
    weighted sum of what is recorded so far is a lower bound of the final estimate: checked every
    few steps. Once it passes a limit, the rank being recorded is finished (within a moment: a
    million steps, 10 s) so that the refusal can say how large the case is, projected from the
    ranks done: N × their mean, specials counted as they are.
    """

    CHECK_EVERY = 8  # steps
    FINISH_STEPS, FINISH_S = 1_000_000, 10.0

    def __init__(self, mesh: RecordingMesh, case: str, sample: list[tuple[int, bool]], max_steps: int | None,
                 max_seconds: float | None) -> None:
        self.mesh, self.case, self.sampled = mesh, case, len(sample)
        self.limits = {"max_steps": max_steps, "max_seconds": max_seconds}
        self.world_size = mesh.world_size
        self.specials = sum(special for _, special in sample)
        self.weight = (self.world_size - self.specials) / (len(sample) - self.specials)
        self.done: list[tuple[bool, int, float]] = []  # (special, steps, seconds) per rank recorded
        self.special, self.started, self.passed, self.recording = False, 0.0, "", False
        self.crossed = (0, 0.0)  # the rank in progress's steps and seconds when a limit was passed
        mesh.check = self.check

    def begin(self, special: bool) -> None:
        self.special, self.started, self.recording = special, time.perf_counter(), True
        del self.mesh.steps[:]  # only counts are kept: the sample's memory is one rank's
        self.mesh.check_at = _STEP_FIELDS * self.CHECK_EVERY

    def end(self) -> None:
        self.done.append((self.special, len(self.mesh.steps) // _STEP_FIELDS, time.perf_counter() - self.started))
        self.recording = False
        if self.passed:
            self.refuse(at_least=False)
        self.check()

    def _bound(self, current: bool) -> tuple[float, float]:
        """The weighted steps and seconds so far (with the rank in progress if ``current``)."""
        current = current and self.recording
        done = self.done + ([(self.special, len(self.mesh.steps) // _STEP_FIELDS,
                              time.perf_counter() - self.started)] if current else [])
        factor = [1.0 if special else self.weight for special, _, _ in done]
        return (sum(f * steps for f, (_, steps, _) in zip(factor, done)),
                sum(f * seconds for f, (_, _, seconds) in zip(factor, done)))

    def projection(self) -> tuple[float, float]:
        """Steps and seconds for every rank, from the ranks done: N × their mean, specials as they are."""
        special = [(steps, seconds) for is_special, steps, seconds in self.done if is_special]
        others = [(steps, seconds) for is_special, steps, seconds in self.done if not is_special]
        rest = (self.world_size - len(special)) / max(len(others), 1)
        return (sum(s for s, _ in special) + rest * sum(s for s, _ in others),
                sum(t for _, t in special) + rest * sum(t for _, t in others))

    def check(self) -> None:
        """At every few steps and after every rank: has the lower bound passed a limit?"""
        steps, seconds = len(self.mesh.steps) // _STEP_FIELDS, time.perf_counter() - self.started
        if self.passed:  # finishing the rank in progress, for the projection; unless it takes long
            if steps - self.crossed[0] > self.FINISH_STEPS or seconds - self.crossed[1] > self.FINISH_S:
                self.refuse(at_least=True)
        else:
            steps_bound, seconds_bound = self._bound(current=True)
            if self.limits["max_steps"] is not None and steps_bound > self.limits["max_steps"]:
                self.passed, self.crossed = "max_steps", (steps, seconds)
            elif self.limits["max_seconds"] is not None and seconds_bound > self.limits["max_seconds"]:
                self.passed, self.crossed = "max_seconds", (steps, seconds)
        self.mesh.check_at = len(self.mesh.steps) + _STEP_FIELDS * self.CHECK_EVERY

    def refuse(self, at_least: bool) -> None:
        """Raise for the limit passed: steps first (they are counted, not timed), then time."""
        steps, seconds = self._bound(current=True) if at_least else self.projection()
        recorded = len(self.done) + at_least
        basis = ("counted on every rank" if recorded == self.world_size and not at_least else
                 f"{'extrapolated' if at_least else 'estimated'} from {len(self.done)}"
                 f"{' and a part' if at_least else ''} of the {self.sampled} ranks sampled")
        max_steps, max_seconds = self.limits["max_steps"], self.limits["max_seconds"]
        if max_steps is not None and steps > max_steps:
            raise too_many_steps(self.case, steps, max_steps, basis, at_least)
        if max_seconds is not None and seconds > max_seconds:
            raise too_slow(self.case, seconds, max_seconds, basis, at_least)
        self.passed = ""  # the ranks done project below the limits after all: go on

    def finish(self) -> Estimate:
        """Every sampled rank recorded: the estimate, or the refusal if it is past a limit."""
        steps, seconds = self._bound(current=False)
        if any(self.limits[name] is not None and value > self.limits[name]
               for name, value in [("max_steps", steps), ("max_seconds", seconds)]):
            self.refuse(at_least=False)
        return Estimate(self.world_size, round(steps), seconds, self.sampled, self.sampled == self.world_size)


def estimate(collective: str, algorithm: str | None, world_size: int, nbytes: int, root: int = 0,
             ranks_per_host: int = 1, max_steps: int | None = None, max_seconds: float | None = None) -> Estimate:
    """The steps, time and memory of simulating a case, from recording a sample of its ranks
    (arguments already validated; :func:`lab.sim.estimate` is the checked call).

    With ``max_steps``/``max_seconds``, raises :class:`SimulationTooLarge` as soon as the sample
    shows the case past them: a 20,000-rank ring allreduce (800 million steps) after its first
    sampled rank (40,000 steps). Up to 19 ranks are all recorded: the count is then exact.

        estimate("allreduce", "ring", 2000, 4096).steps      # 7,996,000 = 2000 · 2 · 1999
    """
    case = describe(collective, algorithm, world_size, nbytes)
    at_least_one_step_per_rank(case, world_size, max_steps)
    sample = _sample(world_size, root)
    mesh = RecordingMesh(world_size, ranks_per_host)
    meter = _Meter(mesh, case, sample, max_steps, max_seconds)
    x = _mapped_input(nbytes // 4)
    for rank, special in sample:
        meter.begin(special)
        mesh.rank = rank
        _call(collective, mesh, x, algorithm, root)
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
        mesh.check_at = (max_steps + 1) * _STEP_FIELDS

        def passed() -> None:
            raise too_many_steps(case, max_steps + 1, max_steps, f"reached while recording rank {mesh.rank:,} "
                                 f"of {world_size:,}", at_least=True)
        mesh.check = passed
    x = _mapped_input(nbytes // 4)  # never written: the same input serves every rank
    step_ptr = np.zeros(world_size + 1, dtype=np.int64)
    for rank in range(world_size):
        mesh.rank = rank
        _call(collective, mesh, x, algorithm, root)
        step_ptr[rank + 1] = len(mesh.steps) // _STEP_FIELDS
    ran = {a for _, a in mesh.ran}
    if len(ran) > 1:
        raise RuntimeError(f"ranks ran different algorithms for one {collective}: {sorted(ran)}")
    return mesh, (ran.pop() if ran else algorithm or ""), step_ptr


def _check_counters(case: str, steps: np.ndarray) -> None:
    """The per-rank byte counts are int64 sums: refuse a case whose bytes would overflow them."""
    for column, what in [(1, "sent"), (3, "received")]:
        total = float(steps[:, column].sum(dtype=np.float64))
        if total >= 2.0 ** 62:
            raise SimulationTooLarge(f"too large to simulate: {case} has its ranks {what} {total:,.0f} bytes in all, "
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
    mesh, ran, step_ptr = _record(collective, algorithm if table is not None else None, world_size, nbytes, root,
                                  ranks_per_host, max_steps)
    steps = np.frombuffer(mesh.steps, dtype=np.int64).reshape(-1, _STEP_FIELDS)
    _check_counters(describe(collective, ran or algorithm, world_size, nbytes), steps)
    return Schedule(
        collective=collective, algorithm=ran or algorithm, world_size=world_size, nbytes=nbytes,
        step_ptr=step_ptr, send_peer=steps[:, 0].copy(), send_bytes=steps[:, 1].copy(),
        recv_peer=steps[:, 2].copy(), recv_bytes=steps[:, 3].copy(), reduces=steps[:, 4].astype(bool),
        record_s=time.perf_counter() - started)
