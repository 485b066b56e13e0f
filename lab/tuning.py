"""How ``algorithm="auto"`` chooses, as NCCL's tuner does: predict each algorithm's time, take the least.

Each algorithm's time on N ranks for an n-byte tensor is modelled as

    t = steps(N) · α_step + volume(N) · n · β_byte

with steps (latency terms on the critical path) and volume (bytes through the busiest rank per
tensor byte) from the algorithm's structure, :func:`algorithm_shape`, and α_step, β_byte fitted
per transport, collective and algorithm by ``python -m lab results`` into ``lab/tuning.json``.
``auto`` compares the algorithms that have a fitted model for the transport (among the registry's
``auto`` candidates); with fewer than two, it falls back to a fixed size threshold,
``AUTO_LARGE_MIN_BYTES``, between a latency-bound and a bandwidth-bound algorithm (the registry's
``fallback`` picks). ``LAB_ALGO`` overrides both, like
``NCCL_ALGO`` (see :func:`lab.collectives.forced_algorithm`).

n is the full tensor T as nccl-tests counts it: the allreduce/broadcast/reduce tensor, the
allgather and gather result, the reduce_scatter, all_to_all and scatter input.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from lab.collectives import registry

TUNING_PATH = Path(__file__).with_name("tuning.json")

#: Without fitted models, ``auto`` picks the bandwidth-bound algorithm from this many bytes up.
AUTO_LARGE_MIN_BYTES = 256 * 1024



def algorithm_shape(algorithm: str, world_size: int, collective: str = "allreduce") -> tuple[float, float]:
    """(latency steps on the critical path, bytes through the busiest rank per tensor byte): the
    algorithm's ``shape`` (:mod:`lab.collectives.registry`), from its docstring's cost. Never
    zero, so that a fit can always use both terms."""
    steps, volume = registry.ALGORITHMS[collective][algorithm].shape(world_size)
    return max(steps, 1), max(volume, 1e-12)


@functools.cache
def fitted_models() -> dict:
    """``{transport: {collective: {algorithm: {"alpha_step_us", "beta_byte_us"}}}}`` from
    ``tuning.json``, or ``{}``."""
    try:
        return json.loads(TUNING_PATH.read_text())["models"]
    except (OSError, KeyError, ValueError):
        return {}


def predict_us(algorithm: str, nbytes: int, world_size: int, transport: str, collective: str = "allreduce",
               models: dict | None = None) -> float | None:
    """The model's time for one call, or None if this transport has no fit for the algorithm.

    ``models``: fits in ``tuning.json``'s layout (default: that file's).
    """
    fit = (fitted_models() if models is None else models).get(transport, {}).get(collective, {}).get(algorithm)
    if fit is None:
        return None
    steps, volume = algorithm_shape(algorithm, world_size, collective)
    return steps * fit["alpha_step_us"] + volume * nbytes * fit["beta_byte_us"]


def predict_hierarchical_us(nbytes: int, world_size: int, hosts: int, intra: str, models: dict | None = None
                            ) -> float | None:
    """Hierarchical allreduce's time on ``hosts`` hosts of L = N/H ranks: ring phases inside the
    host on the ``intra`` transport's ring fit, 2(L-1)·(α + T/L·β), plus the ring across hosts on
    tcp's ring fit, 2(H-1)·(α' + T/H·β') (the L shards share the host's link). None without fits."""
    fits = fitted_models() if models is None else models
    inside = fits.get(intra, {}).get("allreduce", {}).get("ring")
    across = fits.get("tcp", {}).get("allreduce", {}).get("ring")
    if inside is None or across is None:
        return None
    per_host = world_size // hosts
    return (2 * (per_host - 1) * (inside["alpha_step_us"] + nbytes / per_host * inside["beta_byte_us"])
            + 2 * (hosts - 1) * (across["alpha_step_us"] + nbytes / hosts * across["beta_byte_us"]))


def choose_across_hosts(nbytes: int, world_size: int, hosts: int, intra: str = "shm",
                        models: dict | None = None) -> str:
    """``auto`` for an allreduce whose ranks span ``hosts`` hosts: ``"hierarchical"`` if its
    predicted time (:func:`predict_hierarchical_us`) beats every flat algorithm's on the tcp fits
    (a flat algorithm's steps cross hosts), else the fastest flat one. Without fits: hierarchical
    from ``AUTO_LARGE_MIN_BYTES`` up, tcp's choice below."""
    flat = choose(nbytes, world_size, "tcp", "allreduce", models)
    hierarchical = predict_hierarchical_us(nbytes, world_size, hosts, intra, models)
    flat_us = predict_us(flat, nbytes, world_size, "tcp", "allreduce", models)
    if hierarchical is None or flat_us is None:
        return "hierarchical" if nbytes >= AUTO_LARGE_MIN_BYTES else flat
    return "hierarchical" if hierarchical < flat_us else flat


def choose(nbytes: int, world_size: int, transport: str, collective: str = "allreduce",
           models: dict | None = None) -> str:
    """The algorithm ``auto`` runs: the fastest predicted among the fitted ones, or the size
    threshold when fewer than two have a fit. ``models`` as for :func:`predict_us`."""
    predictions = {a: predict_us(a, nbytes, world_size, transport, collective, models)
                   for a in registry.auto_candidates(collective)}
    fitted = {a: t for a, t in predictions.items() if t is not None}
    if len(fitted) < 2:
        small, large = registry.fallback(collective)
        return large if nbytes >= AUTO_LARGE_MIN_BYTES else small
    return min(fitted, key=fitted.get)
