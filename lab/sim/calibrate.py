"""Fit :class:`~lab.sim.network.Network` to measured results per setting, then validate it on cases the fit never saw.

The model has link terms (α, bandwidth), CPU terms (per-message overheads ``o_send`` and
``o_recv``, a per-byte ``copy`` on each side and the reduction's ``γ``), ``wake`` (a receiver
waiting asleep starts that long after its message arrived) and ``memory`` (what a byte copied
costs more in a case whose working set outgrows the machine's last-level cache), and the
measured machine's cores and cache, which every rank of one machine shares (``cores`` and
``last_level_cache_bytes`` from the run's ``machine.json``, else this machine's; emulated hosts
are namespaces on that one machine, so their ranks share them too). A setting's eight
parameters minimise the mean ``|log(predicted / measured)|`` of its calibration cases (a
robust fit: 1 KB counts as much as 16 MB, and a case the model cannot describe shifts it by its
rank, not its size), by Levenberg–Marquardt on reweighted least squares of the parameters'
logarithms (positive, scale-free). Every evaluation replays every calibration case on the lab's
recorded schedules, so the critical path, the waits for ports and for cores are the simulator's
own, and replays it as the benchmark measured it (:func:`benchmark_us`): ``LOOP_CALLS`` calls back
to back, each rank timing its own call from the end of its last, so that the senders of a rooted
collective run ahead into the next call while the root takes their messages, as they do in
``lab.benchmark``'s loop (a single call from a common start had gather on tcp 2× too slow).

How well each parameter is determined: the fit error's rise when that parameter alone moves by
±20 % (the smaller of the two rises): a few per cent or more is well determined, near zero means
the measurements hardly constrain it (another parameter does its work, or it does not matter).

Split: a case calibrates when its world size is 2, 4 or 8 and its size is 1 KB·16^k (1 KB, 16 KB,
256 KB, 4 MB, 64 MB) or the largest its setting measured (16 MB on one machine, 64 MB across
hosts), so that validation sizes lie between calibrated ones and never beyond them; every other
case (N = 3, 5, 6, 7 at every size, and 4 KB, 64 KB, 1 MB and on hosts 16 MB at N = 2, 4, 8)
validates. Measured inputs, as ``python -m lab results`` writes them (:data:`SOURCES`): the pool's
transports at N = 4 (``allreduce.csv``, ``collectives.csv``) and at other N (``ranks/N/``, from
``python -m lab results --ranks N --quick --keep-tuning --out results/ranks/N``), emulated hosts with one rank each
(``hosts/allreduce.csv``) and with two (``hosts/hierarchical.csv``, shared memory inside a host:
its intra-host link is the shm setting's).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from lab.catalog import COLLECTIVES as CATALOG
from lab.sim.core import recorded_schedule
from lab.sim.event_loop import loop_times, match_messages
from lab.sim.network import MAX_RANKS_PER_HOST, Network, last_level_cache_bytes
from lab.sim.schedule import Schedule, algorithms

#: Measured CSVs (globs relative to the results directory) and what their rows are.
SOURCES = [("allreduce.csv", "transport"), ("collectives.csv", "transport"),
           ("ranks/*/allreduce.csv", "transport"), ("ranks/*/collectives.csv", "transport"),
           ("hosts/allreduce.csv", "hosts"), ("hosts/hierarchical.csv", "hosts")]
#: The fitted parameters: Network field, the start of the fit, its bounds, and the report's name.
PARAMETERS = [("alpha_us", 20.0, (1e-3, 1e6), "α (µs)"), ("gbit", 10.0, (1e-3, 1e4), "Gbit/s"),
              ("send_overhead_us", 10.0, (1e-3, 1e6), "o_send (µs)"),
              ("recv_overhead_us", 10.0, (1e-3, 1e6), "o_recv (µs)"),
              ("copy_us_per_byte", 1e-4, (1e-9, 1.0), "copy (µs/KB)"),
              ("gamma_us_per_byte", 1e-4, (1e-9, 1.0), "γ (µs/KB)"),
              ("wake_us", 10.0, (1e-3, 1e6), "wake (µs)"),
              ("memory_us_per_byte", 1e-4, (1e-9, 1.0), "memory (µs/KB)")]
CALIBRATION_WORLDS = (2, 4, 8)
#: Calls of the back-to-back loop a case is replayed as (lab.benchmark's loop, shortened).
LOOP_CALLS = 4
ITERATIONS = 100
#: The steps (in the logarithm of each parameter) of the Jacobian's differences, one fit each.
DIFFERENCE_STEPS = (1e-2, 1e-3)
#: Points drawn to start from (each parameter up to e^SPREAD, 7.4×, either side of its usual start),
#: and how many of the best of them the fit starts from.
SCREENED, SCREENED_STARTS, SPREAD = 64, 3, 2.0
#: The factors of the polish's moves (one parameter, or two the opposite ways), and the most
#: evaluations a fit takes with it.
POLISH_FACTORS = (0.5, 0.8, 0.95, 1.05, 1.2, 2.0)
POLISH_EVALUATIONS = 6000


def _input_bytes(collective: str, nbytes: int, world: int) -> int:
    """Each rank's input for a measured size, as lab.benchmark builds it (allgather: T/N per rank;
    one float32 at least)."""
    return max(CATALOG[collective].input_bytes(nbytes, world), 4)


def calibrates(world: int, nbytes: int, largest: int) -> bool:
    """Whether a case is one the fit uses (N = 2, 4, 8 at 1 KB·16^k or at ``largest``, the largest
    size its setting measured) rather than one it is validated on."""
    if world not in CALIBRATION_WORLDS:
        return False
    if nbytes == largest:  # the top of the range: validation interpolates, it does not extrapolate
        return True
    return nbytes >= 1024 and not nbytes & (nbytes - 1) and (nbytes.bit_length() - 11) % 4 == 0


def measured_on(results_dir: Path, source: str) -> str:
    """When a measured CSV was written (its directory's ``machine.json``)."""
    info = Path(results_dir) / source
    info = info.parent / "machine.json"
    return json.loads(info.read_text()).get("date", "?") if info.exists() else "?"


def _machine(csv: Path) -> dict:
    """What the machine a CSV was measured on said of itself (its directory's ``machine.json``)."""
    info = csv.parent / "machine.json"
    return json.loads(info.read_text()) if info.exists() else {}


def _cores(csv: Path) -> int:
    """The cores of the machine a CSV was measured on, else this one's."""
    return int(_machine(csv).get("cores", os.cpu_count() or 1))


def _cache_bytes(csv: Path) -> int:
    """The last-level cache of the machine a CSV was measured on, else this one's (0: unknown)."""
    recorded = _machine(csv).get("last_level_cache_bytes")
    return int(recorded) if recorded is not None else last_level_cache_bytes() or 0


def measured(results_dir: Path) -> pd.DataFrame:
    """The lab's own measured rows that the simulator can replay, with a ``setting`` per network,
    the host structure (``ranks_per_host``), the machine's ``cores`` and the case's ``role``."""
    table = algorithms()
    frames = []
    for pattern, kind in SOURCES:
        for path in sorted(Path(results_dir).glob(pattern)):
            frame = pd.read_csv(path)
            frame = frame[(frame["impl"] == "lab") & frame["collective"].isin(list(table))]
            frame = frame[[a in table[c] for c, a in zip(frame["collective"], frame["algorithm"])]].copy()
            if kind == "hosts":
                per_host = frame["ranks_per_host"] if "ranks_per_host" in frame else pd.Series(1, frame.index)
                frame["ranks_per_host"] = per_host.astype(int)
                frame["setting"] = [
                    f"{h} hosts, {g:g} Gbit/s" if L == 1 else f"{h} hosts × {L} ranks, {g:g} Gbit/s"
                    for h, L, g in zip(frame["hosts"], frame["ranks_per_host"], frame["link_gbit"])]
            else:
                frame["ranks_per_host"] = 1
                frame["setting"] = frame["transport"]
            frame["cores"], frame["cache_bytes"] = _cores(path), _cache_bytes(path)
            frame["source"], frame["kind"] = path.relative_to(results_dir).as_posix(), kind
            frames.append(frame[[
                "setting", "collective", "algorithm", "world", "bytes", "median_us", "ranks_per_host",
                "cores", "cache_bytes", "source", "kind"]])
    columns = [
        "setting", "collective", "algorithm", "world", "bytes", "median_us", "ranks_per_host", "cores",
        "cache_bytes", "source", "kind", "sim_bytes", "role"]
    if not frames:
        return pd.DataFrame(columns=columns)
    frame = pd.concat(frames, ignore_index=True)
    frame["sim_bytes"] = [
        _input_bytes(c, b, w) for c, b, w in zip(frame["collective"], frame["bytes"], frame["world"])]
    largest = frame.groupby("setting")["bytes"].transform("max")
    frame["role"] = [
        "calibration" if calibrates(int(w), int(b), int(top)) else "validation"
        for w, b, top in zip(frame["world"], frame["bytes"], largest)]
    return frame[columns]


@dataclass(frozen=True)
class Fit:
    """One setting's fitted network, its fit error and how well each parameter is determined."""

    network: Network
    error: float  # mean |log(predicted / measured)| over the calibration cases
    determined: dict[str, float]  # per parameter: the error's smallest relative rise at ±20 %
    evaluations: int


def benchmark_us(schedule: Schedule, match: np.ndarray, network: Network) -> float:
    """What ``python -m lab results`` would measure of a case: the median of the last
    ``LOOP_CALLS - 1`` calls of a back-to-back loop (:func:`~lab.sim.event_loop.loop_times`; the first
    starts cold, as the benchmark's warm-up calls do). ``schedule`` is one call's, repeated
    ``LOOP_CALLS`` times, and ``match`` its pairing (:func:`benchmark_schedule`)."""
    return float(np.median(loop_times(schedule, match, network, LOOP_CALLS)[1:]))


def benchmark_schedule(collective: str, algorithm: str, world: int, nbytes: int,
                       ranks_per_host: int = 1) -> tuple[Schedule, np.ndarray]:
    """A case's schedule as :func:`benchmark_us` replays it (``LOOP_CALLS`` calls), and its pairing."""
    schedule, _ = recorded_schedule(collective, algorithm, world, nbytes, 0, ranks_per_host, None)
    loop = schedule.repeated(LOOP_CALLS)
    return loop, match_messages(loop)


class _Cases:
    """The cases of one setting, recorded and paired once, replayed on any network.

    ``ranks_per_host`` is how the cases' ranks were laid out on hosts; None: every case's ranks on
    one machine, one host (so hierarchical allreduce records as it ran there: inside one host).
    """
    def __init__(self, rows: pd.DataFrame, ranks_per_host: int | None) -> None:
        self.schedules = [
            benchmark_schedule(row.collective, row.algorithm, int(row.world), int(row.sim_bytes),
                               ranks_per_host or int(row.world)) for row in rows.itertuples(index=False)]
        self.measured_us = rows["median_us"].to_numpy(dtype=float)

    def subset(self, keep: np.ndarray) -> _Cases:
        """The cases where ``keep`` (a bool per case) is true, their schedules not recorded again."""
        part = object.__new__(_Cases)
        part.schedules = [s for s, kept in zip(self.schedules, keep) if kept]
        part.measured_us = self.measured_us[keep]
        return part

    def predict(self, network: Network) -> np.ndarray:
        return np.array([benchmark_us(s, match, network) for s, match in self.schedules])

    def residuals(self, network: Network) -> np.ndarray:
        """log(predicted / measured) per case; a case predicted at 0 µs counts as 1 µs."""
        return np.log(np.maximum(self.predict(network), 1.0) / self.measured_us)

    def error(self, network: Network) -> float:
        """Mean |log(predicted / measured)|."""
        return float(np.mean(np.abs(self.residuals(network))))


def _network(base: Network, x: np.ndarray) -> Network:
    """``base`` with the parameters whose logarithms are ``x`` (clamped into their bounds)."""
    values = {name: float(np.clip(math.exp(v), *bounds)) for v, (name, _, bounds, _) in zip(x, PARAMETERS)}
    return replace(base, **values)


def least_absolute(residuals: Callable[[np.ndarray],
                                       np.ndarray], x: np.ndarray, low: np.ndarray, high: np.ndarray,
                   iterations: int = ITERATIONS, step: float = 1e-3) -> tuple[np.ndarray, float, int]:
    """Minimise the mean of ``|residuals(x)|`` from ``x``, each x inside [low, high]: (x, that mean, evaluations).

    Levenberg–Marquardt on reweighted least squares (weights 1/|r|: the squares then sum to the
    absolute values), with the Jacobian by forward differences of ``step``. A simulated time is a
    sum of parameters times counts along its critical path, so the model is linear in the parameters
    wherever the path does not change, and each step nearly solves it.

        least_absolute(lambda x: x - 3.0, np.zeros(1), np.full(1, -9.0), np.full(1, 9.0))[0]   # about [3.0]
    """
    r = residuals(x)
    evaluations, damping = 1, 1e-3
    for _ in range(iterations):
        weight = 1.0 / np.maximum(np.abs(r), 1e-6)
        jacobian = np.column_stack([(residuals(x + step * unit) - r) / step for unit in np.eye(len(x))])
        evaluations += len(x)
        normal = jacobian.T @ (jacobian * weight[:, None])
        gradient = jacobian.T @ (weight * r)
        # Damp until a step lowers the error; stop when no damping does.
        while damping < 1e8:
            candidate = np.clip(
                x + np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient), low,
                high)
            r_candidate = residuals(candidate)
            evaluations += 1
            if np.abs(r_candidate).mean() < np.abs(r).mean():
                improvement = np.abs(r).mean() - np.abs(r_candidate).mean()
                x, r, damping = candidate, r_candidate, damping / 3.0
                break
            damping *= 4.0
        else:
            break
        if improvement < 1e-9:
            break
    return x, float(np.abs(r).mean()), evaluations


def fit(cases: _Cases, base: Network) -> Fit:
    """The parameters that make the simulator best match ``cases`` on ``base``'s hosts and cores."""
    def residuals(x: np.ndarray) -> np.ndarray:
        return cases.residuals(_network(base, x))

    bounds = np.log([bounds for _, _, bounds, _ in PARAMETERS])
    low, high = bounds[:, 0], bounds[:, 1]
    start = np.log([start for _, start, _, _ in PARAMETERS])
    # The error has local minima: a replayed loop's times are piecewise linear in the parameters
    # (an event order changes at each kink) and some trade against each other (o_send for o_recv,
    # α for the wake-up). So the least-squares steps start from the usual start and from the
    # SCREENED_STARTS best of SCREENED points drawn around it (the same every time), each with
    # Jacobians of two difference steps (one can point into a kink); the best fit is kept.
    drawn = np.clip(start + np.random.default_rng(0).uniform(-SPREAD, SPREAD, (SCREENED, len(start))), low,
                    high)
    screened = sorted(drawn, key=lambda point: float(np.abs(residuals(point)).mean()))[:SCREENED_STARTS]
    x, best, evaluations = start, math.inf, SCREENED
    for origin in (start, *screened):
        for step in DIFFERENCE_STEPS:
            candidate, error, spent = least_absolute(residuals, origin, low, high, step=step)
            evaluations += spent
            if error < best:
                x, best = candidate, error
    # Polish: reweighting can stop short of the least absolute error where a path changes; move one
    # parameter, or two the opposite ways, while that lowers it (so no ±20 % move below lowers it
    # either), and let the least-squares steps go on from each better point.
    moves = [*np.eye(len(x)), *(a - b for i, a in enumerate(np.eye(len(x))) for b in np.eye(len(x))[i + 1:])]
    improved = True
    while improved and evaluations < POLISH_EVALUATIONS:
        improved = False
        for move in moves:
            for factor in POLISH_FACTORS:
                trial = np.clip(x + move * math.log(factor), low, high)
                error = float(np.abs(residuals(trial)).mean())
                evaluations += 1
                if error < best * (1 - 1e-9):
                    x, best, improved = trial, error, True
        if improved:
            candidate, error, spent = least_absolute(residuals, x, low, high, step=DIFFERENCE_STEPS[0])
            evaluations += spent
            if error < best:
                x, best = candidate, error
    network = _network(base, x)
    determined = {}
    for name, _, _, _ in PARAMETERS:
        value = getattr(network, name)
        rises = [
            cases.error(replace(network, **{name: value * factor})) / best - 1.0 for factor in (0.8, 1.2)]
        determined[name] = min(rises)
    return Fit(network, best, determined, evaluations)


def calibrate(results_dir: Path) -> tuple[dict[str, Fit], pd.DataFrame]:
    """A fit per setting, and every measured case with its prediction, the ratio and its role."""
    frame = measured(results_dir)
    fits: dict[str, Fit] = {}
    parts = []
    # The pool's shm first: its link is the one inside a host of the emulated hosts with several ranks.
    settings = sorted(frame["setting"].unique(), key=lambda s: (s != "shm", "hosts" in s, s))
    for setting in settings:
        rows = frame[frame["setting"] == setting].copy()
        per_host = int(rows["ranks_per_host"].iloc[0])
        base = Network(ranks_per_host=per_host, cores=int(rows["cores"].iloc[0]),
                       ranks_per_cpu=MAX_RANKS_PER_HOST, cache_bytes=int(rows["cache_bytes"].iloc[0]) or None)
        if per_host > 1 and "shm" in fits:
            inside = fits["shm"].network
            base = replace(base, intra_alpha_us=inside.alpha_us, intra_gbit=inside.gbit)
        if not (rows["role"] == "calibration").any():
            rows["role"] = "calibration"  # nothing to calibrate on but these: they validate nothing
        # One machine's ranks are one host to the algorithms; to the replay, with no host links
        # and the same α inside as between, one host or one per rank times alike.
        cases = _Cases(rows, per_host if rows["kind"].iloc[0] == "hosts" else None)
        fits[setting] = result = fit(cases.subset((rows["role"] == "calibration").to_numpy()), base)
        rows["predicted_us"] = cases.predict(result.network)
        rows["ratio"] = rows["predicted_us"] / rows["median_us"]
        parts.append(rows)
    table = pd.concat(parts, ignore_index=True) if parts else frame.assign(predicted_us=[], ratio=[])
    return fits, table
