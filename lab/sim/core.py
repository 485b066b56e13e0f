"""``simulate`` and ``best_algorithm``: record the real algorithm on virtual ranks, replay it on a network."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.sim.network import Network
from lab.sim.record import ROOTED, Schedule, SimulationUnsupported, algorithms, record
from lab.sim.replay import Message, replay

#: Recorded schedules up to this many steps are kept (a calibration replays the same ones often).
_CACHE_MAX_STEPS = 200_000
_CACHE_MAX_ENTRIES = 256
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
        return {"bytes_sent": int(self.bytes_sent[rank]), "bytes_received": int(self.bytes_received[rank]),
                "messages_sent": int(self.messages_sent[rank]), "messages_received": int(self.messages_received[rank])}


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value >= high):
        span = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {span}; got {value!r}")
    return int(value)


def _check(collective: Any, world_size: Any, nbytes: Any, root: Any, network: Any) -> tuple[str, int, int, int, Network]:
    table = algorithms()
    if collective not in table:
        raise ValueError(f"collective must be one of {', '.join(map(repr, table))}; got {collective!r}")
    world_size = _check_int("world_size", world_size, 1)
    nbytes = _check_int("nbytes", nbytes, 0)
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (the input is float32 elements); got {nbytes}")
    root = _check_int(ROOTED.get(collective, "root"), root, 0, world_size) if collective in ROOTED else 0
    if network is None:
        network = Network()
    elif not isinstance(network, Network):
        raise TypeError(f"network must be a lab.sim.Network; got {type(network).__name__}")
    return collective, world_size, nbytes, root, network


def _schedule(collective: str, algorithm: str, world_size: int, nbytes: int, root: int,
              ranks_per_host: int, max_steps: int | None) -> tuple[Schedule, bool]:
    """The recorded schedule, and whether it was recorded now (False: from the cache)."""
    key = (collective, algorithm, world_size, nbytes, root, ranks_per_host)
    cached = _cache.get(key)
    if cached is not None:
        return cached, False
    schedule = record(collective, algorithm, world_size, nbytes, root, ranks_per_host, max_steps)
    if schedule.steps <= _CACHE_MAX_STEPS:
        if len(_cache) >= _CACHE_MAX_ENTRIES:
            _cache.pop(next(iter(_cache)))
        _cache[key] = schedule
    return schedule, True


def simulate(collective: str, algorithm: str, world_size: int, nbytes: int, network: Network | None = None,
             *, root: int = 0, max_steps: int | None = None) -> SimResult:
    """Run ``collective`` with ``algorithm`` on ``world_size`` virtual ranks and time it on ``network``.

    ``nbytes`` is each rank's input tensor (float32 elements), as the real call takes it; ``root``
    is broadcast's ``src`` / reduce's ``dst``. ``max_steps``: raise :class:`SimulationTooLarge`
    instead of recording more steps than that (about 1 s and 100 MB per million). The algorithm is the lab's own function, run on a
    recording mesh, so the per-rank byte and message counts are the ones a real run reports.

        net = lab.sim.Network(alpha_us=20.0, gbit=10.0)
        r = lab.sim.simulate("allreduce", "ring", world_size=4, nbytes=1 << 20, network=net)
        r.time_us            # 6 · (20 + 262,144 · 0.0008) = 1,378.3 µs
        r.bytes_sent         # array([786432, 786432, 786432, 786432])
    """
    collective, world_size, nbytes, root, network = _check(collective, world_size, nbytes, root, network)
    names = algorithms()[collective]
    if algorithm not in names:
        hint = " (for the fastest, call lab.sim.best_algorithm)" if algorithm == "auto" else ""
        raise ValueError(f"algorithm for {collective} must be one of {', '.join(map(repr, names))}; "
                         f"got {algorithm!r}{hint}")
    schedule, fresh = _schedule(collective, algorithm, world_size, nbytes, root, network.ranks_per_host, max_steps)
    timing = replay(schedule, network)
    sends, recvs = schedule.send_peer >= 0, schedule.recv_peer >= 0
    return SimResult(
        collective=collective, algorithm=schedule.algorithm, world_size=world_size, nbytes=nbytes, network=network,
        time_us=float(timing.finish_us.max()), finish_us=timing.finish_us,
        bytes_sent=schedule.per_rank(np.where(sends, schedule.send_bytes, 0)),
        bytes_received=schedule.per_rank(np.where(recvs, schedule.recv_bytes, 0)),
        messages_sent=schedule.per_rank(sends), messages_received=schedule.per_rank(recvs),
        critical_path=timing.critical_path, record_s=schedule.record_s if fresh else 0.0, replay_s=timing.replay_s)


def predict(collective: str, world_size: int, nbytes: int, network: Network | None = None, *, root: int = 0,
            candidates: list[str] | tuple[str, ...] | None = None) -> dict[str, float]:
    """``{algorithm: simulated time_us}`` for every algorithm of ``collective`` (or ``candidates``);
    algorithms the recording mesh cannot run (they split the mesh) are left out."""
    collective, world_size, nbytes, root, network = _check(collective, world_size, nbytes, root, network)
    names = algorithms()[collective] if candidates is None else tuple(candidates)
    times = {}
    for name in names:
        try:
            times[name] = simulate(collective, name, world_size, nbytes, network, root=root).time_us
        except SimulationUnsupported:
            continue
    return times


def best_algorithm(collective: str, world_size: int, nbytes: int, network: Network | None = None, *,
                   root: int = 0, candidates: list[str] | tuple[str, ...] | None = None) -> str:
    """The algorithm with the least simulated time (ties: the first in the lab's table).

        lab.sim.best_algorithm("allreduce", world_size=1024, nbytes=1 << 20,
                               network=lab.sim.Network(alpha_us=20.0, gbit=10.0))
    """
    times = predict(collective, world_size, nbytes, network, root=root, candidates=candidates)
    if not times:
        raise ValueError(f"no algorithm of {collective} can be simulated")
    return min(times, key=times.get)
