"""The validation table (every primitive, lab vs gloo) and the per-rank byte counters.

What ``python -m lab`` prints. The rank-side functions live here, in an importable module, so
that rank processes can unpickle them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import torch

import lab
from lab.algorithms import registry
from lab.reference import gloo_collective, tolerance


def cases() -> list[tuple[str, str]]:
    """(primitive, algorithm): every algorithm of every collective in the registry, and ``auto``
    where the call takes an algorithm."""
    return [(c, a) for c in registry.ALGORITHMS
            for a in (*registry.names(c), *(["auto"] if registry.choosable(c) else []))]


#: Whose result must be the same bytes on every rank.
SHARED_RESULT = ("allreduce", "broadcast", "allgather")


def byte_algorithms() -> list[str]:
    """Allreduce algorithms in the byte-counter table, each against its docstring's formula."""
    return [name for name, entry in registry.ALGORITHMS["allreduce"].items() if entry.bytes_sent]


DTYPES = ("float32", "int32")


def _inputs(world_size: int, count: int, dtype: str, seed: int) -> torch.Tensor:
    """(ranks, count): random normal floats, or integers in [-1000, 1000)."""
    rows = []
    for rank in range(world_size):
        rng = np.random.default_rng([seed, rank])
        row = rng.normal(0, 10, count) if dtype.startswith("float") else rng.integers(-1000, 1000, count)
        rows.append(torch.tensor(row).to(getattr(torch, dtype)))
    return torch.stack(rows)


def _options(mesh: lab.Mesh, primitive: str) -> dict:
    """The root of rooted collectives: the last rank (not the default, 0)."""
    last = mesh.world_size - 1
    return {
        "broadcast": {"src": last}, "reduce": {"dst": last}, "gather": {"dst": last},
        "scatter": {"src": last}}.get(primitive, {})


def _run_lab(mesh: lab.Mesh, primitive: str, algorithm: str, x: torch.Tensor) -> torch.Tensor | None:
    if primitive in ("reduce", "barrier"):
        return getattr(lab, primitive)(mesh, *([x] if primitive == "reduce" else []),
                                       **_options(mesh, primitive))
    return getattr(lab, primitive)(mesh, x, algorithm=algorithm, **_options(mesh, primitive))


def validate_rank(mesh: lab.Mesh, count: int, seed: int) -> list[dict]:
    """In one rank: each case through the lab and through gloo; this rank's error and digest."""
    rows = []
    for dtype in DTYPES:
        stack = _inputs(mesh.world_size, count, dtype, seed)
        bound = tolerance(stack)
        for primitive, algorithm in cases():
            expected = gloo_collective(mesh, primitive, stack[mesh.rank].clone(), **_options(mesh, primitive))
            got = _run_lab(mesh, primitive, algorithm, stack[mesh.rank].clone())
            if got is None and expected is None:  # a barrier, a gather off its root: nothing to compare
                got = expected = torch.zeros(0)
            if primitive == "reduce_scatter":
                bound_here = torch.tensor_split(bound, mesh.world_size)[mesh.rank]
            elif primitive in ("allreduce", "reduce"):
                bound_here = bound
            else:
                bound_here = torch.zeros(())
            error = (got.double() - expected.double()).abs()
            rows.append({
                "primitive": primitive, "algorithm": algorithm, "dtype": dtype,
                "error": float(error.max()) if error.numel() else 0.0, "within": bool((error
                                                                                       <= bound_here).all()),
                "tolerance": float(bound_here.max()) if bound_here.numel() else 0.0,
                "digest": hashlib.blake2b(got.numpy().tobytes()).hexdigest()})
    return rows


def byte_counters_rank(mesh: lab.Mesh, numel: int) -> list[dict]:
    """In one rank: payload bytes of one float32 allreduce per algorithm."""
    rows = []
    for algorithm in byte_algorithms():
        mesh.reset_stats()
        lab.allreduce(mesh, torch.ones(numel), algorithm=algorithm)
        rows.append({"algorithm": algorithm, "rank": mesh.rank, **mesh.stats()})
    return rows


def validation_table(transports: list[str], world_sizes: list[int], count: int, seed: int) -> pd.DataFrame:
    frames = []
    for transport in transports:
        for n in world_sizes:
            with lab.launch(n, transport=transport) as cluster:
                per_rank = cluster.run(validate_rank, count, seed)
            for i, row in enumerate(per_rank[0]):
                cells = [ranks[i] for ranks in per_rank]
                same = len({c["digest"] for c in cells}) == 1
                shared = row["primitive"] in SHARED_RESULT
                ok = all(c["within"] for c in cells) and (same or not shared)
                frames.append({
                    "transport": transport, "N": n, "primitive": row["primitive"],
                    "algorithm": row["algorithm"], "dtype": row["dtype"], "elements": count,
                    "max |lab - gloo|": max(c["error"] for c in cells), "tolerance": max(c["tolerance"]
                                                                                         for c in cells),
                    "identical on all ranks": ("yes" if same else "NO") if shared else "n/a",
                    "result": "PASS" if ok else "FAIL"})
    return pd.DataFrame(frames)


def byte_table(world_size: int, numel: int) -> pd.DataFrame:
    with lab.launch(world_size) as cluster:
        per_rank = cluster.run(byte_counters_rank, numel)
    total = numel * 4
    rows = []
    for row in sorted((r for ranks in per_rank for r in ranks), key=lambda r: (r["algorithm"], r["rank"])):
        algorithm, rank = row["algorithm"], row["rank"]
        model, formula = registry.ALGORITHMS["allreduce"][algorithm].bytes_sent(rank, world_size, total)
        ok = row["bytes_sent"] == row["bytes_received"] == model
        rows.append({
            "algorithm": algorithm, "rank": rank, "bytes sent": row["bytes_sent"],
            "bytes received": row["bytes_received"], "model": formula, "model bytes": model,
            "result": "PASS" if ok else "FAIL"})
    return pd.DataFrame(rows)
