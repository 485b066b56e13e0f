"""``python -m lab cluster fit LOG... --model nccl``: NCCL's cost model (:mod:`lab.sim.nccl`) fitted
to a cluster's nccl-tests logs of 2 or more nodes, predicted at more nodes, in about a second.

    python -m lab cluster fit n2.log n8.log --model nccl --nic-gbit 200 --nics-per-node 2 --nic-path phb \\
        --cpu amd --fabric dragonfly:256:1.0625:0.7 --predict-hosts 256 540 --tuner-file nccl_tuner.conf

The cluster is stated once, on the command line: GPUs a node (default: the logs' ranks over their
hosts), NICs a node (default: one a GPU) and their Gbit/s, how far a NIC is from its GPUs
(``--nic-path``: LL128 runs across nodes only up to PXB), the CPU vendor (NCCL's tables are indexed
by it), the NCCL release that ran the logs (``--nccl-version``: 2.21, or 2.18), and the fabric above
the nodes, given as built (``fat-tree:NODES_PER_LEAF:OVERSUBSCRIPTION
[:SPINE_HOP_US]`` or ``dragonfly:NODES_PER_GROUP:GLOBAL_LINK_SHARE[:GLOBAL_HOP_US]``). Prints every
term (its value, whether fitted, NCCL's default or given, and which logs and sizes fixed it), then
per collective and node count an nccl-tests table predicted there with the algorithm, protocol and
channels NCCL runs; ``--json`` one JSON object instead; ``--tuner-file`` writes NCCL's example tuner
plugin's file for the predicted node counts. A bad value is one line naming the option, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pandas as pd

from lab.command_line import checked, finite_json, number, output_file, refused, whole
from lab.perf.table import predicted as predicted_table
from lab.sim.nccl import tuner_file
from lab.sim.nccl.constants import VERSIONS
from lab.sim.nccl.fitting import NcclFitReport, fit
from lab.sim.nccl.model import collective_name
from lab.sim.nccl.topology import CPUS, NIC_PATHS, ClusterTopology, Dragonfly, FatTree, positive

MODELS = ("simulator", "nccl")
FABRIC_FORMS = ("fat-tree:NODES_PER_LEAF:OVERSUBSCRIPTION[:SPINE_HOP_US] or "
                "dragonfly:NODES_PER_GROUP:GLOBAL_LINK_SHARE[:GLOBAL_HOP_US]")
FABRICS = {
    "fat-tree": (FatTree, ("nodes_per_leaf", "oversubscription", "spine_hop_us")),
    "dragonfly": (Dragonfly, ("nodes_per_group", "global_link_share", "global_hop_us"))}
#: The options only NCCL's model takes (None: not given).
NCCL_OPTIONS = ("gpus_per_node", "nics_per_node", "nic_gbit", "nic_path", "cpu", "fabric", "tuner_file",
                "nccl_version")


def fabric(text: str) -> FatTree | Dragonfly:
    """An argparse type: ``fat-tree:NODES_PER_LEAF:OVERSUBSCRIPTION[:SPINE_HOP_US]`` or
    ``dragonfly:NODES_PER_GROUP:GLOBAL_LINK_SHARE[:GLOBAL_HOP_US]``, each field checked by name."""
    kind, *fields = text.split(":")
    if kind not in FABRICS or not 2 <= len(fields) <= 3:
        raise argparse.ArgumentTypeError(f"must be {FABRIC_FORMS}; got {text!r}")
    make, names = FABRICS[kind]
    try:
        values = {names[0]: int(fields[0]) if fields[0].isascii() and fields[0].isdigit() else fields[0]}
        for name, field in zip(names[1:], fields[1:]):
            try:
                values[name] = float(field)
            except ValueError:
                raise ValueError(f"{name} must be a number; got {field!r}") from None
        return make(**values)
    except ValueError as problem:
        raise argparse.ArgumentTypeError(str(problem)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and the options of NCCL's model on ``python -m lab cluster fit``."""
    parser.add_argument(
        "--model", choices=MODELS, default="simulator",
        help="the simulator's algorithms on a fitted Network (default), or NCCL's own cost "
        "model (its tuner's closed forms: logs of 2+ nodes, any node count, seconds)")
    nccl = parser.add_argument_group("the cluster as built, for --model nccl")
    nccl.add_argument("--gpus-per-node", type=whole(1), help="default: the logs' ranks over their hosts")
    nccl.add_argument("--nics-per-node", type=whole(1), help="default: one a GPU")
    nccl.add_argument("--nic-gbit", type=checked(number, lambda v: positive(v, "nic_gbit")),
                      help="each NIC's speed, Gbit/s (required with --model nccl)")
    nccl.add_argument("--nic-path", choices=NIC_PATHS, help="a NIC's path to its GPUs, as NCCL names it "
                      "(default pxb)")
    nccl.add_argument("--cpu", choices=CPUS, help="the CPU's vendor (default intel)")
    nccl.add_argument("--fabric", type=fabric, help=f"{FABRIC_FORMS} (given as built: no log sees it)")
    nccl.add_argument(
        "--nccl-version", choices=VERSIONS,
        help="the NCCL release that ran the logs (default 2.21): its tuner picks each size's "
        "algorithm and protocol and gives the terms no log sees")
    nccl.add_argument("--tuner-file", metavar="PATH",
                      help="write NCCL's example tuner plugin's file for the --predict-hosts node counts")


def check_options(args: argparse.Namespace) -> None:
    """Refuse NCCL's options with the simulator, and what NCCL's model needs and lacks."""
    if args.model != "nccl":
        given = [name for name in NCCL_OPTIONS if getattr(args, name) is not None]
        if given:
            args.parser.error(f"argument --{given[0].replace('_', '-')}: only with --model nccl")
        return
    if args.nic_gbit is None:
        args.parser.error("argument --nic-gbit: required with --model nccl (each NIC's Gbit/s)")
    if args.tuner_file is not None:
        if not args.predict_hosts:
            args.parser.error("argument --tuner-file: needs the node counts of --predict-hosts")
        try:
            output_file(args.tuner_file, "--tuner-file")
        except ValueError as problem:
            args.parser.error(str(problem))


def _gpus_per_node(args: argparse.Namespace, logs: list[pd.DataFrame]) -> int:
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    per_node = {df.attrs["ranks"] // df.attrs["hosts"] for df in logs if df.attrs.get("hosts")}
    if len(per_node) != 1:
        args.parser.error("argument --gpus-per-node: required where the logs do not say their hosts"
                          if not per_node else f"argument --gpus-per-node: the logs have {sorted(per_node)} "
                          "ranks a host; give the cluster's")
    return per_node.pop()


def topology_of(args: argparse.Namespace, logs: list[pd.DataFrame]) -> ClusterTopology:
    """The cluster as the options state it."""
    gpus = _gpus_per_node(args, logs)
    stated = {
        name: value
        for name, value in (("nic_path", args.nic_path), ("cpu", args.cpu), ("fabric", args.fabric))
        if value is not None}
    try:
        return ClusterTopology(gpus_per_node=gpus, nics_per_node=args.nics_per_node or gpus,
                               nic_gbit=args.nic_gbit, **stated)
    except ValueError as problem:  # (each option is checked alone; together they cannot fail yet)
        args.parser.error(str(problem))


def predictions(report: NcclFitReport, logs: list[pd.DataFrame], hosts: list[int]) -> list[dict]:
    """Per collective of the logs and per node count: the predicted table at the logs' sizes."""
    collectives = list(dict.fromkeys(collective_name(df.attrs["collective"]) for df in logs))
    out = []
    for collective in collectives:
        sizes = sorted({
            int(size)
            for df in logs if collective_name(df.attrs["collective"]) == collective for size in df["bytes"]
            if size > 0})
        for nodes in hosts:
            out.append({
                "collective": collective, "hosts": nodes,
                "ranks": nodes * report.model.topology.gpus_per_node,
                "table": report.model.table(collective, nodes, sizes)})
    return out


def describe(topology: ClusterTopology) -> str:
    fabric = "none given" if topology.fabric is None else repr(topology.fabric)
    return (f"{topology.gpus_per_node} GPUs a node ({topology.intra_link}), {topology.nics_per_node} NICs "
            f"of {topology.nic_gbit:g} Gbit/s at {topology.nic_path}, cpu {topology.cpu}; "
            f"fabric (given) {fabric}")


def run(args: argparse.Namespace, logs: list[pd.DataFrame]) -> int:
    """Fit, predict, print (and write the tuner file); a log the fit refuses names the file."""
    topology = topology_of(args, logs)
    try:
        for nodes in args.predict_hosts:
            topology.nodes(nodes, "hosts")
    except ValueError as problem:
        args.parser.error(f"argument --predict-hosts: {problem}")
    try:
        report = fit(topology, logs, args.nccl_version or "2.21")
    except ValueError as problem:
        args.parser.error(refused(problem))
    predicted = predictions(report, logs, args.predict_hosts)
    if args.tuner_file is not None:
        collectives = list(dict.fromkeys(p["collective"] for p in predicted))
        tuner_file.write(args.tuner_file, tuner_file.rules(report.model, args.predict_hosts, collectives),
                         comment=f"fitted by python -m lab cluster fit --model nccl on {len(logs)} logs")
    if args.json:
        out = {
            "model": report.model.name, "topology": dataclasses.asdict(topology),
            "fabric": None if topology.fabric is None else type(topology.fabric).__name__,
            "error": report.error, "terms": report.terms.to_dict(orient="records"),
            "graphs": report.graphs.to_dict(orient="records"),
            "samples": report.samples.to_dict(orient="records"),
            "predictions": [{**p, "table": p["table"].to_dict(orient="records")}
                            for p in predicted], "tuner_file": args.tuner_file}
        print(json.dumps(finite_json(out), allow_nan=False))
        return 0
    head = (f"NCCL's cost model (NCCL {args.nccl_version or '2.21'}'s tuner, fitted to the logs) on "
            f"{describe(topology)}")
    parts = [head, report.text()]
    for p in predicted:
        title = f"Predicted {p['collective']} at {p['hosts']} nodes ({p['ranks']} ranks):"
        parts += [
            "", title,
            predicted_table(p["collective"], p["ranks"], p["table"].itertuples(index=False),
                            extra=("algorithm", "protocol", "channels"))]
    if args.tuner_file is not None:
        parts += ["", f"Wrote NCCL's example tuner file: {args.tuner_file}"]
    print("\n".join(parts))
    return 0
