"""The sources the lab's compiled code is built from, guarded against a stale Numba cache.

Every module with compiled code (``@compilable`` algorithms, the compiled plane's entry points,
the simulator's replay) and every lab or kernels module it imports: compiled code reads their
functions and constants, and ``cache=True`` would not see them change (:mod:`kernels.cache`).
``tests/test_layout.py`` checks that the list misses none. Imported first by ``lab``, so the
guard runs before anything compiles.
"""

from __future__ import annotations

from pathlib import Path

from kernels import cache

ROOT = Path(__file__).resolve().parents[2]
_ALGORITHMS = ("all_to_all_pairwise", "allgather_recursive_doubling", "allreduce_one_shot",
               "allreduce_recursive_doubling", "allreduce_tree", "barrier_dissemination",
               "broadcast_binomial", "fold", "gather_binomial", "gather_linear", "reduce_binomial",
               "reduce_scatter_recursive_halving", "scatter_binomial", "scatter_linear")
#: Relative to the repository's root, sorted.
SOURCES = tuple(
    sorted([
        *(f"kernels/{path.name}" for path in (ROOT / "kernels").glob("*.py")),
        *(f"lab/algorithms/{name}.py" for name in _ALGORITHMS), "lab/checks.py", "lab/compiled/__init__.py",
        "lab/fingerprint.py", "lab/flight.py", "lab/ops.py", "lab/algorithms/peers.py",
        "lab/compiled/plane.py", "lab/sim/network.py", "lab/sim/schedule.py", "lab/sim/event_loop.py"]))

cache.guard("lab", [ROOT / source for source in SOURCES])
