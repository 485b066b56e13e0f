"""Reduction kernels for the collectives lab: Numba (``kernels.reduce``) and baselines
(``kernels.python``). Imports nothing from ``lab``."""
