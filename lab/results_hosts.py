"""``python -m lab results --hosts 4 8 --link-gbit 1``: the lesson's claims measured across hosts.

One rank per emulated host (:mod:`lab.hosts`), every host's link capped at ``G`` Gbit/s each way,
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
that section into ``<out>/REPORT.md`` when it exists.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import lab
from lab import collectives
from lab.benchmark import measure
from lab.report import splice

#: 1 KB to 64 MB in powers of 4.
SIZES = [1 << k for k in range(10, 27, 2)]
#: A case is CPU-bound, not link-bound, when the cores are this busy and the link is not full.
CPU_BOUND_BUSY = 0.9
LINK_FULL = 0.8


def link_model_us(algorithm: str, world: int, nbytes: int, gbit: float) -> float:
    """The link-bound time of one allreduce of ``nbytes`` (no latency term), or NaN if unmodelled."""
    n, levels = world, math.ceil(math.log2(world)) if world > 1 else 0
    factor = {"ring": 2 * (n - 1) / n, "halving_doubling": 2 * (n - 1) / n, "naive": 2 * (n - 1),
              "tree": 2 * levels, "recursive_doubling": levels}.get(algorithm)
    return np.nan if factor is None else factor * nbytes * 8 / (gbit * 1e3)


def calls_for(nbytes: int) -> int:
    """Timed calls per case: fewer where each call takes seconds through a capped link."""
    return 100 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 5 if nbytes <= 4 << 20 else 3


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _rank_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the rank processes have used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _bytes_per_algorithm(mesh: lab.Mesh, nbytes: int, algorithms: list[str]) -> dict[str, int]:
    """Payload bytes this rank sends in one allreduce of ``nbytes`` per algorithm."""
    sent = {}
    for algorithm in algorithms:
        x = torch.ones(nbytes // 4)
        mesh.reset_stats()
        lab.allreduce(mesh, x, algorithm=algorithm)
        sent[algorithm] = mesh.stats()["bytes_sent"]
    return sent


def sweep(host_counts: list[int], gbits: list[float], sizes: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every allreduce algorithm and gloo at every size, one pool per (hosts, rate)."""
    from tqdm import tqdm

    algorithms = list(collectives.ALLREDUCE_ALGORITHMS)
    impls = [("lab", a) for a in algorithms] + [("gloo", "gloo")]
    rows, counted = [], []
    with tqdm(total=len(host_counts) * len(gbits) * len(impls) * len(sizes), unit="case") as bar:
        for hosts in host_counts:
            for gbit in gbits:
                with lab.launch(hosts, hosts=hosts, link_gbit=gbit, transport="tcp") as cluster:
                    probe = 1 << 20
                    for rank, sent in enumerate(cluster.run(_bytes_per_algorithm, probe, algorithms)):
                        counted += [{"hosts": hosts, "rank": rank, "algorithm": a, "bytes": probe, "bytes_sent": s}
                                    for a, s in sent.items()]
                    for impl, algorithm in impls:
                        for nbytes in sizes:
                            bar.set_description(f"H={hosts} {gbit:g} Gbit/s {algorithm} {nbytes >> 10} KB")
                            pids = cluster.pids
                            busy, total, ranks, wall = *_cpu_times(), _rank_cpu_seconds(pids), time.monotonic()
                            row = measure(cluster, "allreduce", impl, nbytes, algorithm, calls_for(nbytes))
                            busy2, total2 = _cpu_times()
                            ranks_cpu = (_rank_cpu_seconds(pids) - ranks) / ((time.monotonic() - wall) * os.cpu_count())
                            row.update(hosts=hosts, link_gbit=gbit, cpu_busy=(busy2 - busy) / max(total2 - total, 1),
                                       ranks_cpu=ranks_cpu,
                                       link_model_us=link_model_us(algorithm, hosts, nbytes, gbit))
                            row["link_use"] = row["busbw_GBps"] * 8 / gbit
                            rows.append(row)
                            bar.update()
    return pd.DataFrame(rows), pd.DataFrame(counted)


def models(frame: pd.DataFrame) -> pd.DataFrame:
    """α-β per (hosts, rate, algorithm), and the ring/tree crossover predicted and measured."""
    from lab.results import fit_alpha_beta

    rows = []
    for (hosts, gbit, algorithm), group in frame.groupby(["hosts", "link_gbit", "algorithm"]):
        group = group.sort_values("bytes")
        alpha, beta, r2 = fit_alpha_beta(group["bytes"].to_numpy(float), group["median_us"].to_numpy(float))
        rows.append({"hosts": hosts, "link_gbit": gbit, "algorithm": algorithm, "alpha_us": alpha,
                     "beta_us_per_byte": beta, "bandwidth_GBps": 1 / beta / 1e3 if beta > 0 else math.inf, "r2": r2})
    table = pd.DataFrame(rows)
    table["crossover_predicted_bytes"] = pd.NA
    table["crossover_measured_bytes"] = pd.NA
    for (hosts, gbit), fits in table.groupby(["hosts", "link_gbit"]):
        fits = fits.set_index("algorithm")
        ring, tree = fits.loc["ring"], fits.loc["tree"]
        predicted = np.nan
        if tree["beta_us_per_byte"] > ring["beta_us_per_byte"]:
            predicted = max((ring["alpha_us"] - tree["alpha_us"]) / (tree["beta_us_per_byte"] - ring["beta_us_per_byte"]), 0)
        data = frame[(frame["hosts"] == hosts) & (frame["link_gbit"] == gbit)]
        medians = data.pivot(index="bytes", columns="algorithm", values="median_us")
        wins = medians.index[medians["ring"] < medians["tree"]]
        mask = (table["hosts"] == hosts) & (table["link_gbit"] == gbit)
        table.loc[mask, "crossover_predicted_bytes"] = None if np.isnan(predicted) else round(predicted)
        table.loc[mask, "crossover_measured_bytes"] = int(wins.min()) if len(wins) else None
    return table


def _verdict(ratio: float, low: float, high: float) -> str:
    return "confirmed" if low <= ratio <= high else "refuted"


def claims(frame: pd.DataFrame, model: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """Each of the lesson's claims, per (hosts, rate), with the figures that confirm or refute it."""
    rows = []
    largest = int(frame["bytes"].max())
    for (hosts, gbit), data in frame.groupby(["hosts", "link_gbit"]):
        at = data[data["bytes"] == largest].set_index("algorithm")
        n = hosts

        def add(claim: str, predicted: float, measured: float, low: float, high: float, note: str = "",
                timed: bool = True) -> None:
            ratio = measured / predicted if predicted else np.nan
            bound = timed and at["cpu_busy"].max() >= CPU_BOUND_BUSY and at.loc["ring", "link_use"] < LINK_FULL
            verdict = "CPU-bound: rerun at a lower --link-gbit" if bound else _verdict(ratio, low, high)
            rows.append({"hosts": hosts, "link_gbit": gbit, "claim": claim, "predicted": predicted,
                         "measured": measured, "ratio": ratio, "verdict": verdict, "note": note})

        ring_bytes = counted[(counted["hosts"] == hosts) & (counted["algorithm"] == "ring")]
        probe = int(ring_bytes["bytes"].iloc[0])
        add("ring sends 2T(N-1)/N per rank (bytes, T = 1 MB)", 2 * probe * (n - 1) / n,
            float(ring_bytes["bytes_sent"].max()), 1.0, 1.0, "payload bytes counted by mesh.stats()", timed=False)
        for algorithm, claim in [("ring", "ring's time is 2T(N-1)/N·β: the link bound"),
                                 ("naive", "naive's root link carries (N-1)·T each way: 2(N-1)·T·β"),
                                 ("tree", "tree's depth is log2 N: 2·⌈log2 N⌉·T·β")]:
            add(f"{claim} (T = {largest >> 20} MB, µs)", float(at.loc[algorithm, "link_model_us"]),
                float(at.loc[algorithm, "median_us"]), 0.9, 1.5, "measured / link model within [0.9, 1.5]")
        fits = model[(model["hosts"] == hosts) & (model["link_gbit"] == gbit)].iloc[0]
        predicted, measured = fits["crossover_predicted_bytes"], fits["crossover_measured_bytes"]
        if pd.isna(predicted) or pd.isna(measured):
            rows.append({"hosts": hosts, "link_gbit": gbit, "claim": "ring overtakes tree at the α-β crossover (bytes)",
                         "predicted": predicted, "measured": measured, "ratio": np.nan, "verdict": "refuted",
                         "note": "no crossover " + ("predicted" if pd.isna(predicted) else "measured")})
        else:
            add("ring overtakes tree at the α-β crossover (bytes)", float(predicted), float(measured), 0.25, 4.0,
                "within one size step (x4) of the prediction")
    # Across host counts: ring stays flat, naive grows with N.
    for gbit, data in frame[frame["bytes"] == largest].groupby("link_gbit"):
        counts = sorted(data["hosts"].unique())
        if len(counts) < 2:
            continue
        a, b = counts[0], counts[-1]
        t = data.set_index(["hosts", "algorithm"])["median_us"]
        for algorithm, claim, factor in [
                ("ring", f"ring's time stays flat from {a} to {b} hosts", (2 * (b - 1) / b) / (2 * (a - 1) / a)),
                ("naive", f"naive's time grows with N from {a} to {b} hosts", (b - 1) / (a - 1))]:
            measured = float(t[(b, algorithm)] / t[(a, algorithm)])
            rows.append({"hosts": f"{a}->{b}", "link_gbit": gbit, "claim": claim + " (time ratio)", "predicted": factor,
                         "measured": measured, "ratio": measured / factor,
                         "verdict": _verdict(measured / factor, 0.75, 1.33), "note": "ratio within [0.75, 1.33]"})
    return pd.DataFrame(rows)


def plots(out: Path, frame: pd.DataFrame, model: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(frame.groupby(["hosts", "link_gbit"]))
    for name, column, ylabel in [("latency", "median_us", "median µs per call (slowest rank)"),
                                 ("busbw", "link_use", "busbw / link cap")]:
        fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
        for ax, ((hosts, gbit), data) in zip(axes[0], groups):
            for algorithm, group in data.groupby("algorithm"):
                group = group.sort_values("bytes")
                line = ax.plot(group["bytes"], group[column], "o-", label=algorithm)[0]
                if name == "latency" and group["link_model_us"].notna().any():
                    ax.plot(group["bytes"], group["link_model_us"], ":", color=line.get_color())
            if name == "latency":
                crossover = model[(model["hosts"] == hosts) & (model["link_gbit"] == gbit)]
                for col, style in [("crossover_predicted_bytes", "--"), ("crossover_measured_bytes", "-")]:
                    if crossover[col].notna().any():
                        ax.axvline(float(crossover[col].iloc[0]), color="k", linestyle=style, alpha=0.5,
                                   label=col.split("_")[1] + " ring/tree crossover")
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="k", linestyle="--", label="link cap")
            ax.set_xscale("log")
            ax.set(title=f"allreduce, {hosts} hosts x 1 rank, links {gbit:g} Gbit/s", xlabel="tensor bytes",
                   ylabel=ylabel)
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"allreduce_{name}.png", dpi=110)
        plt.close(fig)


def report(frame: pd.DataFrame, model: pd.DataFrame, verdicts: pd.DataFrame, info: dict) -> str:
    from lab.results import markdown

    largest = int(frame["bytes"].max())
    big = frame[frame["bytes"] == largest][["hosts", "link_gbit", "algorithm", "median_us", "busbw_GBps",
                                            "link_use", "link_model_us", "cpu_busy", "ranks_cpu"]]
    fits = model[["hosts", "link_gbit", "algorithm", "alpha_us", "bandwidth_GBps", "r2",
                  "crossover_predicted_bytes", "crossover_measured_bytes"]]
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
        markdown(verdicts), "",
        f"### {largest >> 20} MB: busbw against the link cap", "",
        "`link_use` is busbw (allreduce: algbw·2(N-1)/N) over the cap: 1.0 is a full link; "
        "`cpu_busy` the share of all cores busy during the case (anything running on the machine, the "
        "switch's packet forwarding included), `ranks_cpu` the share the rank processes used.", "",
        markdown(big), "",
        "### α-β fits and the ring/tree crossover", "",
        "t(n) = α + β·n fitted per algorithm (`model.csv`); the predicted crossover is where the ring and tree "
        "lines meet, the measured one the smallest size where ring's median beat tree's.", "",
        markdown(fits), "",
        "![latency](allreduce_latency.png)", "", "![busbw](allreduce_busbw.png)", "",
        "Regenerate: `python -m lab results --hosts 4 8 --link-gbit 1` (add `--link-gbit 0.5` where the CPU binds).",
        "",
    ])


def main(out_dir: str, host_counts: list[int], gbits: list[float], sizes: list[int] | None = None) -> int:
    from lab.hosts import check_link_gbit
    from lab.results import machine

    for gbit in gbits:  # every rate before the first pool: a bad one is an error now, not after a sweep
        check_link_gbit(gbit)
    sizes = sizes or SIZES
    out = Path(out_dir) / "hosts"
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"Across hosts: {host_counts} hosts x {gbits} Gbit/s, {len(sizes)} sizes", file=sys.stderr)
    started = time.monotonic()
    frame, counted = sweep(host_counts, gbits, sizes)
    model = models(frame)
    verdicts = claims(frame, model, counted)
    for name, table in [("allreduce", frame), ("model", model), ("claims", verdicts), ("bytes", counted)]:
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    (out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    plots(out, frame, model)
    section = report(frame, model, verdicts, info)
    (out / "REPORT.md").write_text(section)
    splice(Path(out_dir) / "REPORT.md", section.replace("](allreduce_", "](hosts/allreduce_"), "across-hosts")
    print(f"Wrote {out}/ in {time.monotonic() - started:.0f} s: "
          f"{int((verdicts['verdict'] == 'confirmed').sum())} of {len(verdicts)} claims confirmed")
    return 0


# -- many ranks per host: hierarchical against the flat ring and gloo -------------------------------

#: What the simulator's prediction at scale assumes (inter-host: the measured links' order of α;
#: inside a host: shared memory). Stated in the report.
SIM_NETWORK = {"alpha_us": 20.0, "intra_alpha_us": 5.0, "intra_gbit": 100.0}
SIM_HOSTS, SIM_RANKS_PER_HOST = 128, 8


def _inter_host_bytes(mesh: lab.Mesh, nbytes: int, algorithms: list[str]) -> dict[str, tuple[int, int]]:
    """(bytes sent, of which to other hosts) by this rank in one allreduce of ``nbytes`` per algorithm."""
    sent = {}
    for algorithm in algorithms:
        x = torch.ones(nbytes // 4)
        mesh.reset_stats()
        lab.allreduce(mesh, x, algorithm=algorithm)
        stats = mesh.stats()
        sent[algorithm] = (stats["bytes_sent"], stats["bytes_sent_inter_host"])
    return sent


def hierarchy_sweep(host_counts: list[int], per_host: int, gbit: float, sizes: list[int]
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """hierarchical, ring (both over transport="auto") and gloo on H hosts x ``per_host`` ranks."""
    from tqdm import tqdm

    algorithms = ["hierarchical", "ring"]
    impls = [("lab", a) for a in algorithms] + [("gloo", "gloo")]
    rows, counted = [], []
    with tqdm(total=len(host_counts) * len(impls) * len(sizes), unit="case") as bar:
        for hosts in host_counts:
            world = hosts * per_host
            with lab.launch(world, hosts=hosts, link_gbit=gbit, transport="auto") as cluster:
                for nbytes in sizes:
                    for rank, sent in enumerate(cluster.run(_inter_host_bytes, nbytes, algorithms)):
                        counted += [{"hosts": hosts, "ranks_per_host": per_host, "host": rank // per_host,
                                     "rank": rank, "algorithm": a, "bytes": nbytes, "bytes_sent": s,
                                     "bytes_sent_inter_host": inter} for a, (s, inter) in sent.items()]
                for impl, algorithm in impls:
                    for nbytes in sizes:
                        bar.set_description(f"{hosts}x{per_host} {gbit:g} Gbit/s {algorithm} {nbytes >> 10} KB")
                        row = measure(cluster, "allreduce", impl, nbytes, algorithm, calls_for(nbytes))
                        row.update(hosts=hosts, ranks_per_host=per_host, link_gbit=gbit)
                        rows.append(row)
                        bar.update()
    return pd.DataFrame(rows), pd.DataFrame(counted)


def hierarchy_at_scale(sizes: list[int], gbit: float) -> pd.DataFrame:
    """lab.sim's prediction for 128 hosts x 8 ranks: hierarchical against the flat ring."""
    from lab import sim

    net = sim.Network(gbit=gbit, ranks_per_host=SIM_RANKS_PER_HOST, **SIM_NETWORK)
    world = SIM_HOSTS * SIM_RANKS_PER_HOST
    rows = []
    for nbytes in sizes:
        times = {a: sim.simulate("allreduce", a, world, nbytes, net).time_us for a in ("hierarchical", "ring")}
        rows.append({"hosts": SIM_HOSTS, "ranks_per_host": SIM_RANKS_PER_HOST, "link_gbit": gbit, "bytes": nbytes,
                     "hierarchical_us": times["hierarchical"], "ring_us": times["ring"],
                     "ring_over_hierarchical": times["ring"] / times["hierarchical"]})
    return pd.DataFrame(rows)


def hierarchy_report(frame: pd.DataFrame, counted: pd.DataFrame, scale: pd.DataFrame, info: dict) -> str:
    from lab.results import markdown

    times = frame.pivot_table(index=["hosts", "ranks_per_host", "bytes"], columns="algorithm",
                              values="median_us").reset_index()
    times["ring_over_hierarchical"] = times["ring"] / times["hierarchical"]
    times["gloo_over_hierarchical"] = times["gloo"] / times["hierarchical"]
    per_host = (counted.groupby(["hosts", "ranks_per_host", "algorithm", "bytes", "host"])["bytes_sent_inter_host"]
                .sum().groupby(["hosts", "ranks_per_host", "algorithm", "bytes"]).max().unstack("algorithm")
                .reset_index())
    per_host.columns.name = None
    per_host = per_host.rename(columns={"hierarchical": "hierarchical_B_per_host", "ring": "ring_B_per_host"})
    n = per_host["hosts"] * per_host["ranks_per_host"]
    per_host["model_hierarchical"] = 2 * (per_host["hosts"] - 1) * per_host["bytes"] // per_host["hosts"]
    per_host["model_ring"] = 2 * (n - 1) * per_host["bytes"] // n
    largest = int(frame["bytes"].max())
    big = times[times["bytes"] == largest]
    wins = ", ".join(f"{h}x{l}: {r:.2f}x" for h, l, r in big[["hosts", "ranks_per_host", "ring_over_hierarchical"]]
                     .itertuples(index=False))
    gbit = float(frame["link_gbit"].iloc[0])
    return "\n".join([
        "## Many ranks per host: hierarchical allreduce", "",
        f"H emulated hosts of L ranks each, links capped at {gbit:g} Gbit/s each way, `transport=\"auto\"` (shared "
        "memory inside a host, TCP between hosts). `hierarchical` reduce-scatters inside each host, allreduces "
        "each shard across hosts (a ring for shards of 64 KiB and more, recursive doubling below), then "
        "allgathers inside; `ring` is the flat ring over all N = H·L ranks, laid out host by host; gloo runs "
        f"over TCP everywhere. Machine: {info['cpu']}, {info['cores']} cores; commit {info['commit']}; "
        f"{info['date']}. Medians of the slowest rank; noisy (a shared machine).", "",
        f"At {largest >> 20} MB, ring time / hierarchical time: {wins}.", "",
        "### Time per call (µs)", "", markdown(times), "",
        "### Bytes that crossed each host's link (counters, `bytes_sent_inter_host` summed per host)", "",
        "The model: hierarchical 2T(H-1)/H per host link with a ring across hosts (shards of 64 KiB and "
        "more; smaller shards cross by recursive doubling, which moves more bytes in fewer steps), flat ring "
        "2T(N-1)/N (only each host's last rank sends across).", "", markdown(per_host), "",
        f"### Predicted at {SIM_HOSTS} hosts x {SIM_RANKS_PER_HOST} ranks (lab.sim)", "",
        f"`lab.sim.Network(alpha_us={SIM_NETWORK['alpha_us']:g}, gbit={gbit:g}, ranks_per_host={SIM_RANKS_PER_HOST}, "
        f"intra_alpha_us={SIM_NETWORK['intra_alpha_us']:g}, intra_gbit={SIM_NETWORK['intra_gbit']:g})`; every "
        "message holds its host's link for α + n·β, so the L shards crossing at once queue on the link.", "",
        markdown(scale), "",
        "Regenerate: `python -m lab results --hosts 2 4 --ranks-per-host 2 --link-gbit 1`.", "",
    ])


def hierarchy_main(out_dir: str, host_counts: list[int], per_host: int, gbit: float,
                   sizes: list[int] | None = None) -> int:
    """``python -m lab results --hosts 2 4 --ranks-per-host 2``: writes ``<out>/hosts/hierarchical*.csv``
    and the section "Many ranks per host" into ``<out>/REPORT.md``."""
    from lab.hosts import check_link_gbit
    from lab.results import machine

    check_link_gbit(gbit)
    sizes = sizes or SIZES
    out = Path(out_dir) / "hosts"
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = time.monotonic()
    frame, counted = hierarchy_sweep(host_counts, per_host, gbit, sizes)
    scale = hierarchy_at_scale(sizes, gbit)
    for name, table in [("hierarchical", frame), ("hierarchical_bytes", counted), ("hierarchical_sim", scale)]:
        table.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    section = hierarchy_report(frame, counted, scale, info)
    (out / "REPORT_hierarchical.md").write_text(section)
    splice(Path(out_dir) / "REPORT.md", section, "ranks-per-host")
    print(f"Wrote {out}/hierarchical*.csv in {time.monotonic() - started:.0f} s")
    return 0
