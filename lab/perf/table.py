"""``lab.perf``'s table: the text nccl-tests prints (header, a row per size, footer), to the character."""

from __future__ import annotations

import argparse
import os

from lab.benchmark import bus_factor
from lab.perf.data import layout
from lab.perf.spec import AVERAGES, PROGRAMS, TYPES, Spec


def format_time(us: float) -> str:
    """A time as nccl-tests prints it: 7 wide, 2 decimals below 100 µs, 1 below 10,000, then none."""
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def titles() -> list[str]:
    """nccl-tests' three lines of column titles (common.cu's Reporter), to the character."""
    widths = (10, 12, 8, 6, 6, *(7, 6, 6, 7) * 2)  # #wrong: 7 wide, no gap before it
    gaps = ("", *["  "] * 7, "", "  ", "  ", "  ", "")
    names = ("size", "count", "type", "redop", "root", *("time", "algbw", "busbw", "#wrong") * 2)
    units = ("(B)", "(elements)", "", "", "", *("(us)", "(GB/s)", "(GB/s)", "") * 2)
    lines = [zip(gaps, texts, widths) for texts in (names, units)]
    titled = ["# " + "".join(f"{gap}{text:>{width}}" for gap, text, width in line) for line in lines]
    return ["# " + " " * 61 + "out-of-place" + " " * 23 + "in-place" + " " * 10, *titled]


def header(spec: Spec, args: argparse.Namespace, ranks: list[tuple], transport: str) -> str:
    """nccl-tests' lines above the table: the program, the parameters, the devices, the column titles."""
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    hosts = len({host for _, _, host, _ in ranks})
    lines = [f"# Collective test starting: {PROGRAMS[spec.collective]}",
             (f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
              f"warmup iters: {spec.warmup} iters: {spec.iters} agg iters: 1 "
              f"validation: {spec.check} graph: 0"),
             (f"# lab: python -m lab perf, transport {transport}, algorithm {spec.algorithm}, "
              f"{len(ranks)} ranks on {hosts} host(s), link {_link(args)}, {os.cpu_count()} cores"),
             "#", "# Using devices"]
    lines += [f"#  Rank {rank:2d} Group  0 Pid {pid:6d} on {host:>10s} device {device:2d} [cpu] "
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
    root = spec.root if spec.collective in ("broadcast", "reduce") else -1
    text = f"{size:12d}  {count:12d}  {spec.dtype:>8s}  {spec.op or 'none':>6s}  {root:6d}"
    busbws, failed = [], 0
    for name in ("oop", "ip"):
        us = AVERAGES[average]([rank[name][0] for rank in per_rank])
        algbw = size / (us * 1e3) if us > 0 else 0.0  # GB/s
        busbws.append(algbw * bus_factor(spec.collective, n))
        wrong = sum(rank[name][1] for rank in per_rank)
        shown = "N/A" if wrong < 0 else wrong
        text += f"  {format_time(us):>7s}  {algbw:6.2f}  {busbws[-1]:6.2f}  {shown:>5}"
        failed += wrong > 0
    return text, busbws, failed


def footer(busbws: list[float], failed: int) -> str:
    """nccl-tests' last lines: runs with wrong elements, and the average busbw of every run."""
    average = sum(busbws) / len(busbws) if busbws else 0.0
    return (f"# Out of bounds values : {failed} {'FAILED' if failed else 'OK'}\n"
            f"# Avg bus bandwidth    : {average:g} \n#")
