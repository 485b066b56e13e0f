"""How ``algorithm="auto"`` chooses, as NCCL's tuner does: predict each algorithm's time, take the least.

Each algorithm's time on N ranks for an n-byte tensor is modelled as

    t = steps(N) · α_step + volume(N) · n · β_byte

with steps (latency terms on the critical path) and volume (bytes through the busiest rank per
tensor byte) from the algorithm's structure, :func:`algorithm_shape`, and α_step, β_byte fitted
per transport, collective and algorithm by ``python -m lab results`` into ``lab/tuning.json``.
``auto`` compares the algorithms that have a fitted model for the transport; with fewer than
two, it falls back to a fixed size threshold, ``AUTO_LARGE_MIN_BYTES``, between a latency-bound
and a bandwidth-bound algorithm (:data:`FALLBACK`). ``LAB_ALGO`` overrides both, like
``NCCL_ALGO`` (see :func:`lab.collectives.forced_algorithm`).

n is the full tensor T as nccl-tests counts it: the allreduce/broadcast/reduce tensor, the
allgather result, the reduce_scatter and all_to_all input.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TUNING_PATH = Path(__file__).with_name("tuning.json")

#: Without fitted models, ``auto`` picks the bandwidth-bound algorithm from this many bytes up.
AUTO_LARGE_MIN_BYTES = 256 * 1024

#: Per collective: (below the threshold, from the threshold up) without fitted models.
FALLBACK = {
    "allreduce": ("tree", "ring"),
    "broadcast": ("binomial", "scatter_allgather"),
    "allgather": ("recursive_doubling", "ring"),
    "reduce_scatter": ("recursive_halving", "ring"),
    "all_to_all": ("bruck", "pairwise"),
}

#: The algorithms ``auto`` chooses between (naive is the lesson's baseline, never a choice).
AUTO_CANDIDATES = {
    "allreduce": ("ring", "tree", "recursive_doubling", "halving_doubling", "double_tree"),
    "broadcast": ("binomial", "scatter_allgather"),
    "allgather": ("ring", "recursive_doubling"),
    "reduce_scatter": ("ring", "recursive_halving"),
    "all_to_all": ("pairwise", "bruck"),
}


def algorithm_shape(algorithm: str, world_size: int, collective: str = "allreduce") -> tuple[float, float]:
    """(latency steps on the critical path, bytes through the busiest rank per tensor byte).

    From each algorithm's docstring, with p = 2^⌊log2 N⌋, d = ⌈log2 N⌉ and f = 2 when N is not
    a power of two (the fold's hand-over and hand-back steps, each moving the whole tensor),
    else 0. Double tree counts the first segment's trip up and down (later segments pipeline
    behind it) and the 2T an inner-node-plus-leaf rank moves.
    """
    n = world_size
    d = math.ceil(math.log2(n)) if n > 1 else 0
    lp = n.bit_length() - 1
    p = 1 << lp
    f = 0 if n == p else 2
    shapes = {
        ("allreduce", "ring"): (2 * (n - 1), 2 * (n - 1) / n),
        ("allreduce", "tree"): (2 * d, 2 * d),
        ("allreduce", "naive"): (2 * (n - 1), 2 * (n - 1)),
        ("allreduce", "recursive_doubling"): (lp + f, lp + f),
        ("allreduce", "halving_doubling"): (2 * lp + f, 2 * (p - 1) / p + f),
        ("allreduce", "double_tree"): (2 * d, 2.0),
        # On one host (where fits are made) hierarchical is a ring's reduce-scatter and allgather;
        # across hosts, see predict_hierarchical_us.
        ("allreduce", "hierarchical"): (2 * (n - 1), 2 * (n - 1) / n),
        ("broadcast", "binomial"): (d, d),
        ("broadcast", "scatter_allgather"): (d + n - 1, 2 * (n - 1) / n),
        ("allgather", "ring"): (n - 1, (n - 1) / n),
        ("allgather", "recursive_doubling"): (lp + f, (n - 1) / n + f / 2),
        ("reduce_scatter", "ring"): (n - 1, (n - 1) / n),
        ("reduce_scatter", "recursive_halving"): (lp + f, (n - 1) / n + f / 2),
        ("reduce", "binomial"): (d, d),
        ("all_to_all", "pairwise"): (n - 1, (n - 1) / n),
        ("all_to_all", "bruck"): (d, d / 2),
        ("barrier", "dissemination"): (d, 0.0),
    }
    steps, volume = shapes[collective, algorithm]
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
                   for a in AUTO_CANDIDATES[collective]}
    fitted = {a: t for a, t in predictions.items() if t is not None}
    if len(fitted) < 2:
        small, large = FALLBACK[collective]
        return large if nbytes >= AUTO_LARGE_MIN_BYTES else small
    return min(fitted, key=fitted.get)
