"""How ``auto`` chooses, and the α-β fits behind it (no processes needed)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pandas as pd
import pytest

from lab import results, tuning
from lab.algorithms import registry
from lab.benchmark import ALGORITHMS
from lab.collectives.choice import choose, forced_algorithm
from lab.results import fit_alpha_beta, models, tuning_from

pytestmark = pytest.mark.no_ranks


def test_the_fit_recovers_a_known_line():
    sizes = np.array([1 << k for k in range(10, 25, 2)], dtype=float)
    alpha, beta, r2 = fit_alpha_beta(sizes, 300.0 + 0.001 * sizes)
    assert alpha == pytest.approx(300.0) and beta == pytest.approx(0.001) and r2 == pytest.approx(1.0)


def fake_sweep() -> pd.DataFrame:
    """Tree: 4 steps of 50 µs, 2 bytes per byte; ring: 6 steps of 100 µs, 1.5 bytes per byte."""
    rows = []
    for nbytes in [1 << k for k in range(10, 25, 2)]:
        for algorithm, steps, alpha, volume in [("ring", 6, 100.0, 1.5), ("tree", 4, 50.0, 4.0)]:
            rows.append({
                "transport": "shm", "collective": "allreduce", "algorithm": algorithm, "world": 4,
                "bytes": nbytes, "median_us": steps * alpha + volume * nbytes * 0.001})
    return pd.DataFrame(rows)


def test_crossovers_predicted_and_measured():
    table = models(fake_sweep())
    # 600 + 0.0015 n = 200 + 0.004 n  ->  n = 160,000 bytes; the first measured size past it is 256 KB
    assert table["crossover_predicted_bytes"].iloc[0] == pytest.approx(160_000, rel=1e-6)
    assert table["crossover_measured_bytes"].iloc[0] == 256 << 10


def test_without_a_network_auto_follows_the_fitted_model_at_any_world_size(monkeypatch):
    fitted = tuning_from(models(fake_sweep()))
    assert fitted["shm"]["allreduce"]["ring"]["alpha_step_us"] == pytest.approx(100.0)
    assert fitted["shm"]["allreduce"]["tree"]["beta_byte_us"] == pytest.approx(0.001)
    monkeypatch.setattr(tuning, "fitted_models", lambda: fitted)
    monkeypatch.setattr(tuning, "calibrated_networks", dict)  # no simulator (tests/test_explain.py has it)
    monkeypatch.delenv("LAB_ALGO", raising=False)
    assert choose("allreduce", 1 << 10, 4, "shm") == "tree"
    assert choose("allreduce", 16 << 20, 4, "shm") == "ring"
    # with 16 ranks the ring has 30 steps against the tree's 8: the crossover moves up
    assert tuning.predict_us("ring", 256 << 10, 16, "shm") > tuning.predict_us("tree", 256 << 10, 16, "shm")
    assert choose("allreduce", 256 << 10, 16, "shm") == "tree"
    # a transport without a model falls back to the size threshold
    assert choose("allreduce", tuning.AUTO_LARGE_MIN_BYTES, 4, "tcp") == "ring"
    assert choose("allreduce", tuning.AUTO_LARGE_MIN_BYTES - 1, 4, "tcp") == "tree"


def test_lab_algo_overrides_auto(monkeypatch):
    monkeypatch.setenv("LAB_ALGO", "naive")
    assert choose("allreduce", 16 << 20, 4, "shm") == "naive"
    monkeypatch.setenv("LAB_ALGO", "butterfly")
    with pytest.raises(ValueError, match="LAB_ALGO"):
        choose("allreduce", 1, 4, "shm")


def test_the_shipped_tuning_file_has_a_model_per_transport():
    fitted = tuning.fitted_models()
    assert {"shm", "queue"} <= set(fitted)
    for collectives in fitted.values():
        assert "ring" in collectives["allreduce"] and "tree" in collectives["allreduce"]
        for collective, algorithms in collectives.items():
            assert set(algorithms) <= set(ALGORITHMS[collective]), collective
            for fit in algorithms.values():
                assert fit["alpha_step_us"] > 0 and fit["beta_byte_us"] > 0


def test_every_algorithm_has_a_shape_and_every_choice_is_a_real_algorithm():
    for collective, algorithms in ALGORITHMS.items():
        for algorithm in algorithms:
            for n in range(1, 65):
                steps, volume = tuning.algorithm_shape(algorithm, n, collective)
                assert steps >= 1 and volume > 0
        assert set(registry.auto_candidates(collective)) <= set(algorithms)
        assert set(registry.fallback(collective)) <= set(algorithms)
    # the step counts of the docstrings: N = 8 and N = 6 (the fold adds two whole-tensor steps)
    assert tuning.algorithm_shape("recursive_doubling", 8) == (3, 3)
    assert tuning.algorithm_shape("recursive_doubling", 6) == (4, 4)
    assert tuning.algorithm_shape("halving_doubling", 8) == (6, 1.75)
    assert tuning.algorithm_shape("bruck", 8, "all_to_all") == (3, 1.5)


def full_sweep() -> pd.DataFrame:
    """Every allreduce algorithm at 4 ranks on one transport: exactly t = steps·α + volume·n·β,
    with α = 100 µs for every algorithm but recursive doubling's 20 µs (so it wins small sizes)
    and β = 0.001 µs/byte; and broadcast, binomial vs scatter_allgather."""
    rows = []
    for nbytes in [1 << k for k in range(10, 25, 2)]:
        for collective, algorithm in [("allreduce", a) for a in registry.auto_candidates("allreduce")] + [
            ("broadcast", "binomial"), ("broadcast", "scatter_allgather")]:
            steps, volume = tuning.algorithm_shape(algorithm, 4, collective)
            alpha = 20.0 if algorithm == "recursive_doubling" else 100.0
            rows.append({
                "transport": "tcp", "collective": collective, "algorithm": algorithm, "world": 4,
                "bytes": nbytes, "median_us": steps * alpha + volume * nbytes * 0.001})
    return pd.DataFrame(rows)


def test_auto_chooses_among_every_fitted_algorithm_of_every_collective(monkeypatch):
    fitted = tuning_from(models(full_sweep()))
    assert set(fitted["tcp"]["allreduce"]) == set(registry.auto_candidates("allreduce"))
    monkeypatch.setattr(tuning, "fitted_models", lambda: fitted)
    monkeypatch.setattr(tuning, "calibrated_networks", dict)  # no simulator: the threshold below
    monkeypatch.delenv("LAB_ALGO", raising=False)
    # small: 2 steps of 20 µs; large: halving-doubling's 1.5 bytes per byte in 4 steps beats the
    # ring's 1.5 bytes per byte in 6, and everything else moves more
    assert choose("allreduce", 1 << 10, 4, "tcp") == "recursive_doubling"
    assert choose("allreduce", 16 << 20, 4, "tcp") == "halving_doubling"
    assert choose("broadcast", 1 << 10, 4, "tcp") == "binomial"
    assert choose("broadcast", 16 << 20, 4, "tcp") == "scatter_allgather"
    # a collective without fits falls back to its size threshold
    assert choose("all_to_all", 1 << 10, 4, "tcp") == "bruck"
    assert choose("all_to_all", tuning.AUTO_LARGE_MIN_BYTES, 4, "tcp") == "pairwise"
    assert choose("allgather", 1 << 10, 4, "tcp") == "recursive_doubling"


def test_lab_algo_applies_per_collective_where_the_name_is_valid(monkeypatch):
    monkeypatch.setenv("LAB_ALGO", "ring")
    assert forced_algorithm("allreduce") == forced_algorithm("allgather") == forced_algorithm(
        "reduce_scatter") == "ring"
    assert forced_algorithm("broadcast") is None and forced_algorithm("all_to_all") is None  # auto as usual
    monkeypatch.setenv("LAB_ALGO", "bruck")
    assert forced_algorithm("all_to_all") == "bruck" and forced_algorithm("allreduce") is None
    monkeypatch.setenv("LAB_ALGO", "tree, allreduce=double_tree, broadcast=scatter_allgather")
    assert forced_algorithm("allreduce") == "double_tree"  # the targeted entry wins over a bare name
    assert forced_algorithm("broadcast") == "scatter_allgather" and forced_algorithm("allgather") is None
    assert choose("broadcast", 1, 4, "shm") == "scatter_allgather"
    for bad, message in [("allreduce=bruck", "allreduce=ring"), ("alltoall=bruck", "a collective among"),
                         ("ring,butterfly", "butterfly")]:
        monkeypatch.setenv("LAB_ALGO", bad)
        with pytest.raises(ValueError, match="LAB_ALGO") as info:
            forced_algorithm("allgather")
        assert message in str(info.value)


def bent_sweep(world: int = 8) -> pd.DataFrame:
    """Two allreduce algorithms measured at 1 KB, 1 MB and 16 MB on ``world`` ranks, as the queue
    transport measured them at 8 ranks: the ring is fast at 1 MB and slow at 16 MB, a bend that no
    single α-β line through the three sizes follows."""
    medians = {"ring": [3517.0, 6784.0, 310473.0], "halving_doubling": [2112.0, 10285.0, 143775.0]}
    return pd.DataFrame([{
        "transport": "queue", "collective": "allreduce", "algorithm": algorithm, "world": world,
        "impl": "lab", "bytes": nbytes, "median_us": us} for algorithm, times in medians.items()
                         for nbytes, us in zip([1 << 10, 1 << 20, 16 << 20], times)])


def test_at_a_measured_world_size_auto_follows_the_measured_medians():
    measured = bent_sweep()
    fitted = tuning_from(models(measured), measured)
    ring = fitted["queue"]["allreduce"]["ring"]
    assert ring["world"] == 8 and ring["points"] == [[1024, 3517.0], [1 << 20, 6784.0], [16 << 20, 310473.0]]
    # the single line through the three sizes is far off at 16 MB (the bend), so it alone picks the ring there
    steps, volume = tuning.algorithm_shape("ring", 8)
    line_16mb = steps * ring["alpha_step_us"] + volume * (16 << 20) * ring["beta_byte_us"]
    assert line_16mb < 143775.0  # under half the 310,473 µs measured
    # each measured size predicts what was measured there; between two, the line through them
    for nbytes, us in ring["points"]:
        assert tuning.predict_us("ring", nbytes, 8, "queue", models=fitted) == pytest.approx(us)
    middle = (1 << 20) + ((16 << 20) - (1 << 20)) // 2
    assert tuning.predict_us("ring", middle, 8, "queue", models=fitted) == pytest.approx(
        (6784.0 + 310473.0) / 2, rel=1e-6)
    # below the smallest size: its time; above the largest: its time plus the fitted per-byte term
    assert tuning.predict_us("ring", 100, 8, "queue", models=fitted) == pytest.approx(3517.0)
    above = tuning.predict_us("ring", 32 << 20, 8, "queue", models=fitted)
    assert above == pytest.approx(310473.0 + volume * (16 << 20) * ring["beta_byte_us"])
    decide = functools.partial(tuning.decide, world_size=8, transport="queue", models=fitted, networks={},
                               worlds=(8,))
    assert decide(16 << 20).algorithm == "halving_doubling"  # measured: 143,775 µs against the ring's 310,473
    assert decide(1 << 20).algorithm == "ring"  # measured: 6,784 against 10,285
    # at a world size the points were not measured at, the α-β fit scaled by the shape, as before
    steps4, volume4 = tuning.algorithm_shape("ring", 4)
    assert tuning.predict_us("ring", 16 << 20, 4, "queue",
                             models=fitted) == pytest.approx(steps4 * ring["alpha_step_us"] + volume4 *
                                                             (16 << 20) * ring["beta_byte_us"])


def test_calibrate_only_stores_the_models_of_every_measured_world_size(tmp_path, monkeypatch):
    for world in (2, 8):  # what python -m lab results --ranks N --out DIR/ranks/N writes, the sweep made up
        folder = tmp_path / "ranks" / str(world)
        folder.mkdir(parents=True)
        bent_sweep(world).to_csv(folder / "allreduce.csv", index=False)
        bent_sweep(world).iloc[:0].to_csv(folder / "collectives.csv", index=False)
        for name in ("latency_floor", "bucketing", "overlap", "kernels", "gloo_check"):
            pd.DataFrame({"unused": [0]}).to_csv(folder / f"{name}.csv", index=False)
        (folder / "machine.json").write_text(json.dumps({"date": "today"}))
    main = tuning_from(models(full_sweep()), full_sweep().assign(impl="lab"))
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"world": 4, "worlds": [4], "models": main}))
    monkeypatch.setattr(tuning, "TUNING_PATH", path)
    monkeypatch.setattr(results, "networks_from",
                        lambda results_dir: {})  # the calibration has tests of its own
    tuning.tuning_table.cache_clear()
    tuning.fitted_models.cache_clear()
    try:
        table = results.store_fits(tmp_path)
        assert table["worlds"] == [2, 4, 8] and set(table["models_by_world"]) == {"2", "8"}
        assert tuning.swept_worlds() == (2, 4, 8)
        assert tuning.measured_models(8)["queue"]["allreduce"]["ring"]["world"] == 8
        assert tuning.measured_models(4) == main and tuning.measured_models(16) == {}
        choice = tuning.decide(16 << 20, 8, "queue")
        assert (choice.algorithm, choice.source) == ("halving_doubling", "fitted model")
        assert tuning.decide(1 << 10, 4, "tcp").algorithm == "recursive_doubling"  # the main sweep's, kept
    finally:
        tuning.tuning_table.cache_clear()
        tuning.fitted_models.cache_clear()


def test_auto_asks_the_registered_advisor_where_no_fit_decides(monkeypatch):
    """lab.tuning knows no simulator: at a world size never measured it asks each registered
    advisor in turn; one that cannot use the network (None) passes, the next decides, by name."""
    asked = []

    def cannot(collective, nbytes, world_size, network):
        asked.append("cannot")

    def tree_wins(collective, nbytes, world_size, network):
        asked.append((collective, nbytes, world_size, network["alpha_us"]))
        return {
            a: tuning.AlgorithmTime(a, 1.0 if a == "tree" else 2.0, "mine", 1, 0.0, 1.0, 0.0)
            for a in ("ring", "tree")}, {"naive": "not asked"}

    monkeypatch.setattr(tuning, "ADVISORS", {})
    tuning.register_advisor("cannot", cannot)
    tuning.register_advisor("mine", tree_wins)
    choice = tuning.decide(3 << 19, 8, "shm", models={}, networks={"shm": {"alpha_us": 7.0}}, worlds=(4,))
    assert (choice.algorithm, choice.source, choice.nbytes) == ("tree", "mine", 1 << 20)
    assert choice.left_out == {"naive": "not asked"} and asked == ["cannot", ("allreduce", 1 << 20, 8, 7.0)]
    monkeypatch.setattr(tuning, "ADVISORS", {})
    assert tuning.decide(3 << 19, 8, "shm", models={},
                         networks={"shm": {"alpha_us": 7.0}}).source == "size threshold"
