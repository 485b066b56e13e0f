"""``simulate`` and ``best_algorithm``: record the real algorithm on virtual ranks, replay it on a network."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lab import checks
from lab.sim import limits
from lab.sim import schedule as recorder
from lab.sim.event_loop import Message, replay
from lab.sim.limits import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    MAX_NBYTES,
    MAX_WORLD_SIZE,
    Estimate,
    SimulationTooLarge,
    SimulationUnsupported,
)
from lab.sim.network import Network
from lab.sim.schedule import ROOTED, Schedule, algorithms, record

#: Recorded schedules up to this many steps are kept (a calibration replays the same ones often),
#: up to this many steps in all (about 41 bytes a step: 164 MB), the oldest dropped first.
_CACHE_MAX_STEPS = 200_000
_CACHE_TOTAL_STEPS = 4_000_000
_cache: dict[tuple, Schedule] = {}


@dataclass(frozen=True)
class SimResult:
    """One simulated collective. Per-rank arrays are indexed by rank; counts are what
    ``mesh.stats()`` of a real run reports (payload bytes only)."""

    collective: str
    algorithm: str
    world_size: int
    nbytes: int
    network: Network
    time_us: float  # when the last rank finished (all start at 0)
    finish_us: np.ndarray  # float64 per rank
    bytes_sent: np.ndarray  # int64 per rank
    bytes_received: np.ndarray
    messages_sent: np.ndarray
    messages_received: np.ndarray
    critical_path: list[Message]  # the chain of messages that set time_us, first to last
    record_s: float  # wall time spent recording the schedule (0 when it came from the cache)
    replay_s: float  # wall time spent in the event loop

    @property
    def messages(self) -> int:
        """Messages sent by all ranks together."""
        return int(self.messages_sent.sum())

    def stats(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s counters, with the keys of ``mesh.stats()``."""
        return {
            "bytes_sent": int(self.bytes_sent[rank]), "bytes_received": int(self.bytes_received[rank]),
            "messages_sent": int(self.messages_sent[rank]),
            "messages_received": int(self.messages_received[rank])}


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (or >= low), or a ValueError naming ``name`` and the range."""
    if not checks.is_int(value) or value < low \
            or (high is not None and value > high):
        span = f"from {low:,} to {high:,}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {span}; got {value!r}")
    return int(value)


def check_limits(max_steps: Any, max_seconds: Any) -> tuple[int | None, float | None]:
    """The recording's limits: ``max_steps`` an integer >= 1, ``max_seconds`` a number > 0; None: none."""
    if max_steps is not None:
        if not checks.is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1 or None (no limit); got {max_steps!r}")
        max_steps = int(max_steps)
    if max_seconds is not None:
        if not checks.is_real(max_seconds) or not max_seconds > 0:
            raise ValueError(f"max_seconds must be a number > 0 or None (no limit); got {max_seconds!r}")
        max_seconds = float(max_seconds)
    return max_steps, max_seconds


def _check(collective: Any, world_size: Any, nbytes: Any, root: Any,
           network: Any) -> tuple[str, int, int, int, Network]:
    table = algorithms()
    if collective not in table:
        raise ValueError(f"collective must be one of {', '.join(map(repr, table))}; got {collective!r}")
    # Bounded before anything is allocated: one int64 per rank at 2**40 ranks is 8 TiB.
    world_size = _check_int("world_size", world_size, 1, MAX_WORLD_SIZE)
    nbytes = _check_int("nbytes", nbytes, 0, MAX_NBYTES)
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (the input is float32 elements); got {nbytes}")
    if world_size * nbytes >= 2**62:  # allgather's output is N·T bytes: numpy's sizes and our counters are int64
        raise ValueError(f"world_size × nbytes must be below 2**62 (allgather's output, the byte counters); "
                         f"got {world_size:,} × {nbytes:,}")
    root = _check_int(ROOTED.get(collective, "root"), root, 0, world_size - 1) if collective in ROOTED else 0
    if network is None:
        network = Network()
    elif not isinstance(network, Network):
        raise TypeError(f"network must be a lab.sim.Network; got {type(network).__name__}")
    return collective, world_size, nbytes, root, network


def _check_algorithm(collective: str, algorithm: Any) -> None:
    names = algorithms()[collective]
    if algorithm not in names:
        hint = " (for the fastest, call lab.sim.best_algorithm)" if algorithm == "auto" else ""
        raise ValueError(f"algorithm for {collective} must be one of {', '.join(map(repr, names))}; "
                         f"got {algorithm!r}{hint}")


def _key(collective: str, algorithm: str, world_size: int, nbytes: int, root: int,
         ranks_per_host: int) -> tuple:
    return collective, algorithm, world_size, nbytes, root, ranks_per_host


def _keep(key: tuple, schedule: Schedule) -> None:
    """Cache a small recording, dropping the oldest until all fit in ``_CACHE_TOTAL_STEPS``."""
    if schedule.steps > min(_CACHE_MAX_STEPS, _CACHE_TOTAL_STEPS):
        return
    kept = sum(s.steps for s in _cache.values())
    while _cache and kept + schedule.steps > _CACHE_TOTAL_STEPS:
        kept -= _cache.pop(next(iter(_cache))).steps
    _cache[key] = schedule


def _fits(collective: str, algorithm: str, world_size: int, nbytes: int, root: int, ranks_per_host: int,
          max_steps: int | None, max_seconds: float | None) -> None:
    """Refuse (:class:`SimulationTooLarge`) a case that a sample of its ranks shows past the limits."""
    case = limits.describe(collective, algorithm, world_size, nbytes)
    cached = _cache.get(_key(collective, algorithm, world_size, nbytes, root, ranks_per_host))
    if cached is not None:  # recorded already: its steps are known (the same answer as without a cache)
        if max_steps is not None and cached.steps > max_steps:
            raise limits.too_many_steps(case, cached.steps, max_steps, "counted on every rank")
        return
    if world_size <= limits.SAMPLED_RANKS + 3:
        # The sample would be every rank: the recording itself, which stops at max_steps, is as cheap.
        limits.at_least_one_step_per_rank(case, world_size, max_steps)
        return
    table_algorithm = algorithm if recorder.algorithm_choices(collective) is not None else None
    recorder.estimate(collective, table_algorithm, world_size, nbytes, root, ranks_per_host, max_steps,
                      max_seconds)


def recorded_schedule(collective: str, algorithm: str, world_size: int, nbytes: int, root: int,
                      ranks_per_host: int, max_steps: int | None) -> tuple[Schedule, bool]:
    """The recorded schedule of a case (kept in a small cache: :func:`simulate` and the
    calibration replay one schedule on many networks), and whether it was recorded now."""
    key = _key(collective, algorithm, world_size, nbytes, root, ranks_per_host)
    cached = _cache.get(key)
    if cached is not None:
        return cached, False
    schedule = record(collective, algorithm, world_size, nbytes, root, ranks_per_host, max_steps)
    _keep(key, schedule)
    return schedule, True


def simulate(collective: str, algorithm: str, world_size: int, nbytes: int, network: Network | None = None, *,
             root: int = 0, max_steps: int | None = DEFAULT_MAX_STEPS,
             max_seconds: float | None = DEFAULT_MAX_SECONDS) -> SimResult:
    """Run ``collective`` with ``algorithm`` on ``world_size`` virtual ranks and time it on ``network``.

    ``nbytes`` is each rank's input tensor (float32 elements), as the real call takes it; ``root``
    is broadcast's ``src`` / reduce's ``dst``. The algorithm is the lab's own function, run on a
    recording mesh, so the per-rank byte and message counts are the ones a real run reports.

    Limits: ``world_size`` up to 2**24 and ``nbytes`` up to 1 TiB (``ValueError`` beyond, before
    anything is allocated). A case whose recording would pass ``max_steps`` steps (default 10
    million: about 1.7 GB and 10-40 s) or take longer than ``max_seconds`` (default 300 s), as a
    sample of its ranks shows (:func:`estimate`), raises :class:`SimulationTooLarge` before it
    is recorded, naming the limit and the value to pass; ``None`` lifts a limit.

        net = lab.sim.Network(alpha_us=20.0, gbit=10.0)
        r = lab.sim.simulate("allreduce", "ring", world_size=4, nbytes=1 << 20, network=net)
        r.time_us            # 6 · (20 + 262,144 · 0.0008) = 1,378.3 µs
        r.bytes_sent         # array([786432, 786432, 786432, 786432])
        lab.sim.simulate("allreduce", "ring", 20_000, 4096)      # SimulationTooLarge: ... past max_steps=10,000,000
    """
    collective, world_size, nbytes, root, network = _check(collective, world_size, nbytes, root, network)
    _check_algorithm(collective, algorithm)
    max_steps, max_seconds = check_limits(max_steps, max_seconds)
    _fits(collective, algorithm, world_size, nbytes, root, network.ranks_per_host, max_steps, max_seconds)
    return _simulate(collective, algorithm, world_size, nbytes, network, root, max_steps)


def _simulate(collective: str, algorithm: str, world_size: int, nbytes: int, network: Network, root: int,
              max_steps: int | None) -> SimResult:
    """:func:`simulate` once checked and estimated."""
    schedule, fresh = recorded_schedule(collective, algorithm, world_size, nbytes, root,
                                        network.ranks_per_host, max_steps)
    timing = replay(schedule, network)
    sends, recvs = schedule.send_peer >= 0, schedule.recv_peer >= 0
    return SimResult(collective=collective, algorithm=schedule.algorithm, world_size=world_size,
                     nbytes=nbytes, network=network, time_us=float(timing.finish_us.max()),
                     finish_us=timing.finish_us,
                     bytes_sent=schedule.per_rank(np.where(sends, schedule.send_bytes, 0)),
                     bytes_received=schedule.per_rank(np.where(recvs, schedule.recv_bytes,
                                                               0)), messages_sent=schedule.per_rank(sends),
                     messages_received=schedule.per_rank(recvs), critical_path=timing.critical_path,
                     record_s=schedule.record_s if fresh else 0.0, replay_s=timing.replay_s)


def estimate(collective: str, algorithm: str, world_size: int, nbytes: int, *, root: int = 0,
             ranks_per_host: int = 1) -> Estimate:
    """What simulating a case would cost, from recording a sample of its ranks (19 at most):
    ``.steps``, ``.seconds``, ``.memory_bytes`` (``.exact`` when every rank was recorded).

        e = lab.sim.estimate("allreduce", "ring", 20_000, 4096)
        e.steps, e.memory_bytes       # (799,960,000, about 136 GB): past the default max_steps
    """
    collective, world_size, nbytes, root, _ = _check(collective, world_size, nbytes, root, None)
    _check_algorithm(collective, algorithm)
    ranks_per_host = _check_int("ranks_per_host", ranks_per_host, 1, MAX_WORLD_SIZE)
    table_algorithm = algorithm if recorder.algorithm_choices(collective) is not None else None
    return recorder.estimate(collective, table_algorithm, world_size, nbytes, root, ranks_per_host)


def compare(collective: str, world_size: int, nbytes: int, network: Network | None = None, *, root: int = 0,
            candidates: list[str] | tuple[str, ...] | None = None, max_steps: int | None = DEFAULT_MAX_STEPS,
            max_seconds: float | None = DEFAULT_MAX_SECONDS) -> dict[str, float]:
    """``{algorithm: simulated time_us}`` for every algorithm of ``collective`` (or ``candidates``);
    algorithms the recording mesh cannot run (they split the mesh) are left out.

    ``max_steps``/``max_seconds`` as in :func:`simulate`, for each algorithm: every candidate is
    estimated before any is simulated, and one past a limit raises :class:`SimulationTooLarge`
    (leaving it out would let :func:`best_algorithm` answer among the others, silently).
    """
    collective, world_size, nbytes, root, network = _check(collective, world_size, nbytes, root, network)
    max_steps, max_seconds = check_limits(max_steps, max_seconds)
    runnable, names = _runnable(collective, world_size, nbytes, root, network.ranks_per_host, candidates,
                                max_steps, max_seconds)
    times = {}
    for name in runnable:
        result = _runs(names, name, _simulate, collective, name, world_size, nbytes, network, root, max_steps)
        if result:
            times[name] = result.time_us
    return times


def predictable(collective: str, world_size: int, nbytes: int, *, ranks_per_host: int = 1, root: int = 0,
                candidates: list[str] | tuple[str, ...] | None = None, max_steps: int
                | None = DEFAULT_MAX_STEPS, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> list[str]:
    """The algorithms :func:`compare` would simulate (those the recorder can run), from the
    estimates alone: a case past the limits raises :class:`SimulationTooLarge` as :func:`compare`
    would, before anything is recorded in full (``python -m lab cluster fit`` checks its host
    counts so, before it fits).

        lab.sim.core.predictable("allreduce", 100_000, 4096)   # SimulationTooLarge: allreduce (ring) ...
    """
    collective, world_size, nbytes, root, _ = _check(collective, world_size, nbytes, root, None)
    ranks_per_host = _check_int("ranks_per_host", ranks_per_host, 1, MAX_WORLD_SIZE)
    runnable, _ = _runnable(collective, world_size, nbytes, root, ranks_per_host, candidates, max_steps,
                            max_seconds)
    return runnable


def _runnable(collective: str, world_size: int, nbytes: int, root: int, ranks_per_host: int, candidates: Any,
              max_steps: Any, max_seconds: Any) -> tuple[list[str], tuple[str, ...]]:
    """(the candidates the recorder can run, every candidate), each estimated within the limits
    (checked here: :func:`predictable` is called with them unchecked)."""
    max_steps, max_seconds = check_limits(max_steps, max_seconds)
    if candidates is not None and not isinstance(candidates, (list, tuple)):  # ("ring" is not ["ring"])
        raise TypeError(f"candidates must be a list of algorithm names or None; got {candidates!r}")
    names = algorithms()[collective] if candidates is None else tuple(candidates)
    for name in names:
        _check_algorithm(collective, name)
    return [
        name for name in names if _runs(names, name, _fits, collective, name, world_size, nbytes, root,
                                        ranks_per_host, max_steps, max_seconds)], names


def _runs(names: tuple[str, ...], name: str, step: Any, *args: Any) -> Any:
    """``step(*args)`` for candidate ``name`` of :func:`compare`: its result (True if None), or
    False where the recorder cannot run it; a case too large says how to leave it out."""
    try:
        result = step(*args)
    except SimulationTooLarge as exc:
        others = [n for n in names if n != name]
        raise SimulationTooLarge(f"{exc} Or leave it out: candidates={others!r}.") from None
    except SimulationUnsupported:
        return False
    return True if result is None else result


def best_algorithm(collective: str, world_size: int, nbytes: int, network: Network | None = None, *,
                   root: int = 0, candidates: list[str] | tuple[str, ...] | None = None, max_steps: int
                   | None = DEFAULT_MAX_STEPS, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> str:
    """The algorithm with the least simulated time (ties: the first in the lab's table); limits
    as in :func:`compare`.

        lab.sim.best_algorithm("allreduce", world_size=1024, nbytes=1 << 20,
                               network=lab.sim.Network(alpha_us=20.0, gbit=10.0))
    """
    times = compare(collective, world_size, nbytes, network, root=root, candidates=candidates,
                    max_steps=max_steps, max_seconds=max_seconds)
    if not times:
        raise ValueError(f"no algorithm of {collective} can be simulated")
    return min(times, key=times.get)
