"""Bad inputs to ``python -m lab``'s commands (``workload``'s: tests/test_workload_files_hostile.py):
each is argparse's kind of error, one line naming the option (or the file), exit status 2, no
traceback and nothing run; and ``cluster fit --json`` prints valid JSON, never NaN or Infinity.

Each command runs in this process (``lab.__main__.main``), with ``lab.launch`` and ``lab.spawn``
standing in for a pool that must not start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import refusal

import lab
from lab.__main__ import main

pytestmark = pytest.mark.no_ranks

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
ONE_GPU_LOG = str(DATA / "logs" / "public" / "alltoall_h100_2nodes_1gpu.log")  # 2 hosts of 1 rank

#: (argv, what the error's line must say): the option it names, or the file and line.
BAD_INPUTS = [
    (["perf", "allreduce", "--ranks", "9999"], "argument --ranks: at most 82 on shm; got 9999"),
    (["perf", "allreduce", "--ranks", "51", "--transport", "queue"], "argument --ranks: at most 50 on queue"),
    (["perf", "allreduce", "--ranks", "200", "--hosts", "2"], "argument --ranks: at most 82 a host on auto"),
    (["perf", "allreduce", "-b", "1e400"], "argument -b/--minbytes: invalid size '1e400'"),
    (["perf", "allreduce", "-b", "infK"], "argument -b/--minbytes: invalid size 'infK'"),
    (["perf", "allreduce", "-b", "inf"], "argument -b/--minbytes: invalid size 'inf'"),
    (["perf", "allreduce", "-b", "1000G", "-e",
      "1000G"], "argument -e/--maxbytes: 1,073,741,824,000 bytes on 4 ranks need about"),
    (["perf", "allreduce", "-e", "1e30"], "argument -e/--maxbytes"),
    (["perf", "allreduce", "-b", "1", "-e", "1M", "-i", "1"],
     "argument -i/--stepbytes: 1 to 1,048,576 bytes in steps of 1 is 1,048,576 sizes, more than 100,000"),
    (["perf", "allreduce", "-n", "²"], "argument -n/--iters: must be a whole number from 1 up"),
    (["cluster", "fit", ONE_GPU_LOG, "--predict-hosts", "0"], "argument --predict-hosts: must be a whole"),
    (["cluster", "fit", ONE_GPU_LOG, "--predict-hosts", "9" * 20], "argument --predict-hosts"),
    (["cluster", "fit", ONE_GPU_LOG, "--nics-per-host", "0"], "argument --nics-per-host: must be a whole"),
    (["cluster", "fit", ONE_GPU_LOG, "--oversubscription",
      "nan"], "argument --oversubscription: oversubscription must be a number from 1"),
    (["cluster", "fit", ONE_GPU_LOG, "--hosts-per-leaf", "10" * 12], "--hosts-per-leaf: hosts_per_leaf must"),
    (["cluster", "fit", "/nonexistent.log"], "/nonexistent.log: No such file or directory"),
    (["simulate", "--world-sizes", "0"], "--world-sizes: must be a whole number from 1 to 16,777,216"),
    (["simulate", "--sizes", "4097"], "--sizes: '4097' holds 4,097 B: a size must be a multiple of 4"),
    (["simulate", "--sizes", "1GB..1KB"], "argument --sizes: a size range must go from a size >= 1 byte"),
    (["simulate", "--gbit", "0"], "argument --gbit: gbit must be a number from 1e-06"),
    (["simulate", "--ranks-per-host", "0"], "argument --ranks-per-host: must be a whole number"),
    (["simulate", "--collectives", "alltoall"], "argument --collectives: invalid choice: 'alltoall'"),
    (["simulate", "--max-seconds", "nan"], "argument --max-seconds: max_seconds must be a number > 0"),
    (["simulate", "--alpha-us", "1", "--gap-us", "2"], "argument --gap-us: gap_us must be a number from 0"),
    (["simulate", "--sizes", "4096", "--out", "/dev/null/sim"], "argument --out: /dev/null/sim: Not a"),
    (["explain", "allreduce", "--ranks", "0", "--bytes", "1K"], "argument --ranks: must be a whole number"),
    (["explain", "allreduce", "--ranks", "4", "--bytes", "2048G"], "argument --bytes: must be at most"),
    (["explain", "allreduce", "ring", "--ranks", "4", "--bytes", "1K", "--plot",
      "/nonexistent/ring.png"], "argument --plot: the folder of /nonexistent/ring.png does not exist"),
    (["timeline", "/nonexistent.jsonl"], "/nonexistent.jsonl: No such file or directory"),
    (["timeline", str(TRACES)], f"{TRACES}: Is a directory"),
    (["timeline", str(TRACES / "not_json.jsonl")], "not_json.jsonl, line 2: not JSON"),
    (["timeline", str(TRACES / "no_rank.jsonl")], "no_rank.jsonl, line 1: 'rank' must be a whole number"),
    (["timeline", str(TRACES / "step_without_bytes.jsonl")], "line 1: 'sends' must be a list of [rank,"),
    (["timeline", str(TRACES / "no_rank.jsonl"), "-o",
      "/nonexistent/t.json"], "argument -o/--output: the folder of /nonexistent/t.json does not exist"),
    (["validate", "--world-sizes", "99999"], "argument --world-sizes: at most 82 ranks on shm"),
    (["validate", "--elements", "0"], "argument --elements: must be a whole number from 1 up"),
    (["validate", "--elements", "100000000000"], "argument --elements: 100,000,000,000 elements at 4 ranks"),
    (["results", "--ranks", "0"], "argument --ranks: must be a whole number from 1 up"),
    (["results", "--hosts", "2", "--link-gbit", "nan"], "argument --link-gbit: link_gbit must be a number"),
    (["results", "--data-plane", "100"], "argument --data-plane: at most 82 ranks on shm"),
    (["results", "--calibrate-only", "--out", "/nonexistent"], "argument --out: /nonexistent is no folder")]


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pool started")

    monkeypatch.setattr(lab, "launch", started)
    monkeypatch.setattr(lab, "spawn", started)


@pytest.mark.parametrize("argv, says", BAD_INPUTS, ids=[" ".join(argv)[:60] for argv, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_naming_it_and_exit_status_2(capsys, nothing_runs, argv, says):
    assert says in refusal(capsys, argv)


def test_predicting_more_hosts_than_the_simulator_takes_names_predict_hosts(capsys, monkeypatch):
    """Refused from the simulator's estimates before the fit (which takes tens of seconds on
    larger logs): the fit is never called."""
    def fitted(*args: object, **kwargs: object) -> None:
        raise AssertionError("the logs were fitted before the host count was checked")

    monkeypatch.setattr("lab.sim.cluster_cli.fit_cluster_report", fitted)
    line = refusal(capsys, ["cluster", "fit", ONE_GPU_LOG, "--predict-hosts", "4", "100000", "--json"])
    assert "argument --predict-hosts: too large to simulate: all_to_all" in line and "100,000 ranks" in line
    eight_gpus = ONE_GPU_LOG.replace("1gpu", "8gpus")  # 8 ranks a host: 2**24 ranks are 2,097,152 hosts
    line = refusal(capsys, ["cluster", "fit", eight_gpus, "--predict-hosts", str(1 << 24)])
    assert "argument --predict-hosts: hosts must be an integer >= 1, at most 2,097,152 (16,777,216" in line


def test_cluster_fit_names_a_log_whose_numbers_fit_several_collectives_and_takes_collective(capsys, tmp_path):
    """An alltoall log that names no program (nor does its file): its numbers are allgather's as
    much, so the command names both; --collective says which (issue 42, item 4)."""
    text = Path(ONE_GPU_LOG).read_text().replace("alltoall_perf", "")
    path = tmp_path / "n2.out"
    path.write_text(text)
    line = refusal(capsys, ["cluster", "fit", str(path)])
    assert f"{path}: the log does not say which collective" in line and "fit 2: allgather, all_to_all" in line
    assert "--collective" in line
    assert main(["cluster", "fit",
                 str(path), "--collective", "all_to_all", "--predict-hosts", "1", "--json"]) == 0
    (predicted,) = json.loads(capsys.readouterr().out)["predictions"]
    assert predicted["collective"] == "all_to_all"
    assert "argument --collective: invalid choice: 'alltoall'" in refusal(
        capsys, ["cluster", "fit", str(path), "--collective", "alltoall"])


def test_cluster_fit_names_the_lines_of_a_failed_start(capsys):
    path = DATA / "logs" / "hostile" / "all_reduce_failed_start_cxi.log"
    line = refusal(capsys, ["cluster", "fit", str(path)])
    assert f"{path}, line 20: no nccl-tests table in the log" in line and "line 16: " in line
    assert "CXI alloc failed on cxi0: request exceeds ACs limits" in line


def test_the_cluster_s_json_is_valid_json_where_a_rate_has_no_time(capsys):
    """At one host of one rank nothing moves: no time, so no algbw or busbw (null, not Infinity/NaN)."""
    assert main(["cluster", "fit", ONE_GPU_LOG, "--predict-hosts", "1", "--json"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    result = json.loads(capsys.readouterr().out, parse_constant=refuse)
    (predicted,) = result["predictions"]
    assert predicted["ranks"] == 1 and predicted["table"]
    rows = predicted["table"]
    assert all(row["time_us"] == 0 and row["algbw"] is None and row["busbw"] is None for row in rows)
    assert main(["cluster", "fit", ONE_GPU_LOG, "--predict-hosts", "1"]) == 0
    table = capsys.readouterr().out.split("Predicted all_to_all at 1 hosts (1 ranks):")[1]
    assert "N/A" in table and "inf" not in table and "nan" not in table
