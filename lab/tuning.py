"""How ``algorithm="auto"`` chooses, as NCCL's tuner does: predict each algorithm's time, take the least.

Each algorithm's time on N ranks for an n-byte tensor is modelled as

    t = steps(N) · α_step + volume(N) · n · β_byte

with steps and volume from the algorithm's structure (ring: 2(N-1) steps moving 2(N-1)/N·n;
tree: 2⌈log2 N⌉ steps each moving n; naive: 2(N-1) whole-tensor messages through rank 0) and
α_step, β_byte fitted per transport by ``python -m lab results`` into ``lab/tuning.json``. Without
that file, ``auto`` falls back to a fixed threshold, ``AUTO_RING_MIN_BYTES``. ``LAB_ALGO``
overrides both, like ``NCCL_ALGO``.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TUNING_PATH = Path(__file__).with_name("tuning.json")

#: Without fitted models, ``auto`` picks ring from this many bytes up and tree below.
AUTO_RING_MIN_BYTES = 256 * 1024

#: The algorithms ``auto`` chooses between (naive is the lesson's baseline, never a choice).
AUTO_CANDIDATES = ("ring", "tree")


def algorithm_shape(algorithm: str, world_size: int) -> tuple[float, float]:
    """(latency steps on the critical path, bytes moved per tensor byte) of an allreduce."""
    n = world_size
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    shapes = {"ring": (2 * (n - 1), 2 * (n - 1) / n), "tree": (2 * depth, 2 * depth),
              "naive": (2 * (n - 1), 2 * (n - 1))}
    steps, volume = shapes[algorithm]
    return max(steps, 1), max(volume, 1e-12)


@functools.cache
def fitted_models() -> dict:
    """``{transport: {algorithm: {"alpha_step_us", "beta_byte_us"}}}`` from ``tuning.json``, or ``{}``."""
    try:
        return json.loads(TUNING_PATH.read_text())["models"]
    except (OSError, KeyError, ValueError):
        return {}


def predict_us(algorithm: str, nbytes: int, world_size: int, transport: str) -> float | None:
    """The model's time for one allreduce, or None if this transport has no fitted model."""
    fit = fitted_models().get(transport, {}).get(algorithm)
    if fit is None:
        return None
    steps, volume = algorithm_shape(algorithm, world_size)
    return steps * fit["alpha_step_us"] + volume * nbytes * fit["beta_byte_us"]


def choose(nbytes: int, world_size: int, transport: str) -> str:
    """The algorithm ``auto`` runs: the fastest predicted, or the size threshold without a model."""
    predictions = {a: predict_us(a, nbytes, world_size, transport) for a in AUTO_CANDIDATES}
    if any(p is None for p in predictions.values()):
        return "ring" if nbytes >= AUTO_RING_MIN_BYTES else "tree"
    return min(predictions, key=predictions.get)
