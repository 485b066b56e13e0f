"""``python -m lab results --data-plane``: its measurement runs every impl into the CSV,
and its report states each bar of the compiled data plane as met or not, from the numbers."""

from __future__ import annotations

import pandas as pd
import pytest

from lab.results import data_plane

pytestmark = pytest.mark.no_ranks


def synthetic(times: dict[tuple[int, int, str], float]) -> pd.DataFrame:
    rows = [{
        "world": world, "bytes": nbytes, "impl": impl, "median_us": us, "floor_us": nbytes / 1e4,
        "load_average": 1.0, "cores": 2} for (world, nbytes, impl), us in times.items()]
    return pd.DataFrame(rows)


def test_each_bar_is_met_or_not_from_the_numbers():
    big = 16 << 20
    times = {
        (2, 1024, "plain"): 6.0, (2, 1024, "plan"): 3.0, (2, 1024, "mpich"): 4.0, (2, 1024, "python"): 30.0,
        (2, 1024, "gloo"): 500.0, (4, 1024, "plain"): 20.0, (4, 1024, "plan"): 10.0, (4, 1024, "mpich"): 40.0,
        (4, 1024, "python"): 150.0, (4, 1024, "gloo"): 5000.0, (4, big, "plain"): 9000.0,
        (4, big, "plan"): 9000.0, (4, big, "mpich"): 10000.0, (4, big, "python"): 9000.0,
        (4, big, "gloo"): 30000.0, (8, 1024, "plain"): 100.0, (8, 1024, "plan"): 90.0,
        (8, 1024, "python"): 90.0, (8, 1024, "gloo"): 9000.0, (8, 1024, "mpich"): 60.0}
    text = data_plane.section(synthetic(times))
    expected = [
        "1 KB, 2 ranks, plain call ÷ MPICH: 1.50x (bar ≤ 1.5x): **met**",
        "1 KB, 2 ranks, plan ÷ MPICH: 0.75x (bar ≤ 0.5x): **not met**",
        "1 KB, 4 ranks, plain call ÷ MPICH: 0.50x (bar ≤ 0.5x): **met**",
        "1 KB, 4 ranks, plan ÷ MPICH: 0.25x (bar ≤ 0.3x): **met**",
        "1 KB, 4 ranks, speed against gloo: 250.00x (bar ≥ 20x): **met**",
        "16 MB, 4 ranks, speed against gloo: 3.33x (bar ≥ 2.5x): **met**",
        "16 MB, 4 ranks, plain call ÷ MPICH: 0.90x (bar ≤ 0.6x): **not met**",
        "8 ranks, the slowest size up to 64 KiB against the compiled path off (python): 1.11x (bar ≤ 1.0x): "
        "**not met**"]
    for line in expected:
        assert line in text, text
    assert "| 1 KB | 6 | 3 | 30 | 500 | 4 | 1.5 | 0.75 | 83.3 |" in text, text


@pytest.mark.slow  # two pools, gloo and MPICH timed: CI, not the fast loop
def test_a_small_run_measures_every_impl_and_splices_the_report(tmp_path):
    (tmp_path / "REPORT.md").write_text("# Results\n")
    assert data_plane.main(str(tmp_path), [2], [1024]) == 0
    table = pd.read_csv(tmp_path / "data_plane.csv")
    assert set(data_plane.IMPLS) <= set(table["impl"]), table
    assert (table["median_us"] > 0).all() and (table["floor_us"] > 0).all()
    report = (tmp_path / "REPORT.md").read_text()
    assert report.startswith("# Results") and "## The data plane against MPICH and gloo" in report
    assert "**2 ranks**" in report and "| 1 KB |" in report


def test_a_case_is_the_median_of_its_rounds_with_every_call_counted():
    """Rounds of 10, 30 and 20 µs (a stall filled the second): the case is 20 µs over 300 calls,
    its bandwidths those of 20 µs (busbw 2(N-1)/N of algbw for an allreduce on 4 ranks)."""
    rounds = pd.DataFrame([{
        "collective": "allreduce", "impl": impl, "algorithm": "auto", "transport": "shm", "world": 4,
        "bytes": 1024, "median_us": us * scale, "p10_us": us * scale - 1, "p90_us": us * scale + 1,
        "algbw_GBps": 0.0, "busbw_GBps": 0.0, "calls": 100} for us in (10.0, 30.0, 20.0)
                           for impl, scale in (("plan", 1), ("plain", 2))])
    table = data_plane._median_of_rounds(rounds).set_index("impl")
    assert table["median_us"].to_dict() == {"plan": 20.0, "plain": 40.0}
    assert table.loc["plan", "p10_us"] == 19.0 and table.loc["plan", "calls"] == 300
    assert table.loc["plan", "algbw_GBps"] == pytest.approx(1024 / 20e3)
    assert table.loc["plan", "busbw_GBps"] == pytest.approx(1.5 * 1024 / 20e3)
