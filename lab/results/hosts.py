"""``python -m lab results --hosts 4 8 --link-gbit 1``: the lesson's claims measured across hosts.

One rank per emulated host (:mod:`lab.hosts.emulated`), every host's link capped at ``G`` Gbit/s each way,
so each rank's link is its own bottleneck, as the lesson assumes. For every host count and rate:
every allreduce algorithm and gloo from 1 KB to 64 MB, an α-β fit per algorithm, the ring/tree
crossover predicted (from the fits) and measured, busbw against the cap, the CPU load of each
case, and the lesson's claims marked confirmed or refuted against the link model:

    ring, halving_doubling   2(N-1)/N · T · β      (each rank sends and receives 2T(N-1)/N)
    naive                    2(N-1) · T · β        (rank 0's link carries (N-1)·T each way)
    tree                     2·⌈log2 N⌉ · T · β    (a binomial reduce, then a broadcast: T per level)
    recursive_doubling       ⌈log2 N⌉ · T · β      (T each way per step, both directions at once)

with β = 8 / (G·10⁹) s per byte. Writes ``<out>/hosts/``: ``allreduce.csv``, ``model.csv``,
``claims.csv``, ``bytes.csv``, PNGs and ``REPORT.md`` (the section "Across hosts"), and copies
that section into ``<out>/REPORT.md`` when it exists. The sizes, call counts, cases and byte
counters here serve :mod:`lab.results.hierarchy` too.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import lab
from lab.algorithms import registry
from lab.benchmark import measure
from lab.hosts.emulated import check_link_gbit
from lab.report_sections import splice
from lab.results.fits import bandwidth_gbps, crossover, fit_medians
from lab.results.plots import across_hosts
from lab.results.report import markdown
from lab.results.sweeps import machine, save_machine, save_tables

#: 1 KB to 64 MB in powers of 4.
SIZES = [1 << k for k in range(10, 27, 2)]
#: The size whose bytes each rank counts (ring's 2T(N-1)/N claim).
PROBE_BYTES = 1 << 20
#: A case is CPU-bound, not link-bound, when the cores are this busy and the link is not full.
CPU_BOUND_BUSY = 0.9
LINK_FULL = 0.8
CROSSOVER_CLAIM = "ring overtakes tree at the α-β crossover (bytes)"


def link_model_us(algorithm: str, world: int, nbytes: int, gbit: float) -> float:
    """The link-bound time of one allreduce of ``nbytes`` (no latency term: the bytes through the
    busiest rank, from the registry's cost shape, at ``gbit``), or NaN for an impl that is not a
    lab algorithm (gloo)."""
    entry = registry.ALGORITHMS["allreduce"].get(algorithm)
    return np.nan if entry is None else entry.shape(world)[1] * nbytes * 8 / (gbit * 1e3)


def calls_for(nbytes: int) -> int:
    """Timed calls per case: fewer where each call takes seconds through a capped link."""
    return 100 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 5 if nbytes <= 4 << 20 else 3


def allreduce_cases(algorithms: list[str], sizes: list[int]) -> list[tuple[str, str, int]]:
    """(impl, algorithm, bytes): every algorithm of ``algorithms`` at every size, then gloo."""
    impls = [*(("lab", a) for a in algorithms), ("gloo", "gloo")]
    return [(impl, algorithm, nbytes) for impl, algorithm in impls for nbytes in sizes]


def bytes_sent(mesh: lab.Mesh, nbytes: int, algorithms: list[str]) -> dict[str, tuple[int, int]]:
    """In one rank: (payload bytes sent, of which to other hosts) in one allreduce of ``nbytes``,
    per algorithm (``mesh.stats()``'s counters)."""
    sent = {}
    for algorithm in algorithms:
        x = torch.ones(nbytes // 4)
        mesh.reset_stats()
        lab.allreduce(mesh, x, algorithm=algorithm)
        stats = mesh.stats()
        sent[algorithm] = (stats["bytes_sent"], stats["bytes_sent_inter_host"])
    return sent


def hosts_dir(out_dir: str) -> Path:
    """``<out_dir>/hosts/``, made if missing."""
    out = Path(out_dir) / "hosts"
    out.mkdir(parents=True, exist_ok=True)
    return out


# -- the sweep ---------------------------------------------------------------------------------------


def sweep(host_counts: list[int], gbits: list[float], sizes: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every allreduce algorithm and gloo at every size, one pool per (hosts, rate).

    Returns (one row per case, each rank's bytes sent per algorithm at :data:`PROBE_BYTES`)."""
    from tqdm import tqdm  # the plots extra, as for the figures

    algorithms = list(registry.names("allreduce"))
    cases = allreduce_cases(algorithms, sizes)
    rows, counted = [], []
    with tqdm(total=len(host_counts) * len(gbits) * len(cases), unit="case") as bar:
        for hosts, gbit in itertools.product(host_counts, gbits):
            with lab.launch(hosts, hosts=hosts, link_gbit=gbit, transport="tcp") as cluster:
                counted += [{
                    "hosts": hosts, "rank": rank, "algorithm": a, "bytes": PROBE_BYTES, "bytes_sent": s}
                            for rank, sent in enumerate(cluster.run(bytes_sent, PROBE_BYTES, algorithms))
                            for a, (s, _) in sent.items()]
                for impl, algorithm, nbytes in cases:
                    bar.set_description(f"H={hosts} {gbit:g} Gbit/s {algorithm} {nbytes >> 10} KB")
                    rows.append(measure_loaded(cluster, impl, algorithm, nbytes, hosts, gbit))
                    bar.update()
    return pd.DataFrame(rows), pd.DataFrame(counted)


def measure_loaded(cluster: Any, impl: str, algorithm: str, nbytes: int, hosts: int, gbit: float) -> dict:
    """One case's row with its setting, its link-model time and use of the link, and the CPU load:
    the share of all cores busy during it (``cpu_busy``: anything on the machine, the switch's
    forwarding included) and the share the rank processes used (``ranks_cpu``)."""
    pids = cluster.pids
    busy, total, ranks, wall = *cpu_times(), rank_cpu_seconds(pids), time.monotonic()
    row = measure(cluster, "allreduce", impl, nbytes, algorithm, calls_for(nbytes))
    busy2, total2 = cpu_times()
    ranks_cpu = (rank_cpu_seconds(pids) - ranks) / ((time.monotonic() - wall) * os.cpu_count())
    row.update(hosts=hosts, link_gbit=gbit, cpu_busy=(busy2 - busy) / max(total2 - total, 1),
               ranks_cpu=ranks_cpu, link_model_us=link_model_us(algorithm, hosts, nbytes, gbit))
    row["link_use"] = row["busbw_GBps"] * 8 / gbit
    return row


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def rank_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the rank processes have used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


# -- fits and claims ---------------------------------------------------------------------------------


def models(frame: pd.DataFrame) -> pd.DataFrame:
    """α-β per (hosts, rate, algorithm), and the ring/tree crossover predicted and measured."""
    rows = []
    for (hosts, gbit, algorithm), group in frame.groupby(["hosts", "link_gbit", "algorithm"]):
        alpha, beta, r2 = fit_medians(group)
        rows.append({
            "hosts": hosts, "link_gbit": gbit, "algorithm": algorithm, "alpha_us": alpha,
            "beta_us_per_byte": beta, "bandwidth_GBps": bandwidth_gbps(beta), "r2": r2})
    table = pd.DataFrame(rows)
    table["crossover_predicted_bytes"] = pd.NA
    table["crossover_measured_bytes"] = pd.NA
    for (hosts, gbit), fits in table.groupby(["hosts", "link_gbit"]):
        setting = (frame["hosts"] == hosts) & (frame["link_gbit"] == gbit)
        predicted, measured = crossover(fits.set_index("algorithm"), frame[setting])
        mask = (table["hosts"] == hosts) & (table["link_gbit"] == gbit)
        table.loc[mask, "crossover_predicted_bytes"] = None if np.isnan(predicted) else round(predicted)
        table.loc[mask, "crossover_measured_bytes"] = None if np.isnan(measured) else int(measured)
    return table


def claims(frame: pd.DataFrame, model: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """Each of the lesson's claims, per (hosts, rate), with the figures that confirm or refute it."""
    rows = []
    largest = int(frame["bytes"].max())
    for (hosts, gbit), data in frame.groupby(["hosts", "link_gbit"]):
        at = data[data["bytes"] == largest].set_index("algorithm")
        fits = model[(model["hosts"] == hosts) & (model["link_gbit"] == gbit)].iloc[0]
        rows += setting_claims(hosts, gbit, largest, at, fits, counted[counted["hosts"] == hosts])
    rows += growth_claims(frame[frame["bytes"] == largest])
    return pd.DataFrame(rows)


def claim_row(hosts: Any, gbit: float, claim: str, predicted: Any, measured: Any, ratio: float, verdict: str,
              note: str) -> dict:
    """One row of ``claims.csv``."""
    return {
        "hosts": hosts, "link_gbit": gbit, "claim": claim, "predicted": predicted, "measured": measured,
        "ratio": ratio, "verdict": verdict, "note": note}


def checked(hosts: Any, gbit: float, claim: str, predicted: float, measured: float,
            bounds: tuple[float, float], note: str, cpu_bound: bool = False) -> dict:
    """A claim's row: confirmed when measured / predicted lies within ``bounds``, refuted otherwise;
    a ``cpu_bound`` case is neither (the cores, not the link, set its time: rerun at a lower rate)."""
    ratio = measured / predicted if predicted else np.nan
    low, high = bounds
    verdict = ("CPU-bound: rerun at a lower --link-gbit"
               if cpu_bound else "confirmed" if low <= ratio <= high else "refuted")
    return claim_row(hosts, gbit, claim, predicted, measured, ratio, verdict, note)


def setting_claims(hosts: int, gbit: float, largest: int, at: pd.DataFrame, fits: pd.Series,
                   counted: pd.DataFrame) -> list[dict]:
    """One (hosts, rate)'s claims: ring's bytes per rank (``counted``: its ranks' counters), ring's,
    naive's and tree's time against the link model (``at``: the ``largest`` size's cases by
    algorithm), and the crossover (``fits``: any of the setting's fit rows, which all carry it)."""
    n = hosts
    cpu_bound = at["cpu_busy"].max() >= CPU_BOUND_BUSY and at.loc["ring", "link_use"] < LINK_FULL
    ring_bytes = counted[counted["algorithm"] == "ring"]
    probe = int(ring_bytes["bytes"].iloc[0])
    rows = [
        checked(hosts, gbit, "ring sends 2T(N-1)/N per rank (bytes, T = 1 MB)", 2 * probe * (n - 1) / n,
                float(ring_bytes["bytes_sent"].max()), (1.0, 1.0), "payload bytes counted by mesh.stats()")]
    for algorithm, claim in [("ring", "ring's time is 2T(N-1)/N·β: the link bound"),
                             ("naive", "naive's root link carries (N-1)·T each way: 2(N-1)·T·β"),
                             ("tree", "tree's depth is log2 N: 2·⌈log2 N⌉·T·β")]:
        rows.append(
            checked(hosts, gbit, f"{claim} (T = {largest >> 20} MB, µs)",
                    float(at.loc[algorithm, "link_model_us"]), float(at.loc[algorithm, "median_us"]),
                    (0.9, 1.5), "measured / link model within [0.9, 1.5]", cpu_bound))
    predicted, measured = fits["crossover_predicted_bytes"], fits["crossover_measured_bytes"]
    if pd.isna(predicted) or pd.isna(measured):
        rows.append(
            claim_row(hosts, gbit, CROSSOVER_CLAIM, predicted, measured, np.nan, "refuted",
                      "no crossover " + ("predicted" if pd.isna(predicted) else "measured")))
    else:
        rows.append(
            checked(hosts, gbit, CROSSOVER_CLAIM, float(predicted), float(measured), (0.25, 4.0),
                    "within one size step (x4) of the prediction", cpu_bound))
    return rows


def growth_claims(at_largest: pd.DataFrame) -> list[dict]:
    """Per rate, from the fewest hosts to the most: ring's time stays flat, naive's grows with N."""
    rows = []
    for gbit, data in at_largest.groupby("link_gbit"):
        counts = sorted(data["hosts"].unique())
        if len(counts) < 2:
            continue
        a, b = counts[0], counts[-1]
        t = data.set_index(["hosts", "algorithm"])["median_us"]
        for algorithm, claim, factor in [
            ("ring", f"ring's time stays flat from {a} to {b} hosts", (2 * (b - 1) / b) / (2 * (a - 1) / a)),
            ("naive", f"naive's time grows with N from {a} to {b} hosts", (b - 1) / (a - 1))]:
            measured = float(t[(b, algorithm)] / t[(a, algorithm)])
            rows.append(
                checked(f"{a}->{b}", gbit, claim + " (time ratio)", factor, measured, (0.75, 1.33),
                        "ratio within [0.75, 1.33]"))
    return rows


# -- the report ----------------------------------------------------------------------------------------


def report(frame: pd.DataFrame, model: pd.DataFrame, verdicts: pd.DataFrame, info: dict) -> str:
    """The section "Across hosts": the claims, busbw at the largest size, the fits and crossovers."""
    largest = int(frame["bytes"].max())
    big = frame[frame["bytes"] == largest][[
        "hosts", "link_gbit", "algorithm", "median_us", "busbw_GBps", "link_use", "link_model_us", "cpu_busy",
        "ranks_cpu"]]
    fits = model[[
        "hosts", "link_gbit", "algorithm", "alpha_us", "bandwidth_GBps", "r2", "crossover_predicted_bytes",
        "crossover_measured_bytes"]]
    confirmed = int((verdicts["verdict"] == "confirmed").sum())
    return "\n".join([
        "## Across hosts", "",
        "One rank per emulated host: a network namespace each, one software switch, every host's link capped by a "
        "token bucket in each direction (`lab.launch(N, hosts=N, link_gbit=G, transport=\"tcp\")`). Each rank's link "
        "is its own bottleneck, as the lesson assumes; ranks still share this machine's cores, so the CPU load of "
        f"every case is recorded. Machine: {info['cpu']}, {info['cores']} cores; commit {info['commit']}; "
        f"{info['date']}. Timings are medians of the slowest rank; they are noisy (a shared machine).", "",
        f"### The lesson's claims: {confirmed} of {len(verdicts)} confirmed", "",
        "The link model: β = 8/G ns per byte; ring and halving-doubling 2(N-1)/N·T·β, naive 2(N-1)·T·β, "
        "tree 2·⌈log2 N⌉·T·β, recursive doubling ⌈log2 N⌉·T·β (`claims.csv`). A case where the cores were "
        f"≥ {CPU_BOUND_BUSY:.0%} busy and the ring used < {LINK_FULL:.0%} of the link is CPU-bound, not a link "
        "result, and is marked so.", "",
        markdown(verdicts), "", f"### {largest >> 20} MB: busbw against the link cap", "",
        "`link_use` is busbw (allreduce: algbw·2(N-1)/N) over the cap: 1.0 is a full link; "
        "`cpu_busy` the share of all cores busy during the case (anything running on the machine, the "
        "switch's packet forwarding included), `ranks_cpu` the share the rank processes used.", "",
        markdown(big), "", "### α-β fits and the ring/tree crossover", "",
        "t(n) = α + β·n fitted per algorithm (`model.csv`); the predicted crossover is where the ring and tree "
        "lines meet, the measured one the smallest size where ring's median beat tree's.", "",
        markdown(fits), "", "![latency](allreduce_latency.png)", "", "![busbw](allreduce_busbw.png)", "",
        "Regenerate: `python -m lab results --hosts 4 8 --link-gbit 1` (add `--link-gbit 0.5` where the CPU binds).",
        ""])


def main(out_dir: str, host_counts: list[int], gbits: list[float], sizes: list[int] | None = None) -> int:
    """``python -m lab results --hosts 4 8 --link-gbit 1``: writes ``<out>/hosts/`` and the section
    "Across hosts" into ``<out>/REPORT.md``."""
    for gbit in gbits:  # every rate before the first pool: a bad one is an error now, not after a sweep
        check_link_gbit(gbit)
    sizes = sizes or SIZES
    out = hosts_dir(out_dir)
    info = machine()
    print(f"Across hosts: {host_counts} hosts x {gbits} Gbit/s, {len(sizes)} sizes", file=sys.stderr)
    started = time.monotonic()
    frame, counted = sweep(host_counts, gbits, sizes)
    model = models(frame)
    verdicts = claims(frame, model, counted)
    save_tables(out, {"allreduce": frame, "model": model, "claims": verdicts, "bytes": counted})
    save_machine(out, info)
    across_hosts(out, frame, model)
    section = report(frame, model, verdicts, info)
    (out / "REPORT.md").write_text(section)
    splice(Path(out_dir) / "REPORT.md", section.replace("](allreduce_", "](hosts/allreduce_"), "across-hosts")
    print(f"Wrote {out}/ in {time.monotonic() - started:.0f} s: "
          f"{int((verdicts['verdict'] == 'confirmed').sum())} of {len(verdicts)} claims confirmed")
    return 0
