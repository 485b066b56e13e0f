"""lab.sim.read_nccl_tests and lab.sim.read_osu on logs as clusters write them (issue 36, item 1).

The logs under tests/data/logs/ are in nccl-tests' and OSU's own formats: the new layout (redop,
root, #wrong) and the old ones (no root, or no redop, an error column), one process with nGpus 8,
16 ranks on 2 hosts under Open MPI's tags with rows cut mid-line and NCCL's log among them, srun's
labels on lines a terminal wrapped, N/A, a log cut off mid-row. Variants (other launchers' tags,
wraps at other widths, garbage, two runs in one log) are made from them in tmp_path.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import line_of, write

import lab.sim
from lab.sim import read_nccl_tests, read_osu

pytestmark = pytest.mark.no_ranks

LOGS = Path(__file__).parent / "data" / "logs"
ONE_HOST = LOGS / "all_reduce_8gpus_1host.log"
NEW_COLUMNS = [
    "bytes", "count", "dtype", "redop", "root", "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong",
    "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong"]
OLD_TIMES = [
    "oop_time_us", "oop_algbw", "oop_busbw", "oop_error", "ip_time_us", "ip_algbw", "ip_busbw", "ip_error"]


def fold(text: str, width: int) -> str:
    """``text`` as a terminal (or ``fold -w``) wraps it: every line cut into pieces of ``width``."""
    return "".join("".join(line[i:i + width] + "\n" for i in range(0, max(len(line), 1), width))
                   for line in text.splitlines())


def values(df: pd.DataFrame, row: int, *columns: str) -> list:
    return df.iloc[row][list(columns)].tolist()


def test_the_readers_are_lab_sim_api():
    assert lab.sim.read_nccl_tests is read_nccl_tests and lab.sim.read_osu is read_osu
    assert {"read_nccl_tests", "read_osu"} <= set(lab.sim.__all__)


def test_one_process_with_nGpus_8_is_8_ranks_on_one_host():
    df = read_nccl_tests(ONE_HOST)
    assert list(df.columns) == NEW_COLUMNS
    assert df["bytes"].tolist() == [1024 * 4**k for k in range(9)]
    assert df["count"].tolist() == [n // 4 for n in df["bytes"]]
    assert values(df, 0, "oop_time_us", "oop_algbw", "oop_busbw", "ip_time_us") == [13.91, 0.07, 0.13, 13.81]
    assert values(df, -1, "oop_time_us", "oop_algbw", "oop_busbw",
                  "ip_busbw") == [369.1, 181.82, 318.18, 314.18]
    assert (df["dtype"] == "float").all() and (df["redop"] == "sum").all() and (df["root"] == -1).all()
    assert (df[["oop_wrong", "ip_wrong"]] == 0).all().all()
    a = df.attrs
    assert (a["collective"], a["ranks"], a["hosts"], a["host_names"]) == ("allreduce", 8, 1, ["dgx-h100-01"])
    assert (a["ranks_from"], a["ranks_per_process"]) == ("devices", 8)
    assert a["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert a["params"] == {
        "n_thread": 1, "n_gpus": 8, "min_bytes": 1024, "max_bytes": 67108864, "step_factor": 4,
        "warmup_iters": 5, "iters": 20, "agg_iters": 1, "validation": 1, "graph": 0}
    assert (a["avg_busbw"], a["out_of_bounds"], a["complete"], a["failure"]) == (105.092, 0, True, None)
    assert a["nccl_version"] == "2.18.5+cuda12.2" and a["cputime"] is False
    # the footer's average is over every row's busbw, out of place and in place
    assert np.mean([*df["oop_busbw"], *df["ip_busbw"]]) == pytest.approx(a["avg_busbw"], abs=0.01)


def test_16_ranks_on_2_hosts_under_open_mpi_tags_with_rows_cut_mid_line():
    """Rank 0's rows cut by rank 9's NCCL log, tagged again mid-line, and glued to NCCL's own log
    line read as whole rows; the other ranks' lines and a stderr warning are not rows."""
    df = read_nccl_tests(LOGS / "all_reduce_16ranks_2hosts_ompi.log")
    a = df.attrs
    assert (a["ranks"], a["hosts"], a["host_names"]) == (16, 2, ["node-a07", "node-a08"])
    assert (a["ranks_per_process"], a["nccl_version"], a["avg_busbw"]) == (1, "2.18.3+cuda12.2", 28.5537)
    assert df["bytes"].tolist() == [65536 * 4**k for k in range(7)]
    # cut by rank 9's piece
    assert values(df, 1, "oop_time_us", "oop_algbw", "oop_busbw", "ip_time_us",
                  "ip_busbw") == [54.17, 4.84, 9.07, 52.19, 9.42]
    # "22.[1,0]<stdout>:38": the launcher's tag inside a number
    assert values(df, 2, "oop_busbw", "ip_time_us", "ip_algbw") == [22.38, 85.89, 12.21]
    # "-1node-a07:41230:41320 [0] NCCL INFO Using network IB", the row going on on the next line
    assert values(df, 4, "bytes", "root", "oop_time_us", "ip_busbw") == [16777216, -1, 750.1, 41.09]
    assert values(df, -1, "oop_time_us", "ip_time_us") == [11528.0, 11406.0]
    assert (df["oop_busbw"] / df["oop_algbw"]).iloc[-1] == pytest.approx(2 * 15 / 16, rel=1e-3)


def test_srun_labels_on_lines_a_terminal_wrapped_at_100_columns():
    df = read_nccl_tests(LOGS / "all_gather_srun_wrapped.log")
    a = df.attrs
    assert (a["collective"], a["ranks"], a["hosts"]) == ("allgather", 8, 2)
    assert a["host_names"] == ["gpu-b01", "gpu-b02"]
    assert a["devices"] == ["NVIDIA L40S"]  # "NVIDIA L4" + "0S" on the next line
    assert (a["params"]["graph"], a["params"]["iters"]) == (0, 20)  # the parameters' wrapped tail
    assert list(df.columns) == NEW_COLUMNS and (df["redop"] == "none").all()
    assert df["bytes"].tolist() == [8192 * 4**k for k in range(6)]
    assert df["count"].tolist() == [n // 4 // 8 for n in df["bytes"]]
    # "1" + "0.50": a wrap inside a number
    assert values(df, -1, "oop_time_us", "oop_busbw", "ip_time_us", "ip_algbw",
                  "ip_busbw") == [801.9, 9.15, 798.9, 10.50, 9.19]
    assert a["avg_busbw"] == 4.54919


@pytest.mark.parametrize("tag", ["[1,0]<stdout>:", "0: ", "  12: ", "[dgx-h100-01:48211] ", "[default0]:"])
def test_a_launchers_tag_on_every_line_reads_as_the_untagged_log(tmp_path, tag):
    text = "".join(tag + line + "\n" for line in ONE_HOST.read_text().splitlines())
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", text))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert (df.attrs["ranks"], df.attrs["hosts"], df.attrs["avg_busbw"]) == (8, 1, 105.092)


def test_another_ranks_pieces_inside_a_line_go_to_their_own_rank(tmp_path):
    """Rank 0's row cut in three by rank 1's pieces (NCCL's log, and a line that looks like a row):
    rank 0's row reads whole, rank 1's text is not in the table."""
    lines = ["[1,0]<stdout>:" + line for line in ONE_HOST.read_text().splitlines()]
    row = next(i for i, line in enumerate(lines) if "  262144  " in line)
    text = lines[row]
    lines[row] = (text[:40] + "[1,1]<stdout>:dgx-h100-01:48212:48300 [1] NCCL INFO Connected all rings\n"
                  "[1,0]<stdout>:" + text[40:80] + "[1,1]<stdout>:   999   1   2\n[1,0]<stdout>:" + text[80:])
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", "\n".join(lines) + "\n"))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert values(df, 4, "bytes", "oop_time_us", "oop_busbw", "ip_busbw") == [262144, 15.10, 30.38, 29.91]


@pytest.mark.parametrize("width", [40, 64, 80, 100])
def test_lines_wrapped_at_any_width_read_as_the_unwrapped_log(tmp_path, width):
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", fold(ONE_HOST.read_text(), width)))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert (df.attrs["params"]["graph"], df.attrs["ranks"]) == (0, 8)
    assert df.attrs["devices"] == ["NVIDIA H100 80GB HBM3"]


def test_tagged_lines_that_a_terminal_then_wrapped(tmp_path):
    tagged = "".join(f"[1,0]<stdout>:{line}\n" for line in ONE_HOST.read_text().splitlines())
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", fold(tagged, 90)))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert values(df, -1, "oop_time_us", "ip_time_us") == [369.1, 373.8]


def test_another_programs_lines_among_the_rows_are_skipped(tmp_path):
    text = ONE_HOST.read_text().replace(
        "       16384", "Warning: Permanently added 'dgx-h100-02' (ED25519) to the list of known hosts.\n"
        "dgx-h100-01:48211:48290 [3] misc/socket.cc:484 NCCL WARN socketProgress: Connection closed\n"
        "\n       16384", 1)
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", text))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert values(df, 2, "bytes", "oop_time_us") == [16384, 14.11]


def test_the_old_layout_has_redop_but_no_root_and_an_error_column():
    df = read_nccl_tests(LOGS / "all_reduce_old_layout.log")
    assert list(df.columns) == ["bytes", "count", "dtype", "redop", *OLD_TIMES]
    assert df["oop_error"].tolist() == [0.0] + [1e-6] * 6
    assert values(df, -1, "bytes", "oop_time_us", "oop_busbw",
                  "ip_time_us") == [16777216, 128.4, 196.0, 131.7]
    a = df.attrs
    assert (a["ranks"], a["hosts"], a["host_names"]) == (4, 1, ["dgx-work01"])  # "#   Rank  0 Pid": no Group
    assert "agg_iters" not in a["params"] and a["params"]["validation"] == 1 and a["avg_busbw"] == 67.8353


def test_the_old_broadcast_layout_has_a_root_and_no_redop():
    df = read_nccl_tests(LOGS / "broadcast_old_layout.log")
    assert list(df.columns) == ["bytes", "count", "dtype", "root", *OLD_TIMES]
    assert (df["root"] == 0).all() and (df["oop_busbw"] == df["oop_algbw"]).all()
    assert df["oop_time_us"].tolist() == [73.43, 218.9, 793.8, 3085.2]
    a = df.attrs
    assert (a["collective"], a["ranks"], a["hosts"]) == ("broadcast", 2, 2)
    assert a["host_names"] == ["nid007106", "nid007109"]


def test_N_A_reads_as_NaN_and_the_rest_of_the_row_as_numbers():
    df = read_nccl_tests(LOGS / "alltoall_no_check.log")
    assert df["oop_wrong"].isna().all() and df["ip_wrong"].isna().all()
    assert values(df, 0, "bytes", "oop_time_us", "oop_busbw", "ip_time_us") == [131072, 24.49, 4.68, 24.44]
    assert (df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"]) == ("all_to_all", 8, 1)
    assert df.attrs["params"]["validation"] == 0


def test_a_log_cut_off_mid_row_reads_up_to_where_it_stops():
    path = LOGS / "reduce_scatter_truncated.log"
    assert not path.read_text().endswith("\n")
    df = read_nccl_tests(path)
    assert df["bytes"].tolist() == [32768 * 4**k for k in range(5)]
    assert values(df, -1, "oop_time_us", "ip_time_us", "ip_busbw") == [443.1, 433.7, 14.51]
    a = df.attrs
    assert (a["complete"], a["avg_busbw"], a["out_of_bounds"]) == (False, None, None)
    assert (a["program"], a["nccl_tests_version"]) == ("reduce_scatter_perf", "2.17.1")
    assert a["params"]["unalign"] == 0
    assert (a["ranks"], a["hosts"], a["ranks_per_process"]) == (4, 1, 4)


def test_a_short_last_row_is_dropped_and_a_failure_is_kept(tmp_path):
    text = ONE_HOST.read_text()
    cut = text[:text.index("    16777216")]
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", cut + "    16777216       4194304     float\n"))
    assert (len(df), df["bytes"].iloc[-1], df.attrs["complete"]) == (7, 4194304, False)
    failure = "dgx-h100-01: Test NCCL failure common.cu:1004 'unhandled system error'"
    cut += "    16777216       4194304     float     sum      -1" + failure + "\n"
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", cut))
    assert (len(df), df.attrs["failure"], df.attrs["complete"]) == (7, failure, False)


def test_the_collective_comes_from_the_log_then_the_file_name_then_the_caller(tmp_path):
    text = (LOGS / "reduce_scatter_truncated.log").read_text()
    assert read_nccl_tests(write(tmp_path, "run3.log", text)).attrs["collective"] == "reduce_scatter"
    # reduce_scatter's numbers are allgather's too (busbw = algbw · (N-1)/N, size = count · 4 B · N)
    unnamed = text.replace("# Collective test starting: reduce_scatter_perf\n", "")
    command = "$ mpirun -np 1 ./build/all_gather_perf -b 32K -e 128M -f 4 -g 4\n"
    assert read_nccl_tests(write(tmp_path, "x.log", command + unnamed)).attrs["collective"] == "allgather"
    # named nowhere: busbw / algbw, the count, redop and root columns say it (issue 42, item 4)
    df = read_nccl_tests(write(tmp_path, "run4.log", ONE_HOST.read_text()))
    assert df.attrs["collective"] == "allreduce" and df.attrs["collective_from"] == "busbw/algbw"
    # allgather's and alltoall's numbers are alike in every column: the caller says which
    path = write(tmp_path, "run5.log", (LOGS / "alltoall_no_check.log").read_text())
    message = r"run5.log: the log does not say which collective.* fit 2: allgather, all_to_all .*collective="
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(path)
    df = read_nccl_tests(path, collective="all_to_all")
    assert (df.attrs["collective"], df.attrs["collective_from"]) == ("all_to_all", "given")
    with pytest.raises(ValueError, match=r"collective must be one of .*, not 'all_reduce'"):
        read_nccl_tests(path, collective="all_reduce")


def test_without_device_lines_ranks_come_from_busbw_over_algbw(tmp_path):
    def without_devices(path: Path) -> str:
        return "".join(line + "\n" for line in path.read_text().splitlines() if "Rank" not in line)

    df = read_nccl_tests(write(tmp_path, "all_reduce.log", without_devices(ONE_HOST)))
    assert (df.attrs["ranks"], df.attrs["ranks_from"], df.attrs["hosts"]) == (8, "busbw/algbw", None)
    df = read_nccl_tests(write(tmp_path, "broadcast.log", without_devices(LOGS / "broadcast_old_layout.log")))
    assert (df.attrs["ranks"], df.attrs["ranks_from"]) == (None, None)  # busbw = algbw whatever N


def test_newer_columns_cputime_and_timestamp(tmp_path):
    text = ("# nThread 1 nGpus 2 minBytes 1024 maxBytes 2048 step: 2(factor) warmup iters: 5 iters: 20 "
            "agg iters: 1 validation: 1 graph: 0 unalign: 0\n#\n"
            "#       size         count      type   redop    root  cputime   algbw   busbw  #wrong  cputime"
            "   algbw   busbw  #wrong           timestamp\n"
            "        1024           256     float     sum      -1    12.31    0.08    0.08       0    12.02"
            "    0.09    0.09       0  2025-03-14 10:21:07\n"
            "        2048           512     float     sum      -1    12.40    0.17    0.17       0    12.11"
            "    0.17    0.17       0  2025-03-14 10:21:08\n")
    df = read_nccl_tests(write(tmp_path, "all_reduce_perf.log", text))
    assert df.columns[-1] == "timestamp"
    assert df["timestamp"].tolist() == ["2025-03-14 10:21:07", "2025-03-14 10:21:08"]
    assert df["oop_time_us"].tolist() == [12.31, 12.40] and df.attrs["cputime"] is True
    # no device lines: N from busbw / algbw (2(N-1)/N is 1 at N = 2), as nGpus 2 in one process says
    assert (df.attrs["ranks"], df.attrs["ranks_from"], df.attrs["ranks_per_process"]) == (2, "busbw/algbw", 2)
    assert df.attrs["complete"] is False


def test_a_garbage_value_names_the_file_and_the_line(tmp_path):
    text = ONE_HOST.read_text().replace("19.18", "1O.18")
    path = write(tmp_path, "all_reduce.log", text)
    message = rf"^{re.escape(str(path))}, line {line_of(text, '1O.18')}: oop_time_us is '1O.18', not a number"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(path)
    text = ONE_HOST.read_text().replace("float     sum      -1    14.09", "fl%at     sum      -1    14.09")
    with pytest.raises(ValueError, match=rf", line {line_of(text, 'fl%at')}: dtype is 'fl%at', not a name"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))


def test_rows_of_the_wrong_width_name_their_line(tmp_path):
    text = ONE_HOST.read_text().replace("    4.57    7.99      0", "    4.57    7.99      0    12")
    message = rf", line {line_of(text, '7.99      0    12')}: 14 fields where the header has 13"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))
    text = ONE_HOST.read_text().replace("    373.8  179.53  314.18      0", "")
    message = rf", line {line_of(text, '  67108864')}: a row cut short \(9 of 13 fields\)"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))


def test_a_log_with_no_table_or_no_rows_is_an_error(tmp_path):
    path = write(tmp_path, "all_reduce.log", "srun: error: gpu-b01: task 0: Exited with exit code 1\n\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 2: no nccl-tests table in the log"):
        read_nccl_tests(path)
    text = ONE_HOST.read_text()
    head = text[:text.index("        1024")]
    with pytest.raises(ValueError, match=rf", line {line_of(head, 'size')}: a column header with no rows"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", head))


def test_two_runs_in_one_log_are_an_error_at_the_second(tmp_path):
    text = ONE_HOST.read_text()
    second = text.count("\n") + line_of(text, "size")
    message = rf", line {second}: a second nccl-tests table \(the first is at line 15\)"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text + text))
    # a build without MPI: each process runs a one-rank test of its own, on rank-tagged stdout
    both = "".join(f"[1,{rank}]<stdout>:{line}\n" for line in text.splitlines() for rank in (0, 1))
    with pytest.raises(ValueError, match=r", line 30: a second nccl-tests table \(the first is at line 29\)"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", both))


def test_osu_without_min_and_max_columns():
    df = read_osu(LOGS / "osu_allreduce.txt")
    assert list(df.columns) == ["bytes", "avg_us"] and df["bytes"].tolist() == [2**k for k in range(21)]
    assert df["avg_us"].iloc[[0, -1]].tolist() == [3.11, 122.86]
    a = df.attrs
    assert (a["collective"], a["benchmark"], a["version"]) == ("allreduce", "Allreduce Latency", "7.3")
    assert (a["library"], a["accelerator"], a["datatype"]) == ("MPI", None, "MPI_CHAR")
    assert (a["ranks"], a["hosts"]) == (None, None)


def test_osu_full_format_under_srun_labels():
    df = read_osu(LOGS / "osu_bcast_full_srun.txt")
    assert list(df.columns) == ["bytes", "avg_us", "min_us", "max_us", "iterations"]
    assert df.iloc[0].tolist() == [1, 8.50, 6.97, 10.11, 1000]
    assert df.iloc[-1].tolist() == [4194304, 239.44, 196.34, 284.94, 100]
    assert df["iterations"].dtype == np.int64 and (df["min_us"] <= df["avg_us"]).all()
    a = df.attrs
    assert (a["collective"], a["accelerator"], a["version"]) == ("broadcast", "CUDA", "7.4")


def test_osu_v5_all_to_all_and_point_to_point_latency():
    df = read_osu(LOGS / "osu_alltoall_v5.txt")
    assert (df.attrs["collective"], df.attrs["version"]) == ("all_to_all", "5.6.3")
    assert df.attrs["datatype"] is None  # v5 prints none
    assert df.iloc[-1].tolist() == [65536, 50.14, 41.11, 59.66, 100]
    df = read_osu(LOGS / "osu_latency.txt")  # its Datatype line comes after the column header
    assert (df.attrs["collective"], df.attrs["benchmark"]) == (None, "Latency")
    assert df.attrs["datatype"] == "MPI_CHAR"
    assert list(df.columns) == ["bytes", "avg_us"] and df["avg_us"].iloc[[0, -1]].tolist() == [1.58, 7.19]


def test_osu_wrapped_with_a_warning_and_cut_off(tmp_path):
    text = (LOGS / "osu_bcast_full_srun.txt").read_text()
    df = read_osu(write(tmp_path, "osu.txt", fold(text, 36)))  # the title and the header wrap too
    pd.testing.assert_frame_equal(df, read_osu(LOGS / "osu_bcast_full_srun.txt"))
    warned = text.replace("0: 1 ", "0: Warning: NUMA binding failed, continuing\n0: 1 ", 1)
    pd.testing.assert_frame_equal(read_osu(write(tmp_path, "osu.txt", warned)), df)
    df = read_osu(write(tmp_path, "osu.txt", text[:text.index("0: 2048 ") + 20]))
    assert df["bytes"].tolist() == [2**k for k in range(11)] and df["avg_us"].iloc[-1] == 8.41


def test_osu_garbage_no_rows_and_two_runs_are_errors(tmp_path):
    text = (LOGS / "osu_allreduce.txt").read_text().replace("122.86", "12x.86")
    path = write(tmp_path, "osu.txt", text)
    message = rf"^{re.escape(str(path))}, line {line_of(text, '12x.86')}: avg_us is '12x.86', not a number$"
    with pytest.raises(ValueError, match=message):
        read_osu(path)
    title = "# OSU MPI Allgather Latency Test v7.3\n# Datatype: MPI_CHAR.\n"
    with pytest.raises(ValueError, match=r", line 3: a column header with no rows under it"):
        read_osu(write(tmp_path, "osu.txt", title + "# Size       Avg Latency(us)\nsrun: error: node2\n"))
    with pytest.raises(ValueError, match=r", line 2: no column header"):
        read_osu(write(tmp_path, "osu.txt", title))
    text = (LOGS / "osu_allreduce.txt").read_text()
    with pytest.raises(ValueError, match=rf", line {text.count(chr(10)) + 2}: a second OSU table"):
        read_osu(write(tmp_path, "osu.txt", text + text))
    with pytest.raises(ValueError, match=r"no OSU table in the log"):
        read_osu(ONE_HOST)
