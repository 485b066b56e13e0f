"""A new allreduce algorithm, added the way the registry says one is added: its function, its cost
shape and its byte count, and one ``register`` call. Imported only inside rank processes by
tests/test_registry.py, so the test session's own registry stays as the lab ships it.

``reduce_broadcast``: a binomial reduce to rank 0, then a binomial broadcast (tree allreduce's
two halves, composed from the lab's own pieces).
"""

from __future__ import annotations

import numpy as np

from lab.algorithms import allreduce_tree
from lab.algorithms.broadcast_binomial import broadcast_binomial
from lab.algorithms.fold import power_terms
from lab.algorithms.reduce_binomial import reduce_binomial
from lab.algorithms.registry import Algorithm, register
from lab.ops import Reduction

NAME = "reduce_broadcast"


def allreduce_reduce_broadcast(mesh, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` onto rank 0 (binomial), then broadcast it from there: 2·⌈log2 N⌉·(α + T·β)."""
    reduce_binomial(mesh, buf, reduction, 0)
    broadcast_binomial(mesh, buf, 0)


def shape(world_size: int) -> tuple[float, float]:
    d = power_terms(world_size).d
    return 2 * d, 2 * d


register(
    Algorithm("allreduce", NAME, allreduce_reduce_broadcast, shape, code=200,
              bytes_sent=allreduce_tree.bytes_sent))  # the same messages as tree allreduce
