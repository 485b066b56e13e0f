"""Training patterns: 2,004 gradients one by one vs in 25 MB buckets; backward with and without
overlapped gradient allreduces (4 ranks, shm). Rank-side times, slowest rank per call."""

from __future__ import annotations

import pytest
from conftest import RANK_CLOCK, replay

from lab.benchmark import time_bucketing, time_overlap


@pytest.mark.benchmark(timer=RANK_CLOCK, group="gradient sync: 2,004 tensors")
@pytest.mark.parametrize("bucketed", [False, True], ids=["one-by-one", "bucketed"])
def test_bucketing(benchmark, pools, bucketed):
    replay(benchmark, pools("shm").run(time_bucketing, bucketed))


@pytest.mark.benchmark(timer=RANK_CLOCK, group="MLP backward + gradient averaging")
@pytest.mark.parametrize("mode", ["compute", "sequential", "overlap"])
def test_overlap(benchmark, pools, mode):
    replay(benchmark, pools("shm").run(time_overlap, mode))
