"""Every algorithm of every collective, once: the table every list of names in the lab comes from.

An entry says what runs the algorithm, its wire code (the fingerprint's algorithm byte), its cost
shape (for ``auto``'s model and the reports), whether ``auto`` may choose it and which it picks
without fitted models (``"small"`` below :data:`lab.tuning.AUTO_LARGE_MIN_BYTES`, ``"large"``
from there up), and, for allreduce, the bytes each rank moves (for ``python -m lab``'s check) and,
where a rank builds something costly before its first step, the fewest steps of a run (for the
simulator's limits, checked before the build).
A new algorithm is one file (its function, ``shape``, and for an allreduce ``bytes_sent``) and
one line here; the public call, ``LAB_ALGO``, ``auto``, the simulator, the benchmarks, the
results and the validation table pick it up from this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lab import fingerprint
from lab.algorithms import (
    all_to_all_bruck,
    all_to_all_pairwise,
    allgather_pat,
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_chain_tree,
    allreduce_double_tree,
    allreduce_halving_doubling,
    allreduce_hierarchical,
    allreduce_naive,
    allreduce_one_shot,
    allreduce_recursive_doubling,
    allreduce_ring,
    allreduce_ring_channels,
    allreduce_tree,
    allreduce_two_shot,
    barrier_dissemination,
    broadcast_binomial,
    broadcast_scatter_allgather,
    double_tree_schedule,
    gather_binomial,
    gather_linear,
    reduce_binomial,
    reduce_scatter_pat,
    reduce_scatter_recursive_halving,
    reduce_scatter_ring,
    scatter_binomial,
    scatter_linear,
)
from lab.compiled import Compilable


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of one collective (see the module docstring)."""

    collective: str
    name: str
    run: Callable[..., None]
    shape: Callable[[int], tuple[float, float]]  # N -> (latency steps, bytes through the busiest rank / T)
    code: int  # the fingerprint's algorithm byte, unique within the collective
    auto: bool = True  # among what algorithm="auto" compares
    fallback: str = ""  # "small"/"large": auto's pick without fitted models; "across_hosts": its large one there
    bytes_sent: Callable[[int, int, int], tuple[int, str]] | None = None  # (rank, N, T) -> (bytes, formula)
    uneven: bool = True  # an all_to_all algorithm that takes uneven split sizes (Bruck's does not)
    options: Callable[[Any], dict[str, Any]] | None = None  # mesh -> the keyword arguments a call passes
    # (N, elements, item bytes, **options) -> the fewest steps of every rank together, where what
    # a rank builds before its first step is costly (the simulator refuses past its limit up front)
    fewest_steps: Callable[..., int] | None = None
    # an algorithm that knows hosts: (T, N, hosts, inside (α, β), across (α', β'), NICs per host)
    # -> µs, the closed form ``auto`` weighs it by where a call's ranks span hosts
    across_hosts: Callable[..., float] | None = None

    def __call__(self, *args, **kwargs) -> None:
        """Run the algorithm (its function's arguments)."""
        self.run(*args, **kwargs)


def _entry(collective: str, module, name: str, code: int, **options) -> Algorithm:
    run = getattr(module, f"{collective}_{name}")
    return Algorithm(collective, name, run, module.shape, code,
                     bytes_sent=getattr(module, "bytes_sent",
                                        None), fewest_steps=getattr(module, "fewest_steps", None),
                     across_hosts=getattr(module, "across_hosts_us", None), **options)


TABLE: tuple[Algorithm, ...] = (
    _entry("allreduce", allreduce_ring, "ring", 1, fallback="large"),
    _entry("allreduce", allreduce_tree, "tree", 2, fallback="small"),
    _entry("allreduce", allreduce_naive, "naive", 3, auto=False),  # the lesson's baseline, never a choice
    _entry("allreduce", allreduce_recursive_doubling, "recursive_doubling", 5),
    _entry("allreduce", allreduce_halving_doubling, "halving_doubling", 6),
    _entry("allreduce", allreduce_double_tree, "double_tree", 7, options=double_tree_schedule.call_options),
    _entry(
        "allreduce",
        allreduce_hierarchical,
        "hierarchical",
        13,
        auto=False,  # weighed across hosts only
        fallback="across_hosts"),
    _entry("allreduce", allreduce_two_shot, "two_shot", 15),
    _entry("allreduce", allreduce_one_shot, "one_shot", 19, auto=False),  # named only, until results fits it
    _entry("allreduce", allreduce_ring_channels, "ring_channels", 16,
           auto=False),  # weighed across hosts only
    _entry(
        "allreduce",
        allreduce_chain_tree,
        "chain_tree",
        17,
        auto=False,  # weighed across hosts only
        options=double_tree_schedule.call_options),
    _entry("broadcast", broadcast_binomial, "binomial", 4, fallback="small"),
    _entry("broadcast", broadcast_scatter_allgather, "scatter_allgather", 9, fallback="large"),
    _entry("allgather", allgather_ring, "ring", 1, fallback="large"),
    _entry("allgather", allgather_recursive_doubling, "recursive_doubling", 5, fallback="small"),
    _entry("allgather", allgather_pat, "pat", 18),
    _entry("reduce_scatter", reduce_scatter_ring, "ring", 1, fallback="large"),
    _entry("reduce_scatter", reduce_scatter_recursive_halving, "recursive_halving", 8, fallback="small"),
    _entry("reduce_scatter", reduce_scatter_pat, "pat", 18),
    _entry("reduce", reduce_binomial, "binomial", 4, fallback="small"),
    _entry("all_to_all", all_to_all_pairwise, "pairwise", 10, fallback="large"),
    _entry("all_to_all", all_to_all_bruck, "bruck", 11, fallback="small", uneven=False),
    _entry("barrier", barrier_dissemination, "dissemination", 12, fallback="small"),
    _entry("gather", gather_binomial, "binomial", 4, fallback="small"),
    _entry("gather", gather_linear, "linear", 14),
    _entry("scatter", scatter_binomial, "binomial", 4, fallback="small"),
    _entry("scatter", scatter_linear, "linear", 14))

#: ``ALGORITHMS[collective][name]``: every entry, in registration order (the table's, then
#: :func:`register`'s). Everything else reads this dictionary when it runs, so an algorithm
#: registered later is seen everywhere.
ALGORITHMS: dict[str, dict[str, Algorithm]] = {}


def register(algorithm: Algorithm) -> None:
    """Add ``algorithm`` (a name new to its collective, a free wire code) to the lab.

    The table above calls it for the lab's own; a program can call it for one of its own (in a
    module every rank imports, so that every rank's registry holds it)."""
    collectives = fingerprint.PUBLIC_COLLECTIVES
    if algorithm.collective not in collectives:
        raise ValueError(f"collective must be one of {', '.join(collectives)}; got {algorithm.collective!r}")
    known = ALGORITHMS.setdefault(algorithm.collective, {})
    if algorithm.name in (*known, "auto", ""):
        raise ValueError(f"{algorithm.collective} already has an algorithm named {algorithm.name!r}")
    fingerprint.register_algorithm(algorithm.collective, algorithm.name, algorithm.code)
    known[algorithm.name] = algorithm


for _algorithm in TABLE:
    register(_algorithm)

#: The collectives that have algorithms, in the table's order.
COLLECTIVES: tuple[str, ...] = tuple(ALGORITHMS)


def names(collective: str) -> tuple[str, ...]:
    """``collective``'s algorithm names (``auto`` excluded)."""
    return tuple(ALGORITHMS[collective])


def auto_candidates(collective: str) -> tuple[str, ...]:
    """The algorithms ``auto`` compares for ``collective``."""
    return tuple(name for name, entry in ALGORITHMS[collective].items() if entry.auto)


def fallback(collective: str) -> tuple[str, str]:
    """``auto``'s (small, large) picks for ``collective`` without fitted models (one algorithm: both)."""
    picks = {entry.fallback: name for name, entry in ALGORITHMS[collective].items() if entry.fallback}
    return picks.get("small", picks.get("large")), picks.get("large", picks.get("small"))


def across_hosts(collective: str) -> dict[str, Callable[..., float]]:
    """``collective``'s algorithms that know hosts, each with its closed form across hosts
    (:attr:`Algorithm.across_hosts`), in registration order."""
    return {name: entry.across_hosts for name, entry in ALGORITHMS[collective].items() if entry.across_hosts}


def across_hosts_fallback(collective: str) -> str | None:
    """The algorithm that knows hosts ``auto`` runs for large tensors across hosts without fitted
    models (``fallback="across_hosts"``), if ``collective`` has one."""
    return next((name for name, entry in ALGORITHMS[collective].items() if entry.fallback == "across_hosts"),
                None)


def compiled(collective: str) -> tuple[str, ...]:
    """``collective``'s algorithms written for Numba (:mod:`lab.compiled`), in registration order:
    under the compiled path's threshold (:mod:`lab.compiled.plane`) ``auto`` picks among these."""
    return tuple(name for name, entry in ALGORITHMS[collective].items() if isinstance(entry.run, Compilable))


def choosable(collective: str) -> bool:
    """Whether ``collective``'s public call takes an ``algorithm`` (it has more than one)."""
    return len(ALGORITHMS[collective]) > 1
