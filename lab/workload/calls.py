"""The workload's public calls: :func:`replay` with its arguments checked, and a network by name
(:func:`network_named`), re-exported by :mod:`lab.workload`."""

from __future__ import annotations

from typing import Any

import numpy as np

from lab.algorithms import registry
from lab.sim.fitted import calibrated
from lab.sim.network import Network
from lab.workload.format import Workload
from lab.workload.rebucket import rebucket
from lab.workload.replay import DEFAULT_MAX_EVENTS, Replay, ReplayResult, prepare
from lab.workload.retarget import Layout


def network_named(network: Any) -> Network:
    """``network`` as a :class:`lab.sim.Network`: one, or the name of a transport whose network
    the lab fitted, as :func:`lab.sim.calibrated` returns it (shm, queue, tcp).

        network_named("tcp") == lab.sim.calibrated("tcp")       # True
    """
    if isinstance(network, Network):
        return network
    if not isinstance(network, str):
        raise ValueError(
            f"network must be a lab.sim.Network or the name of a fitted transport; got {network!r}")
    try:
        return calibrated(network)
    except ValueError as exc:
        raise ValueError(f"network {network!r}: {exc}") from None


def replay(workload: Workload, world_size: int | None = None, network: Any = None, *,
           algorithms: dict[str, str] | None = None, compute_scale: float = 1.0,
           stragglers: dict[int, float] | None = None, jitter: float = 0.0, seed: int = 0,
           dims: dict[str, int] | None = None, shard: str = "strong", timeline: bool = True,
           bucket_mb: float | None = None, max_events: int | None = DEFAULT_MAX_EVENTS,
           recorded_network: Any = None) -> ReplayResult:
    """Replay ``workload``'s whole steps on ``world_size`` ranks (or the mesh ``dims``; default:
    as recorded) over ``network`` (default: ``Network()``'s).

    ``algorithms``: the algorithm per collective (``{"allreduce": "ring"}``; ``"auto"``: the
    least simulated of ``auto``'s candidates). Default: an operation replayed at its recorded
    group size and bytes runs the algorithm the lab ran (where the file says it), any other the
    least simulated (:func:`lab.workload.replay.algorithm_for`). ``bucket_mb``: a DDP recording
    that knows its gradients (:func:`record_gradients`) re-bucketed at that cap
    (:mod:`lab.workload.rebucket`). ``compute_scale`` multiplies every rank's recorded
    compute; ``stragglers={rank: factor}`` multiplies one rank's more; ``jitter`` draws every
    rank's factor from ``1 + jitter * |N(0, 1)|`` (``seed``). ``shard``: ``"strong"`` keeps a sharded
    group's model total, ``"weak"`` its per-rank bytes (:mod:`lab.workload.retarget`).
    ``recorded_network``: the network the recording ran on (default: ``network``), where a send's
    recorded time on its rank's thread (:mod:`lab.workload.thread_time`) holds its α + n·β there,
    which the replay takes out before it adds ``network``'s.

    Limits, checked before the replay starts (:func:`lab.workload.replay.prepare`): ``world_size`` up
    to 2**24, the simulator's; ``max_events`` events, every target rank's together (default 5 million:
    about 1 GB, 3 with the timeline, half a minute; None: none), else :class:`lab.sim.SimulationTooLarge`
    with the count; each collective within the simulator's own limits at its target size.

        r = lab.workload.replay(w, world_size=8, network=lab.sim.Network(alpha_us=5, gbit=100))
        r.step_us           # array([...]): one value per recorded step
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be what lab.workload.load returns; got {type(workload).__name__}")
    if workload.steps == 0:
        raise ValueError(
            f"{workload.path or 'the workload'} has no whole step: call lab.workload.mark_step() "
            "after each optimizer.step() while recording")
    if bucket_mb is not None:
        workload = rebucket(workload, bucket_mb)
    layout = Layout.of(workload, world_size, dims, shard)
    net = Network() if network is None else network_named(network)
    recorded = None if recorded_network is None else network_named(recorded_network)
    algorithms = dict(algorithms or {})
    for collective, name in algorithms.items():
        if name not in (*registry_names(collective), "auto"):
            raise ValueError(
                f"algorithms[{collective!r}] must be one of {', '.join(registry_names(collective))} or auto; "
                f"got {name!r}")
    factors = _factors(layout.world_size, compute_scale, stragglers, jitter, seed)
    prepare(workload, layout, net, algorithms, max_events, timeline)
    run = Replay(workload, layout, net, algorithms, factors, timeline, recorded)
    run.run()
    return run.result()


def registry_names(collective: str) -> tuple[str, ...]:
    """The algorithms a replay can time ``collective`` with (``ValueError`` for an unknown collective)."""
    if collective not in registry.ALGORITHMS:
        raise ValueError(f"algorithms: {collective!r} is not a collective ({', '.join(registry.ALGORITHMS)})")
    return tuple(registry.names(collective))


def _factors(world_size: int, compute_scale: float, stragglers: dict[int, float] | None, jitter: float,
             seed: int) -> np.ndarray:
    """Each rank's compute factor."""
    for name, value in (("compute_scale", compute_scale), ("jitter", jitter)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    factors = np.full(world_size, float(compute_scale))
    if jitter:
        factors *= 1 + jitter * np.abs(np.random.default_rng(seed).standard_normal(world_size))
    for rank, factor in (stragglers or {}).items():
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"stragglers: {rank!r} is not a rank in [0, {world_size})")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < float("inf"):
            raise ValueError(f"stragglers[{rank}] must be a finite factor > 0; got {factor!r}")
        factors[rank] *= factor
    return factors
