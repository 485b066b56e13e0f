"""Broadcast, allgather, reduce_scatter, reduce, all_to_all, barrier, gather and scatter, every
algorithm, shm, queue and tcp, against gloo in the same run."""

from __future__ import annotations

import pytest
from conftest import BENCH_SIZES, RANK_CLOCK, bench_collective, size_id

from lab.benchmark import ALGORITHMS

COLLECTIVES = [
    "broadcast", "allgather", "reduce_scatter", "reduce", "all_to_all", "barrier", "gather", "scatter"]
CASES = [(c, a) for c in COLLECTIVES for a in ALGORITHMS[c]]


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
@pytest.mark.parametrize("transport", ["shm", "queue", "tcp"])
@pytest.mark.parametrize("collective, algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_collective(benchmark, pools, collective, algorithm, transport, nbytes):
    if collective == "barrier" and nbytes != BENCH_SIZES[0]:
        pytest.skip("a barrier moves no bytes: timed once, at the first size")
    bench_collective(benchmark, pools(transport), collective, "lab", nbytes, algorithm)


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective_gloo(benchmark, pools, collective, nbytes):
    if collective == "barrier" and nbytes != BENCH_SIZES[0]:
        pytest.skip("a barrier moves no bytes: timed once, at the first size")
    bench_collective(benchmark, pools("shm"), collective, "gloo", nbytes)
