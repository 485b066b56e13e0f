"""How ``auto`` chooses, and the α-β fits behind it (no processes needed)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lab import tuning
from lab.collectives import choose_allreduce
from lab.results import fit_alpha_beta, models, tuning_from


def test_the_fit_recovers_a_known_line():
    sizes = np.array([1 << k for k in range(10, 25, 2)], dtype=float)
    alpha, beta, r2 = fit_alpha_beta(sizes, 300.0 + 0.001 * sizes)
    assert alpha == pytest.approx(300.0) and beta == pytest.approx(0.001) and r2 == pytest.approx(1.0)


def fake_sweep() -> pd.DataFrame:
    """Tree: 4 steps of 50 µs, 2 bytes per byte; ring: 6 steps of 100 µs, 1.5 bytes per byte."""
    rows = []
    for nbytes in [1 << k for k in range(10, 25, 2)]:
        for algorithm, steps, alpha, volume in [("ring", 6, 100.0, 1.5), ("tree", 4, 50.0, 4.0)]:
            rows.append({"transport": "shm", "algorithm": algorithm, "world": 4, "bytes": nbytes,
                         "median_us": steps * alpha + volume * nbytes * 0.001})
    return pd.DataFrame(rows)


def test_crossovers_predicted_and_measured():
    table = models(fake_sweep())
    # 600 + 0.0015 n = 200 + 0.004 n  ->  n = 160,000 bytes; the first measured size past it is 256 KB
    assert table["crossover_predicted_bytes"].iloc[0] == pytest.approx(160_000, rel=1e-6)
    assert table["crossover_measured_bytes"].iloc[0] == 256 << 10


def test_auto_follows_the_fitted_model_at_any_world_size(monkeypatch):
    fitted = tuning_from(models(fake_sweep()))
    assert fitted["shm"]["ring"]["alpha_step_us"] == pytest.approx(100.0)
    assert fitted["shm"]["tree"]["beta_byte_us"] == pytest.approx(0.001)
    monkeypatch.setattr(tuning, "fitted_models", lambda: fitted)
    monkeypatch.delenv("LAB_ALGO", raising=False)
    assert choose_allreduce(1 << 10, 4, "shm") == "tree"
    assert choose_allreduce(16 << 20, 4, "shm") == "ring"
    # with 16 ranks the ring has 30 steps against the tree's 8: the crossover moves up
    assert tuning.predict_us("ring", 256 << 10, 16, "shm") > tuning.predict_us("tree", 256 << 10, 16, "shm")
    assert choose_allreduce(256 << 10, 16, "shm") == "tree"
    # a transport without a model falls back to the size threshold
    assert choose_allreduce(tuning.AUTO_RING_MIN_BYTES, 4, "tcp") == "ring"
    assert choose_allreduce(tuning.AUTO_RING_MIN_BYTES - 1, 4, "tcp") == "tree"


def test_lab_algo_overrides_auto(monkeypatch):
    monkeypatch.setenv("LAB_ALGO", "naive")
    assert choose_allreduce(16 << 20, 4, "shm") == "naive"
    monkeypatch.setenv("LAB_ALGO", "butterfly")
    with pytest.raises(ValueError, match="LAB_ALGO"):
        choose_allreduce(1, 4, "shm")


def test_the_shipped_tuning_file_has_a_model_per_transport():
    fitted = tuning.fitted_models()
    assert {"shm", "queue"} <= set(fitted)
    for algorithms in fitted.values():
        for fit in algorithms.values():
            assert fit["alpha_step_us"] > 0 and fit["beta_byte_us"] > 0
