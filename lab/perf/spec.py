"""``lab.perf``'s vocabulary: the collectives, types, ops and averages it takes; :class:`Spec`."""

from __future__ import annotations

import dataclasses

import torch

from lab.catalog import COLLECTIVES as CATALOG

#: The collectives perf runs (not yet gather and scatter), by the lab's name, and the nccl-tests
#: program each is (:mod:`lab.catalog`).
PROGRAMS = {
    name: CATALOG[name].program
    for name in ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all", "reduce")}
#: nccl-tests' type names (``-d``), as its type column prints them.
TYPES = {
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.uint32,
    "int64": torch.int64, "uint64": torch.uint64, "half": torch.float16, "float": torch.float32,
    "double": torch.float64, "bfloat16": torch.bfloat16}
#: The types the lab's reductions take (the others it only moves).
REDUCED_TYPES = ("float", "double", "half", "bfloat16", "int32", "int64")
OPS = ("sum", "prod", "max", "min", "avg")
#: Collectives whose result is a new tensor (the others work in place), and which reduce.
RETURNING = tuple(name for name in PROGRAMS if CATALOG[name].returns)
REDUCING = tuple(name for name in PROGRAMS if CATALOG[name].reduces)
#: How ``-a`` combines the ranks' times, as nccl-tests numbers it.
AVERAGES = {0: lambda times: times[0], 1: lambda times: sum(times) / len(times), 2: min, 3: max}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One perf run's settings, as every rank gets them (``op`` None: the collective reduces nothing)."""

    collective: str
    dtype: str = "float"
    op: str | None = "sum"
    root: int = 0
    algorithm: str = "auto"
    iters: int = 20
    warmup: int = 5
    check: int = 1
