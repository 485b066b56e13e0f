"""REPORT.md's section on workloads: a recorded training step's replay against the measured step.

Rendered from what ``bench/workload_accuracy.py`` writes into ``results/workloads/``
(``accuracy.csv``, ``replay_1024.csv``, ``machine.json``), by that command once it measured and by
``python -m lab results --report-only`` from the files (:func:`splice_section`).

    splice_section(Path("results"))     # results/REPORT.md, from results/workloads/
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lab.report_sections import splice

MARKER = "workloads"
FOLDER = "workloads"  # under results/


def accuracy_table(table: pd.DataFrame) -> str:
    """The accuracy table as markdown: one line per comparison (``accuracy.csv``'s rows)."""
    header = ("| parallelism | model | comparison | measured | replayed (its compute) | error | target | "
              "compute scaled by the shared cores |")
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table.itertuples():
        verdict = "meets" if row.meets else "misses"
        error = f"{row.error:+.1%}".replace("-", "−")
        scaled = (f"{row.cores_scaled_ms:,.1f} ms ({row.cores_scaled_error:+.1%})".replace("-", "−")
                  if row.cores_scaled_ms != row.replayed_ms else "")
        lines.append(
            f"| {'DDP' if row.parallelism == 'ddp' else 'FSDP2'} | {row.model} (batch {row.batch}) | "
            f"{row.comparison.replace('recorded size', f'{row.recorded_hosts} hosts')} | "
            f"{row.measured_ms:,.1f} ms | {row.replayed_ms:,.1f} ms ({row.compute_ms:,.1f}) | "
            f"{error if row.meets else f'**{error}**'} | {row.target:.0%}: {verdict} | {scaled} |")
    return "\n".join(lines)


def section(folder: Path) -> str:
    """The section, from ``folder`` (``results/workloads``)."""
    table = pd.read_csv(folder / "accuracy.csv")
    timing = pd.read_csv(folder / "replay_1024.csv").iloc[0]
    info = json.loads((folder / "machine.json").read_text())
    meets = int(table["meets"].sum())
    method = (
        f"`sudo python bench/workload_accuracy.py` on {info['date']} (commit {info['commit']}; {info['cpu']}, "
        f"{info['cores']} cores, torch {info['torch']}; `workloads/accuracy.csv`, `replay_1024.csv`, "
        "`machine.json`). A two-layer MLP trains with DDP or FSDP2 on 2 and on 4 emulated hosts (tcp, "
        "1 Gbit/s links, one rank a host), every rank recorded; its recording is replayed on the network "
        "the lab fitted for those hosts (`lab.sim.calibrated(\"tcp\", hosts=H, link_gbit=1.0)`) at the "
        "recorded size, and recorded on 2 hosts, replayed on 4. Measured: the median of the slowest rank's "
        "step after the warm-up steps. Targets: within 10 % at the recorded size, within 20 % from 2 hosts "
        "to 4.")
    verdict = (
        f"{meets} of {len(table)} cases meet their target. Emulated hosts share this machine's cores: the "
        "last column replays with the compute scaled as the shared cores scale it, which a recording made "
        "on fewer hosts cannot know (docs/workloads.md says which cases miss and why).")
    scale = (
        f"- Replay of `{timing['recording']}` on {int(timing['ranks']):,} ranks: {timing['seconds']:.1f} s "
        f"({int(timing['operations'])} operations, the last step {timing['step_ms']:,.1f} ms; target: under "
        "a minute).")
    return "\n".join([
        "## Workloads: a recorded step replayed against the measured one", "", method, "",
        accuracy_table(table), "", verdict, "", scale, ""])


def splice_section(results_dir: Path) -> bool:
    """Put the section into ``results_dir/REPORT.md`` from ``results_dir/workloads/``, where both
    are; whether it did."""
    folder = Path(results_dir) / FOLDER
    report = Path(results_dir) / "REPORT.md"
    if not (folder / "accuracy.csv").exists() or not report.exists():
        return False
    splice(report, section(folder), MARKER)
    return True
