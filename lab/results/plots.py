"""The figures of ``results/`` and ``results/hosts/`` (matplotlib, the ``plots`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.results.sweeps import REFERENCES, Measurements, lab_transports


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; imported here, so that the lab runs without
    the ``plots`` extra until a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(ax: Any, legend_size: int = 7) -> None:
    """A panel's legend and log-friendly grid."""
    ax.legend(fontsize=legend_size)
    ax.grid(True, which="both", alpha=0.3)


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def draw(out: Path, run: Measurements, model: pd.DataFrame) -> None:
    """``allreduce_latency.png``, ``busbw.png``, ``kernels.png`` and ``training.png`` in ``out``."""
    allreduce_latency(out / "allreduce_latency.png", run.allreduce, model[model["collective"] == "allreduce"])
    busbw(out / "busbw.png", run.allreduce, run.others)
    kernels(out / "kernels.png", run.kernels)
    training(out / "training.png", run.bucketing, run.overlap)


def allreduce_latency(path: Path, allreduce: pd.DataFrame, fits: pd.DataFrame) -> None:
    """One panel per lab transport: every algorithm's medians and fitted line, the references, and
    the measured ring/tree crossover."""
    transports = lab_transports(allreduce)
    fig, axes = pyplot().subplots(1, len(transports), figsize=(6.5 * len(transports), 4.8), squeeze=False)
    for ax, transport in zip(axes[0], transports):
        for algorithm in [*registry.names("allreduce"), *REFERENCES]:
            where = transport if algorithm not in REFERENCES else algorithm  # a reference's transport: its name
            data = allreduce[(allreduce["algorithm"] == algorithm) & (allreduce["transport"] == where)]
            if not data.empty:
                medians_and_fit(ax, algorithm, data, fits)
        crossover = fits[fits["transport"] == transport]["crossover_measured_bytes"].dropna()
        if len(crossover):
            ax.axvline(crossover.iloc[0], color="k", linestyle="--", label="measured crossover")
        ax.set(title=f"allreduce, {allreduce['world'].iloc[0]} ranks, {transport} transport",
               xlabel="tensor bytes", ylabel="median µs per call (slowest rank)")
        finish(ax)
    save(fig, path)


def medians_and_fit(ax: Any, algorithm: str, data: pd.DataFrame, fits: pd.DataFrame) -> None:
    """``algorithm``'s measured medians as dots and, where it was fitted, its α + β·n line."""
    line = ax.loglog(data["bytes"], data["median_us"], "o", label=f"{algorithm} (measured)")[0]
    fit = fits[(fits["transport"] == data["transport"].iloc[0]) & (fits["algorithm"] == algorithm)]
    if not fit.empty:
        grid = np.geomspace(data["bytes"].min(), data["bytes"].max(), 100)
        ax.loglog(grid, fit["alpha_us"].iloc[0] + fit["beta_us_per_byte"].iloc[0] * grid, "-",
                  color=line.get_color(), alpha=0.6, label=f"{algorithm} α+βn fit")


def busbw(path: Path, allreduce: pd.DataFrame, others: pd.DataFrame) -> None:
    """busbw against size, one panel per collective that moves bytes; allreduce as ring (the
    bandwidth-optimal one) and gloo."""
    everything = pd.concat([allreduce[allreduce["algorithm"].isin(["ring", "gloo"])], others])
    moving = [c for c in registry.COLLECTIVES if CATALOG[c].moves_bytes]  # a barrier has no bandwidth
    fig, axes = pyplot().subplots(1, len(moving), figsize=(5.5 * len(moving), 4.6))
    for ax, collective in zip(axes, moving):
        data = everything[everything["collective"] == collective]
        for (transport, algorithm), group in data.groupby(["transport", "algorithm"]):
            ax.semilogx(group["bytes"], group["busbw_GBps"], "o-", label=f"{algorithm} ({transport})")
        ax.set(title=f"{collective} busbw", xlabel="tensor bytes", ylabel="busbw GB/s")
        finish(ax)
    save(fig, path)


def kernels(path: Path, table: pd.DataFrame) -> None:
    """GB/s against size, one line per kernel implementation and variant."""
    fig, ax = pyplot().subplots(figsize=(7, 4.6))
    for (impl, variant), group in table.groupby(["impl", "variant"]):
        ax.loglog(group["bytes"], group["GBps"], "o-", label=f"{impl}: {variant}")
    ax.set(title="float32 sum kernels (bytes of all inputs read per second)", xlabel="bytes per buffer",
           ylabel="GB/s")
    finish(ax, legend_size=8)
    save(fig, path)


def training(path: Path, bucketing: pd.DataFrame, overlap: pd.DataFrame) -> None:
    """Bars: gradient sync one by one against bucketed; backward alone, then averaging, then overlapped."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    left.bar(bucketing["mode"], bucketing["median_ms"], color=["tab:red", "tab:green"])
    left.set(
        title=f"gradient sync, {bucketing['tensors'].iloc[0]} tensors "
        f"({bucketing['bytes'].iloc[0] / 2**20:.0f} MiB)", ylabel="median ms (slowest rank)")
    right.bar(overlap["mode"], overlap["median_ms"], color=["tab:gray", "tab:red", "tab:green"])
    right.set(title="MLP backward + gradient averaging", ylabel="median ms (slowest rank)")
    save(fig, path)


# -- across hosts ----------------------------------------------------------------------------------


def across_hosts(out: Path, frame: pd.DataFrame, model: pd.DataFrame) -> None:
    """``allreduce_latency.png`` (with the link model dotted and the ring/tree crossovers) and
    ``allreduce_busbw.png`` (busbw over the link cap) in ``out``, one panel per (hosts, rate)."""
    groups = list(frame.groupby(["hosts", "link_gbit"]))
    for name, column, ylabel in [("latency", "median_us", "median µs per call (slowest rank)"),
                                 ("busbw", "link_use", "busbw / link cap")]:
        fig, axes = pyplot().subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
        for ax, ((hosts, gbit), data) in zip(axes[0], groups):
            for algorithm, group in data.groupby("algorithm"):
                group = group.sort_values("bytes")
                line = ax.plot(group["bytes"], group[column], "o-", label=algorithm)[0]
                if name == "latency" and group["link_model_us"].notna().any():
                    ax.plot(group["bytes"], group["link_model_us"], ":", color=line.get_color())
            if name == "latency":
                crossovers(ax, model[(model["hosts"] == hosts) & (model["link_gbit"] == gbit)])
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="k", linestyle="--", label="link cap")
            ax.set_xscale("log")
            ax.set(title=f"allreduce, {hosts} hosts x 1 rank, links {gbit:g} Gbit/s", xlabel="tensor bytes",
                   ylabel=ylabel)
            finish(ax)
        save(fig, out / f"allreduce_{name}.png")


def crossovers(ax: Any, fits: pd.DataFrame) -> None:
    """The predicted (dashed) and measured (solid) ring/tree crossovers of one setting's ``fits``."""
    for column, style in [("crossover_predicted_bytes", "--"), ("crossover_measured_bytes", "-")]:
        if fits[column].notna().any():
            ax.axvline(float(fits[column].iloc[0]), color="k", linestyle=style, alpha=0.5,
                       label=column.split("_")[1] + " ring/tree crossover")
