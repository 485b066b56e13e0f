"""How well a cluster fitted to its 1-2 host nccl-tests logs predicts more hosts: the lab's emulated
hosts (fit 2, predict 4 and 8) and a public H100 cluster's logs (fit 1-2 nodes, predict 10).

    sudo python bench/cluster_validation.py                       # writes results/cluster/
    sudo python bench/cluster_validation.py -e 16M -f 4 --out /tmp/cluster

**Emulated hosts.** For each collective (default allreduce), ``python -m lab perf`` runs the lab's
own algorithm (``--algorithm``, default ring) on 2, 4 and 8 emulated hosts, one rank a host, each
host's link capped at ``--link-gbit`` (default 1 Gbit/s each way), and its nccl-tests table is
kept as a log. One rank a host, because the 8 ranks of 8 hosts already share this machine's
cores: a second rank a host would double the CPU work per link without loading the links more,
and the links are what the model is about. (One host of one rank runs no collective, so the fit
has the 2-host log alone.) ``lab.sim.fit_cluster_report`` fits that log with the algorithm the
runs used as its only candidate, and ``lab.sim.predict`` predicts every size of the 4- and 8-host
logs with it, so the comparison is the model's, not a choice between algorithms. Two fits of
the same log: its α and bandwidth (the default, what a cluster's user gets), and the hosts as
built: the link's bandwidth the cap, no wire latency, every rank on this machine's cores, and
the CPU work per message and per byte fitted (``terms=``), which 8 ranks on 2 cores wait on.

**Public logs** (``tests/data/logs/public/``, its README names the source): all-to-all on a
cluster of H100 nodes, fitted on its 2-node log (1 GPU a node) or its 1- and 2-node logs (8 GPUs
a node, 8 NICs a node given) and predicted at the 10-node run of the same nodes, with the lab's
pairwise all-to-all (NCCL's all-to-all also sends each peer its block directly).

The error of a size is ``predicted / measured - 1`` of the out-of-place time (the time the fit
sees). Targets per size band: up to 64 KiB within 2x, 1-32 MiB within 35 %, from 64 MiB within
15 %. Writes into ``--out``: the emulated hosts' logs (``all_reduce_ring_4hosts.log``, ...),
``cases.csv`` (source, collective, ranks a host, hosts, size, role, measured_us, predicted_us,
error, band), ``bands.csv`` (per source, collective, hosts and band: the mean and worst error, the
target, met or not), ``fit.csv`` (the fitted terms) and ``machine.json`` (the machine, versions,
each run's command, seconds and the load average around it); prints the band table as markdown.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

import lab.sim
from lab.perf import PROGRAMS
from lab.results.sweeps import machine, save_machine
from lab.sim.cluster import BANDS, band_of
from lab.sim.network import MAX_RANKS_PER_HOST

#: Per size band, the (lowest, highest) predicted / measured that meets the target; None: no target.
TARGETS = {
    "up to 64 KiB": (0.5, 2.0), "64 KiB-1 MiB": None, "1-32 MiB": (0.65, 1.35), "from 64 MiB": (0.85, 1.15)}
FIT_HOSTS, PREDICTED_HOSTS = 2, (4, 8)
EMULATED = {
    "emulated hosts, α-β fitted": None,
    "emulated hosts as built, CPU fitted": ["recv_overhead_us", "copy_us_per_byte"]}
PUBLIC_LOGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "logs" / "public"


@dataclass(frozen=True)
class Validation:
    """Logs to fit and logs to predict, of one cluster and collective, and how the model sees them."""

    source: str
    fit: list[pd.DataFrame]
    predicted: list[pd.DataFrame]
    network: lab.sim.Network  # the cluster as built: what the logs cannot tell
    algorithm: str  # the one candidate, in the fit and in the predictions
    terms: list[str] | None = None  # the terms fitted (None: the link terms the logs see)


#: The public excerpts: (source, fitted logs, predicted logs, the cluster as built).
PUBLIC = [("H100 nodes, 1 GPU a node", ["alltoall_h100_2nodes_1gpu.log"], ["alltoall_h100_10nodes_1gpu.log"],
           lab.sim.Network()),
          ("H100 nodes, 8 GPUs a node", ["alltoall_h100_1node_8gpus.log", "alltoall_h100_2nodes_8gpus.log"],
           ["alltoall_h100_10nodes_8gpus.log"], lab.sim.Network(nics_per_host=8))]


def perf_command(collective: str, hosts: int, args: argparse.Namespace) -> list[str]:
    """``python -m lab perf`` for ``collective`` on ``hosts`` emulated hosts of one rank each."""
    return [
        sys.executable, "-m", "lab", "perf", collective, "-b", args.minbytes, "-e", args.maxbytes, "-f",
        str(args.stepfactor), "-n",
        str(args.iters), "-w",
        str(args.warmup_iters), "--ranks",
        str(hosts), "--hosts",
        str(hosts), "--link-gbit", f"{args.link_gbit:g}", "--algorithm", args.algorithm]


def run_perf(collective: str, hosts: int, args: argparse.Namespace, out: Path) -> tuple[pd.DataFrame, dict]:
    """Run perf and keep its table as a log: the log read back, and what the run was (command,
    seconds, the 1-minute load average before and after)."""
    command = perf_command(collective, hosts, args)
    path = out / f"{PROGRAMS[collective].removesuffix('_perf')}_{args.algorithm}_{hosts}hosts.log"
    load_before, started = os.getloadavg()[0], time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed ({done.returncode}):\n{done.stderr}")
    path.write_text(done.stdout)
    run = {
        "command": " ".join(["python", *command[1:]]), "log": path.name, "seconds": round(seconds, 1),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    print(f"{run['command']}: {seconds:.0f} s, load {run['load_before']} -> {run['load_after']}", flush=True)
    return lab.sim.read_nccl_tests(path), run


def predicted_cases(network: lab.sim.Network, log: pd.DataFrame, algorithm: str) -> pd.DataFrame:
    """Every size of ``log`` predicted on ``network`` at the log's hosts and ranks a host, ``algorithm`` alone."""
    collective, hosts, per_host = log.attrs["collective"], log.attrs[
        "hosts"], log.attrs["ranks"] // log.attrs["hosts"]
    predicted = [
        lab.sim.predict(network, collective, hosts=hosts, nbytes=int(size), ranks_per_host=per_host,
                        candidates=[algorithm]).time_us for size in log["bytes"]]
    return pd.DataFrame({
        "collective": collective, "ranks_per_host": per_host, "hosts": hosts,
        "size": log["bytes"].astype(int), "role": "predicted", "measured_us": log["oop_time_us"],
        "predicted_us": predicted})


def validate(case: Validation) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fit ``case.fit``, predict ``case.predicted``: every case (the fit's own rows too, role
    "fit") and the fitted terms."""
    report = lab.sim.fit_cluster_report(case.fit, case.network, candidates=[case.algorithm], terms=case.terms)
    fitted = report.cases.rename(columns={"bytes": "size"}).assign(
        ranks_per_host=lambda f: f["ranks"] // f["hosts"], role="fit")
    columns = ["collective", "ranks_per_host", "hosts", "size", "role", "measured_us", "predicted_us"]
    cases = pd.concat(
        [fitted[columns], *(predicted_cases(report.network, log, case.algorithm) for log in case.predicted)],
        ignore_index=True)
    cases.insert(0, "source", case.source)
    cases["error"] = cases["predicted_us"] / cases["measured_us"] - 1
    cases["band"] = [band_of(int(size)) for size in cases["size"]]
    terms = report.terms[["term", "meaning", "value",
                          "fitted"]].assign(source=case.source, collective=case.fit[0].attrs["collective"],
                                            fit_error=report.error)
    return cases, terms


def band_table(cases: pd.DataFrame) -> pd.DataFrame:
    """Per source, collective, ranks a host, hosts and size band: the cases, the mean |error|, the
    worst error (the one farthest from 0), the target and whether every case in the band meets it."""
    rows = []
    keys = ["source", "collective", "ranks_per_host", "hosts", "role"]
    for key, group in cases.groupby(keys, sort=False):
        for band, _ in BANDS:
            errors = group.loc[group["band"] == band, "error"]
            if errors.empty:
                continue
            target, ratios = TARGETS[band], errors + 1
            meets = None if target is None else bool(((ratios >= target[0]) & (ratios <= target[1])).all())
            rows.append({
                **dict(zip(keys, key)), "band": band, "cases": len(errors),
                "mean_abs_error": float(errors.abs().mean()),
                "worst_error": float(errors.loc[errors.abs().idxmax()]),
                "target": "" if target is None else target_text(target), "meets": meets})
    return pd.DataFrame(rows)


def target_text(target: tuple[float, float]) -> str:
    """``within 2x`` for (0.5, 2), ``within 15%`` for (0.85, 1.15)."""
    low, high = target
    return f"within {high:g}x" if abs(low * high - 1) < 1e-9 else f"within {high - 1:.0%}"


def markdown(bands: pd.DataFrame) -> str:
    """The band table as markdown: one line per source, collective, host count and band."""
    title = "| source | collective | ranks a host | hosts | | band | sizes | mean \\|error\\| | worst error | target |"
    lines = [title, "| --- " * 10 + "|"]
    for row in bands.itertuples():
        verdict = "" if row.meets is None else f": {'meets' if row.meets else 'misses'}"
        lines.append(f"| {row.source} | {row.collective} | {row.ranks_per_host} | {row.hosts} | {row.role} | "
                     f"{row.band} | {row.cases} | {row.mean_abs_error:.1%} | {row.worst_error:+.1%} | "
                     f"{row.target}{verdict} |")
    return "\n".join(lines)


def emulated(args: argparse.Namespace, out: Path) -> tuple[list[Validation], list[dict]]:
    """Every collective measured on 2, 4 and 8 emulated hosts: what to validate (each of
    :data:`EMULATED`'s fits), and the runs."""
    as_built = lab.sim.Network(alpha_us=0.0, gbit=args.link_gbit, cores=os.cpu_count() or 1,
                               ranks_per_cpu=MAX_RANKS_PER_HOST)
    validations, runs = [], []
    for collective in args.collectives:
        logs = {}
        for hosts in (FIT_HOSTS, *PREDICTED_HOSTS):
            logs[hosts], run = run_perf(collective, hosts, args, out)
            runs.append(run)
        validations += [
            Validation(source, [logs[FIT_HOSTS]], [logs[h] for h in PREDICTED_HOSTS],
                       lab.sim.Network() if terms is None else as_built, args.algorithm, terms)
            for source, terms in EMULATED.items()]
    return validations, runs


def public() -> list[Validation]:
    """The public excerpts, fitted and predicted with the lab's pairwise all-to-all."""
    def read(names: list[str]) -> list[pd.DataFrame]:
        return [lab.sim.read_nccl_tests(PUBLIC_LOGS / name) for name in names]

    return [
        Validation(source, read(fit), read(predicted), network, "pairwise")
        for source, fit, predicted, network in PUBLIC]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", nargs="+", default=["allreduce"], choices=sorted(PROGRAMS))
    parser.add_argument("--algorithm", default="ring",
                        help="the algorithm every run uses and the model predicts")
    parser.add_argument("-b", "--minbytes", default="1K")
    parser.add_argument("-e", "--maxbytes", default="128M")
    parser.add_argument("-f", "--stepfactor", type=int, default=2)
    parser.add_argument("-n", "--iters", type=int, default=10, help="timed calls per size")
    parser.add_argument("-w", "--warmup_iters", type=int, default=3, help="untimed calls per size")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="each emulated host's link, each way")
    parser.add_argument("--out", default="results/cluster")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info, started = machine(), time.monotonic()
    validations, runs = emulated(args, out)
    results = [validate(v) for v in [*validations, *public()]]
    cases = pd.concat([c for c, _ in results], ignore_index=True)
    terms = pd.concat([t for _, t in results], ignore_index=True)
    bands = band_table(cases)
    cases.to_csv(out / "cases.csv", index=False, float_format="%.6g")
    bands.to_csv(out / "bands.csv", index=False, float_format="%.6g")
    terms.to_csv(out / "fit.csv", index=False, float_format="%.6g")
    save_machine(
        out, {
            **info, "command": " ".join(["python", *sys.argv]), "seconds": round(time.monotonic() - started),
            "load_average_end": [round(x, 2) for x in os.getloadavg()], "runs": runs})
    for (source, collective), group in terms[terms["fitted"]].groupby(["source", "collective"], sort=False):
        print(f"{source}, {collective}: fitted " + ", ".join(f"{row.term} {row.value:.4g}"
                                                             for row in group.itertuples()))
    print(f"\n{markdown(bands)}")


if __name__ == "__main__":
    main()
