"""``python -m lab workload replay``: a recorded step replayed at any scale, and where it goes.

    python -m lab workload replay step.jsonl --ranks 1024 --network tcp
    python -m lab workload replay step.jsonl --dims dp=128 tp=8 --algorithm allreduce=ring --json
    python -m lab workload replay step.jsonl --ranks 64 --alpha-us 5 --gbit 100 --timeline sim.json
    python -m lab workload replay step.jsonl --ranks 1024 --network tcp --bucket-mb 4   # DDP, 4 MiB buckets
    python -m lab workload export step.jsonl --ranks 64 --goal step.goal   # for LogGOPSim, ATLAHS

Prints the step time, the compute and the exposed communication per step, the breakdown table
(one row per operation) and what dominates; ``--json`` prints one JSON object instead (valid JSON:
a value that is no finite number is null). Every bad input (a file that cannot be read or is no
workload, an output in a missing folder, a size past the limits) is one line naming the option
or the file, and exit status 2, as argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import math

from lab.command_line import output_file, refused, whole
from lab.errors import LabError
from lab.sim.limits import MAX_WORLD_SIZE
from lab.sim.network import Network
from lab.workload.calls import network_named, replay
from lab.workload.format import load
from lab.workload.goal import export_goal
from lab.workload.replay import DEFAULT_MAX_EVENTS

#: What a bad input raises, each an error of the command line (exit status 2), not a traceback:
#: a bad value, a file that cannot be read (OSError) and the simulator's refusals (LabError's).
REFUSED = (ValueError, OSError, LabError, argparse.ArgumentTypeError)


def _pairs(texts: list[str], option: str, value: type) -> dict:
    out = {}
    for text in texts or []:
        name, sep, given = text.partition("=")
        try:
            out[name] = value(given)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{option} takes NAME=VALUE pairs; got {text!r}")
    return out


def _network(args: argparse.Namespace) -> Network:
    if args.network is not None:
        if args.alpha_us is not None or args.gbit is not None:
            raise ValueError("--network and --alpha-us/--gbit describe the network twice: give one")
        return network_named(args.network)
    return Network(alpha_us=20.0 if args.alpha_us is None else args.alpha_us,
                   gbit=10.0 if args.gbit is None else args.gbit)


def summary(result, top: int = 10) -> str:
    """The step, compute and exposed times per step, the operations that expose the most, and
    what dominates. With more than one step the ranking leaves the first out: it holds the
    program's setup and warm-up (DDP's broadcast of the parameters, FSDP2's first gathers), not
    the step that repeats."""
    lines = [f"{result.world_size:,} ranks on {result.network.describe()}", ""]
    for step, (total, compute,
               exposed) in enumerate(zip(result.step_us, result.compute_us, result.exposed_comm_us)):
        lines.append(f"step {step}: {total:,.1f} µs = compute {compute:,.1f} µs + exposed communication "
                     f"{exposed:,.1f} µs ({exposed / total:.0%})" if total else f"step {step}: 0 µs")
    first = 1 if len(result.step_us) > 1 else 0
    frame = result.breakdown
    frame = frame[frame["step"] >= first] if not frame.empty else frame
    if not frame.empty:
        shown = frame.sort_values("exposed_us", ascending=False).head(top)
        last = len(result.step_us) - 1
        ranked = "the step" if not first else f"step {last}" if last == first else f"steps {first}-{last}"
        table = shown.to_string(index=False, float_format=lambda v: f"{v:,.1f}")
        lines += ["", f"what exposes the most, {ranked}:", table, ""]
        worst = shown.iloc[0]
        total = float(result.step_us[first:].sum())
        lines.append(
            f"dominates: {worst['op']} #{worst['index']} of step {worst['step']} on {worst['group_size']} "
            f"ranks ({worst['nbytes']:,} bytes, {worst['algorithm']}), {worst['exposed_us']:,.1f} µs "
            f"exposed ({worst['exposed_us'] / total:.0%} of {ranked})" if total else "")
    stages = result.stages
    if stages is not None and not stages.empty:  # a pipeline's: each stage's step after the first
        kept = stages[stages["step"] >= first].groupby("rank")
        mean = kept[["compute_us", "exposed_us", "bubble_us", "bubble_share"]].mean()
        lines += ["", "per stage (mean over the steps ranked): compute, exposed communication, bubble"]
        lines += [
            f"rank {rank} (stage {', '.join(map(str, held))}): compute {row.compute_us:,.1f} µs, exposed "
            f"{row.exposed_us:,.1f} µs, bubble {row.bubble_us:,.1f} µs ({row.bubble_share:.0%} of the step)"
            for (rank, row), held in zip(mean.iterrows(), kept["stages"].first())]
    return "\n".join(lines)


def as_json(result) -> dict:
    """The result as one JSON object."""
    def finite(values):
        return [float(v) if math.isfinite(v) else None for v in values]

    return {
        "world_size": result.world_size, "step_us": finite(result.step_us),
        "compute_us": finite(result.compute_us), "exposed_comm_us": finite(result.exposed_comm_us),
        "breakdown": json.loads(result.breakdown.to_json(orient="records")),
        "stages": json.loads(result.stages.to_json(orient="records")) if result.stages is not None else []}


def export(args: argparse.Namespace) -> int:
    try:
        output_file(args.goal, "--goal")
        written = export_goal(load(args.workload), args.goal, args.ranks,
                              dims=_pairs(args.dims, "--dims", int) or None, network=_network(args),
                              algorithms=_pairs(args.algorithm, "--algorithm", str), shard=args.shard,
                              bucket_mb=args.bucket_mb, max_events=args.max_events)
    except REFUSED as exc:
        args.parser.error(refused(exc))
    print(f"Wrote {args.goal} ({written:,} operations across its ranks; LogGOPSim's txt2bin reads it)")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        if args.timeline is not None:
            output_file(args.timeline, "--timeline")
        algorithms = _pairs(args.algorithm, "--algorithm", str)
        dims = _pairs(args.dims, "--dims", int) or None
        result = replay(load(args.workload), args.ranks, _network(args), algorithms=algorithms, dims=dims,
                        compute_scale=args.compute_scale, shard=args.shard, timeline=args.timeline
                        is not None, bucket_mb=args.bucket_mb, max_events=args.max_events)
        if args.timeline:
            result.timeline(args.timeline)
    except REFUSED as exc:
        args.parser.error(refused(exc))
    print(json.dumps(as_json(result), allow_nan=False) if args.json else summary(result))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``python -m lab workload``."""
    parser = commands.add_parser("workload", help="replay a recorded training step at any scale")
    actions = parser.add_subparsers(dest="action", required=True)
    run = actions.add_parser("replay", help="replay a workload file on M ranks and say where the step goes")
    goal = actions.add_parser("export", help="write the re-targeted steps as GOAL (LogGOPSim, ATLAHS)")
    for command in (run, goal):
        command.add_argument("workload", help="the JSONL file recorded with workload= or LAB_WORKLOAD")
        command.add_argument("--ranks", type=whole(1, MAX_WORLD_SIZE), metavar="M",
                             help=f"world size, up to {MAX_WORLD_SIZE:,} (default: as recorded)")
        command.add_argument("--dims", nargs="+", metavar="NAME=SIZE",
                             help="a DeviceMesh recording's sizes per dimension")
        command.add_argument("--network", help="a fitted network by name (shm, queue, tcp: lab/tuning.json)")
        command.add_argument("--alpha-us", type=float, help="per-message latency, µs (default 20)")
        command.add_argument("--gbit", type=float, help="link bandwidth, Gbit/s each way (default 10)")
        command.add_argument(
            "--algorithm", nargs="+", metavar="COLLECTIVE=NAME",
            help="the algorithm per collective (auto: the least simulated of auto's candidates; default: "
            "the recorded one at the recorded size, else auto)")
        command.add_argument("--shard", choices=["strong", "weak"], default="strong",
                             help="a sharded group keeps the model's total (strong) or per-rank bytes (weak)")
        command.add_argument(
            "--bucket-mb", type=float, metavar="MB",
            help="re-bucket a DDP recording's gradients at this cap (MiB, as DDP's bucket_cap_mb; the "
            "recording must know its gradients: lab.workload.record_gradients)")
        command.add_argument(
            "--max-events", type=whole(1), default=DEFAULT_MAX_EVENTS, metavar="N",
            help=f"refuse a replay of more events, every rank's together (default {DEFAULT_MAX_EVENTS:,})")
    run.add_argument("--compute-scale", type=float, default=1.0, help="multiply every rank's compute")
    run.add_argument("--timeline", metavar="FILE.json", help="also write the simulated steps for Perfetto")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.set_defaults(run=main, parser=run)
    goal.add_argument("--goal", required=True, metavar="FILE.goal", help="where to write the GOAL schedule")
    goal.set_defaults(run=export, parser=goal)
