"""``python -m lab cluster fit``: fit a cluster to its own nccl-tests logs, predict it at more hosts.

    python -m lab cluster fit 1host.log 2hosts.log --predict-hosts 4 8 16
    python -m lab cluster fit 1host.log 2hosts.log --nics-per-host 8 --oversubscription 2 --json
    python -m lab cluster fit n1.out n2.out --collective allgather   # logs that do not say which
    python -m lab cluster fit n2.log n8.log --model nccl --nic-gbit 200 --predict-hosts 256 540  # NCCL's

Prints the fitted terms (and which logs determine each), the fit's error per log and size band,
and per host count an nccl-tests table predicted there, in nccl-tests' text (its columns, the
predicted time, algbw and busbw out of place; the algorithm chosen last:
:func:`lab.perf.table.predicted`, which :func:`lab.sim.read_nccl_tests` reads back); ``--json``
prints one JSON object instead (valid JSON: a rate with no time, at one rank,
is null). The NICs, the fabric inside a host and the switch tier are the cluster as built: logs of
one or two hosts cannot tell them apart. A bad input (a log that cannot be read or fitted, a term
out of range, a host count past what the simulator takes) is one line naming the option or the
file, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pandas as pd

from lab.command_line import finite_json, refused, whole
from lab.perf.table import predicted
from lab.sim.cluster import FitReport, check_predictable, fit_cluster_report, predict_table
from lab.sim.cluster_cases import widest_ranks_per_host
from lab.sim.limits import MAX_WORLD_SIZE, SimulationUnsupported
from lab.sim.logs import COLLECTIVES, read_nccl_tests
from lab.sim.nccl import cli as nccl_cli
from lab.sim.network import Network, network_term


def _built(args: argparse.Namespace) -> Network:
    """The cluster as built, from the options (the terms the fit does not set)."""
    return Network(nics_per_host=args.nics_per_host, intra_fabric="bus" if args.bus else "switch",
                   oversubscription=args.oversubscription, hosts_per_leaf=args.hosts_per_leaf)


def _sizes(logs: list[pd.DataFrame], collective: str) -> list[int]:
    """Every size the logs of ``collective`` measured, smallest first."""
    return sorted({int(size) for df in logs if df.attrs["collective"] == collective for size in df["bytes"]})


def predictions(report: FitReport, logs: list[pd.DataFrame], hosts: list[int]) -> list[dict]:
    """Per collective of the logs and per host count: the predicted nccl-tests table."""
    collectives = list(dict.fromkeys(df.attrs["collective"] for df in logs))
    return [{
        "collective": collective, "hosts": count, "ranks": count * report.network.ranks_per_host,
        "table": predict_table(report.network, collective, count, _sizes(logs, collective))}
            for collective in collectives for count in hosts]


def as_json(report: FitReport, predicted: list[dict]) -> dict:
    """The fit and the predictions as one JSON-ready object."""
    return {
        "network": dataclasses.asdict(report.network), "describe": report.network.describe(),
        "error": report.error, "terms": report.terms.to_dict(orient="records"),
        "bands": report.bands.astype({"band": str}).to_dict(orient="records"),
        "cases": report.cases.to_dict(orient="records"),
        "predictions": [{**p, "table": p["table"].to_dict(orient="records")} for p in predicted]}


def _name(log: str) -> str:
    return Path(log).name


def _terms_text(report: FitReport) -> str:
    """One line per term: its value, the logs that determine it, and each log's rise at ±20 %."""
    lines = [f"  {'term':<22} {'value':>10}   determined by; ±20 % raises a log's mean |log error| by"]
    for row in report.terms.itertuples(index=False):
        if not row.fitted:
            why = "given: no log sees it"
        else:
            rises = ", ".join(f"{_name(log)} {rise:.3f}" for log, rise in row.rise.items())
            why = f"{', '.join(map(_name, row.determined_by)) or 'no log alone'}; {rises}"
        lines.append(f"  {row.meaning:<22} {row.value:>10.4g}   {why}")
    return "\n".join(lines)


def nccl_table(table: pd.DataFrame, collective: str, ranks: int) -> str:
    """A predicted table as nccl-tests prints a run (:func:`lab.perf.table.predicted`: the lab's
    one writer of that text), the algorithm in a column of its own."""
    return predicted(collective, ranks, table.itertuples(index=False))


def text(report: FitReport, predicted: list[dict]) -> str:
    """The fit and the predictions as the command prints them."""
    percent = "{:.1%}".format
    bands = report.bands.assign(log=report.bands["log"].map(_name),
                                mean_error=report.bands["mean_error"].map(percent),
                                max_error=report.bands["max_error"].map(percent))
    parts = [
        f"Fitted network: {report.network.describe()}",
        f"Mean |log(predicted / measured)| over {len(report.cases)} rows: {report.error:.4f}\n", "Terms:",
        _terms_text(report), "", "Fit error per log and size band (|predicted / measured - 1|):",
        bands.to_string(index=False)]
    for p in predicted:
        title = f"Predicted {p['collective']} at {p['hosts']} hosts ({p['ranks']} ranks):"
        parts += ["", title, nccl_table(p["table"], p["collective"], p["ranks"])]
    return "\n".join(parts)


def check_hosts(network: Network, logs: list[pd.DataFrame], hosts: list[int]) -> None:
    """Refuse, before the fit, a host count the simulator cannot predict the logs' collectives at
    (its ranks, or a recording too large at the largest size, where the most steps are), from its
    estimates alone: the fit takes tens of seconds, these milliseconds."""
    network = dataclasses.replace(network, ranks_per_host=widest_ranks_per_host(logs))
    for collective in dict.fromkeys(df.attrs["collective"] for df in logs):
        for count in hosts:
            check_predictable(network, collective, hosts=count, nbytes=_sizes(logs, collective)[-1])


def run(args: argparse.Namespace) -> int:
    nccl_cli.check_options(args)
    try:  # an unreadable log, a log without hosts: a usage error naming the file
        logs = [read_nccl_tests(path, args.collective) for path in args.logs]
        widest_ranks_per_host(logs)  # (checks each log's collective, ranks and hosts)
    except (OSError, ValueError) as exc:
        args.parser.error(refused(exc))
    if args.model == "nccl":  # NCCL's closed forms (lab.sim.nccl.cli)
        return nccl_cli.run(args, logs)
    try:  # a host count past the simulator's limits (its ranks, or a recording too large)
        check_hosts(_built(args), logs, args.predict_hosts)
    except (ValueError, SimulationUnsupported) as exc:
        args.parser.error(f"argument --predict-hosts: {exc}")
    try:  # a log that cannot be fitted: a usage error naming the file
        report = fit_cluster_report(logs, _built(args))
    except ValueError as exc:
        args.parser.error(refused(exc))
    try:  # a smaller size past the limits, where the largest was not
        predicted = predictions(report, logs, args.predict_hosts)
    except (ValueError, SimulationUnsupported) as exc:
        args.parser.error(f"argument --predict-hosts: {exc}")
    print(
        json.dumps(finite_json(as_json(report, predicted)), allow_nan=False) if args.
        json else text(report, predicted))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``python -m lab cluster fit LOG... [--predict-hosts H...] [--json]`` and the cluster as built."""
    parser = commands.add_parser("cluster", help="fit a cluster to its logs; predict more hosts")
    actions = parser.add_subparsers(dest="action", required=True)
    fit = actions.add_parser("fit", help="fit the network's terms to nccl-tests logs; predict H hosts")
    fit.add_argument("logs", nargs="+", help="nccl-tests logs (all_reduce_perf, ...), of 1 or 2 hosts say")
    fit.add_argument(
        "--collective", choices=COLLECTIVES,
        help="the collective every log measured (default: what each log, its file's name or its "
        "numbers say)")
    fit.add_argument("--predict-hosts", type=whole(1, MAX_WORLD_SIZE), nargs="+", default=[], metavar="H",
                     help="host counts to predict an nccl-tests table at")
    fit.add_argument("--nics-per-host", type=network_term("nics_per_host", whole(1)), default=1,
                     help="NICs per host (ranks per host: rails)")
    fit.add_argument("--bus", action="store_true", help="a host's ranks share one bus (default: a switch)")
    fit.add_argument("--oversubscription", type=network_term("oversubscription"), default=1.0,
                     help="the switch tier's (default 1)")
    fit.add_argument("--hosts-per-leaf", type=network_term("hosts_per_leaf", whole(1)), default=1,
                     help="hosts under one leaf switch (default 1)")
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    nccl_cli.add_arguments(fit)
    fit.set_defaults(run=run, parser=fit)
