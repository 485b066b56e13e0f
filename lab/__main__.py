"""``python -m lab``: the validation table (every primitive, lab vs gloo) and the byte counters.

    python -m lab                              # validate: shm and queue transports, 3 and 4 ranks
    python -m lab validate --world-sizes 2 5 --transports shm
    python -m lab results                      # regenerate results/ (sweeps, models, plots, report)
    python -m lab results --hosts 4 8 --link-gbit 1   # allreduce across emulated hosts: results/hosts/
    python -m lab kernels                      # Python vs numpy vs Numba reduction bandwidth
    python -m lab timeline run.jsonl -o timeline.json --png timeline.png   # a trace, per rank
    python -m lab simulate --world-sizes 64 1024 --sizes 1KB..1GB --gbit 100 --alpha-us 5   # results/sim/
    python -m lab explain allreduce --ranks 8 --bytes 1M   # what auto picks, each algorithm's time, why
    python -m lab explain allreduce ring --ranks 8 --bytes 256K --plot ring.png   # and its schedule, drawn
    python -m lab workload replay step.jsonl --ranks 1024 --network tcp   # a recorded step at 1,024 ranks
    python -m lab perf allreduce -b 1K -e 64M -f 2 --ranks 4   # the lab's own runs as an nccl-tests table
    python -m lab cluster fit 1host.log 2hosts.log --predict-hosts 4 8 16   # a cluster fitted to its logs
    python -m lab flight /tmp/fr               # torch-format flight-recorder dumps: where the ranks part

Exits non-zero if any validation row fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pandas as pd

from lab.backend import flight_verdict  # python -m lab flight (lab/backend/flight_verdict.py)
from lab.command_line import checked, number, output_file, refused, whole
from lab.hosts.emulated import check_link_gbit


def compile_plane() -> None:
    """Numba's compilation of the compiled data plane, paid before the table and said out loud: a
    machine's first run compiles for about a minute (once, into Numba's disk cache)."""
    import lab
    from lab.warmup import cache_is_cold, compile_all

    if cache_is_cold():
        print(
            "Compiling the compiled data plane with Numba: about a minute on a machine's first run "
            "(once, into Numba's disk cache; later runs load it in about 3 s) ...", flush=True)
    started = time.monotonic()
    lab.spawn(compile_all, 2, transport="shm")
    print(f"Compiled data plane ready ({time.monotonic() - started:.1f} s).\n", flush=True)


def _check_ranks(args: argparse.Namespace, option: str, counts: list[int], transports: list[str]) -> None:
    """Each of ``counts`` ranks can run on each of ``transports``, or the parser's error names ``option``."""
    from lab.launch.transports import POOL_TRANSPORTS

    for transport in transports:
        most = POOL_TRANSPORTS[transport].max_world_size
        if max(counts, default=0) > most:
            args.parser.error(f"argument {option}: at most {most} ranks on {transport}; got {max(counts)}")


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def validate(args: argparse.Namespace) -> int:
    from lab.validate import byte_table, validation_table

    _check_ranks(args, "--world-sizes", args.world_sizes, args.transports)
    # Each rank builds every rank's inputs (float64 at most) and gathers as many: about 4 such stacks
    needed = max(4 * 8 * n * n * args.elements for n in args.world_sizes)
    if needed > _memory_bytes():
        args.parser.error(f"argument --elements: {args.elements:,} elements at {max(args.world_sizes)} ranks "
                          f"need about {needed / 1e9:.3g} GB of memory, more than this machine's "
                          f"{_memory_bytes() / 1e9:.3g} GB")
    started = time.monotonic()
    compile_plane()
    table = validation_table(args.transports, args.world_sizes, args.elements, args.seed)
    pd.set_option("display.width", 200)
    print("Validation: lab vs torch.distributed (gloo), random inputs, same ranks\n")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2e}"))

    n, numel = 4, 256 * 1024
    counters = byte_table(n, numel)
    print(f"\nPayload bytes per rank, one allreduce of T = {numel * 4:,} bytes (float32) on N = {n} ranks")
    print(
        f"ring: 2T(N-1)/N = {2 * numel * 4 * (n - 1) // n:,} each way; naive root: (N-1)T = {(n - 1) * numel * 4:,}\n"
    )
    print(counters.to_string(index=False))

    failed = int((table["result"] == "FAIL").sum() + (counters["result"] == "FAIL").sum())
    print(
        f"\n{len(table) + len(counters) - failed} passed, {failed} failed in {time.monotonic() - started:.1f} s"
    )
    return 1 if failed else 0


def results(args: argparse.Namespace) -> int:
    from lab import results as results_module
    from lab.benchmark import SIZES

    sizes = [1 << 10, 1 << 20, 16 << 20] if args.quick else SIZES
    if (args.calibrate_only or args.report_only) and not os.path.isdir(args.out):  # (nothing to read)
        args.parser.error(f"argument --out: {args.out} is no folder of results")
    _check_ranks(args, "--ranks", [args.ranks], ["tcp"] if args.hosts else args.transports)
    _check_ranks(args, "--data-plane", args.data_plane or [], ["shm"])
    if args.calibrate_only:  # refit the simulator's networks from OUT's CSVs, measure nothing
        from lab.tuning import TUNING_PATH

        table = results_module.store_fits(args.out)
        print(f"Wrote the networks of {', '.join(table['networks']) or 'no transport'} and the models at N = "
              f"{', '.join(map(str, table['worlds']))} (fitted to {args.out}/) to {TUNING_PATH}")
        return 0
    if args.report_only:  # rewrite OUT/REPORT.md from OUT's CSVs, measure nothing
        try:
            return results_module.report_only(args.out)
        except OSError as exc:  # (its machine.json, a CSV)
            args.parser.error(f"argument --out: {refused(exc)}")
    if args.data_plane is not None:  # plain call, plan, Python path, gloo, MPICH: OUT/data_plane.csv
        from lab.results import data_plane

        return data_plane.main(args.out, args.data_plane or None, sizes if args.quick else None)
    if args.backend:  # the torch.distributed backend against lab.allreduce and gloo: OUT/backend.csv
        from lab.results import backend

        return backend.main(args.out, sorted({2, args.ranks}))
    if args.hosts:  # across emulated hosts: results/hosts/ (lab/results/hosts.py, hierarchy.py)
        from lab.results import hierarchy, hosts

        if args.ranks_per_host:  # hierarchical vs ring vs gloo, H hosts x L ranks, transport="auto"
            return hierarchy.main(args.out, args.hosts, args.ranks_per_host, args.link_gbit[0],
                                  sizes if args.quick else None)
        return hosts.main(args.out, args.hosts, args.link_gbit, sizes if args.quick else None)
    return results_module.main(args.out, args.ranks, args.transports, sizes,
                               update_tuning=not args.keep_tuning, rounds=args.rounds)


def kernels(args: argparse.Namespace) -> int:
    from lab.results import kernel_sweep

    table = kernel_sweep()
    pd.set_option("display.width", 200)
    print(
        table.pivot_table(index="bytes", columns=["impl", "variant"],
                          values="GBps").to_string(float_format=lambda v: f"{v:.3g}"))
    print("\nGB/s: bytes of all inputs read per second")
    return 0


def timeline(args: argparse.Namespace) -> int:
    import json

    from lab.timeline import plot_timeline, read_trace, to_chrome_trace

    try:  # the outputs' folders first, then the trace: a missing file, a line that is no row
        output_file(args.output, "-o/--output")
        if args.png:
            output_file(args.png, "--png")
        rows = read_trace(args.trace)
    except (OSError, ValueError) as exc:
        args.parser.error(refused(exc))
    if args.png and not rows:
        args.parser.error(f"argument --png: {args.trace} has no rows to draw")
    with open(args.output, "w") as out:
        json.dump(to_chrome_trace(rows), out)
    if args.png:
        plot_timeline(rows, args.png)
    print(f"{len(rows)} rows -> {args.output}" + (f" and {args.png}" if args.png else "") +
          " (open the JSON in https://ui.perfetto.dev)")
    return 0


def add_results(commands: argparse._SubParsersAction) -> None:
    """``python -m lab results``: what it measures, into which files."""
    sweep = commands.add_parser("results", help="regenerate results/ and lab/tuning.json")
    sweep.add_argument("--out", default="results")
    sweep.add_argument("--ranks", type=whole(1), default=4)
    sweep.add_argument("--transports", nargs="+", default=["shm", "queue", "tcp"],
                       choices=["shm", "queue", "tcp"])
    sweep.add_argument("--quick", action="store_true", help="1 KB, 1 MB and 16 MB only")
    sweep.add_argument("--rounds", type=whole(1), default=5,
                       help="rounds of every case, the least round's median kept (default 5; 1 is 5x faster)")
    sweep.add_argument("--keep-tuning", action="store_true", help="do not refresh lab/tuning.json")
    sweep.add_argument(
        "--calibrate-only", action="store_true",
        help="measure nothing: refit to OUT's CSVs (and OUT/ranks/N's) the simulator's network per "
        "transport and the models of every world size measured into lab/tuning.json")
    sweep.add_argument(
        "--report-only", action="store_true",
        help="measure nothing: rewrite OUT/REPORT.md from OUT's CSVs and machine.json (keeping the "
        "sections other commands spliced in)")
    sweep.add_argument("--hosts", nargs="+", type=whole(1), metavar="H",
                       help="instead: allreduce across H emulated hosts, one rank each (writes OUT/hosts/)")
    sweep.add_argument("--link-gbit", nargs="+", type=checked(number, check_link_gbit), default=[1.0],
                       metavar="G", help="with --hosts: each host's link cap in Gbit/s each way (default 1)")
    sweep.add_argument(
        "--ranks-per-host", type=whole(1), metavar="L",
        help="with --hosts: L ranks per host, transport='auto': hierarchical vs ring vs gloo "
        "(writes OUT/hosts/hierarchical*.csv and REPORT.md's 'Many ranks per host')")
    sweep.add_argument(
        "--backend", action="store_true",
        help="instead: dist.all_reduce on the \"lab\" backend vs lab.allreduce vs gloo, and a DDP "
        "step on each, under torchrun at 2 ranks and at --ranks (OUT/backend.csv, REPORT.md's section)")
    sweep.add_argument(
        "--data-plane", nargs="*", type=whole(1), metavar="N",
        help="instead: allreduce 1 KB to 16 MB on shm at N ranks (default 2 4 8): plain call, plan, "
        "compiled path off, gloo and MPICH, and the memory floor (OUT/data_plane.csv, "
        "REPORT.md's section)")
    sweep.set_defaults(run=results, parser=sweep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab", description=
        "The collectives lab. Without a command: the validation table (lab vs gloo) and byte counters.")
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser("validate", help="the validation table (the default)")
    check.add_argument("--transports", nargs="+", default=["shm", "queue"], choices=["shm", "queue", "tcp"])
    check.add_argument("--world-sizes", nargs="+", type=whole(1), default=[3, 4], metavar="N")
    check.add_argument("--elements", type=whole(1), default=1001, help="per rank (default 1001: odd)")
    check.add_argument("--seed", type=whole(0), default=0)
    check.set_defaults(run=validate, parser=check)
    add_results(commands)
    kernel = commands.add_parser("kernels", help="Python vs numpy vs Numba reduction bandwidth")
    kernel.set_defaults(run=kernels)
    trace = commands.add_parser("timeline", help="a JSONL trace as a Chrome/Perfetto timeline")
    trace.add_argument("trace", help="the JSONL file written with trace= or LAB_TRACE")
    trace.add_argument("-o", "--output", default="timeline.json")
    trace.add_argument("--png", help="also draw it to this PNG")
    trace.set_defaults(run=timeline, parser=trace)
    from lab.perf import add_parser as add_perf  # python -m lab perf (lab/perf/)
    from lab.sim.cluster_cli import add_parser as add_cluster  # python -m lab cluster (lab/sim/)
    from lab.sim.explain import add_parser as add_explain  # python -m lab explain (lab/sim/explain.py)
    from lab.sim.sweep import add_parser as add_simulate  # python -m lab simulate (lab/sim/sweep.py)
    from lab.workload.cli import add_parser as add_workload  # python -m lab workload (lab/workload/cli.py)

    for add_parser in (add_simulate, add_explain, add_workload, add_perf, add_cluster,
                       flight_verdict.add_parser):  # each its subcommand
        add_parser(commands)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in (*commands.choices, "-h", "--help"):
        argv = ["validate", *argv]  # the validation table is the default command
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
