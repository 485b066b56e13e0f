"""``python -m lab results --backend``: its run measures every call into the CSV, and its report
states torch's call on the lab against the lab's own, gloo's and torch's own layer, from the numbers."""

from __future__ import annotations

import pandas as pd
import pytest

from lab.results import backend

pytestmark = pytest.mark.no_ranks


def synthetic() -> pd.DataFrame:
    per_call = {
        ("all_reduce", 1024): {"dist (lab)": 16.0, "lab": 8.0, "dist (gloo)": 400.0, "dist (nothing)": 4.0},
        ("all_reduce", 16 << 20): {"dist (lab)": 5000.0, "lab": 5000.0, "dist (gloo)": 15000.0},
        ("broadcast", 1024): {"dist (lab)": 30.0, "lab": 10.0, "dist (gloo)": 300.0, "dist (nothing)": 5.0}}
    rows = [{
        "part": "per call", "collective": collective, "what": what, "ranks": 2, "bytes": nbytes,
        "median_us": us} for (collective, nbytes), calls in per_call.items() for what, us in calls.items()]
    rows += [{
        "part": "DDP step", "collective": "DDP", "what": f"DDP on {name}", "ranks": 2, "bytes": 4_000_000,
        "median_us": us}
             for name, us in (("lab", 80_000.0), ("gloo", 100_000.0), ("no communication", 60_000.0))]
    table = pd.DataFrame(rows)
    table["load_average"], table["cores"] = 1.0, 2
    return table


def test_the_section_states_each_ratio_from_the_numbers():
    text = backend.section(synthetic())
    # torch's call on the lab ÷ the lab's: 2x; the best torch allows (lab + torch's own layer): 1.5x
    assert "| 2 | all_reduce | 1 KB | 16 | 8 | 400 | 4 | 2 | 1.5 | 25 |" in text, text
    assert "| 2 | broadcast | 1 KB | 30 | 10 | 300 | 5 | 3 | 1.5 | 10 |" in text, text
    assert "lab 80.0 ms, gloo 100.0 ms (the lab 1.25x gloo's speed); the same step communicating nothing " \
           "60.0 ms (at most 1.67x gloo's speed)" in text, text


@pytest.mark.slow  # torchrun, a 16 MB allreduce and DDP steps on three groups: CI, not the fast loop
def test_a_small_run_measures_every_call_and_splices_the_report(tmp_path):
    (tmp_path / "REPORT.md").write_text("# Results\n")
    assert backend.main(str(tmp_path), ranks=[2], steps=1, rounds=1) == 0
    table = pd.read_csv(tmp_path / "backend.csv")
    calls = table[table["part"] == "per call"]
    assert set(calls["collective"]) == set(backend.LAB_NAMES), table
    small_reduce = calls[(calls["collective"] == "all_reduce") & (calls["bytes"] == 1024)]
    assert set(small_reduce["what"]) == {"dist (lab)", "lab", "dist (gloo)", "dist (nothing)"}, table
    assert set(table[table["part"] == "DDP step"]["what"]) == {
        "DDP on lab", "DDP on gloo", "DDP on no communication"}
    assert (table["median_us"] > 0).all(), table
    report = (tmp_path / "REPORT.md").read_text()
    assert report.startswith("# Results") and "## torch.distributed on the lab" in report, report
