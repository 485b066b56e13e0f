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
from lab.reference import gloo_collective, tolerance

CASES = [  # (primitive, algorithm)
    ("allreduce", "ring"), ("allreduce", "tree"), ("allreduce", "naive"), ("allreduce", "auto"),
    ("broadcast", "binomial"), ("allgather", "ring"), ("reduce_scatter", "ring"),
]
DTYPES = ("float32", "int32")


def _inputs(world_size: int, count: int, dtype: str, seed: int) -> torch.Tensor:
    """(ranks, count): random normal floats, or integers in [-1000, 1000)."""
    rows = []
    for rank in range(world_size):
        rng = np.random.default_rng([seed, rank])
        row = rng.normal(0, 10, count) if dtype.startswith("float") else rng.integers(-1000, 1000, count)
        rows.append(torch.tensor(row).to(getattr(torch, dtype)))
    return torch.stack(rows)


def _run_lab(mesh: lab.Mesh, primitive: str, algorithm: str, x: torch.Tensor) -> torch.Tensor:
    if primitive == "allreduce":
        return lab.allreduce(mesh, x, algorithm=algorithm)
    if primitive == "broadcast":
        return lab.broadcast(mesh, x, src=mesh.world_size - 1)
    return getattr(lab, primitive)(mesh, x)


def validate_rank(mesh: lab.Mesh, count: int, seed: int) -> list[dict]:
    """In one rank: each case through the lab and through gloo; this rank's error and digest."""
    rows = []
    for dtype in DTYPES:
        stack = _inputs(mesh.world_size, count, dtype, seed)
        bound = tolerance(stack)
        for primitive, algorithm in CASES:
            options = {"src": mesh.world_size - 1} if primitive == "broadcast" else {}
            expected = gloo_collective(mesh, primitive, stack[mesh.rank].clone(), **options)
            got = _run_lab(mesh, primitive, algorithm, stack[mesh.rank].clone())
            if primitive == "reduce_scatter":
                bound_here = torch.tensor_split(bound, mesh.world_size)[mesh.rank]
            elif primitive == "allreduce":
                bound_here = bound
            else:
                bound_here = torch.zeros(())
            error = (got.double() - expected.double()).abs()
            rows.append({
                "primitive": primitive, "algorithm": algorithm, "dtype": dtype,
                "error": float(error.max()) if error.numel() else 0.0,
                "within": bool((error <= bound_here).all()),
                "tolerance": float(bound_here.max()) if bound_here.numel() else 0.0,
                "digest": hashlib.blake2b(got.numpy().tobytes()).hexdigest(),
            })
    return rows


def byte_counters_rank(mesh: lab.Mesh, numel: int) -> list[dict]:
    """In one rank: payload bytes of one float32 allreduce per algorithm."""
    rows = []
    for algorithm in ("ring", "tree", "naive"):
        mesh.reset_stats()
        lab.allreduce(mesh, torch.ones(numel), algorithm=algorithm)
        rows.append({"algorithm": algorithm, "rank": mesh.rank, **mesh.stats()})
    return rows


def _tree_messages(rank: int, world_size: int) -> int:
    """Messages a rank sends in tree allreduce: one per child, plus one to its parent."""
    children = 0
    mask = 1
    while mask < world_size and not rank & mask:
        children += rank + mask < world_size
        mask <<= 1
    return children + (rank != 0)


def validation_table(transports: list[str], world_sizes: list[int], count: int, seed: int) -> pd.DataFrame:
    frames = []
    for transport in transports:
        for n in world_sizes:
            with lab.launch(n, transport=transport) as cluster:
                per_rank = cluster.run(validate_rank, count, seed)
            for i, row in enumerate(per_rank[0]):
                cells = [ranks[i] for ranks in per_rank]
                same = len({c["digest"] for c in cells}) == 1
                shared = row["primitive"] != "reduce_scatter"  # reduce_scatter gives each rank its block
                ok = all(c["within"] for c in cells) and (same or not shared)
                frames.append({
                    "transport": transport, "N": n, "primitive": row["primitive"], "algorithm": row["algorithm"],
                    "dtype": row["dtype"], "elements": count,
                    "max |lab - gloo|": max(c["error"] for c in cells),
                    "tolerance": max(c["tolerance"] for c in cells),
                    "identical on all ranks": ("yes" if same else "NO") if shared else "n/a",
                    "result": "PASS" if ok else "FAIL",
                })
    return pd.DataFrame(frames)


def byte_table(world_size: int, numel: int) -> pd.DataFrame:
    with lab.launch(world_size) as cluster:
        per_rank = cluster.run(byte_counters_rank, numel)
    total = numel * 4
    rows = []
    for row in sorted((r for ranks in per_rank for r in ranks), key=lambda r: (r["algorithm"], r["rank"])):
        algorithm, rank = row["algorithm"], row["rank"]
        if algorithm == "ring":
            model, formula = 2 * total * (world_size - 1) // world_size, "2T(N-1)/N"
        elif algorithm == "tree":
            messages = _tree_messages(rank, world_size)
            model, formula = messages * total, f"{messages}T"
        else:
            model, formula = (total * (world_size - 1), "(N-1)T") if rank == 0 else (total, "T")
        ok = row["bytes_sent"] == row["bytes_received"] == model
        rows.append({"algorithm": algorithm, "rank": rank, "bytes sent": row["bytes_sent"],
                     "bytes received": row["bytes_received"], "model": formula, "model bytes": model,
                     "result": "PASS" if ok else "FAIL"})
    return pd.DataFrame(rows)
