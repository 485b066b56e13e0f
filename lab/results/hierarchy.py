"""``python -m lab results --hosts 2 4 --ranks-per-host 2``: hierarchical allreduce against the flat
ring and gloo, on H emulated hosts of L ranks each (``transport="auto"``: shared memory inside a
host, TCP between hosts), with the bytes that crossed each host's link and ``lab.sim``'s
prediction at 128 hosts x 8 ranks. Writes ``<out>/hosts/hierarchical*.csv`` and the section
"Many ranks per host" into ``<out>/REPORT.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

import lab
from lab import sim
from lab.benchmark import measure
from lab.hosts.emulated import check_link_gbit
from lab.report_sections import splice
from lab.results.hosts import SIZES, allreduce_cases, bytes_sent, calls_for, hosts_dir
from lab.results.report import markdown
from lab.results.sweeps import machine, save_tables

#: The comparison this section makes: the two-level allreduce against the flat ring.
ALGORITHMS = ["hierarchical", "ring"]
#: What the simulator's prediction at scale assumes (inter-host: the measured links' order of α;
#: inside a host: shared memory). Stated in the report.
SIM_NETWORK = {"alpha_us": 20.0, "intra_alpha_us": 5.0, "intra_gbit": 100.0}
SIM_HOSTS, SIM_RANKS_PER_HOST = 128, 8


def sweep(host_counts: list[int], per_host: int, gbit: float,
          sizes: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """hierarchical, ring (both over transport="auto") and gloo on H hosts x ``per_host`` ranks.

    Returns (one row per case, each rank's bytes sent and sent to other hosts per algorithm and size)."""
    from tqdm import tqdm  # the plots extra, as for the figures

    cases = allreduce_cases(ALGORITHMS, sizes)
    rows, counted = [], []
    with tqdm(total=len(host_counts) * len(cases), unit="case") as bar:
        for hosts in host_counts:
            with lab.launch(hosts * per_host, hosts=hosts, link_gbit=gbit, transport="auto") as cluster:
                for nbytes in sizes:
                    counted += [{
                        "hosts": hosts, "ranks_per_host": per_host, "host": rank // per_host, "rank": rank,
                        "algorithm": a, "bytes": nbytes, "bytes_sent": s, "bytes_sent_inter_host": inter}
                                for rank, sent in enumerate(cluster.run(bytes_sent, nbytes, ALGORITHMS))
                                for a, (s, inter) in sent.items()]
                for impl, algorithm, nbytes in cases:
                    bar.set_description(f"{hosts}x{per_host} {gbit:g} Gbit/s {algorithm} {nbytes >> 10} KB")
                    row = measure(cluster, "allreduce", impl, nbytes, algorithm, calls_for(nbytes))
                    row.update(hosts=hosts, ranks_per_host=per_host, link_gbit=gbit)
                    rows.append(row)
                    bar.update()
    return pd.DataFrame(rows), pd.DataFrame(counted)


def at_scale(sizes: list[int], gbit: float) -> pd.DataFrame:
    """lab.sim's prediction for 128 hosts x 8 ranks: hierarchical against the flat ring."""
    net = sim.Network(gbit=gbit, ranks_per_host=SIM_RANKS_PER_HOST, **SIM_NETWORK)
    world = SIM_HOSTS * SIM_RANKS_PER_HOST
    rows = []
    for nbytes in sizes:
        times = {a: sim.simulate("allreduce", a, world, nbytes, net).time_us for a in ALGORITHMS}
        rows.append({
            "hosts": SIM_HOSTS, "ranks_per_host": SIM_RANKS_PER_HOST, "link_gbit": gbit, "bytes": nbytes,
            "hierarchical_us": times["hierarchical"], "ring_us": times["ring"],
            "ring_over_hierarchical": times["ring"] / times["hierarchical"]})
    return pd.DataFrame(rows)


def times_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Median µs per (hosts, ranks per host, size), one column per algorithm, and ring's and gloo's
    time over hierarchical's."""
    times = frame.pivot_table(index=["hosts", "ranks_per_host", "bytes"], columns="algorithm",
                              values="median_us").reset_index()
    times["ring_over_hierarchical"] = times["ring"] / times["hierarchical"]
    times["gloo_over_hierarchical"] = times["gloo"] / times["hierarchical"]
    return times


def per_host_bytes(counted: pd.DataFrame) -> pd.DataFrame:
    """The bytes that crossed the busiest host's link per setting, algorithm and size (its ranks'
    counters summed), next to each algorithm's model."""
    per_host = (counted.groupby(["hosts", "ranks_per_host", "algorithm", "bytes",
                                 "host"])["bytes_sent_inter_host"].sum().groupby([
                                     "hosts", "ranks_per_host", "algorithm",
                                     "bytes"]).max().unstack("algorithm").reset_index())
    per_host.columns.name = None
    per_host = per_host.rename(columns={"hierarchical": "hierarchical_B_per_host", "ring": "ring_B_per_host"})
    n = per_host["hosts"] * per_host["ranks_per_host"]
    per_host["model_hierarchical"] = 2 * (per_host["hosts"] - 1) * per_host["bytes"] // per_host["hosts"]
    per_host["model_ring"] = 2 * (n - 1) * per_host["bytes"] // n
    return per_host


def report(frame: pd.DataFrame, counted: pd.DataFrame, scale: pd.DataFrame, info: dict) -> str:
    """The section "Many ranks per host": times, bytes across each host's link, and the prediction at scale."""
    times = times_table(frame)
    largest = int(frame["bytes"].max())
    big = times[times["bytes"] == largest]
    wins = ", ".join(
        f"{h}x{l}: {r:.2f}x"
        for h, l, r in big[["hosts", "ranks_per_host", "ring_over_hierarchical"]].itertuples(index=False))
    gbit = float(frame["link_gbit"].iloc[0])
    return "\n".join([
        "## Many ranks per host: hierarchical allreduce", "",
        f"H emulated hosts of L ranks each, links capped at {gbit:g} Gbit/s each way, `transport=\"auto\"` (shared "
        "memory inside a host, TCP between hosts). `hierarchical` reduce-scatters inside each host, allreduces "
        "each shard across hosts (a ring for shards of 64 KiB and more, recursive doubling below), then "
        "allgathers inside; `ring` is the flat ring over all N = H·L ranks, laid out host by host; gloo runs "
        f"over TCP everywhere. Machine: {info['cpu']}, {info['cores']} cores; commit {info['commit']}; "
        f"{info['date']}. Medians of the slowest rank; noisy (a shared machine).", "",
        f"At {largest >> 20} MB, ring time / hierarchical time: {wins}.", "", "### Time per call (µs)", "",
        markdown(times), "",
        "### Bytes that crossed each host's link (counters, `bytes_sent_inter_host` summed per host)", "",
        "The model: hierarchical 2T(H-1)/H per host link with a ring across hosts (shards of 64 KiB and "
        "more; smaller shards cross by recursive doubling, which moves more bytes in fewer steps), flat ring "
        "2T(N-1)/N (only each host's last rank sends across).", "",
        markdown(per_host_bytes(counted)), "",
        f"### Predicted at {SIM_HOSTS} hosts x {SIM_RANKS_PER_HOST} ranks (lab.sim)", "",
        f"`lab.sim.Network(alpha_us={SIM_NETWORK['alpha_us']:g}, gbit={gbit:g}, ranks_per_host={SIM_RANKS_PER_HOST}, "
        f"intra_alpha_us={SIM_NETWORK['intra_alpha_us']:g}, intra_gbit={SIM_NETWORK['intra_gbit']:g})`; every "
        "message holds its host's link for α + n·β, so the L shards crossing at once queue on the link.", "",
        markdown(scale), "",
        "Regenerate: `python -m lab results --hosts 2 4 --ranks-per-host 2 --link-gbit 1`.", ""])


def main(out_dir: str, host_counts: list[int], per_host: int, gbit: float,
         sizes: list[int] | None = None) -> int:
    """``python -m lab results --hosts 2 4 --ranks-per-host 2``: writes ``<out>/hosts/hierarchical*.csv``
    and the section "Many ranks per host" into ``<out>/REPORT.md``."""
    check_link_gbit(gbit)
    sizes = sizes or SIZES
    out = hosts_dir(out_dir)
    info = machine()
    started = time.monotonic()
    frame, counted = sweep(host_counts, per_host, gbit, sizes)
    scale = at_scale(sizes, gbit)
    save_tables(out, {"hierarchical": frame, "hierarchical_bytes": counted, "hierarchical_sim": scale})
    section = report(frame, counted, scale, info)
    (out / "REPORT_hierarchical.md").write_text(section)
    splice(Path(out_dir) / "REPORT.md", section, "ranks-per-host")
    print(f"Wrote {out}/hierarchical*.csv in {time.monotonic() - started:.0f} s")
    return 0
