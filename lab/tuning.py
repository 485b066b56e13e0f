"""How ``algorithm="auto"`` chooses, as NCCL's tuner does: predict each algorithm's time, take the least.

Each algorithm's time on N ranks for an n-byte tensor is modelled as

    t = steps(N) · α_step + volume(N) · n · β_byte

with steps (latency terms on the critical path) and volume (bytes through the busiest rank per
tensor byte) from the algorithm's structure, :func:`algorithm_shape`, and α_step, β_byte fitted
per transport, collective and algorithm by ``python -m lab results`` into ``lab/tuning.json``.
``auto`` compares the algorithms that have a fitted model for the transport (among the registry's
``auto`` candidates) at the world sizes they were measured at (``tuning.json``'s ``worlds``: the
main sweep's ``models`` and ``models_by_world``, from ``results/ranks/N``). There each follows its
measured medians: between two measured sizes the straight line through them (an α and a β per
interval, so a measured size predicts what was measured there), below the smallest that size's
time, above the largest the fitted per-byte term on top. At a world size never swept, or for a
transport or collective with fewer than two fits, it asks the registered advisors
(:func:`register_advisor`; this module imports nothing above it): ``import lab`` registers the
simulator (:mod:`lab.sim.advisor`, loaded when first asked), which replays every candidate on the transport's network as :mod:`lab.sim.calibrate`
fitted it (``tuning.json``'s ``networks``), the least simulated time winning. That choice is made once per (collective, transport,
N, power-of-two size bucket), simulated at the bucket's smallest size, so a steady-state call costs
a dictionary look-up. With neither fits nor a network it falls back to a fixed size threshold,
``AUTO_LARGE_MIN_BYTES``, between a latency-bound and a bandwidth-bound algorithm (the registry's
``fallback`` picks). ``LAB_ALGO`` overrides all of them, like ``NCCL_ALGO`` (see
:func:`lab.collectives.choice.forced_algorithm`). :func:`explain` says which of these decided, and why.

n is the full tensor T as nccl-tests counts it: the allreduce/broadcast/reduce tensor, the
allgather and gather result, the reduce_scatter, all_to_all and scatter input.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab.algorithms import registry

TUNING_PATH = Path(__file__).with_name("tuning.json")

#: Without fitted models, ``auto`` picks the bandwidth-bound algorithm from this many bytes up.
AUTO_LARGE_MIN_BYTES = 256 * 1024
#: The transports ``python -m lab results`` measures, each with its fitted models and network.
TRANSPORTS = ("shm", "queue", "tcp")
#: Who predicts the candidates' times where no fitted model decides, by name (the way NCCL's tuner
#: plugins plug in): ``advisor(collective, nbytes, world_size, network)`` -> ``(predictions, left
#: out with why)``, or None where it cannot use ``network`` (``tuning.json``'s keyword arguments
#: for the transport). ``import lab`` registers ``"simulator"`` (:mod:`lab.sim.advisor`); this module
#: knows nothing above it.
ADVISORS: dict[str, Callable[[str, int, int, dict], tuple[dict, dict] | None]] = {}
#: The advisors' choices: (collective, transport, N, size bucket, network) -> algorithm.
_SIMULATED: dict[tuple, str] = {}
_MAX_SIMULATED = 4096


def register_advisor(name: str, advisor: Callable[[str, int, int, dict], tuple[dict, dict] | None]) -> None:
    """Let ``advisor`` predict where no fitted model decides (:data:`ADVISORS`); ``name`` is the
    :class:`Choice`'s ``source`` when it decides. Registering a name again replaces it."""
    ADVISORS[name] = advisor


def algorithm_shape(algorithm: str, world_size: int, collective: str = "allreduce") -> tuple[float, float]:
    """(latency steps on the critical path, bytes through the busiest rank per tensor byte): the
    algorithm's ``shape`` (:mod:`lab.algorithms.registry`), from its docstring's cost. Never
    zero, so that a fit can always use both terms."""
    steps, volume = registry.ALGORITHMS[collective][algorithm].shape(world_size)
    return max(steps, 1), max(volume, 1e-12)


@functools.cache
def tuning_table() -> dict:
    """``tuning.json`` as ``python -m lab results`` wrote it (``models``, ``world``, ``worlds``,
    ``sizes``, ``networks``), or ``{}``."""
    try:
        table = json.loads(TUNING_PATH.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


@functools.cache
def fitted_models() -> dict:
    """``{transport: {collective: {algorithm: {"alpha_step_us", "beta_byte_us"}}}}`` from
    ``tuning.json``, or ``{}``."""
    return tuning_table().get("models", {})


def measured_models(world_size: int) -> dict:
    """The fits measured at ``world_size`` (the main sweep's :func:`fitted_models` at its world,
    ``models_by_world`` at the others), or ``{}``."""
    table = tuning_table()
    if world_size == table.get("world"):
        return fitted_models()
    return table.get("models_by_world", {}).get(str(world_size), {})


def swept_worlds() -> tuple[int, ...]:
    """The world sizes the fitted models were measured at (``tuning.json``'s ``worlds``, or its
    ``world``): ``auto`` trusts the fits there and asks the simulator elsewhere."""
    table = tuning_table()
    return tuple(table.get("worlds") or ([table["world"]] if "world" in table else ()))


def calibrated_networks() -> dict[str, dict]:
    """``{transport: Network keyword arguments}``: each transport's network as
    :func:`lab.sim.calibrate.calibrate` fitted it to the measured results (``tuning.json``'s
    ``networks``, written by ``python -m lab results``), or ``{}``."""
    return tuning_table().get("networks", {})


def predict_us(algorithm: str, nbytes: int, world_size: int, transport: str, collective: str = "allreduce",
               models: dict | None = None) -> float | None:
    """The model's time for one call, or None if this transport has no fit for the algorithm.

    ``models``: fits in ``tuning.json``'s layout (default: that file's).
    """
    fit = (fitted_models() if models is None else models).get(transport, {}).get(collective,
                                                                                 {}).get(algorithm)
    if fit is None:
        return None
    return sum(fitted_terms(fit, algorithm, nbytes, world_size, collective))


def fitted_terms(fit: dict, algorithm: str, nbytes: int, world_size: int,
                 collective: str = "allreduce") -> tuple[float, float]:
    """(latency µs, per-byte µs) of one fitted model for an ``nbytes`` call on ``world_size`` ranks.

    At the world size its ``points`` were measured at: between two measured sizes the line
    through their medians, below the smallest its median, above the largest the largest's median
    plus the fitted per-byte term for the bytes beyond. Elsewhere the α-β fit scaled by the
    algorithm's shape, steps(N)·α_step and volume(N)·n·β_byte. The per-byte part is the line's
    slope times n (none where the medians fall with size: noise)."""
    steps, volume = algorithm_shape(algorithm, world_size, collective)
    points = fit.get("points") if fit.get("world") == world_size else None
    if not points:
        return steps * fit["alpha_step_us"], volume * nbytes * fit["beta_byte_us"]
    sizes = [size for size, _ in points]
    at = bisect.bisect_left(sizes, nbytes)
    if at == 0:  # at or below the smallest measured size
        return points[0][1], 0.0
    if at == len(points):  # above the largest
        slope = volume * max(fit["beta_byte_us"], 0.0)
        last_bytes, last_us = points[-1]
        return last_us - slope * last_bytes, slope * nbytes
    (low_bytes, low_us), (high_bytes, high_us) = points[at - 1], points[at]
    slope = max((high_us - low_us) / (high_bytes - low_bytes), 0.0)
    time_us = low_us + (high_us - low_us) * (nbytes - low_bytes) / (high_bytes - low_bytes)
    return time_us - slope * nbytes, slope * nbytes


def _ring_fits(intra: str, models: dict | None) -> tuple[dict, dict] | None:
    """(the ``intra`` transport's ring fit, tcp's ring fit): the terms inside a host and between
    hosts that the predictions across hosts use; None without both."""
    fits = fitted_models() if models is None else models
    inside = fits.get(intra, {}).get("allreduce", {}).get("ring")
    across = fits.get("tcp", {}).get("allreduce", {}).get("ring")
    return None if inside is None or across is None else (inside, across)


def across_hosts_us(algorithm: str, nbytes: int, world_size: int, hosts: int, intra: str = "shm",
                    models: dict | None = None, nics_per_host: int = 1) -> float | None:
    """An allreduce algorithm that knows hosts, timed on ``hosts`` hosts of N/H ranks by its own
    closed form (its registry entry's ``across_hosts``) on the ring fits: the ``intra``
    transport's inside a host, tcp's between hosts. None without both fits."""
    terms = _ring_fits(intra, models)
    if terms is None:
        return None
    inside, across = ((t["alpha_step_us"], t["beta_byte_us"]) for t in terms)
    return registry.ALGORITHMS["allreduce"][algorithm].across_hosts(nbytes, world_size, hosts, inside, across,
                                                                    nics_per_host)


def flat_across_hosts_us(nbytes: int, world_size: int, models: dict | None = None) -> dict[str, float]:
    """Each flat allreduce ``auto`` may run (those with a tcp fit) on ranks of different hosts:
    its steps and bytes (:func:`algorithm_shape`) at tcp's ring fit, α'·steps + β'·bytes. Between
    hosts a link moves every byte at one rate whichever algorithm sends it; each algorithm's own
    tcp fit is made on one machine, where the cores' contention, not a link, sets its per-byte
    cost (there the binomial tree's comes out a quarter of the ring's, across 1 Gbit/s links it
    moves 2·⌈log2 N⌉·T through a rank against the ring's 2(N-1)/N·T). ``{}`` without the fits."""
    tcp = (fitted_models() if models is None else models).get("tcp", {}).get("allreduce", {})
    if "ring" not in tcp:
        return {}
    alpha, beta = tcp["ring"]["alpha_step_us"], tcp["ring"]["beta_byte_us"]
    shapes = {
        name: algorithm_shape(name, world_size)
        for name in registry.auto_candidates("allreduce") if name in tcp}
    return {name: steps * alpha + volume * nbytes * beta for name, (steps, volume) in shapes.items()}


def choose_across_hosts(nbytes: int, world_size: int, hosts: int, intra: str = "shm",
                        models: dict | None = None, nics_per_host: int = 1) -> str:
    """``auto`` for an allreduce whose ranks span ``hosts`` hosts: the least predicted time among
    the flat algorithms on the link between hosts (:func:`flat_across_hosts_us`) and every
    registered algorithm that knows hosts, by its own closed form (:func:`across_hosts_us`;
    ``nics_per_host``: 1 on the lab's emulated hosts), a flat one winning ties. Without fits: the
    registry's ``fallback="across_hosts"`` pick (hierarchical) from ``AUTO_LARGE_MIN_BYTES`` up,
    tcp's choice below."""
    times = flat_across_hosts_us(nbytes, world_size, models)
    across = {
        name: across_hosts_us(name, nbytes, world_size, hosts, intra, models, nics_per_host)
        for name in registry.across_hosts("allreduce")}
    if not times or None in across.values():
        flat = choose(nbytes, world_size, "tcp", "allreduce", models)
        large = registry.across_hosts_fallback("allreduce")
        return large if large and nbytes >= AUTO_LARGE_MIN_BYTES else flat
    return min({**times, **across}.items(), key=lambda item: item[1])[0]


@dataclass(frozen=True)
class AlgorithmTime:
    """One algorithm's predicted time, split into its α-β terms.

    ``steps`` latency terms and ``path_bytes`` bytes on the critical path: for the fitted model
    the algorithm's shape (steps(N), volume(N)·n), for the simulator the messages and bytes of
    the simulated critical path. ``other_us`` is what the two terms leave unexplained (the
    simulator's waits and CPU terms; 0 for the fitted model)."""

    algorithm: str
    time_us: float
    source: str  # "fitted model" or "simulator"
    steps: int
    path_bytes: float
    latency_us: float  # steps · α
    bandwidth_us: float  # path_bytes · β

    @property
    def other_us(self) -> float:
        return self.time_us - self.latency_us - self.bandwidth_us


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picks and what it compared: see :func:`decide`."""

    algorithm: str
    source: str  # "fitted model", "simulator" or "size threshold"
    nbytes: int  # the size the predictions are for (the simulator's: its size bucket's smallest)
    predictions: dict[str, AlgorithmTime]
    left_out: dict[str, str]  # candidates without a prediction, and why
    network: dict | None  # the simulator's Network keyword arguments, when it decided


def _fitted_predictions(nbytes: int, world_size: int, transport: str, collective: str,
                        models: dict) -> dict[str, AlgorithmTime]:
    """The fitted model's predictions for the candidates that have a fit."""
    fits = models.get(transport, {}).get(collective, {})
    out = {}
    for algorithm in registry.auto_candidates(collective):
        fit = fits.get(algorithm)
        if fit is None:
            continue
        steps, volume = algorithm_shape(algorithm, world_size, collective)
        latency, bandwidth = fitted_terms(fit, algorithm, nbytes, world_size, collective)
        out[algorithm] = AlgorithmTime(algorithm, latency + bandwidth, "fitted model", round(steps),
                                       volume * nbytes, latency, bandwidth)
    return out


def size_bucket(nbytes: int) -> int:
    """The smallest size of ``nbytes``'s power-of-two bucket (0 for 0): the size ``auto``
    simulates for every size from it to twice it, exclusive."""
    return 1 << (nbytes.bit_length() - 1) if nbytes > 0 else 0


def _tables(world_size: int, models: dict | None, networks: dict | None,
            worlds: tuple[int, ...] | None) -> tuple[dict, dict, tuple[int, ...] | None]:
    """:func:`decide`'s models, networks and worlds: those passed in, else ``tuning.json``'s (the
    models measured at ``world_size``, else the main sweep's)."""
    if models is None:
        models, worlds = measured_models(world_size) or fitted_models(), swept_worlds(
        ) if worlds is None else worlds
    return models, calibrated_networks() if networks is None else networks, worlds


def decide(nbytes: int, world_size: int, transport: str, collective: str = "allreduce",
           models: dict | None = None, networks: dict | None = None,
           worlds: tuple[int, ...] | None = None) -> Choice:
    """What ``auto`` picks for an ``nbytes`` ``collective`` on ``world_size`` ranks of
    ``transport``, with every prediction it compared (``LAB_ALGO`` aside).

    In order: the fitted models, if at least two candidates have one and ``world_size`` is one
    they were measured at (following the measured medians there: :func:`fitted_terms`); else
    the simulator on the transport's calibrated network, at :func:`size_bucket` of ``nbytes``;
    else the fitted models extrapolated to this world size; else the size threshold. ``models``,
    ``networks`` and ``worlds`` default to ``tuning.json``'s (:func:`measured_models` at
    ``world_size``, else :func:`fitted_models`; :func:`calibrated_networks`,
    :func:`swept_worlds`); models passed in count as measured at every world size unless
    ``worlds`` says otherwise.

        decide(1 << 20, 8, "shm").algorithm     # at 8 ranks, never swept: the simulator's pick
    """
    models, networks, worlds = _tables(world_size, models, networks, worlds)
    fitted = _fitted_predictions(nbytes, world_size, transport, collective, models)
    if len(fitted) >= 2 and (worlds is None or world_size in worlds):
        return Choice(min(fitted, key=lambda a: fitted[a].time_us), "fitted model", nbytes, fitted, {}, None)
    network = networks.get(transport)
    if isinstance(network, dict):
        bucket = size_bucket(nbytes)
        for source, advisor in ADVISORS.items():
            advised = advisor(collective, bucket, world_size, network)
            if advised is not None and advised[0]:
                predicted, left_out = advised
                return Choice(min(predicted, key=lambda a: predicted[a].time_us), source, bucket, predicted,
                              left_out, network)
    if len(fitted) >= 2:
        return Choice(min(fitted, key=lambda a: fitted[a].time_us), "fitted model", nbytes, fitted, {}, None)
    small, large = registry.fallback(collective)
    return Choice(large if nbytes >= AUTO_LARGE_MIN_BYTES else small, "size threshold", nbytes, fitted, {},
                  None)


def choose(nbytes: int, world_size: int, transport: str, collective: str = "allreduce",
           models: dict | None = None, networks: dict | None = None,
           worlds: tuple[int, ...] | None = None) -> str:
    """The algorithm ``auto`` runs: :func:`decide`'s pick. The simulator's picks are kept per
    (collective, transport, N, size bucket, network): a later call in the same bucket replays
    nothing."""
    models, networks, worlds = _tables(world_size, models, networks, worlds)
    fitted = _fitted_predictions(nbytes, world_size, transport, collective, models)
    if len(fitted) >= 2 and (worlds is None or world_size in worlds):
        return min(fitted, key=lambda a: fitted[a].time_us)
    network = networks.get(transport)
    key = (collective, transport, world_size, size_bucket(nbytes),
           tuple(sorted(network.items())) if isinstance(network, dict) else None)
    chosen = _SIMULATED.get(key)
    if chosen is not None:
        return chosen
    choice = decide(nbytes, world_size, transport, collective, models, networks, worlds)
    if choice.source in ADVISORS:  # the same for the whole bucket (the others depend on nbytes)
        if len(_SIMULATED) >= _MAX_SIMULATED:
            _SIMULATED.clear()
        _SIMULATED[key] = choice.algorithm
    return choice.algorithm
