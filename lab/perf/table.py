"""nccl-tests' text, to the character (header, a row per size, footer): the lab's one writer of it,
for ``python -m lab perf``'s runs and ``python -m lab cluster fit``'s predicted tables alike;
:func:`lab.sim.read_nccl_tests` reads either back."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable

from lab.catalog import COLLECTIVES as CATALOG
from lab.perf.data import layout
from lab.perf.spec import AVERAGES, PROGRAMS, TYPES, Spec


def format_time(us: float) -> str:
    """A time as nccl-tests prints it: 7 wide, 2 decimals below 100 µs, 1 below 10,000, then none."""
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def titles(extra: str = "") -> list[str]:
    """nccl-tests' three lines of column titles (common.cu's Reporter), to the character; ``extra``:
    a column of the lab's after them (a prediction's ``algorithm``)."""
    widths = (10, 12, 8, 6, 6, *(7, 6, 6, 7) * 2)  # #wrong: 7 wide, no gap before it
    gaps = ("", *["  "] * 7, "", "  ", "  ", "  ", "")
    names = ("size", "count", "type", "redop", "root", *("time", "algbw", "busbw", "#wrong") * 2)
    units = ("(B)", "(elements)", "", "", "", *("(us)", "(GB/s)", "(GB/s)", "") * 2)
    lines = [zip(gaps, texts, widths) for texts in (names, units)]
    titled = ["# " + "".join(f"{gap}{text:>{width}}" for gap, text, width in line) for line in lines]
    if extra:
        titled[0] += f"  {extra}"
    return ["# " + " " * 61 + "out-of-place" + " " * 23 + "in-place" + " " * 10, *titled]


def _rate(value: float) -> str:
    """A bandwidth as nccl-tests prints it; ``N/A`` where there is none (no time: one rank)."""
    return f"{value:6.2f}" if math.isfinite(value) else f"{'N/A':>6}"


def text_row(size: int, count: int, dtype: str, redop: str, root: int,
             runs: Iterable[tuple[float, float, float, int]], extra: str = "") -> str:
    """One row as nccl-tests prints it: the size's columns, then per run (out of place, in place)
    its µs, algbw, busbw and wrong elements (-1: ``N/A``, not checked; a time that is no number:
    ``N/A`` in every column of the run), and ``extra`` after them."""
    text = f"{size:12d}  {count:12d}  {dtype:>8s}  {redop:>6s}  {root:6d}"
    for us, algbw, busbw, wrong in runs:
        time = format_time(us) if math.isfinite(us) else "N/A"
        text += f"  {time:>7s}  {_rate(algbw)}  {_rate(busbw)}  {'N/A' if wrong < 0 else wrong:>5}"
    return f"{text}  {extra}" if extra else text


def predicted(collective: str, world_size: int, rows: Iterable, extra: tuple[str,
                                                                             ...] = ("algorithm",)) -> str:
    """A predicted table (rows with ``bytes``, ``time_us``, ``algbw``, ``busbw`` and the fields
    ``extra``) as nccl-tests prints a run of ``collective`` at ``world_size`` ranks, float: its
    program's line, out of place the prediction, in place and ``#wrong`` ``N/A`` (nothing ran),
    then ``extra`` (what ran: the algorithm; NCCL's protocol and channels) in columns of their own."""
    record = CATALOG[collective]
    redop, root = "sum" if record.reduces else "none", 0 if record.rooted else -1
    lines = [f"# Collective test starting: {record.program}", *titles(" ".join(extra))]
    for row in rows:
        size, count = layout(collective, int(row.bytes), world_size, 4)
        runs = [(row.time_us, row.algbw, row.busbw, -1), (math.nan, math.nan, math.nan, -1)]
        lines.append(
            text_row(size, count, "float", redop, root, runs,
                     " ".join(str(getattr(row, name)) for name in extra)))
    return "\n".join(lines)


def header(spec: Spec, args: argparse.Namespace, ranks: list[tuple], transport: str) -> str:
    """nccl-tests' lines above the table: the program, the parameters, the devices, the column titles."""
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    hosts = len({host for _, _, host, _ in ranks})
    lines = [
        f"# Collective test starting: {PROGRAMS[spec.collective]}",
        (f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
         f"warmup iters: {spec.warmup} iters: {spec.iters} agg iters: 1 "
         f"validation: {spec.check} graph: 0"),
        (f"# lab: python -m lab perf, transport {transport}, algorithm {spec.algorithm}, "
         f"{len(ranks)} ranks on {hosts} host(s), link {_link(args)}, {os.cpu_count()} cores"), "#",
        "# Using devices"]
    lines += [
        f"#  Rank {rank:2d} Group  0 Pid {pid:6d} on {host:>10s} device {device:2d} [cpu] "
        f"lab-{transport}" for rank, pid, host, device in ranks]
    return "\n".join([*lines, "#", *titles()])


def _link(args: argparse.Namespace) -> str:
    """What links the ranks: ``1 Gbit/s each way`` between emulated hosts."""
    return "none (one host)" if not args.hosts or args.hosts == 1 else (
        f"{args.link_gbit:g} Gbit/s each way" if args.link_gbit else "uncapped")


def row(spec: Spec, nbytes: int, per_rank: list[dict[str, tuple[float, int]]],
        average: int = 1) -> tuple[str, list[float], int]:
    """One size's row as nccl-tests prints it, its two busbw and how many of its two runs were wrong.

    >>> row(Spec("allreduce"), 1024, [{"oop": (10.0, 0), "ip": (9.0, 0)}] * 2)[0].split()
    ['1024', '256', 'float', 'sum', '-1', '10.00', '0.10', '0.10', '0', '9.00', '0.11', '0.11', '0']
    """
    n = len(per_rank)
    size, count = layout(spec.collective, nbytes, n, TYPES[spec.dtype].itemsize)
    record = CATALOG[spec.collective]
    runs, busbws, failed = [], [], 0
    for name in ("oop", "ip"):
        us = AVERAGES[average]([rank[name][0] for rank in per_rank])
        algbw = size / (us * 1e3) if us > 0 else 0.0  # GB/s
        busbws.append(algbw * record.bus_factor(n))
        wrong = sum(rank[name][1] for rank in per_rank)
        runs.append((us, algbw, busbws[-1], wrong))
        failed += wrong > 0
    text = text_row(size, count, spec.dtype, spec.op or "none", spec.root if record.rooted else -1, runs)
    return text, busbws, failed


def footer(busbws: list[float], failed: int) -> str:
    """nccl-tests' last lines: runs with wrong elements, and the average busbw of every run."""
    average = sum(busbws) / len(busbws) if busbws else 0.0
    return (f"# Out of bounds values : {failed} {'FAILED' if failed else 'OK'}\n"
            f"# Avg bus bandwidth    : {average:g} \n#")
