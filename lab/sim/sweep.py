"""``python -m lab simulate``: every algorithm at every (N, size) on a network you describe, into ``results/sim/``.

    python -m lab simulate --world-sizes 2 4 8 16 32 64 128 256 512 1024 --sizes 1KB..1GB \\
        --gbit 100 --alpha-us 5 --gap-us 0.5          # add --ranks-per-host 8 for hosts of 8

Writes into ``--out`` (default ``results/sim/``) ``sim.csv`` (one row per collective, algorithm, N and size), ``best.csv`` and
``best_<collective>.png`` (the fastest algorithm per N and size), ``crossover.csv`` and
``crossover.png`` (where ring starts to beat tree, as a function of N: simulated and from the
closed forms), and ``report.md`` ("At scale", plus "Simulator vs measurement" from
:mod:`lab.sim.calibrate` when measured results are there), which also goes into the
``REPORT.md`` next to ``--out`` (between markers, replacing an older copy) when there is one.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from lab.command_line import checked, number, refused, whole
from lab.report_sections import splice
from lab.sim.core import check_limits, simulate
from lab.sim.limits import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    MAX_NBYTES,
    MAX_WORLD_SIZE,
    SimulationUnsupported,
)
from lab.sim.network import Network, network_term
from lab.sim.schedule import COLLECTIVES, algorithms

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536 (binary units: KB = 1024 bytes); a bare number is bytes."""
    found = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not found:
        raise ValueError(f"size must look like 4096, 64KB, 16MB or 1GB; got {text!r}")
    return int(found.group(1)) * _UNITS[found.group(2)]


def parse_sizes(items: list[str]) -> list[int]:
    """Sizes and ranges: ``["1KB..1GB"]`` is 1 KB, 4 KB, 16 KB, ... 1 GB (powers of 4)."""
    sizes: set[int] = set()
    for item in items:
        if ".." in item:
            low, high = (parse_size(part) for part in item.split("..", 1))
            if low < 1 or high < low:
                raise ValueError(f"a size range must go from a size >= 1 byte up; got {item!r}")
            size = low
            while size <= high:
                sizes.add(size)
                size *= 4
        else:
            sizes.add(parse_size(item))
    return sorted(sizes)


def label(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sweep(world_sizes: list[int], sizes: list[int], network: Network, collectives: list[str],
          max_steps: int | None = DEFAULT_MAX_STEPS,
          max_seconds: float | None = DEFAULT_MAX_SECONDS) -> pd.DataFrame:
    """One row per (collective, algorithm, N, size): simulated time, bandwidths, counters, costs.
    A case past ``max_steps``/``max_seconds`` (or that the recorder cannot run) gets a note instead."""
    table = algorithms()
    cases = [(c, a, n, s) for c in collectives for n in world_sizes for s in sizes for a in table[c]]
    rows = []
    started = time.monotonic()
    for i, (collective, algorithm, n, nbytes) in enumerate(cases, 1):
        sys.stderr.write(f"\r{i:>5}/{len(cases)}  {time.monotonic() - started:6.0f} s  "
                         f"{collective} {algorithm} N={n} {label(nbytes):<8}")
        row = {"collective": collective, "algorithm": algorithm, "world": n, "bytes": nbytes}
        try:
            r = simulate(collective, algorithm, n, nbytes, network, max_steps=max_steps,
                         max_seconds=max_seconds)
        except SimulationUnsupported as why:
            rows.append({**row, "note": str(why).split(":")[0]})
            continue
        rows.append({
            **row, "time_us": r.time_us, "algbw_GBps": nbytes / r.time_us / 1e3 if r.time_us else np.nan,
            "messages": r.messages, "max_bytes_sent": int(r.bytes_sent.max(initial=0)),
            "max_bytes_received": int(r.bytes_received.max(initial=0)),
            "critical_path_messages": len(r.critical_path), "record_s": r.record_s, "replay_s": r.replay_s,
            "note": ""})
    sys.stderr.write("\n")
    return pd.DataFrame(rows)


def best(frame: pd.DataFrame) -> pd.DataFrame:
    """The fastest algorithm per (collective, N, size), and how much it beats the runner-up by."""
    timed = frame.dropna(subset=["time_us"]).sort_values(["collective", "world", "bytes", "time_us"],
                                                         kind="stable")
    rows = []
    for (collective, n, nbytes), group in timed.groupby(["collective", "world", "bytes"], sort=True):
        first = group.iloc[0]
        second = group.iloc[1] if len(group) > 1 else None
        rows.append({
            "collective": collective, "world": n, "bytes": nbytes, "best": first["algorithm"],
            "time_us": first["time_us"], "runner_up": None if second is None else second["algorithm"],
            "margin": np.nan if second is None else second["time_us"] / first["time_us"]})
    return pd.DataFrame(rows)


def closed_form_crossover(n: int, network: Network) -> float:
    """T where 2(N-1)(α + T/N·β) = 2·log2 N·(α + T·β) (N a power of two; inf when ring never wins)."""
    depth = math.log2(n)
    alpha, beta = network.alpha_us, network.beta_us_per_byte
    slope = beta * (depth - (n - 1) / n)
    return math.inf if slope <= 0 else alpha * ((n - 1) - depth) / slope


def crossover(frame: pd.DataFrame, network: Network) -> pd.DataFrame:
    """Per N: the size from which ring allreduce beats tree, interpolated between the swept sizes
    (both times are affine in T between two sizes, when N divides the element count)."""
    rows = []
    timed = frame[(frame["collective"] == "allreduce")
                  & frame["algorithm"].isin(["ring", "tree"])].dropna(subset=["time_us"])
    for n, group in timed.groupby("world"):
        wide = group.pivot_table(index="bytes", columns="algorithm", values="time_us").dropna()
        if not {"ring", "tree"} <= set(wide.columns) or n < 2:
            continue
        gap = (wide["ring"] - wide["tree"]).to_numpy()  # < 0: ring is faster
        sizes = wide.index.to_numpy(dtype=float)
        found = math.nan
        if gap[0] < 0:
            found = sizes[0]  # ring already wins at the smallest size swept
        else:
            for i in range(1, len(gap)):
                if gap[i] < 0 <= gap[i - 1]:
                    found = sizes[i - 1] + (sizes[i] - sizes[i - 1]) * gap[i - 1] / (gap[i - 1] - gap[i])
                    break
        exact = closed_form_crossover(n, network) if n & (n - 1) == 0 else math.nan
        rows.append({"world": n, "crossover_bytes": found, "closed_form_bytes": exact})
    return pd.DataFrame(rows)


def plot_best(best_frame: pd.DataFrame, collective: str, network: Network, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = best_frame[best_frame["collective"] == collective]
    grid = data.pivot(index="world", columns="bytes", values="best")
    names = [a for a in algorithms()[collective] if a in set(data["best"])]
    codes = grid.apply(lambda col: col.map({a: i for i, a in enumerate(names)})).to_numpy(dtype=float)
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * grid.shape[1], 1.2 + 0.45 * grid.shape[0]))
    cmap = plt.get_cmap("tab10", max(len(names), 1))
    ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, aspect="auto")
    for (i, j), value in np.ndenumerate(grid.to_numpy()):
        if isinstance(value, str):
            ax.text(j, i, value.replace("_", "\n"), ha="center", va="center", fontsize=6)
    ax.set_xticks(range(grid.shape[1]), [label(int(b)) for b in grid.columns], rotation=45, ha="right")
    ax.set_yticks(range(grid.shape[0]), [str(n) for n in grid.index])
    ax.set_xlabel("tensor size per rank")
    ax.set_ylabel("ranks (N)")
    ax.set_title(f"fastest {collective} algorithm (simulated; {network.describe()})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_crossover(cross: pd.DataFrame, network: Network, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cross["world"], cross["crossover_bytes"], "o-",
            label="simulated (interpolated between swept sizes)")
    ax.plot(cross["world"], cross["closed_form_bytes"], "--",
            label="closed form: 2(N-1)(α+Tβ/N) = 2·log2N·(α+Tβ)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("tensor size where ring starts to beat tree (bytes)")
    ax.set_title(f"ring/tree allreduce crossover ({network.describe()})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table_md(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(frame.columns) + " |\n| " + " | ".join("---" for _ in frame.columns) + " |\n"
    return header + "".join("| " + " | ".join(str(v) for v in row) + " |\n"
                            for row in frame.itertuples(index=False))


def at_scale(frame: pd.DataFrame, best_frame: pd.DataFrame, cross: pd.DataFrame, network: Network,
             images: str = "sim") -> str:
    """REPORT.md's "At scale": the lesson's claims checked at the largest N swept."""
    allreduce = frame[(frame["collective"] == "allreduce")].dropna(subset=["time_us"])
    if allreduce.empty:
        return ""
    n = int(allreduce["world"].max())
    at_n = allreduce[allreduce["world"] == n]
    lines = [
        f"## At scale (simulated, N up to {n})\n",
        f"Network: {network.describe()}. Every number below comes from `python -m lab simulate`, which runs "
        "the lab's own algorithm functions on virtual ranks (no processes, no data) and times their "
        "messages on that network: see docs/simulation.md.\n"]
    grid = at_n.pivot_table(index="bytes", columns="algorithm", values="time_us")
    shown = grid.copy()
    shown.index = [label(int(b)) for b in shown.index]
    shown = shown.map(lambda v: f"{v:,.0f}" if pd.notna(v) else "-")
    lines.append(f"Allreduce time at N = {n} (µs):\n")
    lines.append(_table_md(shown.reset_index(names="size")))
    ring = at_n[at_n["algorithm"] == "ring"]
    if not ring.empty:
        row = ring.iloc[-1]
        lines.append(
            f"\n- **Ring's traffic per rank is 2T(N-1)/N**: at N = {n}, T = {label(int(row['bytes']))}, "
            f"each rank sends {int(row['max_bytes_sent']):,} bytes = "
            f"{row['max_bytes_sent'] / row['bytes']:.4f}·T (2(N-1)/N = {2 * (n - 1) / n:.4f}).")
    naive = at_n[at_n["algorithm"] == "naive"]
    if not naive.empty and not ring.empty:
        big = naive.iloc[-1]
        ring_big = ring[ring["bytes"] == big["bytes"]]
        if not ring_big.empty:
            lines.append(
                f"- **Naive is O(N)**: rank 0 sends {int(big['max_bytes_sent']):,} bytes "
                f"((N-1)·T) and takes {big['time_us'] / ring_big.iloc[0]['time_us']:,.0f}× ring's time "
                f"at {label(int(big['bytes']))}.")
    c = cross[cross["world"] == n]
    if not c.empty:
        found, exact = c.iloc[0]["crossover_bytes"], c.iloc[0]["closed_form_bytes"]
        small = cross.iloc[0]
        lines.append(
            f"- **Where ring beats tree moves up with N**: from about {label_float(small['crossover_bytes'])} "
            f"at N = {int(small['world'])} to about {label_float(found)} at N = {n} "
            f"(closed form {label_float(exact)}). Ring pays 2(N-1)·α, which grows linearly with N; "
            "tree pays 2·log2N·α but moves T per step instead of T/N, so ring needs ever larger "
            "tensors to win back its latency.")
    double = _double_tree_line(grid, n)
    if double:
        lines.append(double)
    fastest = _fastest_line(best_frame, n)
    if fastest:
        lines.append(fastest)
    lines.append(f"\n![best algorithm]({images}/best_allreduce.png)  ![crossover]({images}/crossover.png)\n")
    return "\n".join(lines) + "\n"


def _fastest_line(best_frame: pd.DataFrame, n: int) -> str:
    """The fastest allreduce at ``n`` ranks, size range by size range, or "" where none was swept."""
    winners = best_frame[(best_frame["collective"] == "allreduce") & (best_frame["world"] == n)]
    runs: list[list] = []
    for _, row in winners.iterrows():
        if runs and runs[-1][0] == row["best"]:
            runs[-1][2] = row["bytes"]
        else:
            runs.append([row["best"], row["bytes"], row["bytes"]])
    text = "; ".join(
        f"{a} from {label(int(lo))} to {label(int(hi))}" if lo != hi else f"{a} at {label(int(lo))}"
        for a, lo, hi in runs)
    return f"- **Fastest of all algorithms at N = {n}**: {text}." if runs else ""


def _double_tree_line(grid: pd.DataFrame, n: int) -> str:
    """The double tree against the ring at the largest size and the tree at the smallest (NCCL's
    reason for it: the ring's bandwidth at the tree's latency), or "" where one is missing."""
    if not {"double_tree", "ring", "tree"} <= set(grid.columns) or grid.empty:
        return ""
    small, large = grid.index.min(), grid.index.max()
    return (
        f"- **Double tree: the ring's bandwidth at the tree's latency**: at N = {n} it takes "
        f"{grid.at[large, 'double_tree'] / grid.at[large, 'ring']:.2f}× the ring's time at "
        f"{label(int(large))} and {grid.at[small, 'double_tree'] / grid.at[small, 'tree']:.2f}× the tree's "
        f"at {label(int(small))}: each rank works in both trees at once, its sends of one tree overlapping "
        "the other's (the network's gap, not the whole of α, holds a port).")


def label_float(nbytes: float) -> str:
    if not math.isfinite(nbytes):
        return "never (in the sizes swept)"
    return label(round(nbytes)) if nbytes < 1 << 10 else (
        f"{nbytes / (1 << 20):.3g} MB" if nbytes >= 1 << 20 else f"{nbytes / (1 << 10):.3g} KB")


def _check_sizes(text: str) -> None:
    """``--sizes``' item: a size or range of sizes the simulator takes (float32 inputs: multiples of 4)."""
    for size in parse_sizes([text]):
        if size % 4 or size > MAX_NBYTES:
            raise ValueError(f"{text!r} holds {size:,} B: a size must be a multiple of 4 (float32 "
                             f"elements) up to {MAX_NBYTES:,}")


def main(args: argparse.Namespace) -> int:
    try:  # each term is checked by its option's type: what is left is the gap against α
        network = Network(alpha_us=args.alpha_us, gbit=args.gbit, ranks_per_host=args.ranks_per_host,
                          intra_alpha_us=args.intra_alpha_us, intra_gbit=args.intra_gbit, gap_us=args.gap_us)
    except ValueError as exc:
        args.parser.error(f"argument --gap-us: {exc}")
    sizes = parse_sizes(args.sizes)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        args.parser.error(f"argument --out: {refused(exc)}")
    if not os.access(out, os.W_OK):  # before the sweep, not at its end
        args.parser.error(f"argument --out: {out} cannot be written to")
    started = time.monotonic()
    frame = sweep(sorted(set(args.world_sizes)), sizes, network, args.collectives, args.max_steps,
                  args.max_seconds)
    best_frame = best(frame)
    cross = crossover(frame, network)
    frame.to_csv(out / "sim.csv", index=False, float_format="%.6g")
    best_frame.to_csv(out / "best.csv", index=False, float_format="%.6g")
    cross.to_csv(out / "crossover.csv", index=False, float_format="%.6g")
    for collective in args.collectives:
        if (best_frame["collective"] == collective).any():
            plot_best(best_frame, collective, network, out / f"best_{collective}.png")
    if not cross.empty:
        plot_crossover(cross, network, out / "crossover.png")
    text = at_scale(frame, best_frame, cross, network, images=out.name)
    if args.measured:
        from lab.sim.validation import validation_section

        text += validation_section(Path(args.measured), out)
    (out / "report.md").write_text(text)
    splice(out.parent / "REPORT.md", text, "simulation")
    skipped = int(frame["time_us"].isna().sum()) if "time_us" in frame else len(frame)
    print(
        f"{len(frame) - skipped} simulations ({skipped} skipped) in {time.monotonic() - started:.0f} s -> {out}/"
    )
    if skipped:
        print(f"skipped: {', '.join(sorted(set(frame.loc[frame['time_us'].isna(), 'note'])))}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``simulate`` subcommand of ``python -m lab``."""
    cmd = commands.add_parser("simulate",
                              help="simulate every algorithm at scale on a network model (results/sim/)")
    cmd.add_argument("--world-sizes", nargs="+", type=whole(1, MAX_WORLD_SIZE),
                     default=[2**k for k in range(1, 11)], metavar="N")
    cmd.add_argument(
        "--sizes", nargs="+", default=["1KB..1GB"], type=checked(str, _check_sizes),
        help="sizes per rank (4096, 64KB, 16MB) or ranges A..B in powers of 4 (default 1KB..1GB)")
    cmd.add_argument("--gbit", type=network_term("gbit"), default=100.0,
                     help="link bandwidth, Gbit/s each way (default 100)")
    cmd.add_argument("--alpha-us", type=network_term("alpha_us"), default=5.0,
                     help="per-message latency, µs (default 5)")
    cmd.add_argument(
        "--gap-us", type=number, default=None,
        help="the part of α a message holds its port for (LogP's g; the rest of α is flight time; "
        "default: all of α, as lab.sim.Network's gap_us=None; 0.5: a NIC taking a message "
        "every 0.5 µs)")
    cmd.add_argument("--ranks-per-host", type=network_term("ranks_per_host", whole(1)), default=1,
                     help="ranks sharing one host link (default 1)")
    cmd.add_argument("--intra-alpha-us", type=network_term("intra_alpha_us"), default=None,
                     help="latency inside a host (default: --alpha-us)")
    cmd.add_argument("--intra-gbit", type=network_term("intra_gbit"), default=None,
                     help="bandwidth inside a host (default: --gbit)")
    cmd.add_argument("--collectives", nargs="+", default=["allreduce"], choices=COLLECTIVES, metavar="NAME",
                     help=f"which collectives (default allreduce; any of {', '.join(COLLECTIVES)})")
    cmd.add_argument(
        "--max-steps", type=whole(1), default=DEFAULT_MAX_STEPS,
        help="skip a case whose recording would pass this many steps, as a sample of its ranks shows "
        "(about 170 MB and 1-4 s per million; default 10 million)")
    cmd.add_argument(
        "--max-seconds", type=checked(number, lambda seconds: check_limits(None, seconds)),
        default=DEFAULT_MAX_SECONDS,
        help="skip a case whose recording would take longer, as a sample of its ranks shows "
        "(default 300)")
    cmd.add_argument("--measured", default="results", metavar="DIR",
                     help="measured results to compare with (allreduce.csv, collectives.csv); '' to skip")
    cmd.add_argument("--out", default="results/sim")
    cmd.set_defaults(run=main, parser=cmd)
