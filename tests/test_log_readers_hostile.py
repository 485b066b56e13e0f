"""lab.sim.read_nccl_tests and lab.sim.read_osu on logs that would mislead them (issue 40, items 1,
2, 3, 12 and 13): a rank count one part of the log contradicts, hosts of uneven ranks, an OSU row
without its latency, a file without end, and the text that made the readers quadratic; and on logs
as they come (issue 42, item 4): a log that names no collective, and a run that failed to start.

The hostile logs are in tests/data/logs/hostile/ (each a log of tests/data/logs/ with one thing
wrong); large ones are made in tmp_path, and the rows of the rank-count sweeps as nccl-tests
prints them (:func:`printed`). bench/log_reader.py measures the readers' speed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
from helpers import line_of, write

from lab import sim
from lab.sim import log_lines, log_ranks, read_nccl_tests, read_osu
from lab.sim.log_ranks import bandwidth_ranks

pytestmark = pytest.mark.no_ranks

LOGS = Path(__file__).parent / "data" / "logs"
HOSTILE = LOGS / "hostile"
ONE_HOST = LOGS / "all_reduce_8gpus_1host.log"
OMPI = LOGS / "all_reduce_16ranks_2hosts_ompi.log"
OSU = LOGS / "osu_allreduce.txt"
HEADER = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time"
          "   algbw   busbw #wrong")
#: Low-bandwidth cases: 33 rank counts × 45 rows (9 sizes, 5 times), algbw 0.0001-0.4 GB/s.
SWEEP_RANKS = range(2, 35)
SWEEP_SIZES = [8 << k for k in range(9)]
SWEEP_TIMES = [5.02, 9.87, 13.91, 27.3, 55.1]


def printed(value: float, width: int) -> str:
    """A number as nccl-tests prints it (src/util.cu's getFloatStr): 2 decimals where they fit in
    ``width``, else 1, else none, else an exponent."""
    for decimals in (2, 1, 0):
        text = f"{value:{width}.{decimals}f}"
        if len(text) <= width:
            return text
    return f"{value:{width}.{1 if width >= 7 else 0}e}"


def table_row(size: int, count: int, us: float, factor: float) -> str:
    """One row of a table, out of place and in place alike: algbw = size / time, busbw = algbw · factor."""
    algbw = size / us / 1e3
    cells = f"  {printed(us, 7)}  {printed(algbw, 6)}  {printed(algbw * factor, 6)}       0"
    return f"{size:12d}  {count:12d}     float     none      -1{cells}{cells}"


def log_text(rows: list[str], n_gpus: int = 1, devices: list[str] = ()) -> str:
    params = (f"# nThread 1 nGpus {n_gpus} minBytes 8 maxBytes 2048 step: 2(factor) warmup iters: 5 "
              "iters: 20 agg iters: 1 validation: 1 graph: 0")
    using = ["# Using devices", *devices] if devices else []
    return "\n".join([params, "#", *using, "#", HEADER, *rows, "# Out of bounds values : 0 OK", "#"]) + "\n"


# --- item 1: the rank count, from every source, agreeing ---------------------------------------


def test_an_8_gpu_process_without_device_lines_is_8_ranks_not_14():
    """Its only rows are small: 0.07 / 0.13 GB/s once read as 14 ranks. The rounding allows 7 to
    12 there (with the time, of which algbw is computed), 4 to 8 in the 512 B row: 8."""
    df = read_nccl_tests(HOSTILE / "all_reduce_8gpus_small_no_devices.log")
    assert (df.attrs["ranks"], df.attrs["ranks_per_process"], df.attrs["hosts"]) == (8, 8, None)
    assert df.attrs["ranks_from"] == "busbw/algbw"
    assert bandwidth_ranks("0.07", "0.13", 2.0, 1024, "13.91") == (7, 12)
    assert bandwidth_ranks("0.07", "0.13", 2.0) == (6, math.inf)  # the bandwidths alone


def test_a_garbled_device_line_is_an_error_naming_it():
    """One device line of eight cut short: once read as 7 ranks and fitted as 7 to a host."""
    path = HOSTILE / "all_reduce_garbled_device_line.log"
    message = r", line 9: a device line that cannot be read: '#  Rank  5 Group  0 Pid  48211 on dgx-h100-01 "
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}{message}dev'$"):
        read_nccl_tests(path)


def test_a_device_line_gone_is_an_error_naming_the_counts(tmp_path):
    lines = OMPI.read_text().splitlines(keepends=True)
    last = "".join(line for line in lines if "Rank 15 " not in line)
    message = (r", line (\d+): the log's rank counts disagree: devices \(line 4\) says 15; "
               r"busbw/algbw \(line \1\) says 16$")
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", last))
    middle = "".join(line for line in lines if "Rank  3 " not in line)
    with pytest.raises(ValueError, match=r", line 4: the device lines list 15 ranks but not rank 3"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", middle))
    twice = "".join(line.replace("Rank  3 ", "Rank  2 ") for line in lines)
    with pytest.raises(ValueError, match=r", line 7: rank 2 listed again \(first at line 6\)"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", twice))


def test_each_process_holds_nThread_x_nGpus_ranks(tmp_path):
    text = ONE_HOST.read_text().replace("nGpus 8", "nGpus 4")
    message = r", line 4: process 48211 on dgx-h100-01 has 8 device lines; nThread x nGpus \(line 1\) gives "
    with pytest.raises(ValueError, match=message + "each process 4$"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))
    # without device lines, a multiple of nThread x nGpus: 8 ranks are no multiple of 3
    lines = text.replace("nGpus 4", "nGpus 3").splitlines()
    nameless = "".join(line + "\n" for line in lines if "Rank" not in line)
    message = r"rank counts disagree: nThread x nGpus \(line 1\) says a multiple of 3; busbw/algbw "
    with pytest.raises(ValueError, match=message + r"\(line \d+\) says 8$"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", nameless))


def test_the_count_column_says_the_ranks_where_the_collective_splits_the_buffer(tmp_path):
    text = "".join(line + "\n" for line in (LOGS / "alltoall_no_check.log").read_text().splitlines()
                   if "Rank" not in line)
    df = read_nccl_tests(write(tmp_path, "alltoall.log", text))
    assert (df.attrs["ranks"], df.attrs["ranks_from"]) == (8, "count")  # 131072 B = 4096 floats x 8
    doubled = text.replace("      524288         16384", "      524288         32768")
    message = rf", line {line_of(doubled, '32768')}: size / count says 4 ranks here and 8 at line \d+$"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "alltoall.log", doubled))
    odd = text.replace("      524288         16384", "      524288         16383")
    message = r"size 524288 is not count 16383 × 4 bytes \(float\) × a whole number of ranks$"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "alltoall.log", odd))


def test_rows_whose_busbw_over_algbw_disagree_are_an_error(tmp_path):
    text = ONE_HOST.read_text().replace("181.82  318.18", "181.82  303.03")  # 2·5/6 of algbw: 6 ranks
    message = rf", line {line_of(text, '303.03')}: busbw/algbw says 6 ranks here and 8 at line \d+$"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))
    # an allreduce's busbw (1.75 algbw) is no allgather's (below algbw, whatever N)
    first = line_of(ONE_HOST.read_text(), "  1024  ")
    message = rf", line {first}: busbw 0.13 / algbw 0.07 fits no rank count of allgather"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(ONE_HOST, collective="allgather")


def test_every_low_bandwidth_row_allows_its_true_rank_count():
    """33 rank counts × 45 rows, as many cases as the issue's sweep, for each bus factor: the
    rounded busbw / algbw always allows the true N; where it allows one N only, that is the true
    one. The old rule, round(factor / (factor - busbw / algbw)), is wrong in 406 of them for
    allreduce and 226 for (N-1)/N."""
    exact = 0
    for factor in (2.0, 1.0):
        for n in SWEEP_RANKS:
            for size in SWEEP_SIZES:
                for us in SWEEP_TIMES:
                    algbw = size / us / 1e3
                    a, b, t = printed(algbw, 6), printed(algbw * factor * (n - 1) / n, 6), printed(us, 7)
                    for span in (bandwidth_ranks(a, b, factor), bandwidth_ranks(a, b, factor, size, t)):
                        assert span is not None and span[0] <= n <= span[1], (factor, n, size, us, a, b, span)
                        exact += span[0] == span[1]
    assert exact >= 100  # a sweep that pins N somewhere


@pytest.mark.parametrize("collective, factor", [("all_reduce", 2.0), ("all_gather", 1.0)])
def test_a_log_of_low_bandwidth_rows_reads_its_true_rank_count_or_none(tmp_path, collective, factor):
    """All 45 rows in one log per N, no device lines: the rows together read as N, or as None
    where they allow several; never another count. allgather's count column says N exactly, and
    the bandwidths must allow it."""
    determined = 0
    for n in SWEEP_RANKS:
        split = n if factor == 1.0 else 1  # allgather's size: count floats from each of N ranks
        rows = [
            table_row(size // 4 // split * 4 * split, size // 4 // split, us,
                      factor * (n - 1) / n) for size in SWEEP_SIZES for us in SWEEP_TIMES
            if size // 4 // split]
        df = read_nccl_tests(write(tmp_path, f"{collective}.log", log_text(rows)))
        assert df.attrs["ranks"] in (n, None), n
        determined += df.attrs["ranks"] == n
    assert determined >= 10


def test_nan_negative_duplicate_and_unordered_rows_read_as_before(tmp_path):
    text = ONE_HOST.read_text()
    rows = text.splitlines()[16:25]
    odd = [
        rows[3].replace("14.09    4.65    8.14", "  N/A     N/A     N/A"),
        rows[0].replace("13.91    0.07    0.13",
                        "-13.91   -0.07   -0.13"), rows[5], rows[5], rows[8], rows[1]]
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", text.replace("\n".join(rows), "\n".join(odd))))
    assert df["bytes"].tolist() == [65536, 1024, 1048576, 1048576, 67108864, 4096]
    assert df["oop_time_us"].isna().tolist() == [True] + [False] * 5 and df["oop_time_us"][1] == -13.91
    assert (df.attrs["ranks"], df.attrs["hosts"]) == (8, 1)


# --- item 2: ranks per host as the device lines give them -------------------------------------


def test_hosts_of_8_and_4_ranks_read_as_such_and_are_not_fitted():
    df = read_nccl_tests(HOSTILE / "all_reduce_12ranks_8_plus_4_hosts.log")
    a = df.attrs
    assert (a["ranks"], a["hosts"], a["host_ranks"]) == (12, 2, [8, 4])
    assert a["host_names"] == ["node-a07", "node-a08"]
    message = r"all_reduce_12ranks_8_plus_4_hosts.log: uneven hosts, 8 \+ 4 ranks on node-a07, node-a08 "
    with pytest.raises(ValueError, match=message + r"\(df.attrs\['host_ranks'\]\)"):
        sim.fit_cluster([df])
    assert read_nccl_tests(OMPI).attrs["host_ranks"] == [8, 8]


def test_communicators_split_from_the_ranks_read_as_rank_0s_and_are_not_fitted(tmp_path):
    """NCCL_TESTS_SPLIT_MASK=0x1: processes 0, 2, ... and 1, 3, ... each a communicator of 4, at once."""
    devices = [
        f"#  Rank {r:2d} Group {r % 2:2d} Pid {100 + r:6d} on {'host' + str(r // 4):>10s} "
        f"device {r % 4:2d} [0x01] GPU" for r in range(8)]
    rows = [table_row(size, size // 4, 20.0 + size / 1e4, 2 * 3 / 4) for size in (1 << 20, 1 << 24)]
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", log_text(rows, devices=devices)))
    assert (df.attrs["ranks"], df.attrs["groups"], df.attrs["host_ranks"]) == (4, 2, [2, 2])
    with pytest.raises(ValueError, match=r"2 communicators ran at once \(NCCL_TESTS_SPLIT"):
        sim.fit_cluster([df])


# --- item 3: an OSU row with a column missing -------------------------------------------------


def test_an_osu_row_without_its_latency_is_an_error_naming_its_line():
    """It once merged into the next row: sizes [1, 2, 48, 16, 32], 48 B with 8 B's latency."""
    path = HOSTILE / "osu_allreduce_missing_latency.txt"
    message = r", line 7: a row cut short \(1 of 2 fields\): a column is missing$"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}{message}"):
        read_osu(path)


def test_an_nccl_tests_row_with_a_column_missing_is_an_error(tmp_path):
    text = ONE_HOST.read_text().replace("    14.09    4.65    8.14      0", "    14.09    4.65    8.14")
    with pytest.raises(ValueError, match=rf", line {line_of(text, '  65536  ')}: a row cut short \(12 of 13"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))


# --- item 12: a file without end, or too large ------------------------------------------------


@pytest.mark.parametrize("read", [read_nccl_tests, read_osu])
def test_dev_zero_is_refused_at_the_line_limit(read):
    with pytest.raises(
            ValueError, match=r"^/dev/zero, line 1: a line longer than 1,048,576 bytes "
            r"\(lab.sim.log_lines.MAX_LINE_BYTES\)"):
        read("/dev/zero")


@pytest.mark.parametrize("read", [read_nccl_tests, read_osu])
def test_a_file_past_the_size_limit_is_refused(tmp_path, monkeypatch, read):
    monkeypatch.setattr(log_lines, "MAX_LOG_BYTES", 10_000)
    path = write(tmp_path, "all_reduce.log", ONE_HOST.read_text() * 8)
    message = r": \d\d,\d\d\d bytes, more than a log may hold \(10,000: lab.sim.log_lines.MAX_LOG_BYTES\)$"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}{message}"):
        read(path)
    # a file that is not a regular one (a device, a pipe) is counted as it is read
    with pytest.raises(ValueError, match=r"^/dev/urandom, line \d+: the log goes on past 10,000 bytes"):
        read("/dev/urandom")


def test_a_line_past_the_line_limit_is_refused_and_one_at_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(log_lines, "MAX_LINE_BYTES", 1000)
    lines = ONE_HOST.read_text().splitlines()
    at_limit = write(tmp_path, "all_reduce.log", "\n".join([*lines[:20], "x" * 1000, *lines[20:]]) + "\n")
    pd.testing.assert_frame_equal(read_nccl_tests(at_limit), read_nccl_tests(ONE_HOST))
    past = write(tmp_path, "all_reduce.log", "\n".join([*lines[:20], "x" * 1001, *lines[20:]]) + "\n")
    with pytest.raises(ValueError, match=r", line 21: a line longer than 1,000 bytes"):
        read_nccl_tests(past)


# --- item 13: linear in the file's size -------------------------------------------------------


def test_200_kb_of_words_after_the_parameters_are_not_glued_to_them(tmp_path):
    """Glued onto the parameter line they were scanned by its pattern again and again (200 KB:
    more than 90 s), and a word such as ``nGpus 4`` among them read as a parameter."""
    words = [f"lorem ipsum {k} dolor sit amet nGpus 4 consectetur adipiscing elit" for k in range(3000)]
    lines = ONE_HOST.read_text().splitlines()
    df = read_nccl_tests(write(tmp_path, "all_reduce.log", "\n".join([lines[0], *words, *lines[1:]]) + "\n"))
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    assert df.attrs["params"] == read_nccl_tests(ONE_HOST).attrs["params"] and df.attrs["ranks"] == 8


@pytest.mark.parametrize("line", ["a1" * 150_000, "node-a07" * 37_500, "[" * 300_000])
def test_a_300k_character_line_among_the_rows(tmp_path, line):
    """Each once backtracked in the failure or NCCL-log patterns (300k characters: more than 90 s)."""
    lines = ONE_HOST.read_text().splitlines()
    path = write(tmp_path, "all_reduce.log", "\n".join([*lines[:18], line, *lines[18:]]) + "\n")
    df = read_nccl_tests(path)
    pd.testing.assert_frame_equal(df, read_nccl_tests(ONE_HOST))
    osu = OSU.read_text().splitlines()
    df = read_osu(write(tmp_path, "osu.txt", "\n".join([*osu[:8], line, *osu[8:]]) + "\n"))
    pd.testing.assert_frame_equal(df, read_osu(OSU))


def test_an_80k_digit_field_is_an_error_quoting_its_ends(tmp_path):
    text = ONE_HOST.read_text().replace("19.18", "1" * 80_000 + "x")
    with pytest.raises(ValueError, match=r"oop_time_us is '1{60}'\.\.\.'1{59}x', not a number$"):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))


# --- issue 42, item 4: the collective where nothing names it; a failed start -----------------

#: Each nccl-tests program as its src/*.cu prints it: the lab's name, the redop and root columns,
#: whether the count column is the whole buffer (else each rank's share: size = count × 4 B × N),
#: and busbw / algbw at N ranks.
PROGRAMS = {
    "all_reduce_perf": ("allreduce", "sum", -1, True, lambda n: 2 * (n - 1) / n),
    "all_gather_perf": ("allgather", "none", -1, False, lambda n:
                        (n - 1) / n), "reduce_scatter_perf": ("reduce_scatter", "sum", -1, False, lambda n:
                                                              (n - 1) / n),
    "alltoall_perf": ("all_to_all", "none", -1, False, lambda n:
                      (n - 1) / n), "broadcast_perf": ("broadcast", "none", 0, True, lambda n: 1.0),
    "reduce_perf": ("reduce", "sum", 0, True, lambda n: 1.0),
    "gather_perf": ("gather", "none", 0, False, lambda n:
                    (n - 1) / n), "scatter_perf": ("scatter", "none", 0, False, lambda n: (n - 1) / n)}
#: Which collectives print the same numbers in every column: the log cannot tell them apart.
ALIKE = [["allgather", "all_to_all"], ["gather", "scatter"]]
COLUMNS = [
    "bytes", "count", "dtype", "redop", "root", "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong",
    "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong"]


def program_rows(program: str, n: int) -> list[tuple[int, list[str]]]:
    """A run of ``program`` at ``n`` ranks, 8 B to 8 GiB, as nccl-tests prints it (its rounding;
    a size too small to split in N is 0): the rows' fields, each row with its line number."""
    _, redop, root, whole, factor = PROGRAMS[program]
    rows = []
    for line, asked in enumerate(8 << k for k in range(0, 31, 5)):
        count = asked // 4 // (1 if whole else n)
        size = count * 4 * (1 if whole else n)
        us = 10 + 2 * math.log2(n) + size / 2e4 if size else 0.2
        algbw = size / us / 1e3
        run = [printed(us, 7), printed(algbw, 6), printed(algbw * factor(n), 6), "0"]
        rows.append((20 + line, [str(size), str(count), "float", redop, str(root), *run, *run]))
    return rows


def test_every_program_at_2_to_1024_ranks_is_told_by_its_numbers():
    """No device lines, no parameter line: busbw / algbw, the count, redop and root columns alone.
    Each program's run allows its own collective (at its N, or an N left open) and no other,
    but for those whose every column is alike (allgather and alltoall, gather and scatter)."""
    for program, (collective, *_) in PROGRAMS.items():
        expected = set(next((alike for alike in ALIKE if collective in alike), [collective]))
        for n in range(2, 1025):
            rows = program_rows(program, n)
            allowed, refused = log_ranks.fitting(Path("run.log"), [], (0, {}), rows, COLUMNS)
            assert set(allowed) == expected, (program, n, refused)
            assert allowed[collective]["ranks"] in (n, None), (program, n)


@pytest.mark.parametrize("n", [2, 1024])
@pytest.mark.parametrize("program", PROGRAMS)
def test_a_log_that_names_no_collective_reads_as_the_one_its_numbers_allow(tmp_path, program, n):
    """The whole log, device lines and all, in a file whose name says nothing: read as its
    collective, or an error naming the file and the collectives it could be."""
    collective = PROGRAMS[program][0]
    devices = [
        f"#  Rank {r:4d} Group  0 Pid {1000 + r:6d} on node{r // 4:04d} device  {r % 4} [0x07] GPU"
        for r in range(n)]
    rows = ["  ".join(fields) for _, fields in program_rows(program, n)]
    path = write(tmp_path, "run.log", log_text(rows, devices=devices))
    alike = next((alike for alike in ALIKE if collective in alike), None)
    if alike:
        message = (rf"^{re.escape(str(path))}: the log does not say which collective .* fit 2: "
                   rf"{', '.join(alike)} .*pass collective= \(python -m lab cluster fit: --collective\)$")
        with pytest.raises(ValueError, match=message):
            read_nccl_tests(path)
        df = read_nccl_tests(path, collective=collective)
    else:
        df = read_nccl_tests(path)
        assert df.attrs["collective_from"] == "busbw/algbw"
    assert (df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"]) == (collective, n, n // 4 or 1)


def test_a_layout_without_redop_and_root_at_2_ranks_is_ambiguous(tmp_path):
    """allreduce's busbw / algbw at 2 ranks is 1, broadcast's and reduce's at any: without the
    redop and root columns, the numbers cannot say which."""
    header = HEADER.replace("   redop    root", "")
    rows = ["  ".join(fields[:3] + fields[5:]) for _, fields in program_rows("all_reduce_perf", 2)]
    path = write(tmp_path, "run.log", log_text(rows).replace(HEADER, header))
    with pytest.raises(ValueError, match=r"fit 3: allreduce, broadcast, reduce "):
        read_nccl_tests(path)
    assert read_nccl_tests(path, collective="allreduce").attrs["ranks"] == 2


def test_numbers_that_fit_no_collective_are_an_error_naming_each(tmp_path):
    """sendrecv_perf's (busbw = algbw, redop none, root -1): no collective the lab reads."""
    rows = [table_row(size, size // 4, 20.0 + size / 1e4, 1.0) for size in (1 << 20, 1 << 24)]
    path = write(tmp_path, "run.log", log_text(rows))
    message = (
        r": the log does not say which collective .* fit none of the collectives it could be "
        r"\(allreduce: the redop column says none; broadcast: the root column says -1; allgather: line 5: "
        r"the log's rank counts disagree: count \(line 5\) says 1; busbw/algbw \(line 5\) says 2507 or "
        r"more; .*; scatter: the root column says -1\)$")
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(path)


def test_a_named_log_whose_numbers_are_not_its_collectives_is_an_error(tmp_path):
    """broadcast's busbw is algbw and its count the whole buffer: an allreduce's log is no broadcast's."""
    message = r", line 17: busbw 0.13 / algbw 0.07 is no broadcast's \(busbw = algbw\)$"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(ONE_HOST, collective="broadcast")
    text = (LOGS / "alltoall_no_check.log").read_text()
    message = r", line 16: size 131072 is not count 4096 × 4 bytes \(float\): no allreduce's row$"
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(write(tmp_path, "all_reduce.log", text))


def test_a_failed_start_is_an_error_naming_the_lines_that_say_why():
    """A run that stopped before its table (a log the lab wrote in the form such a failure takes
    on a Slingshot cluster: libfabric's CXI error, NCCL's WARN, nccl-tests' last words; NCCL's
    INFO lines, "Failed to find ...CollNetPlugin" among them, say nothing of it)."""
    path = HOSTILE / "all_reduce_failed_start_cxi.log"
    message = (rf"^{re.escape(str(path))}, line 20: no nccl-tests table in the log \(read to its end\): "
               r"the run stopped before it \(line 16: 'libfabric:61241:.* x3006c0s13b1n0: CXI alloc failed "
               r"on cxi0: request exceeds ACs limits'; line 17: '.* NCCL WARN NET/OFI Unable to create "
               r"endpoint .*'; line 19: \"x3006c0s13b1n0: Test NCCL failure common.cu:961 .*\"\)$")
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(path)


def test_a_run_that_failed_after_its_header_names_why(tmp_path):
    lines = ONE_HOST.read_text().splitlines()
    failure = "dgx-h100-01: Test CUDA failure common.cu:892 'out of memory'"
    path = write(tmp_path, "all_reduce.log", "\n".join([*lines[:16], failure]) + "\n")
    message = (r", line 15: a column header with no rows under it: the run stopped before its first size "
               rf"\(line 17: {re.escape(repr(failure))}\)$")
    with pytest.raises(ValueError, match=message):
        read_nccl_tests(path)
