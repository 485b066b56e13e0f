"""Reduction kernels for the collectives lab: Numba (``kernels.reduce``) and baselines
(``kernels.python``), the compiled mailboxes and flags, and the guard on their disk cache
(``kernels.cache``). Imports nothing from ``lab``."""

from pathlib import Path

from kernels import cache

cache.guard("kernels", sorted(Path(__file__).parent.glob("*.py")))  # before any of them compiles
