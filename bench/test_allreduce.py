"""Allreduce, every algorithm and auto, shm, queue and tcp, against gloo in the same run."""

from __future__ import annotations

import pytest
from conftest import BENCH_SIZES, RANK_CLOCK, bench_collective, size_id

from lab.benchmark import ALGORITHMS


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
@pytest.mark.parametrize("algorithm", [*ALGORITHMS["allreduce"], "auto"])
@pytest.mark.parametrize("transport", ["shm", "queue", "tcp"])
def test_allreduce(benchmark, pools, transport, algorithm, nbytes):
    bench_collective(benchmark, pools(transport), "allreduce", "lab", nbytes, algorithm)


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
def test_allreduce_gloo(benchmark, pools, nbytes):
    bench_collective(benchmark, pools("shm"), "allreduce", "gloo", nbytes)
