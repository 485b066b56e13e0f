"""Bucketed allreduce round-trips every tensor, every dtype, odd sizes, mixed kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import pool

import lab
from lab.bucketing import allreduce_coalesced, plan_buckets

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def mixed_tensors(rank: int) -> list:
    """Odd sizes and shapes, every dtype interleaved, a numpy array and a non-contiguous view."""
    tensors = []
    for i in range(24):
        dtype = DTYPES[i % len(DTYPES)]
        numel = [0, 1, 3, 17, 100, 1001][i % 6]
        tensors.append(((torch.arange(numel) * 3 + rank) % 32).to(dtype).reshape(-1, 1) if i %
                       5 == 0 else ((torch.arange(numel) * 3 + rank) % 32).to(dtype))
    tensors.append(((np.arange(10) * 3 + rank) % 32).astype(np.float32))
    tensors.append(((torch.arange(20.0) * 3 + rank) % 32).reshape(4, 5)[:, ::2])
    return tensors


def check_round_trip(mesh: lab.Mesh, bucket_bytes: int) -> list[str]:
    mine = mixed_tensors(mesh.rank)
    everyone = [mixed_tensors(r) for r in range(mesh.world_size)]
    allreduce_coalesced(mesh, mine, op="sum", bucket_bytes=bucket_bytes)
    failures = []
    for i, got in enumerate(mine):
        parts = [t[i] for t in everyone]
        want = sum(parts[1:], parts[0])  # exact: small integers in every dtype
        same = np.array_equal(got, want) if isinstance(got, np.ndarray) else torch.equal(got, want)
        if not same:
            failures.append(f"rank {mesh.rank} tensor {i} ({got.dtype}, {tuple(got.shape)})")
    return failures


@pytest.fixture(scope="module")
def cluster():
    with pool(3, "shm") as c:
        yield c


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1000, 25 * 1024 * 1024])
def test_every_tensor_comes_back_reduced_in_place(cluster, bucket_bytes):
    outputs = cluster.run(check_round_trip, bucket_bytes)
    assert not [f for per_rank in outputs for f in per_rank]


def test_buckets_hold_one_dtype_and_respect_the_size():
    tensors = [
        torch.zeros(10),
        torch.zeros(10, dtype=torch.int64),
        torch.zeros(10),
        torch.zeros(100),
        torch.zeros(5)]
    buckets = plan_buckets(tensors, bucket_bytes=80)
    assert sorted(i for b in buckets for i in b) == list(range(5))
    for bucket in buckets:
        assert len({tensors[i].dtype for i in bucket}) == 1
        assert sum(tensors[i].numel() * 4 for i in bucket) <= 80 or len(bucket) == 1
    assert [3] in buckets  # larger than a bucket: alone


def test_bad_bucket_arguments():
    with pytest.raises(ValueError, match="bucket_bytes"):
        allreduce_coalesced(None, [torch.zeros(1)], bucket_bytes=0)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        allreduce_coalesced(None, [torch.zeros(1), torch.zeros(1, dtype=torch.complex64)])
