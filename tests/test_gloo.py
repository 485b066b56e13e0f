"""Every primitive against torch.distributed's gloo backend, on random data, in the same ranks.

Floating-point results may differ from gloo's only by summation order: the bound used is
2(N-1)·eps(dtype)·Σ|x| per element (each side's rounding error is at most (N-1)·eps·Σ|x|).
Integer results, min and max must match exactly. Allreduce results must be bit-identical on
every rank, for every algorithm (the digests of all ranks are compared). The pools use the
default shm segments, and one case is a 4 MB tensor (16 segments per rank and ring phase; 32
double-tree pipeline segments).

Every dtype and op runs on shm (at N = 7 every op on float32, int64 and bfloat16: see
tests/helpers.py's ``matrix_dtypes``); queue and tcp run the wire set of tests/test_collectives.py
(float32 with every op, int64 and bfloat16 with sum: each element width), every algorithm, size
and root. How close a result is to gloo's, and whether every rank has the same bits, is fixed by
the algorithm's order of reduction, which no transport changes: a transport moves bytes and calls
the kernel's ``combine`` on them (see tests/test_collectives.py's docstring).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_and_identical, compare_with_gloo, large_allreduce, pool

import lab

#: The fast loop's pools: shm at 1-4, one each of queue and tcp; CI runs every one.
FAST = {("shm", 1), ("shm", 2), ("shm", 3), ("shm", 4), ("queue", 3), ("tcp", 2)}


@pytest.fixture(
    scope="module", params=[
        pytest.param((t, n), id=f"{t}-N{n}", marks=() if (t, n) in FAST else pytest.mark.slow)
        for t in ("shm", "queue", "tcp") for n in (1, 2, 3, 4, 7)])
def cluster(request):
    transport, world_size = request.param
    with pool(world_size, transport) as c:
        yield c


def test_every_primitive_matches_gloo_on_random_data(cluster):
    n = cluster.world_size
    assert_matches_and_identical(
        cluster.run(compare_with_gloo, [1, n + 1, 1000], 2026, cluster.transport == "shm"))


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
    assert torch.equal(outs[1], sum(inputs)) and torch.equal(outs[0], inputs[0]) and torch.equal(
        outs[2], inputs[2])
    outs = lab.gloo_reference("all_to_all", 3, inputs)
    assert [o.tolist() for o in outs] == [[[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]],
                                          [[2.0, 3.0], [3.0, 4.0], [4.0, 5.0]],
                                          [[4.0, 5.0], [5.0, 6.0], [6.0, 7.0]]]
    assert lab.gloo_reference("barrier", 3, inputs) == [None, None, None]
    with pytest.raises(ValueError, match="op"):
        lab.gloo_reference("alltoallv", 3, inputs)
