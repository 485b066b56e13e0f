"""How fast lab.sim.read_nccl_tests and lab.sim.read_osu read a large log, in MB/s.

    python bench/log_reader.py                  # a 10 MB log for each reader, best of 3 reads
    python bench/log_reader.py --mb 40 --reads 5

The logs are written to a temporary folder as a cluster writes them with ``NCCL_DEBUG=INFO``:
16 ranks on 2 hosts, pages of NCCL's INFO lines (every rank's channels, rings and trees) before
the table and between its rows, a stray warning now and then, and the table itself (nccl-tests'
all_reduce_perf; OSU's osu_allreduce -f). The nccl-tests log is read twice: as one stream, and
with Open MPI's ``--tag-output`` on every line (each rank's lines apart). Each read is checked
(every row read back) before it is timed. A reader linear in the file's size reads a log of 4x
the size in 4x the time: the MB/s of ``--mb 10`` and ``--mb 40`` should be about the same.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lab.sim

RANKS, PER_HOST = 16, 8
SIZES = [1 << k for k in range(3, 29)]

#: A log's line and the rank that wrote it.
Line = tuple[int, str]


def info_page(page: int) -> list[Line]:
    """One page of NCCL's INFO lines: every rank's channel set-up, as ``NCCL_DEBUG=INFO`` prints it."""
    lines = []
    for rank in range(RANKS):
        host, pid, device = f"node-a{7 + rank // PER_HOST:02d}", 41230 + rank, rank % PER_HOST
        lines += [(rank, f"{host}:{pid}:{pid + 70 + page % 7} [{device}] NCCL INFO Channel {c:02d}/0 : "
                   f"{rank}[{device}] -> {(rank + 1) % RANKS}[{(rank + 1) % PER_HOST}] via P2P/CUMEM")
                  for c in range(8)]
        lines.append((rank, f"{host}:{pid}:{pid + 71} [{device}] NCCL INFO Connected all rings"))
        lines.append((rank, f"{host}:{pid}:{pid + 71} [{device}] NCCL INFO Connected all trees"))
    lines.append((RANKS - 1, "Warning: could not pin the process to a core; continuing"))
    return lines


def nccl_tests_log(megabytes: float) -> list[Line]:
    """all_reduce_perf on 16 ranks, its table's rows spread among pages of NCCL's log."""
    head = [
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 268435456 step: 2(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0", "#", "# Using devices"]
    head += [
        f"#  Rank {r:2d} Group  0 Pid {41230 + r:6d} on   node-a{7 + r // PER_HOST:02d} device "
        f"{r % PER_HOST:2d} [0x{r:02x}] NVIDIA H100 80GB HBM3" for r in range(RANKS)]
    rows = []
    for size in SIZES:
        us = 20.0 + size / 40e3
        algbw = size / us / 1e3
        cells = f"{us:7.2f}  {algbw:6.2f}  {algbw * 2 * (RANKS - 1) / RANKS:6.2f}       0"
        rows.append(f"{size:12d}  {size // 4:12d}     float     sum      -1  {cells}  {cells}")
    table = [
        "#", "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong"]
    foot = ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 1.0", "#"]
    return _spread(head, table, rows, foot, megabytes)


def osu_log(megabytes: float) -> list[Line]:
    """osu_allreduce -f, its rows spread among pages of NCCL's log (MPI-CUDA built on NCCL)."""
    head = ["", "# OSU MPI-CUDA Allreduce Latency Test v7.4", "# Datatype: MPI_CHAR."]
    table = ["# Size       Avg Latency(us)   Min Latency(us)   Max Latency(us)  Iterations"]
    rows = [
        f"{size:<10d}{20 + size / 4e4:16.2f}{19 + size / 4e4:18.2f}{22 + size / 4e4:18.2f}{100:12d}"
        for size in SIZES]
    return _spread(head, table, rows, [], megabytes)


def _spread(head: list[str], table: list[str], rows: list[str], foot: list[str],
            megabytes: float) -> list[Line]:
    """The log: ``head``, pages of NCCL's log, the ``table`` header, then each row after as many
    pages as make the whole about ``megabytes`` (rank 0 writes all but NCCL's lines)."""
    page_bytes = sum(len(text) + 1 for _, text in info_page(0))
    pages_per_gap = max(1, round(megabytes * 1e6 / page_bytes / (len(rows) + 1)))
    lines, page = [(0, text) for text in head], 0
    for gap in range(len(rows) + 1):
        for _ in range(pages_per_gap):
            lines += info_page(page)
            page += 1
        lines += [(0, text) for text in (table if gap == 0 else [rows[gap - 1]])]
    return lines + [(0, text) for text in foot]


def text(lines: list[Line], tagged: bool = False) -> str:
    """The log's text, each line after its rank's Open MPI tag where ``tagged``."""
    return "".join(f"[1,{rank}]<stdout>:{line}\n" if tagged else f"{line}\n" for rank, line in lines)


def best_read_s(read: Callable[[Path], object], path: Path, reads: int) -> float:
    best = float("inf")
    for _ in range(reads):
        start = time.perf_counter()
        read(path)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=10.0, help="each log's size in MB (default 10)")
    parser.add_argument("--reads", type=int, default=3, help="reads per log; the best is kept (default 3)")
    args = parser.parse_args()
    nccl_tests, nccl_read = nccl_tests_log(args.mb), lab.sim.read_nccl_tests
    with tempfile.TemporaryDirectory() as folder:
        for name, log, read in (("all_reduce_perf.log", text(nccl_tests), nccl_read),
                                ("all_reduce_perf_tagged.log", text(nccl_tests, tagged=True),
                                 nccl_read), ("osu_allreduce.txt", text(osu_log(args.mb)), lab.sim.read_osu)):
            path = Path(folder) / name
            path.write_text(log)
            df = read(path)
            if df["bytes"].tolist() != SIZES:
                raise AssertionError(f"{name}: read {len(df)} rows, not the {len(SIZES)} written")
            seconds = best_read_s(read, path, args.reads)
            megabytes = path.stat().st_size / 1e6
            print(f"{read.__name__:16s} {name:27s} {megabytes:6.1f} MB  {seconds:7.3f} s  "
                  f"{megabytes / seconds:6.1f} MB/s")


if __name__ == "__main__":
    main()
