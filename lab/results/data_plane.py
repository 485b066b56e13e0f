"""The data plane against MPICH and gloo: ``python -m lab results --data-plane``.

In one run, on the shm transport at each world size (2, 4 and 8 ranks by default), an allreduce
of 1 KB to 16 MB (float32) through:

- ``plain``: ``lab.allreduce(mesh, x)`` (``auto``; small tensors take the compiled data plane);
- ``plan``: ``plan = lab.allreduce_init(mesh, x)`` once, then ``plan()``;
- ``python``: the plain call with the compiled path off (``LAB_COMPILED_MAX_BYTES=0``): the lab
  before the compiled plane, the baseline of "no size slower";
- ``gloo``: ``dist.all_reduce`` in the same rank processes;
- ``mpich``: ``comm.Allreduce`` under ``mpiexec`` (where the ``peers`` extra is installed).

Each is timed by :mod:`lab.benchmark`'s rules (warm-up, the slowest rank per call, the median;
algbw and busbw as nccl-tests), sizes interleaved so that all see the same load, in
:data:`ROUNDS` rounds: a case's time is the median of its rounds' medians (one round of 100
calls of a few µs is a fraction of a millisecond, which one stall of the machine can fill). The memory floor
is one rank's copy bandwidth B measured in the same run: an allreduce in shared memory moves
about 4T bytes through each rank's memory (T in, T read by the reduction, T read and written
out), so ``floor = 4T / B``. Writes ``OUT/data_plane.csv`` and splices "The data plane against
MPICH and gloo" into ``OUT/REPORT.md``, with the bars of the compiled plane met or not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

import lab
from lab import benchmark, mpich
from lab.compiled.plane import max_bytes_from_env
from lab.report_sections import splice

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
WORLD_SIZES = [2, 4, 8]
IMPLS = ["plain", "plan", "python", "gloo"]  # (and mpich, in processes of its own)
MARKER = "data-plane"
ROUNDS = 3


def measure(world_sizes: list[int], sizes: list[int]) -> pd.DataFrame:
    """Every impl at every size and world size (see the module docstring): one row each."""
    rows, load = [], round(os.getloadavg()[0], 1)  # before our ranks add their own
    for world in world_sizes:
        python_pool = lab.launch(world, transport="shm", env={"LAB_COMPILED_MAX_BYTES": "0"})
        with lab.launch(world, transport="shm") as lab_pool, python_pool:
            for _ in range(ROUNDS):
                for nbytes in sizes:
                    for impl in IMPLS:
                        pool = python_pool if impl == "python" else lab_pool
                        row = benchmark.measure(pool, "allreduce", {"plain": "lab",
                                                                    "python": "lab"}.get(impl, impl), nbytes)
                        rows.append({**row, "impl": impl})
                    if mpich.unavailable() is None:
                        rows.append(mpich.measure(world, nbytes))
    table = _median_of_rounds(pd.DataFrame(rows))
    table["floor_us"] = 4 * table["bytes"] / (benchmark.copy_bandwidth() * 1e3)  # GB/s = 1e3 bytes per µs
    table["load_average"], table["cores"] = load, os.cpu_count()
    return table


def _median_of_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per case from its rounds' rows: the median of their medians (and of their p10 and
    p90), every call counted, the bandwidths of that median."""
    case = ["impl", "world", "bytes"]
    table = rounds.groupby(case, sort=False).agg({
        **{c: "first"
           for c in rounds.columns if c not in case}, "median_us": "median", "p10_us": "median",
        "p90_us": "median", "calls": "sum"}).reset_index()[rounds.columns]
    table["algbw_GBps"] = table["bytes"] / (table["median_us"] * 1e3)
    table["busbw_GBps"] = table["algbw_GBps"] * [benchmark.bus_factor("allreduce", n) for n in table["world"]]
    return table


def _size(nbytes: int) -> str:
    return f"{nbytes >> 10} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB"


def bars(times: pd.DataFrame) -> list[str]:
    """The compiled plane's bars (lab time ÷ MPICH's, speed against gloo's), each met or not.
    ``times``: median µs indexed by (world, bytes), one column per impl."""
    lines = []

    def check(what: str, value: float, bound: float, below: bool = True) -> None:
        met = value <= bound if below else value >= bound
        lines.append(
            f"- {what}: {value:.2f}x (bar {'≤' if below else '≥'} {bound}x): **{'met' if met else 'not met'}**"
        )

    for world, plain_bar, plan_bar in ((2, 1.5, 0.5), (4, 0.5, 0.3)):
        if (world, 1024) in times.index and "mpich" in times:
            row = times.loc[(world, 1024)]
            check(f"1 KB, {world} ranks, plain call ÷ MPICH", row["plain"] / row["mpich"], plain_bar)
            check(f"1 KB, {world} ranks, plan ÷ MPICH", row["plan"] / row["mpich"], plan_bar)
    if (4, 1024) in times.index:
        check("1 KB, 4 ranks, speed against gloo",
              times.loc[(4, 1024), "gloo"] / times.loc[(4, 1024), "plain"], 20, below=False)
    if (4, 16 << 20) in times.index:
        row = times.loc[(4, 16 << 20)]
        check("16 MB, 4 ranks, speed against gloo", row["gloo"] / row["plain"], 2.5, below=False)
        if "mpich" in times:
            check("16 MB, 4 ranks, plain call ÷ MPICH", row["plain"] / row["mpich"], 0.6)
    if 8 in times.index.get_level_values(0):  # above the threshold both run the Python path: not compared
        compiled = times.loc[8][times.loc[8].index <= max_bytes_from_env()]
        check(
            f"8 ranks, the slowest size up to {max_bytes_from_env() >> 10} KiB against the compiled path off "
            "(python)", (compiled["plain"] / compiled["python"]).max(), 1.0)
    return lines


def section(table: pd.DataFrame) -> str:
    """REPORT.md's "The data plane against MPICH and gloo"."""
    from lab.results.report import markdown

    times = table.pivot_table(index=["world", "bytes"], columns="impl", values="median_us")
    floors = table.groupby(["world", "bytes"])["floor_us"].first()
    lines = [
        "## The data plane against MPICH and gloo", "",
        ("`python -m lab results --data-plane` (`data_plane.csv`): allreduce on shm through the plain call "
         "(`auto`), a plan (`lab.allreduce_init`), the plain call with the compiled path off (`python`), gloo "
         f"and MPICH, in one run, sizes interleaved, {ROUNDS} rounds; the median over rounds of the median µs of the "
         "slowest rank per call. **floor** is 4T "
         "over one rank's copy bandwidth measured in the same run. Load average "
         f"{table['load_average'].iloc[0]} when it started, on {table['cores'].iloc[0]} cores: with more "
         "ranks than cores these times measure how each library waits as much as what it moves."), ""]
    for world in sorted(table["world"].unique()):
        view = times.loc[world].copy()
        shown = pd.DataFrame({"size": [_size(b) for b in view.index]})
        for impl in [*IMPLS, "mpich"]:
            if impl in view:
                shown[f"{impl} µs"] = view[impl].round(1).to_numpy()
        if "mpich" in view:
            shown["plain ÷ MPICH"] = (view["plain"] / view["mpich"]).round(2).to_numpy()
            shown["plan ÷ MPICH"] = (view["plan"] / view["mpich"]).round(2).to_numpy()
        shown["gloo ÷ plain"] = (view["gloo"] / view["plain"]).round(1).to_numpy()
        shown["floor µs"] = floors.loc[world].round(1).to_numpy()
        shown["plain ÷ floor"] = (view["plain"] / floors.loc[world]).round(1).to_numpy()
        lines += [f"**{world} ranks**", "", markdown(shown), ""]
    lines += ["The bars of the compiled data plane, in this run:", "", *bars(times), ""]
    return "\n".join(lines)


def main(out_dir: str = "results", world_sizes: list[int] | None = None,
         sizes: list[int] | None = None) -> int:
    """Measure, write ``data_plane.csv``, splice the report's section."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = measure(world_sizes or WORLD_SIZES, sizes or SIZES)
    table.to_csv(out / "data_plane.csv", index=False)
    print(table[["world", "bytes", "impl", "median_us", "busbw_GBps"]].to_string(index=False))
    splice(out / "REPORT.md", section(table), MARKER)
    return 0
