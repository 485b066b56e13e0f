"""``python -m lab results``: a sweep's rounds become one row per case, and regenerating the
report keeps the sections other commands spliced into it (no processes needed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from lab.__main__ import main
from lab.algorithms import registry
from lab.report_sections import splice, with_spliced
from lab.results.sweeps import least_of_rounds, sweep

pytestmark = pytest.mark.no_ranks


def test_each_case_keeps_its_least_round_with_that_rounds_spread():
    case = ["collective", "algorithm", "bytes"]
    rounds = [(1024, 30.0, 25.0, 90.0), (1024, 20.0, 19.0, 40.0), (1024, 50.0, 45.0, 60.0),
              (1 << 20, 700.0, 650.0, 900.0), (1 << 20, 900.0, 800.0, 990.0), (1 << 20, 710.0, 600.0, 800.0)]
    rows = pd.DataFrame([{
        "collective": "allreduce", "algorithm": "ring", "bytes": nbytes, "median_us": median, "p10_us": p10,
        "p90_us": p90, "algbw_GBps": nbytes / (median * 1e3), "calls": 100}
                         for nbytes, median, p10, p90 in rounds])
    table = least_of_rounds(rows, case).set_index("bytes")
    assert list(table.index) == [1024, 1 << 20]  # one row per case, in the order measured
    assert table.loc[1024, ["median_us", "p10_us", "p90_us"]].tolist() == [20.0, 19.0, 40.0]
    assert table.loc[1 << 20, ["median_us", "p10_us", "p90_us"]].tolist() == [700.0, 650.0, 900.0]
    assert table.loc[1 << 20, "algbw_GBps"] == pytest.approx((1 << 20) / 700e3)  # the kept round's
    assert (table["calls"] == 300).all() and (table["rounds"] == 3).all()
    assert list(least_of_rounds(rows, case).columns) == [*rows.columns, "rounds"]


def test_a_sweep_needs_a_round(capsys):
    with pytest.raises(ValueError, match="rounds must be at least 1; got 0"):
        sweep(4, ["shm"], [1024], rounds=0)
    with pytest.raises(SystemExit) as exit_info:  # the command refuses it before measuring anything
        main(["results", "--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds: must be a whole number from 1 up; got '0'" in capsys.readouterr().err


def test_regenerating_the_report_keeps_the_spliced_sections(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text("# Results\nold tables\n")
    splice(report, "## Across hosts\nhosts table", "across-hosts")
    splice(report, "## Simulator vs measurement\nline one\n\nline two", "simulation")
    fresh = with_spliced(report, "# Results\nnew tables\n")
    assert "old tables" not in fresh and fresh.startswith("# Results\nnew tables\n")
    assert fresh.index("hosts table") < fresh.index("line one\n\nline two")
    report.write_text(fresh)
    splice(report, "## Simulator vs measurement\nnewer",
           "simulation")  # a later splice still replaces its own
    text = report.read_text()
    assert "newer" in text and "line one" not in text and text.count("<!-- simulation:begin -->") == 1
    assert with_spliced(tmp_path / "absent.md", "# Results\n") == "# Results\n"


def test_the_report_is_rewritten_from_a_runs_csvs_and_auto_picks_the_measured_fastest(tmp_path):
    """``--report-only`` on the committed results: every table from the CSVs, the spliced
    sections kept, and at each measured size "auto picks" the fastest measured auto candidate
    (auto follows the measured medians at the world size they were measured at)."""
    results = Path(__file__).parents[1] / "results"
    for name in ("allreduce", "collectives", "latency_floor", "bucketing", "overlap", "kernels",
                 "gloo_check"):
        shutil.copy(results / f"{name}.csv", tmp_path)
    shutil.copy(results / "machine.json", tmp_path)
    (tmp_path / "REPORT.md").write_text("# Results\nold\n")
    splice(tmp_path / "REPORT.md", "## Across hosts\nkept", "across-hosts")
    assert main(["results", "--report-only", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert text.startswith("# Results\n") and "old" not in text and text.rstrip().endswith(
        "## Across hosts\nkept\n<!-- across-hosts:end -->")
    shm = text[text.index("**shm**"):text.index("**queue**")]
    header, _, *rows = [line.split(" | ") for line in shm.splitlines() if line.startswith("| ")]
    measured = pd.read_csv(tmp_path / "allreduce.csv")
    measured = measured[(measured["transport"] == "shm")
                        & measured["algorithm"].isin(registry.auto_candidates("allreduce"))]
    fastest = measured.loc[measured.groupby("bytes")["median_us"].idxmin()].set_index("bytes")["algorithm"]
    picks = [row[header.index("auto picks")] for row in rows]
    assert picks == fastest.tolist() and len(picks) >= 3  # every measured size


def test_the_workloads_section_is_rendered_from_what_their_bench_wrote(tmp_path):
    """REPORT.md's workloads section, from results/workloads/ (``--report-only`` splices it): one
    line per comparison of accuracy.csv, how many meet their target, and the 1,024-rank replay."""
    from lab.results import workloads

    source = Path(__file__).parents[1] / "results" / "workloads"
    (tmp_path / "workloads").mkdir()
    for name in ("accuracy.csv", "replay_1024.csv", "machine.json"):
        shutil.copy(source / name, tmp_path / "workloads")
    assert not workloads.splice_section(tmp_path)  # (no report to put it in)
    (tmp_path / "REPORT.md").write_text("# Results\n")
    assert workloads.splice_section(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    table = pd.read_csv(source / "accuracy.csv")
    rows = [line for line in text.splitlines() if line.startswith(("| DDP |", "| FSDP2 |"))]
    assert len(rows) == len(table) and f"{table['meets'].sum()} of {len(table)} cases meet" in text
    first = table.iloc[0]
    assert rows[0].startswith(
        f"| DDP | {first['model']} (batch {first['batch']}) | {first['recorded_hosts']} hosts | "
        f"{first['measured_ms']:,.1f} ms |")
    timing = pd.read_csv(source / "replay_1024.csv").iloc[0]
    assert f"on {timing['ranks']:,} ranks: {timing['seconds']:.1f} s" in text
    assert text.rstrip().endswith("<!-- workloads:end -->")
