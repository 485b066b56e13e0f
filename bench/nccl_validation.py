"""NCCL's cost model fitted on ALCF Polaris' 2- and 8-node nccl-tests logs, predicted at 256 and 540
nodes, per size band, beside NCCL's own estimate (its shipped constants on the nominal graph).

    python bench/nccl_validation.py                       # writes results/cluster/nccl/, prints the bands
    python bench/nccl_validation.py --out /tmp/nccl --no-fabric
    python bench/nccl_validation.py --set polaris-nccl-2.18   # NCCL 2.18: fit 2 and 8, predict 128 and 540

The logs (``tests/data/clusters/polaris-nccl-2.21/``, SOURCE.md names their source) are
all_reduce_perf and all_gather_perf, 4 B to 1 GiB. The fit sees the 2- and 8-node logs of both
collectives; the 256- and 540-node logs are only compared against. ``--set polaris-nccl-2.18`` is
the same cluster under NCCL 2.18 (``tests/data/clusters/polaris-nccl-2.18/``), predicted at 128
nodes (all_gather only: the all_reduce run failed to start) and 540, into ``--out``'s ``2.18/``,
with NCCL 2.18's tuner (its constants where they differ from 2.21's) picking and estimating.
Polaris as built is ``lab.sim.nccl.known.POLARIS`` (its dragonfly given; ``--no-fabric`` leaves it
out). Error is ``predicted / measured - 1`` of the out-of-place time. Writes into ``--out``:
``fit.csv`` (every term, its value, source, the rows that fixed it), ``cases.csv`` (every size of the 256- and
540-node logs: measured, fitted and NCCL's estimate), ``bands.csv`` (per node count and band: the
share within the target, the mean and worst error of each), ``knees.csv`` (the fit logs' knees
against the tuner's switch points) and ``nccl_tuner.conf`` (the example tuner plugin's file for
256 and 540 nodes, the fitted model's fastest pairs); prints the band table as markdown.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from lab.sim.logs import read_nccl_tests
from lab.sim.nccl import fit, shipped, tuner_file, validation
from lab.sim.nccl.known import POLARIS

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "clusters"
#: Each set's logs: the node counts fitted, those predicted, and the NCCL release that ran them.
SETS = {"polaris-nccl-2.21": ((2, 8), (256, 540), "2.21"), "polaris-nccl-2.18": ((2, 8), (128, 540), "2.18")}
COLLECTIVES = {"allreduce": "all_reduce", "allgather": "all_gather"}


def logs(nodes: tuple[int, ...], folder: Path = DATA / "polaris-nccl-2.21") -> list[pd.DataFrame]:
    """The set's logs at ``nodes`` (a node count a collective has no log of is left out)."""
    paths = [
        (folder / f"n{n}_{name}.log", collective) for n in nodes for collective, name in COLLECTIVES.items()]
    return [read_nccl_tests(path, collective=collective) for path, collective in paths if path.exists()]


def markdown(bands: pd.DataFrame) -> str:
    """The band table: per node count and band, the target and each model's share within it, mean
    |error| and worst error."""
    lines = [
        "| nodes | band (target) | fitted: within, mean (worst) | NCCL's estimate: within, mean (worst) "
        "|", "|---|---|---|---|"]
    for row in bands.itertuples():
        cells = []
        for label in ("fitted", "nccl"):
            within = getattr(row, f"{label}_within")
            share = "" if pd.isna(within) else f"{within:.0%}, "
            mean, worst = getattr(row, f"{label}_mean"), getattr(row, f"{label}_worst")
            cells.append(f"{share}{mean:.0%} ({worst:+.0%})")
        verdict = "" if row.met is None else (": meets" if row.met else ": misses")
        lines.append(f"| {row.nodes} | {row.band} ({row.target}) | {cells[0]}{verdict} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cluster" / "nccl")
    parser.add_argument("--no-fabric", action="store_true", help="Polaris without its given dragonfly")
    parser.add_argument("--set", choices=SETS, default="polaris-nccl-2.21", help="which logs")
    args = parser.parse_args(argv)
    fit_nodes, predicted_nodes, version = SETS[args.set]
    folder = DATA / args.set
    if not args.out.parent.is_dir():
        parser.error(f"--out: {args.out.parent} is not a folder")
    if args.set != "polaris-nccl-2.21":
        args.out = args.out / args.set.rsplit("-", 1)[1]
    topology = replace(POLARIS, fabric=None) if args.no_fabric else POLARIS
    start = time.perf_counter()
    report = fit(topology, logs(fit_nodes, folder), version)
    cases = validation.cases(report.model, shipped(topology, version=version), logs(predicted_nodes, folder))
    bands = validation.bands(cases)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    report.terms.to_csv(args.out / "fit.csv", index=False)
    cases.to_csv(args.out / "cases.csv", index=False)
    bands.to_csv(args.out / "bands.csv", index=False)
    report.knees.to_csv(args.out / "knees.csv", index=False)
    tuner_file.write(args.out / "nccl_tuner.conf", tuner_file.rules(report.model, predicted_nodes),
                     comment=f"ALCF Polaris ({args.set}), fitted on 2 and 8 nodes: bench/nccl_validation.py")
    print(f"fit on {len(report.samples)} sizes (mean |error| {report.error:.1%}), "
          f"{len(cases)} sizes predicted, {seconds:.2f} s\n")
    print(markdown(bands))


if __name__ == "__main__":
    main()
