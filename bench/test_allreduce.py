"""Allreduce, every algorithm and auto, shm, queue and tcp, against gloo and MPICH in the same run."""

from __future__ import annotations

import pytest
from conftest import BENCH_SIZES, RANK_CLOCK, WORLD_SIZE, bench_collective, replay, size_id

from lab import mpich
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


@pytest.mark.benchmark(timer=RANK_CLOCK)
@pytest.mark.parametrize("nbytes", BENCH_SIZES, ids=size_id)
def test_allreduce_mpich(benchmark, nbytes):
    """MPICH's ``comm.Allreduce`` under ``mpiexec`` (the ``peers`` extra), same timing rules."""
    reason = mpich.unavailable()
    if reason:
        pytest.skip(f"MPICH not measured: {reason}")
    row, per_rank = mpich.measure(WORLD_SIZE, nbytes, per_rank=True)
    benchmark.group = f"allreduce {size_id(nbytes)}"
    benchmark.extra_info.update({k: v for k, v in row.items() if k != "calls"})
    replay(benchmark, per_rank)
