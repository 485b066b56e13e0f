"""Fit :class:`~lab.sim.network.Network` to measured results, then compare predictions with measurement.

A simulated time is a sum along the critical path: ``a·α + b·β`` for a path of ``a`` messages and
``b`` bytes. So a fit is linear once the paths are known: simulate every measured case with a
guess, regress the measured medians on (a, b) with pandas/numpy (least *absolute* relative error,
by reweighted least squares: 1 KB counts as much as 16 MB, and a few cases the model cannot
describe do not drag the rest), re-simulate with the fit (the paths can change) and regress
again, three times.

Measured inputs, as ``python -m lab results`` writes them: ``<dir>/allreduce.csv`` and
``<dir>/collectives.csv`` (one setting per transport: shm pool, tcp over loopback, queue) and,
when they exist, ``<dir>/hosts/allreduce.csv`` from ``python -m lab results --hosts 4 8`` (one
setting per host count and link cap: one rank per emulated host, so each rank's link is the
host's). Any other measured CSV with the same columns plus ``hosts`` and ``link_gbit`` can be
added to :data:`SOURCES`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from lab.sim.core import simulate
from lab.sim.network import ALPHA_US, GBIT, Network
from lab.sim.record import algorithms

#: Measured CSVs (relative to the results directory) and whether their rows are emulated hosts.
SOURCES = [("allreduce.csv", False), ("collectives.csv", False), ("hosts/allreduce.csv", True)]
ITERATIONS = 3
IRLS_STEPS = 20


def _input_bytes(collective: str, nbytes: int, world: int) -> int:
    """Each rank's input for a measured size, as lab.benchmark builds it (allgather: T/N per rank)."""
    numel = max(nbytes // 4, 1)
    if collective == "allgather":
        numel = max(numel // world, 1)
    return numel * 4


def measured(results_dir: Path) -> pd.DataFrame:
    """The lab's own measured rows that the simulator can replay, with a ``setting`` per network."""
    table = algorithms()
    frames = []
    for name, hosts in SOURCES:
        path = Path(results_dir) / name
        if not path.exists():
            continue
        frame = pd.read_csv(path)
        frame = frame[(frame["impl"] == "lab") & frame["collective"].isin(list(table))]
        frame = frame[[a in table[c] for c, a in zip(frame["collective"], frame["algorithm"])]].copy()
        if hosts:
            frame["setting"] = [f"{h} hosts, {g:g} Gbit/s" for h, g in zip(frame["hosts"], frame["link_gbit"])]
        else:
            frame["setting"] = frame["transport"]
        frames.append(frame[["setting", "collective", "algorithm", "world", "bytes", "median_us"]])
    if not frames:
        return pd.DataFrame(columns=["setting", "collective", "algorithm", "world", "bytes", "median_us"])
    frame = pd.concat(frames, ignore_index=True)
    frame["sim_bytes"] = [_input_bytes(c, b, w) for c, b, w in zip(frame["collective"], frame["bytes"], frame["world"])]
    return frame


def _paths(rows: pd.DataFrame, network: Network) -> pd.DataFrame:
    """Messages and bytes on each case's critical path, and its simulated time, on ``network``."""
    out = []
    for row in rows.itertuples(index=False):
        r = simulate(row.collective, row.algorithm, int(row.world), int(row.sim_bytes), network)
        out.append({"messages": len(r.critical_path), "path_bytes": sum(m.nbytes for m in r.critical_path),
                    "predicted_us": r.time_us})
    return pd.DataFrame(out, index=rows.index)


def fit(rows: pd.DataFrame, start: Network | None = None) -> Network:
    """The α and bandwidth that make the simulator best match ``rows`` (one setting)."""
    network = start or Network(alpha_us=50.0, gbit=10.0)
    measured_us = rows["median_us"].to_numpy(dtype=float)
    for _ in range(ITERATIONS):
        paths = _paths(rows, network)
        design = paths[["messages", "path_bytes"]].to_numpy(dtype=float) / measured_us[:, None]
        # Least absolute relative error, by reweighted least squares: a case the model cannot
        # describe (an algorithm whose schedule serialises what the machine overlaps, a CPU-bound
        # case) then shifts the fit by its rank among the errors, not by its size.
        weight = np.ones(len(rows))
        for _ in range(IRLS_STEPS):
            (alpha, beta), *_ = np.linalg.lstsq(design * weight[:, None], weight, rcond=None)
            residual = np.abs(design @ np.array([alpha, beta]) - 1.0)
            weight = 1.0 / np.sqrt(np.maximum(residual, 1e-3))
        # Keep the model physical and inside Network's ranges: no negative latency, a finite bandwidth.
        alpha = min(max(float(alpha), ALPHA_US[0]), ALPHA_US[1])
        gbit = min(max(8.0 / (max(float(beta), 1e-9) * 1e3), GBIT[0]), GBIT[1])
        network = Network(alpha_us=alpha, gbit=gbit)
    return network


def calibrate(results_dir: Path) -> tuple[dict[str, Network], pd.DataFrame]:
    """A fitted network per setting, and every measured case with its prediction and the ratio."""
    frame = measured(results_dir)
    networks, parts = {}, []
    for setting, rows in frame.groupby("setting", sort=True):
        networks[setting] = network = fit(rows)
        rows = rows.join(_paths(rows, network))
        rows["ratio"] = rows["predicted_us"] / rows["median_us"]
        parts.append(rows)
    table = pd.concat(parts, ignore_index=True) if parts else frame.assign(predicted_us=[], ratio=[])
    return networks, table


def best_agreement(table: pd.DataFrame) -> pd.DataFrame:
    """Per setting, collective, N and size: the measured and the predicted fastest algorithm."""
    rows = []
    for key, group in table.groupby(["setting", "collective", "world", "bytes"], sort=True):
        if len(group) < 2:
            continue
        measured_best = group.loc[group["median_us"].idxmin(), "algorithm"]
        predicted_best = group.loc[group["predicted_us"].idxmin(), "algorithm"]
        rows.append(dict(zip(["setting", "collective", "world", "bytes"], key), measured_best=measured_best,
                         predicted_best=predicted_best, agree=measured_best == predicted_best))
    return pd.DataFrame(rows)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def validation_section(results_dir: Path, out: Path) -> str:
    """REPORT.md's "Simulator vs measurement" (and ``calibration.csv``, ``validation.csv`` in ``out``)."""
    networks, table = calibrate(results_dir)
    if table.empty:
        return ""
    agreement = best_agreement(table)
    pd.DataFrame([{"setting": s, "alpha_us": n.alpha_us, "gbit": n.gbit} for s, n in networks.items()]).to_csv(
        out / "calibration.csv", index=False, float_format="%.6g")
    table.to_csv(out / "validation.csv", index=False, float_format="%.6g")
    agreement.to_csv(out / "best_agreement.csv", index=False)
    lines = ["## Simulator vs measurement\n",
             "Each setting's network fitted to its measured medians (least absolute relative error; "
             "`lab.sim.calibrate`), then every measured case predicted with it. Ratio = predicted / measured.\n",
             "| setting | fitted α (µs) | fitted bandwidth (Gbit/s) | cases | within 25 % (≥ 64 KB) | within 2× | "
             "predicted best = measured best |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for setting, network in networks.items():
        rows = table[table["setting"] == setting]
        large = rows[rows["bytes"] >= 64 << 10]
        near = ((large["ratio"] - 1).abs() <= 0.25).mean() if len(large) else np.nan
        within2 = ((rows["ratio"] <= 2) & (rows["ratio"] >= 0.5)).mean()
        agree = agreement[agreement["setting"] == setting]["agree"]
        lines.append(f"| {setting} | {network.alpha_us:,.1f} | {network.gbit:.3g} | {len(rows)} | {near:.0%} | "
                     f"{within2:.0%} | {int(agree.sum())} of {len(agree)} |")
    for setting in networks:
        rows = table[(table["setting"] == setting) & (table["collective"] == "allreduce")]
        if rows.empty:
            continue
        grid = rows.pivot_table(index="bytes", columns=["world", "algorithm"], values="ratio")
        grid.index = [_size(int(b)) for b in grid.index]
        grid.columns = [f"{a} (N={w})" if rows["world"].nunique() > 1 else a for w, a in grid.columns]
        lines.append(f"\nAllreduce on {setting}, predicted / measured:\n")
        lines.append("| size | " + " | ".join(grid.columns) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in grid.columns) + " |")
        lines += [f"| {size} | " + " | ".join(f"{v:.2f}" for v in values) + " |" for size, values in grid.iterrows()]
    misses = agreement[~agreement["agree"]]
    if len(misses):
        lines.append(f"\nWhere the predicted best is not the measured best ({len(misses)} of {len(agreement)}): "
                     + "; ".join(f"{r.setting} {r.collective} N={r.world} {_size(int(r.bytes))}: measured "
                                 f"{r.measured_best}, predicted {r.predicted_best}" for r in misses.head(12).itertuples())
                     + ". The model has one α and one β per setting and no CPU: ranks that share two cores "
                     "(shm, tcp on one machine) also wait for each other's copies and reductions, which the "
                     "network model does not see; where two algorithms are within a few per cent of each "
                     "other, measurement noise decides.")
    return "\n".join(lines) + "\n"
