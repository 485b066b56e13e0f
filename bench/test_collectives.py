"""Broadcast, allgather and reduce_scatter, shm and queue, against gloo in the same run."""

from __future__ import annotations

import pytest
from conftest import BENCH_SIZES, RANK_CLOCK, bench_collective, size_id

COLLECTIVES = ["broadcast", "allgather", "reduce_scatter"]


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
@pytest.mark.parametrize("transport", ["shm", "queue", "tcp"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective(benchmark, pools, collective, transport, nbytes):
    bench_collective(benchmark, pools(transport), collective, "lab", nbytes)


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective_gloo(benchmark, pools, collective, nbytes):
    bench_collective(benchmark, pools("shm"), collective, "gloo", nbytes)
