"""``python -m lab results``: run the sweeps and regenerate ``results/`` (CSVs, models, plots, report).

Everything in ``results/`` comes from one run of this command on one machine, which the report
names; ``lab/tuning.json`` (the fitted models ``algorithm="auto"`` uses) is refreshed with it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

import lab
from lab import mpich, tuning
from lab.collectives import registry
from lab.benchmark import (ALGORITHMS, COLLECTIVES, SIZES, measure, time_bucketing, time_kernel, time_overlap,
                           transformer_gradients)
from lab.tuning import TUNING_PATH, algorithm_shape

KERNEL_SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
PYTHON_KERNEL_MAX_BYTES = 1 << 20  # the pure-Python loop runs ~1 µs per element: stop there
ALLREDUCE_ALGORITHMS = (*ALGORITHMS["allreduce"], "auto")


class Progress:
    """A one-line progress bar on stderr: ``[#######.............]  12/80  allreduce ring 1MB shm``."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done:>3}/{self.total}  "
                         f"{elapsed:5.0f} s  {label:<44}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


#: The references measured next to the lab: their rows' transport and algorithm are their name.
REFERENCES = ("gloo", "mpich")


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


# -- sweeps ----------------------------------------------------------------------------------------


def sweep(world_size: int, transports: list[str], sizes: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every collective, algorithm and transport at every size, with gloo in the same pools, and
    MPICH's allreduce (``mpiexec``, between the pools) when the ``peers`` extra is installed."""
    cases = []
    for transport in transports:
        cases += [(transport, "allreduce", "lab", a, s) for a in ALLREDUCE_ALGORITHMS for s in sizes]
        cases += [(transport, c, "lab", a, s) for c in COLLECTIVES[1:] for a in ALGORITHMS[c] for s in sizes
                  if c != "barrier" or s == sizes[0]]  # a barrier moves no bytes: once
    cases += [(transports[0], c, "gloo", "gloo", s) for c in COLLECTIVES for s in sizes if c != "barrier" or s == sizes[0]]
    no_mpich = mpich.unavailable()
    if no_mpich:
        print(f"MPICH skipped: {no_mpich}", file=sys.stderr)
    progress = Progress(len(cases) + (0 if no_mpich else len(sizes)))
    rows = []
    for transport in transports:
        with lab.launch(world_size, transport=transport) as cluster:
            for case_transport, collective, impl, algorithm, nbytes in cases:
                if case_transport != transport:
                    continue
                rows.append(measure(cluster, collective, impl, nbytes, algorithm))
                progress.step(f"{collective} {algorithm} {size_label(nbytes)} {transport if impl == 'lab' else ''}")
    for nbytes in [] if no_mpich else sizes:
        rows.append(mpich.measure(world_size, nbytes))
        progress.step(f"allreduce MPICH {size_label(nbytes)}")
    frame = pd.DataFrame(rows)
    return frame[frame["collective"] == "allreduce"], frame[frame["collective"] != "allreduce"]


def latency_floor(max_world: int) -> pd.DataFrame:
    """1 KB allreduce at 1, 2, ... ranks: what one collective costs in Python alone (1 rank), on
    idle cores (ranks <= cores) and oversubscribed, to show what bounds small messages."""
    worlds = sorted({1, 2, max_world})
    progress = Progress(len(worlds) * 3)
    rows = []
    for world in worlds:
        with lab.launch(world) as cluster:
            for impl, algorithm in [("lab", "tree"), ("lab", "ring"), ("gloo", "gloo")]:
                rows.append(measure(cluster, "allreduce", impl, 1 << 10, algorithm))
                progress.step(f"latency floor {algorithm} on {world} ranks")
    return pd.DataFrame(rows)


def training_patterns(world_size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Bucketing (2,004 transformer-shaped gradients, one by one vs 25 MB buckets) and overlap
    (an MLP's backward with and without gradient allreduces started from the backward hooks)."""
    progress = Progress(5)
    grads = transformer_gradients()
    total = sum(g.numel() * 4 for g in grads)
    bucket_rows, overlap_rows = [], []
    with lab.launch(world_size) as cluster:
        for mode in ("one by one", "bucketed"):
            per_rank = cluster.run(time_bucketing, mode == "bucketed")
            slowest = np.max(np.array(per_rank, dtype=np.float64), axis=0) / 1e6
            bucket_rows.append({"mode": mode, "tensors": len(grads), "bytes": total, "world": world_size,
                                "median_ms": float(np.median(slowest)), "min_ms": float(slowest.min())})
            progress.step(f"bucketing: {mode}")
        for mode in ("compute", "sequential", "overlap"):
            per_rank = cluster.run(time_overlap, mode)
            slowest = np.max(np.array(per_rank, dtype=np.float64), axis=0) / 1e6
            overlap_rows.append({"mode": mode, "world": world_size, "median_ms": float(np.median(slowest)),
                                 "min_ms": float(slowest.min())})
            progress.step(f"overlap: {mode}")
    overlap = pd.DataFrame(overlap_rows)
    compute = overlap.loc[overlap["mode"] == "compute", "median_ms"].iloc[0]
    overlap["visible_comm_ms"] = overlap["median_ms"] - compute
    return pd.DataFrame(bucket_rows), overlap


def kernel_sweep() -> pd.DataFrame:
    # Size by size, the implementations back to back, so that drift of a shared machine's memory
    # bandwidth hits the ones compared alike.
    cases = [(impl, 2, s) for s in KERNEL_SIZES for impl in ("python", "numpy", "numba")
             if impl != "python" or s <= PYTHON_KERNEL_MAX_BYTES]
    cases += [(impl, 4, s) for s in KERNEL_SIZES for impl in ("numpy", "numba")]
    progress = Progress(len(cases))
    rows = []
    for impl, inputs, nbytes in cases:
        result = time_kernel(impl, nbytes, inputs)
        variant = {2: "dst += src", 4: "dst += a + b + c" if impl == "numba" else "3 chained np.add"}[inputs]
        rows.append({"impl": impl, "op": f"sum, {inputs} inputs", "variant": variant, "bytes": nbytes, **result})
        progress.step(f"kernel {impl} {inputs} inputs {size_label(nbytes)}")
    return pd.DataFrame(rows)


# -- models ----------------------------------------------------------------------------------------


def fit_alpha_beta(sizes: np.ndarray, times_us: np.ndarray) -> tuple[float, float, float]:
    """Fit t(n) = α + β·n to medians, minimising relative error (sizes span four decades).

    Returns α (µs), β (µs per byte) and R² on the raw times.
    """
    design = np.column_stack([1 / times_us, sizes / times_us])
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(times_us), rcond=None)
    predicted = alpha + beta * sizes
    ss_res = float(np.sum((times_us - predicted) ** 2))
    ss_tot = float(np.sum((times_us - times_us.mean()) ** 2))
    return float(alpha), float(beta), 1 - ss_res / ss_tot if ss_tot else 1.0


def models(measured: pd.DataFrame) -> pd.DataFrame:
    """t(n) = α + β·n per transport, collective and algorithm measured at two sizes or more (so
    not the barrier), with allreduce's ring/tree crossover, predicted and measured."""
    rows = []
    for (transport, collective, algorithm), group in measured.groupby(["transport", "collective", "algorithm"]):
        group = group.sort_values("bytes")
        if group["bytes"].nunique() < 2:
            continue
        alpha, beta, r2 = fit_alpha_beta(group["bytes"].to_numpy(float), group["median_us"].to_numpy(float))
        rows.append({"transport": transport, "collective": collective, "algorithm": algorithm,
                     "world": int(group["world"].iloc[0]), "alpha_us": alpha,
                     "bandwidth_GBps": (1 / beta / 1e3) if beta > 0 else math.inf, "beta_us_per_byte": beta, "r2": r2})
    table = pd.DataFrame(rows)
    table["crossover_predicted_bytes"] = np.nan
    table["crossover_measured_bytes"] = np.nan
    allreduce = measured[measured["collective"] == "allreduce"]
    for transport in table["transport"].unique():
        fits = table[(table["transport"] == transport) & (table["collective"] == "allreduce")].set_index("algorithm")
        if not {"ring", "tree"} <= set(fits.index):
            continue
        ring, tree = fits.loc["ring"], fits.loc["tree"]
        predicted = np.nan
        if tree["beta_us_per_byte"] > ring["beta_us_per_byte"]:
            predicted = (ring["alpha_us"] - tree["alpha_us"]) / (tree["beta_us_per_byte"] - ring["beta_us_per_byte"])
            predicted = max(predicted, 0.0)
        medians = allreduce[allreduce["transport"] == transport].pivot(index="bytes", columns="algorithm",
                                                                      values="median_us")
        wins = medians.index[medians["ring"] < medians["tree"]]
        measured = float(wins.min()) if len(wins) else np.nan
        mask = (table["transport"] == transport) & (table["collective"] == "allreduce")
        table.loc[mask, "crossover_predicted_bytes"] = predicted
        table.loc[mask, "crossover_measured_bytes"] = measured
    for column in ("crossover_predicted_bytes", "crossover_measured_bytes"):  # whole bytes, or empty
        table[column] = table[column].round().astype("Int64")
    return table


def tuning_from(model: pd.DataFrame) -> dict:
    """Per transport, collective and algorithm, the per-step latency and per-byte time behind the
    fitted line, so ``auto`` can predict any world size: t = steps(N)·α_step + volume(N)·n·β_byte."""
    fitted: dict = {}
    for row in model.itertuples():
        if row.algorithm not in ALGORITHMS.get(row.collective, ()):  # not auto, not gloo
            continue
        steps, volume = algorithm_shape(row.algorithm, row.world, row.collective)
        fitted.setdefault(row.transport, {}).setdefault(row.collective, {})[row.algorithm] = {
            "alpha_step_us": row.alpha_us / steps, "beta_byte_us": row.beta_us_per_byte / volume,
        }
    return fitted


# -- machine, plots, report -----------------------------------------------------------------------


def machine() -> dict[str, str]:
    import numba
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD") + ("+uncommitted" if git("status", "--porcelain", "lab", "kernels") else "")
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu, "cores": str(os.cpu_count()), "memory": f"{memory_kib / 2**20:.1f} GiB",
        "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "numba": numba.__version__, "numpy": np.__version__, "pandas": pd.__version__, "commit": commit,
    }


def plots(out: Path, allreduce: pd.DataFrame, others: pd.DataFrame, kernels: pd.DataFrame, model: pd.DataFrame,
          bucketing: pd.DataFrame, overlap: pd.DataFrame) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = [t for t in allreduce["transport"].unique() if t not in REFERENCES]
    allreduce_fits = model[model["collective"] == "allreduce"]
    fig, axes = plt.subplots(1, len(transports), figsize=(6.5 * len(transports), 4.8), squeeze=False)
    for ax, transport in zip(axes[0], transports):
        for algorithm in [*ALGORITHMS["allreduce"], *REFERENCES]:
            data = allreduce[(allreduce["algorithm"] == algorithm)
                             & (allreduce["transport"] == (transport if algorithm not in REFERENCES else algorithm))]
            if data.empty:
                continue
            line = ax.loglog(data["bytes"], data["median_us"], "o", label=f"{algorithm} (measured)")[0]
            fit = allreduce_fits[(allreduce_fits["transport"] == data["transport"].iloc[0])
                                 & (allreduce_fits["algorithm"] == algorithm)]
            if not fit.empty:
                grid = np.geomspace(data["bytes"].min(), data["bytes"].max(), 100)
                ax.loglog(grid, fit["alpha_us"].iloc[0] + fit["beta_us_per_byte"].iloc[0] * grid, "-",
                          color=line.get_color(), alpha=0.6, label=f"{algorithm} α+βn fit")
        crossover = allreduce_fits[allreduce_fits["transport"] == transport]["crossover_measured_bytes"].dropna()
        if len(crossover):
            ax.axvline(crossover.iloc[0], color="k", linestyle="--", label="measured crossover")
        ax.set(title=f"allreduce, {allreduce['world'].iloc[0]} ranks, {transport} transport",
               xlabel="tensor bytes", ylabel="median µs per call (slowest rank)")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "allreduce_latency.png", dpi=110)
    plt.close(fig)

    everything = pd.concat([allreduce[allreduce["algorithm"].isin(["ring", "gloo"])], others])
    moving = [c for c in COLLECTIVES if c != "barrier"]  # a barrier has no bandwidth
    fig, axes = plt.subplots(1, len(moving), figsize=(5.5 * len(moving), 4.6))
    for ax, collective in zip(axes, moving):
        data = everything[everything["collective"] == collective]
        for (transport, algorithm), group in data.groupby(["transport", "algorithm"]):
            ax.semilogx(group["bytes"], group["busbw_GBps"], "o-", label=f"{algorithm} ({transport})")
        ax.set(title=f"{collective} busbw", xlabel="tensor bytes", ylabel="busbw GB/s")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "busbw.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for (impl, variant), group in kernels.groupby(["impl", "variant"]):
        ax.loglog(group["bytes"], group["GBps"], "o-", label=f"{impl}: {variant}")
    ax.set(title="float32 sum kernels (bytes of all inputs read per second)", xlabel="bytes per buffer",
           ylabel="GB/s")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "kernels.png", dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(bucketing["mode"], bucketing["median_ms"], color=["tab:red", "tab:green"])
    left.set(title=f"gradient sync, {bucketing['tensors'].iloc[0]} tensors "
                   f"({bucketing['bytes'].iloc[0] / 2**20:.0f} MiB)", ylabel="median ms (slowest rank)")
    right.bar(overlap["mode"], overlap["median_ms"], color=["tab:gray", "tab:red", "tab:green"])
    right.set(title="MLP backward + gradient averaging", ylabel="median ms (slowest rank)")
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=110)
    plt.close(fig)


def markdown(frame: pd.DataFrame) -> str:
    """A pipe table (pandas' to_markdown needs the tabulate package)."""
    def cell(value: object) -> str:
        if value is pd.NA:
            return "–"
        if not isinstance(value, float):
            return f"{value:,}" if isinstance(value, (int, np.integer)) and abs(value) >= 10_000 else str(value)
        if math.isnan(value):
            return "–"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"

    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + " --- |" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def report(out: Path, info: dict, allreduce: pd.DataFrame, others: pd.DataFrame, kernels: pd.DataFrame,
           model: pd.DataFrame, check: pd.DataFrame, floor: pd.DataFrame, bucketing: pd.DataFrame,
           overlap: pd.DataFrame) -> str:
    world = int(allreduce["world"].iloc[0])
    median = allreduce.pivot_table(index="bytes", columns=["transport", "algorithm"], values="median_us")
    gloo = median[("gloo", "gloo")]
    lines = [
        "# Results", "",
        f"Generated by `python -m lab results` on {info['date']} (commit {info['commit']}). Do not edit by hand.", "",
        f"**Machine**: {info['cpu']}, {info['cores']} cores, {info['memory']}; {info['os']}.  ",
        f"**Versions**: Python {info['python']}, torch {info['torch']}, numba {info['numba']}, "
        f"numpy {info['numpy']}, pandas {info['pandas']}.  ",
        f"**Method**: {world} ranks on {info['cores']} cores (oversubscribed when ranks > cores); float32; "
        "time inside the ranks per call of a back-to-back loop after warm-up; a call's time is the slowest "
        "rank's; medians (p10/p90 in the CSVs); gloo runs in the same pools, in the same run"
        + (", and so does MPICH's allreduce (`mpiexec`, same timing rules)." if "mpich" in median.columns.get_level_values(0)
           else "; MPICH was not measured (install the `peers` extra)."), "",
        "## Allreduce: latency against gloo", "",
    ]
    fitted = tuning_from(model)
    algorithms = list(ALGORITHMS["allreduce"])
    lines += [f"Every algorithm side by side, median µs per call on {world} ranks; **fastest** is the fastest "
              "measured algorithm, **auto picks** what `algorithm=\"auto\"` chooses from the models fitted in "
              "this run (see below), **auto µs** what auto measured.", ""]
    mpich_us = median[("mpich", "mpich")] if ("mpich", "mpich") in median.columns else None
    for transport in [t for t in allreduce["transport"].unique() if t not in REFERENCES]:
        table = pd.DataFrame({"size": [size_label(b) for b in median.index]})
        for algorithm in algorithms:
            table[f"{algorithm} µs"] = median[(transport, algorithm)].to_numpy()
        best = median[transport][algorithms].min(axis=1)
        table["gloo µs"] = gloo.to_numpy()
        table["lab/gloo"] = (best / gloo).to_numpy()  # the fastest algorithm's time over gloo's: < 1 is faster
        if mpich_us is not None:
            table["MPICH µs"] = mpich_us.to_numpy()
            table["lab/MPICH"] = (best / mpich_us).to_numpy()
        table["fastest"] = median[transport][algorithms].idxmin(axis=1).to_numpy()
        table["auto picks"] = [tuning.choose(int(b), world, transport, "allreduce", fitted) for b in median.index]
        table["auto µs"] = median[(transport, "auto")].to_numpy()
        lines += [f"**{transport}**", "", markdown(table), ""]
    best_shm = median["shm"][algorithms].min(axis=1) if "shm" in median.columns.get_level_values(0) else None
    lines += ["![allreduce latency](allreduce_latency.png)", ""]
    if best_shm is not None:
        ratio = gloo / best_shm
        small, large = ratio.index.min(), ratio.index.max()
        lines += [
            f"- The best shm algorithm is {ratio[small]:.1f}× gloo's speed at {size_label(small)} and "
            f"{ratio[large]:.2f}× at {size_label(large)}, measured in the same pools in the same run.",
            *([f"- Against MPICH (`comm.Allreduce`, same run, same timing rules) the best shm algorithm takes "
               f"{best_shm[small] / mpich_us[small]:.2f}× MPICH's time at {size_label(small)} and "
               f"{best_shm[large] / mpich_us[large]:.2f}× at {size_label(large)}. MPICH's ranks poll without "
               "sleeping: fastest when every rank has a core, slowest when they outnumber the cores."]
              if mpich_us is not None else []),
            "- Small messages are bound by wake-ups, not bytes: each step of an algorithm is a pipe message "
            "that wakes a sleeping rank, and with more ranks than cores a woken rank also waits for a core, "
            "so tree's 2⌈log2 N⌉ steps beat ring's 2(N-1).",
            "- Large messages are bound by memory bandwidth: every byte is copied into a shared slot and then "
            "read again by the receiver's kernel, on two cores shared by four ranks and gloo's threads.",
            "- What bounds small messages, measured (`latency_floor.csv`, 1 KB, shm): "
            + "; ".join(f"{w} rank{'s' if w > 1 else ''}: tree {g.set_index('algorithm')['median_us']['tree']:.0f} µs, "
                        f"ring {g.set_index('algorithm')['median_us']['ring']:.0f} µs, "
                        f"gloo {g.set_index('algorithm')['median_us']['gloo']:.0f} µs"
                        for w, g in floor.groupby("world"))
            + f". One rank is the Python cost of a call; up to {info['cores']} ranks each has a core and a step "
            "costs a pipe wake-up; beyond that every step also waits for a core.",
            *([f"- **tcp vs gloo** (both over loopback TCP, the like-for-like comparison): at {size_label(large)} "
               f"the best tcp algorithm takes {median['tcp'][algorithms].min(axis=1)[large] / 1e3:.1f} ms "
               f"against gloo's {gloo[large] / 1e3:.1f} ms "
               f"({gloo[large] / median['tcp'][algorithms].min(axis=1)[large]:.2f}× gloo's speed); at "
               f"{size_label(small)} {median['tcp'][algorithms].min(axis=1)[small]:.0f} µs against "
               f"{gloo[small]:.0f} µs."] if "tcp" in median.columns.get_level_values(0) else []),
            "- The queue transport pays two pickling copies and fresh allocations (page faults) per message; "
            "its large-message times swing with the allocator's state from one size to the next.", "",
        ]

    lines += ["## Fitted α-β models and the ring/tree crossover", "",
              "t(n) = α + β·n fitted to the medians (relative least squares); 1/β as GB/s.", ""]
    allreduce_fits = model[model["collective"] == "allreduce"]
    shown = allreduce_fits[["transport", "algorithm", "alpha_us", "bandwidth_GBps", "r2", "crossover_predicted_bytes",
                            "crossover_measured_bytes"]].rename(columns={
        "alpha_us": "α µs", "bandwidth_GBps": "1/β GB/s", "r2": "R²",
        "crossover_predicted_bytes": "predicted crossover (bytes)", "crossover_measured_bytes": "measured crossover (bytes)"})
    lines += [markdown(shown), ""]
    for transport in [t for t in allreduce_fits["transport"].unique() if t not in REFERENCES]:
        rows = allreduce_fits[allreduce_fits["transport"] == transport]
        measured, predicted = (float(rows[c].iloc[0]) if pd.notna(rows[c].iloc[0]) else math.nan
                               for c in ("crossover_measured_bytes", "crossover_predicted_bytes"))
        medians = allreduce[allreduce["transport"] == transport].pivot(index="bytes", columns="algorithm",
                                                                      values="median_us")
        ring_wins = [size_label(b) for b in medians.index if medians.loc[b, "ring"] < medians.loc[b, "tree"]]
        text = (f"- **{transport}**: ring first beats tree at **{size_label(int(measured))}** (measured; ring is "
                f"faster at {', '.join(ring_wins)})"
                if not math.isnan(measured) else f"- **{transport}**: ring never beats tree from 1 KB to 16 MB")
        text += (f"; the fitted lines cross at {predicted / 1024:.0f} KB." if not math.isnan(predicted)
                 else "; the fitted lines do not cross (tree's per-byte cost is not above ring's here).")
        lines.append(text)
    lines += [
        "- Why the margin is thin here: ring, tree and naive all move the same total, 2(N-1)·T bytes per "
        "allreduce (ring: N ranks × 2(N-1)/N·T; tree and naive: 2(N-1) whole-tensor messages). They differ in "
        "how that traffic is spread over links: evenly (ring), through log2 N levels (tree), all through "
        "rank 0 (naive). On one machine every rank shares one memory bus, so at large sizes only the total "
        "counts and the three converge; the crossover moves from run to run. Across hosts, where each link "
        "is its own bottleneck, the per-rank 2T(N-1)/N of the ring is what wins.",
        "- The other algorithms trade the same two terms (docs/algorithms.md): recursive "
        "doubling takes log2 N steps but moves log2 N·T per rank; halving-doubling moves the ring's "
        "2(N-1)/N·T in 2·log2 N steps; double tree moves 2T per rank with depth log2 N, pipelined in segments.",
        "", "`algorithm=\"auto\"` picks the algorithm these models predict fastest (see docs/algorithms.md).", ""]

    lines += ["## The other collectives: every algorithm against gloo", "",
              "Median µs per call; **auto picks** is what `auto` chooses on shm from the models fitted in this run "
              "(sizes as nccl-tests counts them: the allgather result, the reduce_scatter and all_to_all input).", ""]
    for collective in [c for c in COLLECTIVES[1:] if c in set(others["collective"])]:
        data = others[others["collective"] == collective]
        pivot = data.pivot_table(index="bytes", columns=["transport", "algorithm"], values="median_us")
        table = pd.DataFrame({"size": [size_label(b) if b else "–" for b in pivot.index]})
        for transport, algorithm in pivot.columns:
            table[f"{transport} {algorithm} µs" if transport != "gloo" else "gloo µs"] = pivot[(transport, algorithm)].to_numpy()
        if registry.choosable(collective) and "shm" in data["transport"].unique():
            table["auto picks (shm)"] = [tuning.choose(int(b), world, "shm", collective, fitted) for b in pivot.index]
        lines += [f"**{collective}**", "", markdown(table), ""]
    other_fits = model[model["collective"] != "allreduce"][["transport", "collective", "algorithm", "alpha_us",
                                                            "bandwidth_GBps", "r2"]]
    lines += ["Fitted t(n) = α + β·n:", "", markdown(other_fits.rename(columns={
        "alpha_us": "α µs", "bandwidth_GBps": "1/β GB/s", "r2": "R²"})), "", "![busbw](busbw.png)", ""]

    lines += ["## Reduction kernels: Python vs numpy vs Numba", "",
              "GB/s counts the bytes of every input read per second.", ""]
    kt = kernels.pivot_table(index="bytes", columns=["impl", "variant"], values="GBps")
    table = pd.DataFrame({"size": [size_label(b) for b in kt.index]})
    for column in kt.columns:
        table[f"{column[0]}: {column[1]}"] = kt[column].to_numpy()
    lines += [markdown(table), "", "![kernels](kernels.png)", ""]
    big = kernels["bytes"].max()
    at = kernels[kernels["bytes"] == big].set_index(["impl", "variant"])["GBps"]
    mid = kernels[kernels["bytes"] == PYTHON_KERNEL_MAX_BYTES].set_index(["impl", "variant"])["GBps"]
    lines += [
        f"- Numba `dst += src` runs at {at[('numba', 'dst += src')] / at[('numpy', 'dst += src')]:.2f}× numpy's "
        f"`np.add` at {size_label(big)} (bar: ≥ 0.9×).",
        f"- The fused 4-input Numba reduce runs at {at[('numba', 'dst += a + b + c')] / at[('numpy', '3 chained np.add')]:.2f}× "
        f"three chained numpy adds at {size_label(big)} (bar: ≥ 1.5×): one pass instead of three over `dst`.",
        f"- Numba is {mid[('numba', 'dst += src')] / mid[('python', 'dst += src')]:.0f}× the pure-Python loop at "
        f"{size_label(PYTHON_KERNEL_MAX_BYTES)} (bar: ≥ 100×).", "",
    ]

    one, bucketed = (bucketing.set_index("mode").loc[m] for m in ("one by one", "bucketed"))
    small = allreduce[(allreduce["transport"] == "shm") & (allreduce["algorithm"] == "auto")
                      & (allreduce["bytes"] == allreduce["bytes"].min())]
    per_call_us = float(small["median_us"].iloc[0]) if len(small) else float("nan")
    floor_ms = one["tensors"] * per_call_us / 1e3
    modes = overlap.set_index("mode")
    lines += [
        "## Training patterns: bucketing and overlap", "",
        markdown(bucketing), "", markdown(overlap), "", "![training](training.png)", "",
        f"- **Bucketing**: {int(one['tensors'])} transformer-shaped gradients ({one['bytes'] / 2**20:.0f} MiB) "
        f"take {one['median_ms']:.0f} ms one allreduce at a time and {bucketed['median_ms']:.0f} ms in 25 MB "
        f"buckets: **{one['median_ms'] / bucketed['median_ms']:.1f}× faster**. A {size_label(int(small['bytes'].iloc[0]))} "
        f"allreduce costs {per_call_us:.0f} µs here (the table above), so {int(one['tensors'])} calls pay about "
        f"{floor_ms:.0f} ms of latency floor before moving any real volume: that, not bandwidth, is what "
        "bucketing removes (most of these tensors are a few KB).",
        f"- **Overlap**: backward alone takes {modes.loc['compute', 'median_ms']:.1f} ms; averaging the gradients "
        f"after it makes {modes.loc['sequential', 'median_ms']:.1f} ms (visible communication "
        f"{modes.loc['sequential', 'visible_comm_ms']:.1f} ms), and starting each allreduce from the backward "
        f"hooks makes {modes.loc['overlap', 'median_ms']:.1f} ms (visible "
        f"{modes.loc['overlap', 'visible_comm_ms']:.1f} ms). Overlap hides communication only with spare "
        f"resources to run it on; here {world} ranks already share {info['cores']} cores, so the communication "
        "thread competes with backward for the same CPU.", "",
    ]
    lines += ["## Every primitive against gloo", "",
              f"{int((check['result'] == 'PASS').sum())} of {len(check)} rows pass (`gloo_check.csv`; "
              "the same table as `python -m lab`).", ""]
    return "\n".join(lines)


def main(out_dir: str = "results", world_size: int = 4, transports: list[str] | None = None,
         sizes: list[int] | None = None, update_tuning: bool = True) -> int:
    from lab.validate import validation_table

    transports = transports or ["shm", "queue", "tcp"]
    sizes = sizes or SIZES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"Sweeping {len(sizes)} sizes on {world_size} ranks over {', '.join(transports)} and gloo", file=sys.stderr)
    allreduce, others = sweep(world_size, transports, sizes)
    print("Latency floor", file=sys.stderr)
    floor = latency_floor(world_size)
    print("Training patterns", file=sys.stderr)
    bucketing, overlap = training_patterns(world_size)
    print("Kernels", file=sys.stderr)
    kernels = kernel_sweep()
    print("Every primitive against gloo", file=sys.stderr)
    check = validation_table(transports, [3, world_size], 1001, 0)
    model = models(pd.concat([allreduce, others]))
    for name, frame in [("allreduce", allreduce), ("collectives", others), ("kernels", kernels), ("model", model),
                        ("gloo_check", check), ("latency_floor", floor), ("bucketing", bucketing),
                        ("overlap", overlap)]:
        frame.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
    (out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    plots(out, allreduce, others, kernels, model, bucketing, overlap)
    (out / "REPORT.md").write_text(report(out, info, allreduce, others, kernels, model, check, floor,
                                          bucketing, overlap))
    if update_tuning:
        TUNING_PATH.write_text(json.dumps({"generated": info, "world": world_size, "models": tuning_from(model)},
                                          indent=2) + "\n")
    print(f"Wrote {out}/ (REPORT.md, CSVs, PNGs)" + (f" and {TUNING_PATH}" if update_tuning else ""))
    return 0 if (check["result"] == "PASS").all() else 1
