"""The shared harness for the pytest-benchmark suites: pools, sizes, and rank-side timing.

pytest-benchmark times whatever runs between two reads of its timer. Here the timed code runs
inside the ranks (``lab.benchmark.time_collective``), so each test replays the ranks' per-call
times (slowest rank per call) through a clock that advances by exactly those durations: the
statistics pytest-benchmark prints and saves are the ranks' own, and neither process start nor
task dispatch from this process is in them. ``extra_info`` adds median, p10, p90, algbw, busbw.

    pytest bench --benchmark-only                        # the full sweep, 1 KB to 16 MB
    LAB_BENCH_QUICK=1 pytest bench --benchmark-only      # 1 KB, 1 MB and 16 MB only
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import lab
from lab.benchmark import SIZES, summarize, time_collective

QUICK = bool(os.environ.get("LAB_BENCH_QUICK"))
BENCH_SIZES = [1 << 10, 1 << 20, 16 << 20] if QUICK else SIZES
WORLD_SIZE = int(os.environ.get("LAB_BENCH_RANKS", "4"))


def size_id(nbytes: int) -> str:
    return f"{nbytes >> 20}MB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KB"


class RankClock:
    """A timer for pytest-benchmark that advances only when a rank-side duration is replayed."""
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


RANK_CLOCK = RankClock()


@pytest.fixture(scope="session")
def pools():
    """One 4-rank pool per transport for the whole session (started lazily)."""
    started: dict[str, lab.Cluster] = {}

    def get(transport: str) -> lab.Cluster:
        if transport not in started:
            started[transport] = lab.launch(WORLD_SIZE, transport=transport)
        return started[transport]

    yield get
    for cluster in started.values():
        cluster.close()


def bench_collective(benchmark, cluster: lab.Cluster, collective: str, impl: str, nbytes: int,
                     algorithm: str = "auto") -> None:
    """Time one case in the ranks and hand the per-call times to pytest-benchmark."""
    per_rank = cluster.run(time_collective, collective, impl, nbytes, algorithm)
    nbytes = 0 if collective == "barrier" else nbytes  # a barrier moves no bytes
    benchmark.group = f"{collective} {size_id(nbytes)}"
    benchmark.extra_info.update(collective=collective, impl=impl,
                                algorithm=algorithm if impl == "lab" else "gloo",
                                transport=cluster.transport if impl == "lab" else "gloo",
                                world=cluster.world_size, bytes=nbytes,
                                **summarize(per_rank, collective, nbytes, cluster.world_size))
    replay(benchmark, per_rank)


def replay(benchmark, per_rank: list[list[int]]) -> None:
    """Feed pytest-benchmark the slowest rank's time of each call (ns per rank, per call)."""
    slowest = (np.max(np.array(per_rank, dtype=np.float64), axis=0) / 1e9).tolist()
    calls = iter(slowest)

    def one_call() -> None:
        RANK_CLOCK.now += next(calls)

    benchmark.pedantic(one_call, rounds=len(slowest), iterations=1)
