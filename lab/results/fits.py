"""α-β models of measured medians: the fits, the ring/tree crossover, and the models ``auto`` uses."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.algorithms import registry
from lab.tuning import algorithm_shape


def fit_alpha_beta(sizes: np.ndarray, times_us: np.ndarray) -> tuple[float, float, float]:
    """Fit t(n) = α + β·n to medians, minimising relative error (sizes span four decades).

    Returns α (µs), β (µs per byte) and R² on the raw times.
    """
    design = np.column_stack([1 / times_us, sizes / times_us])
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(times_us), rcond=None)
    predicted = alpha + beta * sizes
    ss_res = float(np.sum((times_us - predicted)**2))
    ss_tot = float(np.sum((times_us - times_us.mean())**2))
    return float(alpha), float(beta), 1 - ss_res / ss_tot if ss_tot else 1.0


def fit_medians(group: pd.DataFrame) -> tuple[float, float, float]:
    """:func:`fit_alpha_beta` of one algorithm's rows (``bytes``, ``median_us``), smallest size first."""
    group = group.sort_values("bytes")
    return fit_alpha_beta(group["bytes"].to_numpy(float), group["median_us"].to_numpy(float))


def bandwidth_gbps(beta_us_per_byte: float) -> float:
    """1/β in GB/s (infinite for a flat line)."""
    return (1 / beta_us_per_byte / 1e3) if beta_us_per_byte > 0 else math.inf


def by_size(rows: pd.DataFrame) -> pd.DataFrame:
    """Median µs, one row per size, one column per algorithm (``rows``: one setting's cases)."""
    return rows.pivot(index="bytes", columns="algorithm", values="median_us")


def crossover(fits: pd.DataFrame, rows: pd.DataFrame) -> tuple[float, float]:
    """Where ring overtakes tree, as the lesson says it does: (predicted, measured) bytes, NaN for none.

    Predicted: where the fitted lines α + β·n meet (``fits``: one row per algorithm, indexed by
    it), never below 0, and none unless tree's β is above ring's. Measured: the smallest size whose
    ring median beat tree's (``rows``: the cases of the same setting).
    """
    ring, tree = fits.loc["ring"], fits.loc["tree"]
    predicted = np.nan
    if tree["beta_us_per_byte"] > ring["beta_us_per_byte"]:
        predicted = max(
            (ring["alpha_us"] - tree["alpha_us"]) / (tree["beta_us_per_byte"] - ring["beta_us_per_byte"]),
            0.0)
    medians = by_size(rows)
    wins = medians.index[medians["ring"] < medians["tree"]]
    return predicted, float(wins.min()) if len(wins) else np.nan


def models(measured: pd.DataFrame) -> pd.DataFrame:
    """t(n) = α + β·n per transport, collective and algorithm measured at two sizes or more (so
    not the barrier), with allreduce's ring/tree crossover, predicted and measured."""
    rows = []
    for (transport, collective,
         algorithm), group in measured.groupby(["transport", "collective", "algorithm"]):
        if group["bytes"].nunique() < 2:
            continue
        alpha, beta, r2 = fit_medians(group)
        rows.append({
            "transport": transport, "collective": collective, "algorithm": algorithm,
            "world": int(group["world"].iloc[0]), "alpha_us": alpha, "bandwidth_GBps": bandwidth_gbps(beta),
            "beta_us_per_byte": beta, "r2": r2})
    return with_crossovers(pd.DataFrame(rows), measured[measured["collective"] == "allreduce"])


def with_crossovers(table: pd.DataFrame, allreduce: pd.DataFrame) -> pd.DataFrame:
    """``table`` (the fits) with each transport's allreduce crossover on its allreduce rows, in
    whole bytes (empty where there is none, or where ring or tree was not measured)."""
    table["crossover_predicted_bytes"] = np.nan
    table["crossover_measured_bytes"] = np.nan
    for transport in table["transport"].unique():
        mask = (table["transport"] == transport) & (table["collective"] == "allreduce")
        fits = table[mask].set_index("algorithm")
        if not {"ring", "tree"} <= set(fits.index):
            continue
        predicted, measured = crossover(fits, allreduce[allreduce["transport"] == transport])
        table.loc[mask, "crossover_predicted_bytes"] = predicted
        table.loc[mask, "crossover_measured_bytes"] = measured
    for column in ("crossover_predicted_bytes", "crossover_measured_bytes"):
        table[column] = table[column].round().astype("Int64")
    return table


def tuning_from(model: pd.DataFrame, measured: pd.DataFrame | None = None) -> dict:
    """Per transport, collective and algorithm, the per-step latency and per-byte time behind the
    fitted line, so ``auto`` can predict any world size: t = steps(N)·α_step + volume(N)·n·β_byte;
    with ``measured`` (the sweep's rows), also the world size and the medians the line was fitted
    to (``points``: [bytes, µs] by size), which ``auto`` follows between measured sizes."""
    fitted: dict = {}
    for row in model.itertuples():
        if row.algorithm not in registry.ALGORITHMS.get(row.collective, ()):  # not auto, not gloo
            continue
        steps, volume = algorithm_shape(row.algorithm, row.world, row.collective)
        fit = {"alpha_step_us": row.alpha_us / steps, "beta_byte_us": row.beta_us_per_byte / volume}
        if measured is not None:
            rows = measured[(measured["transport"] == row.transport)
                            & (measured["collective"] == row.collective)
                            & (measured["algorithm"] == row.algorithm) & (measured["world"] == row.world)]
            fit["world"] = int(row.world)
            medians = rows.sort_values("bytes")[["bytes", "median_us"]].to_numpy()
            fit["points"] = [[int(nbytes), float(us)] for nbytes, us in medians]
        fitted.setdefault(row.transport, {}).setdefault(row.collective, {})[row.algorithm] = fit
    return fitted
