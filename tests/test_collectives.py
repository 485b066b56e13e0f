"""The four collectives over world sizes 1-8, both transports, every dtype, op, algorithm and root.

Each case runs inside the ranks: every rank builds every rank's input (``index * stride + rank``,
never all ones, so a misplaced chunk shows), runs the collective, and checks its own output
against the exact expected values, counting wrong elements. Values are chosen so the exact
result is representable in every dtype (half types included), so checks are bit-exact. The
pools use tiny shm segments (256 bytes, 2 slots) so even small tensors cross many segments and
exercise flow control.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lab
from conftest import pool

STRIDE = 3
DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
OPS = ["sum", "prod", "min", "max", "avg"]
ALGORITHMS = ["ring", "tree", "naive", "auto"]
PROD_VALUES = np.array([-2.0, -1.0, 1.0, 2.0])  # products stay exact powers of two


def counts(world_size: int) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by ranks, and many segments."""
    return sorted({0, 1, max(world_size - 1, 0), 2 * world_size + 1, 2053})


def ops_for(dtype: str) -> list[str]:
    return OPS if dtype not in ("int32", "int64") else OPS[:-1]  # avg needs a floating dtype


def values(count: int, rank: int, dtype: str, op: str = "sum") -> np.ndarray:
    """Rank ``rank``'s input as float64 values: ``index * stride + rank`` (bounded where needed)."""
    pattern = np.arange(count) * STRIDE + rank
    if op == "prod":
        return PROD_VALUES[pattern % 4]
    if dtype in ("float16", "bfloat16"):
        return (pattern % 32).astype(np.float64)  # sums of 8 ranks stay exact in 8 mantissa bits
    return pattern.astype(np.float64)


def tensor(v: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.tensor(v).to(getattr(torch, dtype))  # a copy: collectives write in place


def expected_reduction(stack: np.ndarray, op: str, dtype: str) -> torch.Tensor:
    """The exact reduction of a (ranks, count) stack of float64 values, in ``dtype``."""
    world_size = stack.shape[0]
    if op == "avg":
        total = tensor(stack.sum(axis=0), dtype)  # exact in dtype by construction
        divisor = torch.tensor(world_size, dtype=torch.float64 if dtype == "float64" else torch.float32)
        accumulate = torch.float64 if dtype == "float64" else torch.float32
        return (total.to(accumulate) / divisor).to(getattr(torch, dtype))
    reduce = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return tensor(reduce(stack, axis=0), dtype)


def describe_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    wrong = (got != want).nonzero()
    first = tuple(wrong[0].tolist())
    return f"{len(wrong)} wrong elements, first at {first}: got {got[first].item()} want {want[first].item()}"


# -- rank-side checks (run in every rank's process) ----------------------------------------------


def check_allreduce(mesh: lab.Mesh) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for algorithm in ALGORITHMS:
                    stack = np.stack([values(count, r, dtype, op) for r in range(mesh.world_size)])
                    x = tensor(stack[mesh.rank], dtype)
                    result = lab.allreduce(mesh, x, op=op, algorithm=algorithm)
                    want = expected_reduction(stack, op, dtype)
                    if result is not x or not torch.equal(x, want):
                        failures.append(
                            f"rank {mesh.rank} allreduce {algorithm} {op} {dtype}[{count}]: "
                            + ("not in place" if result is not x else describe_mismatch(x, want))
                        )
    return failures


def check_broadcast(mesh: lab.Mesh) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for dtype in DTYPES:
            for src in range(mesh.world_size):
                x = tensor(values(count, mesh.rank, dtype), dtype)
                result = lab.broadcast(mesh, x, src=src)
                want = tensor(values(count, src, dtype), dtype)
                if result is not x or not torch.equal(x, want):
                    failures.append(f"rank {mesh.rank} broadcast src={src} {dtype}[{count}]: "
                                    + ("not in place" if result is not x else describe_mismatch(x, want)))
    return failures


def check_allgather(mesh: lab.Mesh) -> list[str]:
    failures = []
    for count in counts(mesh.world_size):
        for dtype in DTYPES:
            for shape in [(count,), (count, 2)]:
                def rank_input(r: int) -> torch.Tensor:
                    return tensor(values(int(np.prod(shape)), r, dtype), dtype).reshape(shape)

                x = rank_input(mesh.rank)
                before = x.clone()
                got = lab.allgather(mesh, x)
                want = torch.cat([rank_input(r) for r in range(mesh.world_size)])
                if not torch.equal(got, want) or not torch.equal(x, before):
                    failures.append(f"rank {mesh.rank} allgather {dtype}{list(shape)}: "
                                    + describe_mismatch(got, want))
    return failures


def check_reduce_scatter(mesh: lab.Mesh) -> list[str]:
    failures = []
    n = mesh.world_size
    for rows in counts(n):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for shape in [(rows,), (rows, 3)]:
                    numel = int(np.prod(shape))
                    stack = np.stack([values(numel, r, dtype, op) for r in range(n)])
                    x = tensor(stack[mesh.rank], dtype).reshape(shape)
                    before = x.clone()
                    got = lab.reduce_scatter(mesh, x, op=op)
                    full = expected_reduction(stack, op, dtype).reshape(shape)
                    want = torch.tensor_split(full, n)[mesh.rank] if rows else full[:0]
                    if not torch.equal(got, want) or not torch.equal(x, before):
                        failures.append(f"rank {mesh.rank} reduce_scatter {op} {dtype}{list(shape)}: "
                                        + describe_mismatch(got, want))
    return failures


def check_other_inputs(mesh: lab.Mesh) -> list[str]:
    """numpy arrays, non-contiguous tensors, multi-dimensional and 0-d tensors keep their type."""
    failures = []
    n, rank = mesh.world_size, mesh.rank
    # numpy in, numpy out (float16 included), in place
    for dtype in ["float32", "int64", "float16"]:
        a = values(2 * n + 1, rank, dtype).astype(dtype)
        lab.allreduce(mesh, a)
        want = sum(values(2 * n + 1, r, dtype) for r in range(n)).astype(dtype)
        if not isinstance(a, np.ndarray) or not np.array_equal(a, want):
            failures.append(f"rank {rank} numpy allreduce {dtype}")
        g = lab.allgather(mesh, values(3, rank, dtype).astype(dtype))
        if not isinstance(g, np.ndarray) or not np.array_equal(g, np.concatenate([values(3, r, dtype) for r in range(n)]).astype(dtype)):
            failures.append(f"rank {rank} numpy allgather {dtype}")
    # a non-contiguous view: the result lands in the caller's strided tensor, neighbours untouched
    base = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + rank
    view = base[:, 1::2]
    lab.allreduce(mesh, view, algorithm="ring")
    want = sum(torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + r for r in range(n))
    if not torch.equal(base[:, 1::2], want[:, 1::2]) or not torch.equal(base[:, ::2], (torch.arange(24.0).reshape(4, 6) + rank)[:, ::2]):
        failures.append(f"rank {rank} non-contiguous allreduce")
    transposed = (torch.arange(6.0).reshape(2, 3) + rank).t()
    got = lab.reduce_scatter(mesh, transposed)
    full = sum((torch.arange(6.0).reshape(2, 3) + r).t() for r in range(n))
    if not torch.equal(got, torch.tensor_split(full, n)[rank]):
        failures.append(f"rank {rank} non-contiguous reduce_scatter")
    # 0-d tensors: allreduce and broadcast keep the shape; allgather gives (N,)
    scalar = torch.tensor(float(rank))
    lab.allreduce(mesh, scalar)
    if scalar.shape != () or scalar.item() != sum(range(n)):
        failures.append(f"rank {rank} 0-d allreduce")
    gathered = lab.allgather(mesh, torch.tensor(rank))
    if not torch.equal(gathered, torch.arange(n)):
        failures.append(f"rank {rank} 0-d allgather")
    # a tensor that requires grad is reduced in place like any other
    w = torch.arange(5.0, requires_grad=True)
    lab.allreduce(mesh, w, op="max")
    if not torch.equal(w.detach(), torch.arange(5.0)):
        failures.append(f"rank {rank} requires_grad allreduce")
    return failures


def byte_counts(mesh: lab.Mesh, numel: int) -> dict[str, dict[str, int]]:
    """Payload byte counters of one allreduce per algorithm, float32[numel]."""
    counts_by_algorithm = {}
    for algorithm in ["ring", "tree", "naive"]:
        mesh.reset_stats()
        lab.allreduce(mesh, torch.ones(numel), algorithm=algorithm)
        counts_by_algorithm[algorithm] = mesh.stats()
    return counts_by_algorithm


# -- the pools -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(t, n) for t in ("shm", "queue", "tcp") for n in range(1, 9)],
                ids=lambda p: f"{p[0]}-N{p[1]}")
def cluster(request):
    transport, world_size = request.param
    with pool(world_size, transport, segment_bytes=256, slots=2) as c:
        yield c


def assert_no_failures(outputs: list[list[str]]) -> None:
    failures = [f for per_rank in outputs for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:25])


def test_allreduce_every_dtype_op_algorithm_count(cluster):
    assert_no_failures(cluster.run(check_allreduce))


def test_broadcast_every_root_dtype_count(cluster):
    assert_no_failures(cluster.run(check_broadcast))


def test_allgather_every_dtype_count_shape(cluster):
    assert_no_failures(cluster.run(check_allgather))


def test_reduce_scatter_every_dtype_op_count_shape(cluster):
    assert_no_failures(cluster.run(check_reduce_scatter))


def test_numpy_noncontiguous_and_scalar_inputs(cluster):
    assert_no_failures(cluster.run(check_other_inputs))


def test_byte_counters_match_the_cost_model(cluster):
    """Ring: exactly 2T(N-1)/N each way on every rank; tree and naive: as their docstrings say."""
    n = cluster.world_size
    numel = 60 * n  # N divides the element count
    total = numel * 4
    per_rank = cluster.run(byte_counts, numel)
    for rank, by_algorithm in enumerate(per_rank):
        ring = by_algorithm["ring"]
        assert ring["bytes_sent"] == ring["bytes_received"] == 2 * total * (n - 1) // n
        assert ring["messages_sent"] == ring["messages_received"] == 2 * (n - 1)
        children = sum(1 for k in range(n.bit_length()) if not rank & ((1 << k) - 1) and rank + (1 << k) < n
                       and not rank & (1 << k))
        tree_messages = children + (rank != 0)
        tree = by_algorithm["tree"]
        assert tree["bytes_sent"] == tree["bytes_received"] == tree_messages * total
        naive = by_algorithm["naive"]
        assert naive["bytes_sent"] == naive["bytes_received"] == (n - 1 if rank == 0 else 1) * total * (n > 1)
