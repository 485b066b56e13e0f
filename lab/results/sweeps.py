"""The measurements behind ``python -m lab results``, and the record of the machine they ran on.

Each sweep launches its own pools and returns plain tables, one row per case (as
:func:`lab.benchmark.measure` writes them); fitting, plotting and the report come after, from the
tables alone.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pandas as pd
import torch

import lab
from lab import mpich
from lab.algorithms import registry
from lab.benchmark import measure, time_bucketing, time_kernel, time_overlap, transformer_gradients
from lab.catalog import COLLECTIVES as CATALOG
from lab.sim.network import last_level_cache_bytes
from lab.validate import validation_table

KERNEL_SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
PYTHON_KERNEL_MAX_BYTES = 1 << 20  # the pure-Python loop runs ~1 µs per element: stop there
#: The references measured next to the lab: their rows' transport and algorithm are their name.
REFERENCES = ("gloo", "mpich")
#: Rounds of every case in a sweep (:func:`least_of_rounds`).
ROUNDS = 5
#: Every collective but allreduce, in the registry's order (allreduce has tables of its own).
OTHER_COLLECTIVES = tuple(c for c in registry.COLLECTIVES if c != "allreduce")


class Progress:
    """A one-line progress bar on stderr: ``[#######.............]  12/80  allreduce ring 1MB shm``."""
    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()

    def step(self, label: str) -> None:
        """Count one case done, labelled ``label``."""
        self.done += 1
        filled = int(30 * self.done / self.total)
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done:>3}/{self.total}  "
                         f"{elapsed:5.0f} s  {label:<44}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def size_label(nbytes: int) -> str:
    """``16 MB`` or ``4 KB``: a size as the tables and the progress bar show it."""
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def lab_transports(frame: pd.DataFrame) -> list[str]:
    """The lab's transports in ``frame``, in order of appearance (not the references)."""
    return [t for t in frame["transport"].unique() if t not in REFERENCES]


@dataclass(frozen=True)
class Measurements:
    """Everything one ``python -m lab results`` measures, and the machine it ran on."""

    info: dict[str, str]  # machine()
    allreduce: pd.DataFrame  # every allreduce algorithm, auto, gloo and MPICH, per transport and size
    others: pd.DataFrame  # every algorithm of every other collective, and gloo
    floor: pd.DataFrame  # latency_floor()
    bucketing: pd.DataFrame
    overlap: pd.DataFrame
    kernels: pd.DataFrame
    check: pd.DataFrame  # every primitive against gloo: python -m lab's validation table

    @property
    def world(self) -> int:
        """The ranks of the collective sweeps."""
        return int(self.allreduce["world"].iloc[0])

    @property
    def cases(self) -> pd.DataFrame:
        """Every collective's rows, the references' included."""
        return pd.concat([self.allreduce, self.others])

    @property
    def lab_cases(self) -> pd.DataFrame:
        """Every collective's rows measured through the lab's own calls (the models ``auto`` follows)."""
        cases = self.cases
        return cases[cases["impl"] == "lab"]


def measure_all(world_size: int, transports: list[str], sizes: list[int],
                rounds: int = ROUNDS) -> Measurements:
    """Every sweep of ``python -m lab results``, in order, saying on stderr which one runs."""
    info = machine()
    print(f"Sweeping {len(sizes)} sizes on {world_size} ranks over {', '.join(transports)} and gloo",
          file=sys.stderr)
    allreduce, others = sweep(world_size, transports, sizes, rounds)
    print("Latency floor", file=sys.stderr)
    floor = latency_floor(world_size)
    print("Training patterns", file=sys.stderr)
    bucketing, overlap = training_patterns(world_size)
    print("Kernels", file=sys.stderr)
    kernels = kernel_sweep()
    print("Every primitive against gloo", file=sys.stderr)
    check = validation_table(transports, [3, world_size], 1001, 0)
    return Measurements(info, allreduce, others, floor, bucketing, overlap, kernels, check)


# -- the sweeps --------------------------------------------------------------------------------------


def sweep_cases(transports: list[str], sizes: list[int]) -> list[tuple[str, str, str, str, int]]:
    """(transport, collective, impl, algorithm, bytes) of every case of :func:`sweep`: per transport
    every allreduce algorithm and auto, then every algorithm of the other collectives; gloo's last,
    in the first transport's pool."""
    def sized(collective: str) -> list[int]:
        return sizes if CATALOG[collective].moves_bytes else sizes[:1]  # a barrier moves no bytes: once

    cases = []
    for transport in transports:
        cases += [(transport, "allreduce", "lab", a, s) for a in (*registry.names("allreduce"), "auto")
                  for s in sizes]
        cases += [(transport, c, "lab", a, s) for c in OTHER_COLLECTIVES for a in registry.names(c)
                  for s in sized(c)]
    cases += [(transports[0], c, "gloo", "gloo", s) for c in registry.COLLECTIVES for s in sized(c)]
    return cases


def sweep(world_size: int, transports: list[str], sizes: list[int],
          rounds: int = ROUNDS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every collective, algorithm and transport at every size, with gloo in the same pools, and
    MPICH's allreduce (``mpiexec``, between the pools) when the ``peers`` extra is installed:
    ``rounds`` rounds of every case, each case's least (:func:`least_of_rounds`).

    Returns (allreduce rows, every other collective's rows)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1; got {rounds}")
    cases = sweep_cases(transports, sizes)
    no_mpich = mpich.unavailable()
    if no_mpich:
        print(f"MPICH skipped: {no_mpich}", file=sys.stderr)
    progress = Progress(rounds * (len(cases) + (0 if no_mpich else len(sizes))))
    rows = []
    for transport in transports:
        with lab.launch(world_size, transport=transport) as cluster:
            for r in range(rounds):  # every case once a round: drift and stalls fall on all alike
                for case_transport, collective, impl, algorithm, nbytes in cases:
                    if case_transport != transport:
                        continue
                    rows.append(measure(cluster, collective, impl, nbytes, algorithm))
                    progress.step(f"{collective} {algorithm} {size_label(nbytes)} "
                                  f"{transport if impl == 'lab' else ''} (round {r + 1})")
    for _ in range(rounds):
        for nbytes in [] if no_mpich else sizes:
            rows.append(mpich.measure(world_size, nbytes))
            progress.step(f"allreduce MPICH {size_label(nbytes)}")
    frame = least_of_rounds(pd.DataFrame(rows), ["collective", "impl", "algorithm", "transport", "bytes"])
    return frame[frame["collective"] == "allreduce"], frame[frame["collective"] != "allreduce"]


def least_of_rounds(rows: pd.DataFrame, case: list[str]) -> pd.DataFrame:
    """One row per ``case`` from its rounds' rows (the same case measured several times, the other
    cases in between): the round with the least median, with that round's p10, p90 and
    bandwidths, every call counted, and ``rounds`` their number. On shared cores noise only adds
    time, and a stall or a slow scheduling mode can hold a whole round: on 4 ranks over shm the
    least of five rounds' medians repeated within 25 % between two runs in 92 % of cases (64 KB to
    16 MB), one round's median in 63 %."""
    grouped = rows.groupby(case, sort=False)
    best = rows.loc[grouped["median_us"].idxmin()].set_index(case)
    best["calls"] = grouped["calls"].sum()
    best["rounds"] = grouped.size()
    return best.reset_index()[[*rows.columns, "rounds"]]


def latency_floor(max_world: int) -> pd.DataFrame:
    """1 KB allreduce at 1, 2, ... ranks: what one collective costs in Python alone (1 rank), on
    idle cores (ranks <= cores) and oversubscribed, to show what bounds small messages."""
    worlds = sorted({1, 2, max_world})
    progress = Progress(len(worlds) * 3)
    rows = []
    for world in worlds:
        with lab.launch(world) as cluster:
            # the report compares the fewest steps (tree), the most (ring) and gloo
            for impl, algorithm in [("lab", "tree"), ("lab", "ring"), ("gloo", "gloo")]:
                rows.append(measure(cluster, "allreduce", impl, 1 << 10, algorithm))
                progress.step(f"latency floor {algorithm} on {world} ranks")
    return pd.DataFrame(rows)


def slowest_ms(per_rank: list[list[int]]) -> np.ndarray:
    """Per repeat, the slowest rank's time in ms (``per_rank``: each rank's ns per repeat)."""
    return np.max(np.array(per_rank, dtype=np.float64), axis=0) / 1e6


def training_patterns(world_size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Bucketing (2,004 transformer-shaped gradients, one by one vs 25 MB buckets) and overlap
    (an MLP's backward with and without gradient allreduces started from the backward hooks)."""
    progress = Progress(5)
    grads = transformer_gradients()
    total = sum(g.numel() * 4 for g in grads)
    bucket_rows, overlap_rows = [], []
    with lab.launch(world_size) as cluster:
        for mode in ("one by one", "bucketed"):
            slowest = slowest_ms(cluster.run(time_bucketing, mode == "bucketed"))
            bucket_rows.append({
                "mode": mode, "tensors": len(grads), "bytes": total, "world": world_size,
                "median_ms": float(np.median(slowest)), "min_ms": float(slowest.min())})
            progress.step(f"bucketing: {mode}")
        for mode in ("compute", "sequential", "overlap"):
            slowest = slowest_ms(cluster.run(time_overlap, mode))
            overlap_rows.append({
                "mode": mode, "world": world_size, "median_ms": float(np.median(slowest)),
                "min_ms": float(slowest.min())})
            progress.step(f"overlap: {mode}")
    overlap = pd.DataFrame(overlap_rows)
    compute = overlap.loc[overlap["mode"] == "compute", "median_ms"].iloc[0]
    overlap["visible_comm_ms"] = overlap["median_ms"] - compute
    return pd.DataFrame(bucket_rows), overlap


def kernel_sweep() -> pd.DataFrame:
    """GB/s of the float32 sum kernels: Python, numpy and Numba with 2 inputs, numpy and Numba with 4."""
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
        rows.append({
            "impl": impl, "op": f"sum, {inputs} inputs", "variant": variant, "bytes": nbytes, **result})
        progress.step(f"kernel {impl} {inputs} inputs {size_label(nbytes)}")
    return pd.DataFrame(rows)


# -- the record ------------------------------------------------------------------------------------


def commit() -> str:
    """The checkout's short commit, ``+uncommitted`` when lab/ or kernels/ have changes; ``unknown``
    outside a git checkout."""
    def git(*args: str) -> str:
        # From the repository's root: pathspecs are relative to the working directory.
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parents[2],
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "lab", "kernels")
        return git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, str]:
    """What the report names as the source of its figures: date, CPU, cores, memory, last-level cache
    (the simulator's calibration reads it), versions, commit."""
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor() or "unknown")
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal"))
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": str(os.cpu_count()),
        "memory": f"{memory_kib / 2**20:.1f} GiB", "last_level_cache_bytes": str(last_level_cache_bytes() or
                                                                                 0),
        "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "numba": numba.__version__, "numpy": np.__version__, "pandas": pd.__version__, "commit": commit()}


def load(out: Path) -> Measurements:
    """The :class:`Measurements` that :func:`save_tables` and :func:`save_machine` wrote to ``out``."""
    def table(name: str) -> pd.DataFrame:
        return pd.read_csv(out / f"{name}.csv")

    return Measurements(json.loads((out / "machine.json").read_text()), table("allreduce"),
                        table("collectives"), table("latency_floor"), table("bucketing"), table("overlap"),
                        table("kernels"), table("gloo_check"))


def save_machine(out: Path, info: dict[str, str]) -> None:
    """``<out>/machine.json``."""
    (out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")


def save_tables(out: Path, tables: dict[str, pd.DataFrame]) -> None:
    """``<out>/<name>.csv`` per table, floats to 6 significant digits."""
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
