"""Every primitive against torch.distributed's gloo backend, on random data, in the same ranks.

Floating-point results may differ from gloo's only by summation order: the bound used is
2(N-1)·eps(dtype)·Σ|x| per element (each side's rounding error is at most (N-1)·eps·Σ|x|).
Integer results, min and max must match exactly. Allreduce results must be bit-identical on
every rank, for every algorithm (the digests of all ranks are compared). The pools use the
default shm segments, and one case is a 4 MB tensor (16 segments per rank and ring phase; 32
double-tree pipeline segments).

Every dtype and op runs on shm; queue and tcp run the wire set of tests/test_collectives.py
(float32 with every op, int64 and bfloat16 with sum: each element width), every algorithm, size
and root. How close a result is to gloo's, and whether every rank has the same bits, is fixed by
the algorithm's order of reduction, which no transport changes: a transport moves bytes and calls
the kernel's ``combine`` on them (see tests/test_collectives.py's docstring).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import lab
from conftest import pool
from lab.reference import gloo_collective, tolerance

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int32", "int64"]
ALLREDUCE = ["ring", "tree", "naive", "recursive_doubling", "halving_doubling", "double_tree", "auto"]


def random_stack(world_size: int, count: int, dtype: str, op: str, seed: int) -> torch.Tensor:
    """(ranks, count) random inputs; rank r's row is reproducible from ``seed`` and r alone."""
    rows = []
    for rank in range(world_size):
        rng = np.random.default_rng([seed, rank, count])
        if dtype in INTS:
            row = rng.integers(-3, 4, count) if op == "prod" else rng.integers(-1000, 1000, count)
        else:
            row = rng.uniform(0.5, 1.5, count) * rng.choice([-1, 1], count) if op == "prod" else rng.normal(0, 10, count)
        rows.append(torch.tensor(row).to(getattr(torch, dtype)))
    return torch.stack(rows)


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


WIRE_DTYPES = ["float32", "int64", "bfloat16"]  # 4, 8 and 2 bytes: the wire set (module docstring)


def gloo_ops(dtype: str, full: bool) -> list[str]:
    """Every op the dtype takes; the wire set (``full=False``): every op on float32, sum elsewhere."""
    if not full and dtype != "float32":
        return ["sum"]
    return ["sum", "prod", "min", "max"] + (["avg"] if dtype in FLOATS else [])


def compare_with_gloo(mesh: lab.Mesh, sizes: list[int], seed: int, full: bool = True) -> tuple[list[str], list[str]]:
    """Run each primitive through the lab and through gloo; return (failures, allreduce digests).
    ``full``: every dtype and op; otherwise the wire set."""
    failures, digests = [], []
    n, rank = mesh.world_size, mesh.rank

    def check(what: str, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
        error = (got.double() - ref.double()).abs()
        if got.shape != ref.shape or bool((error > tol).any()):
            worst = float(error.max()) if error.numel() else 0.0
            failures.append(f"rank {rank} {what}: max |lab - gloo| = {worst:.3g} over tolerance")

    for count in sizes:
        for dtype in FLOATS + INTS if full else WIRE_DTYPES:
            for op in gloo_ops(dtype, full):
                stack = random_stack(n, count, dtype, op, seed)
                mine = stack[rank]
                ref = gloo_collective(mesh, "allreduce", mine.clone(), op=op)
                for algorithm in ALLREDUCE:
                    got = lab.allreduce(mesh, mine.clone(), op=op, algorithm=algorithm)
                    check(f"allreduce {algorithm} {op} {dtype}[{count}]", got, ref, tolerance(stack, op))
                    digests.append(digest(got))
                rows = stack.reshape(n, count, 1)[rank]
                ref = gloo_collective(mesh, "reduce_scatter", rows.clone(), op=op)
                tol = torch.tensor_split(tolerance(stack, op).reshape(count, 1), n)[rank]
                for algorithm in ["ring", "recursive_halving"]:
                    got = lab.reduce_scatter(mesh, rows, op=op, algorithm=algorithm)
                    check(f"reduce_scatter {algorithm} {op} {dtype}[{count}]", got, ref, tol)
                dst = n // 2
                got = lab.reduce(mesh, mine.clone(), dst=dst, op=op)
                ref = gloo_collective(mesh, "reduce", mine.clone(), dst=dst, op=op)
                check(f"reduce dst={dst} {op} {dtype}[{count}]", got, ref,
                      tolerance(stack, op) if rank == dst else torch.zeros(count))
            stack = random_stack(n, count, dtype, "sum", seed + 1)
            for src, algorithm in [(s, a) for s in sorted({0, n - 1}) for a in ["binomial", "scatter_allgather"]]:
                got = lab.broadcast(mesh, stack[rank].clone(), src=src, algorithm=algorithm)
                check(f"broadcast {algorithm} src={src} {dtype}[{count}]", got, gloo_collective(mesh, "broadcast", stack[rank].clone(), src=src), torch.zeros(count))
                digests.append(digest(got))
            for algorithm in ["ring", "recursive_doubling"]:
                got = lab.allgather(mesh, stack[rank], algorithm=algorithm)
                check(f"allgather {algorithm} {dtype}[{count}]", got, gloo_collective(mesh, "allgather", stack[rank]), torch.zeros(n * count))
            ref = gloo_collective(mesh, "all_to_all", stack[rank])
            for algorithm in ["pairwise", "bruck"]:
                got = lab.all_to_all(mesh, stack[rank], algorithm=algorithm)
                check(f"all_to_all {algorithm} {dtype}[{count}]", got, ref, torch.zeros(ref.shape))
    return failures, digests


def large_allreduce(mesh: lab.Mesh, count: int) -> tuple[list[str], list[str]]:
    """A multi-segment float32 sum per algorithm, against gloo."""
    failures, digests = [], []
    stack = random_stack(mesh.world_size, count, "float32", "sum", 7)
    ref = gloo_collective(mesh, "allreduce", stack[mesh.rank].clone())
    tol = tolerance(stack)
    for algorithm in ALLREDUCE[:-1]:
        got = lab.allreduce(mesh, stack[mesh.rank].clone(), algorithm=algorithm)
        if bool(((got.double() - ref.double()).abs() > tol).any()):
            failures.append(f"rank {mesh.rank} large allreduce {algorithm}")
        digests.append(digest(got))
    return failures, digests


@pytest.fixture(scope="module", params=[pytest.param((t, n), id=f"{t}-N{n}", marks=[pytest.mark.slow] if n == 7 else [])
                                        for t in ("shm", "queue", "tcp") for n in (1, 2, 3, 4, 7)])
def cluster(request):
    transport, world_size = request.param
    with pool(world_size, transport) as c:
        yield c


def assert_matches_and_identical(outputs: list[tuple[list[str], list[str]]]) -> None:
    failures = [f for per_rank, _ in outputs for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:25])
    digests = [d for _, d in outputs]
    assert all(d == digests[0] for d in digests), "allreduce results differ between ranks"


def test_every_primitive_matches_gloo_on_random_data(cluster):
    n = cluster.world_size
    assert_matches_and_identical(cluster.run(compare_with_gloo, [1, n + 1, 1000], 2026, cluster.transport == "shm"))


def test_large_allreduce_matches_gloo_and_is_bit_identical(cluster):
    assert_matches_and_identical(cluster.run(large_allreduce, (1 << 20) + 3))


def test_gloo_reference_runs_on_its_own():
    """The public reference: per-rank outputs of gloo for given inputs, in rank order."""
    inputs = [torch.arange(6.0).reshape(3, 2) + r for r in range(3)]
    outs = lab.gloo_reference("reduce_scatter", 3, inputs, op="max")
    assert [o.tolist() for o in outs] == [[[2.0, 3.0]], [[4.0, 5.0]], [[6.0, 7.0]]]
    outs = lab.gloo_reference("broadcast", 3, inputs, src=2)
    assert all(torch.equal(o, inputs[2]) for o in outs)
    with pytest.raises(ValueError, match="inputs"):
        lab.gloo_reference("allreduce", 2, inputs)
    outs = lab.gloo_reference("reduce", 3, inputs, dst=1, op="sum")
    assert torch.equal(outs[1], sum(inputs)) and torch.equal(outs[0], inputs[0]) and torch.equal(outs[2], inputs[2])
    outs = lab.gloo_reference("all_to_all", 3, inputs)
    assert [o.tolist() for o in outs] == [[[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]], [[2.0, 3.0], [3.0, 4.0], [4.0, 5.0]],
                                          [[4.0, 5.0], [5.0, 6.0], [6.0, 7.0]]]
    assert lab.gloo_reference("barrier", 3, inputs) == [None, None, None]
    with pytest.raises(ValueError, match="op"):
        lab.gloo_reference("alltoallv", 3, inputs)
