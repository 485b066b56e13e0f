"""``python -m lab results``: run the sweeps and regenerate ``results/`` (CSVs, models, plots, report).

Everything in ``results/`` comes from one run of this command on one machine, which the report
names; ``lab/tuning.json`` (the fitted models ``algorithm="auto"`` uses) is refreshed with it.

    sweeps     the measurements (one table per sweep) and the machine they ran on
    fits       α-β fits, the ring/tree crossover, the models auto uses
    plots      the figures (matplotlib)
    report     REPORT.md, one function per section
    hosts      ``--hosts``: the lesson's claims across emulated hosts (results/hosts/)
    hierarchy  ``--hosts --ranks-per-host``: hierarchical allreduce, many ranks per host
    workloads  the workloads' section, from what ``bench/workload_accuracy.py`` wrote (results/workloads/)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lab import tuning
from lab.benchmark import SIZES
from lab.report_sections import with_spliced
from lab.results import plots, report, workloads
from lab.results.fits import fit_alpha_beta, models, tuning_from
from lab.results.sweeps import ROUNDS, kernel_sweep, load, measure_all, save_machine, save_tables
from lab.sim.calibrate import calibrate

__all__ = ["fit_alpha_beta", "kernel_sweep", "main", "models", "store_fits", "tuning_from"]


def main(out_dir: str = "results", world_size: int = 4, transports: list[str] | None = None,
         sizes: list[int] | None = None, update_tuning: bool = True, rounds: int = ROUNDS) -> int:
    """Measure, fit, plot and report into ``out_dir``; refresh ``lab/tuning.json`` unless told not
    to. Returns 1 if a primitive disagreed with gloo, else 0."""
    transports = transports or ["shm", "queue", "tcp"]
    sizes = sizes or SIZES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = measure_all(world_size, transports, sizes, rounds)
    model = models(run.cases)
    save_tables(
        out, {
            "allreduce": run.allreduce, "collectives": run.others, "kernels": run.kernels, "model": model,
            "gloo_check": run.check, "latency_floor": run.floor, "bucketing": run.bucketing,
            "overlap": run.overlap})
    save_machine(out, run.info)
    plots.draw(out, run, model)
    (out / "REPORT.md").write_text(with_spliced(out / "REPORT.md", report.render(run, model)))
    if update_tuning:
        write_tuning({
            "generated": run.info, "world": world_size, "worlds": [world_size],
            "models": tuning_from(model, run.lab_cases),
            "networks": networks_from(out)})  # the simulator's, for auto at other world sizes
    print(f"Wrote {out}/ (REPORT.md, CSVs, PNGs)" + (f" and {tuning.TUNING_PATH}" if update_tuning else ""))
    return 0 if (run.check["result"] == "PASS").all() else 1


def report_only(out_dir: str = "results") -> int:
    """Rewrite ``out_dir/REPORT.md`` from the CSVs and ``machine.json`` of the run there (keeping the
    sections other commands spliced in; the workloads' rendered again from ``out_dir/workloads/``),
    measuring nothing: ``python -m lab results --report-only``."""
    out = Path(out_dir)
    run = load(out)
    (out / "REPORT.md").write_text(with_spliced(out / "REPORT.md", report.render(run, models(run.cases))))
    workloads.splice_section(out)
    print(f"Wrote {out}/REPORT.md from the run of {run.info['date']}")
    return 0


def models_by_world(results_dir: str | Path) -> dict[int, dict]:
    """:func:`tuning_from` of every ``results_dir/ranks/N/`` run (``python -m lab results --ranks N
    --out results/ranks/N``), by N: what ``auto`` follows at the world sizes measured there."""
    by_world = {}
    for folder in sorted(path.parent for path in Path(results_dir).glob("ranks/*/machine.json")):
        run = load(folder)
        by_world[run.world] = tuning_from(models(run.cases), run.lab_cases)
    return by_world


def networks_from(results_dir: str | Path) -> dict[str, dict]:
    """``{transport: Network keyword arguments}`` fitted by :func:`lab.sim.calibrate.calibrate` to
    the measured CSVs in ``results_dir`` (the transports' settings; emulated hosts are left out):
    ``tuning.json``'s ``networks``. Every field of ``Network`` is kept, so parameters the
    calibration learns to fit travel with it."""
    fits, _ = calibrate(Path(results_dir))
    return {
        setting: dataclasses.asdict(fit.network)
        for setting, fit in fits.items() if setting in tuning.TRANSPORTS}


def store_fits(results_dir: str | Path) -> dict:
    """Refit into ``tuning.json``, from the measured CSVs in ``results_dir`` and its
    ``ranks/N/``, the simulator's networks (:func:`networks_from`) and the models of every world
    size measured there (:func:`models_by_world`), keeping the main sweep's models (``python -m
    lab results --calibrate-only``); returns what it wrote."""
    table = tuning.tuning_table()
    by_world = {
        str(n): fits
        for n, fits in models_by_world(Path(results_dir)).items() if n != table.get("world")}
    worlds = sorted({*map(int, by_world), *([table["world"]] if "world" in table else [])})
    table = {**table, "worlds": worlds, "models_by_world": by_world, "networks": networks_from(results_dir)}
    write_tuning(table)
    return table


def write_tuning(table: dict) -> None:
    """Write ``lab/tuning.json`` (the one place that does) and forget what was read of it before."""
    tuning.TUNING_PATH.write_text(json.dumps(table, indent=2) + "\n")
    tuning.tuning_table.cache_clear()
    tuning.fitted_models.cache_clear()
