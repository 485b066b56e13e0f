"""The documented path of the registry, kept for programs written against it:
``lab.collectives.registry.register(Algorithm(...))``. The table lives in :mod:`lab.algorithms.registry`."""

from lab.algorithms.registry import Algorithm, register

__all__ = ["Algorithm", "register"]
