"""The pipeline bubble, measured and replayed: a 4-stage 1F1B job on one host and across slow links.

    python bench/pipeline_workload.py --out /tmp/pipeline          # as root: emulated hosts
    python bench/pipeline_workload.py --steps 8 --warmup 3 --microbatches 16 --out /tmp/pipeline

The same job twice: torch's ``Schedule1F1B`` of 4 stages (one ``Linear(width, width)`` and a
``ReLU`` each, ``--microbatches`` micro-batches of ``--rows`` rows a step) on the lab's backend, its
stages on one host (shared memory) and on 4 emulated hosts (tcp, ``--link-gbit`` links, one stage
a host), every rank recording (``workload=``). Measured: the median over the steps after
``--warmup`` of the slowest rank's step, and the bubble's share of it (per stage, the step less
its recorded compute and its time blocked on collectives: :func:`lab.workload.pipeline.measured_stages`;
averaged over the stages). Replayed: each recording on the network the lab fitted for where it ran
(``lab.sim.calibrated("shm")``; ``calibrated("tcp", hosts=4, link_gbit=...)``), and the one-host
recording re-targeted onto the 4 hosts' network (``recorded_network=`` the one host's), against the 4 hosts' measurement (target: the
step and the bubble's share within 15 %). Predicted: the 4 hosts' recording formed again as 1F1B
at 2 and 4 times the micro-batches and at twice the stages (:mod:`lab.workload.schedule`). The emulated hosts are namespaces of one machine: the
stages share its cores. Writes ``machine.json``, ``pipeline.csv``, ``stages.csv``, ``formed.csv`` and ``timeline.png`` (the 4-host
step's stages, measured above replayed) into ``--out`` and prints the table as markdown.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import lab
from lab.comm import operations as recording
from lab.results.sweeps import machine, save_machine
from lab.workload.pipeline import measured_stages
from lab.workload.schedule import retarget

STAGES, TARGET = 4, 0.15


def train(mesh: lab.Mesh, width: int, rows: int, microbatches: int, steps: int) -> tuple[list[float], int]:
    """``steps`` steps of this rank's stage of the 1F1B pipeline: each one's µs, and the clock
    reading its recording's times count from."""
    torch.set_num_threads(1)  # (the stages share the machine's cores: one thread each)
    lab.backend.init_process_group(mesh)
    torch.manual_seed(mesh.rank)
    module = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
    stage = PipelineStage(module, mesh.rank, mesh.world_size, torch.device("cpu"))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, target: (out - target).square().mean())
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)  # (drawn before the steps: no compute of theirs)
    batches = [[torch.randn(rows * microbatches, width, generator=data) for _ in range(2)]
               for _ in range(steps)]
    times = []
    for inputs, target in batches:
        started = time.perf_counter()
        if mesh.rank == 0:
            schedule.step(inputs)
        elif mesh.rank == mesh.world_size - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        lab.workload.mark_step()
        times.append((time.perf_counter() - started) * 1e6)
    dist.destroy_process_group()
    return times, recording.current().origin_ns


def record(name: str, args: argparse.Namespace, **where: object) -> tuple[Path, list[float], list[int]]:
    """Run the job where ``where`` says (``lab.spawn``'s options), recording: the file, the slowest
    rank's µs of each step, and each rank's clock origin."""
    path = Path(args.out) / f"{name}.jsonl"
    ranks = lab.spawn(train, STAGES, args=(args.width, args.rows, args.microbatches, args.steps),
                      workload=str(path), **where)
    return path, [max(step) for step in zip(*(times for times, _ in ranks))], [origin for _, origin in ranks]


def summary(per_stage: pd.DataFrame, warmup: int) -> tuple[float, float]:
    """The median step (ms) after ``warmup`` and the bubble's median share of it, averaged over the stages."""
    kept = per_stage[per_stage["step"] >= warmup]
    shares = kept.groupby("step")["bubble_share"].mean()
    steps = kept.groupby("step")["step_us"].first()
    return float(statistics.median(steps)) / 1e3, float(statistics.median(shares))


def compare(label: str, path: Path, network: lab.sim.Network, recorded: lab.sim.Network,
            measured: pd.DataFrame, warmup: int) -> dict:
    """The replay of ``path`` (recorded on ``recorded``) on ``network`` against the ``measured``
    per-stage breakdown."""
    result = lab.workload.replay(lab.workload.load(path), network=network, recorded_network=recorded)
    (step, bubble), (real_step, real_bubble) = summary(result.stages, warmup), summary(measured, warmup)
    row = {
        "case": label, "measured_ms": real_step, "replayed_ms": step, "step_error": step / real_step - 1,
        "measured_bubble": real_bubble, "replayed_bubble": bubble, "bubble_error": bubble / real_bubble - 1}
    row["meets"] = abs(row["step_error"]) <= TARGET and abs(row["bubble_error"]) <= TARGET
    print(
        f"{label}: step measured {real_step:.1f} ms, replayed {step:.1f} ms ({row['step_error']:+.1%}); bubble "
        f"{real_bubble:.1%} measured, {bubble:.1%} replayed", flush=True)
    return row, result


def predictions(path: Path, network: lab.sim.Network, microbatches: int, warmup: int) -> pd.DataFrame:
    """The recording at ``path`` formed again as 1F1B (:func:`lab.workload.schedule.retarget`) at
    2 and 4 times its micro-batches and at twice its stages, replayed on ``network``: a prediction."""
    recorded = lab.workload.load(path)
    rows = []
    for factor_m, factor_s in ((1, 1), (2, 1), (4, 1), (1, 2)):
        formed = retarget(recorded, microbatches=microbatches * factor_m, stages=STAGES * factor_s)
        step, bubble = summary(
            lab.workload.replay(formed, network=network).stages, min(warmup, formed.steps - 1))
        rows.append({
            "stages": STAGES * factor_s, "microbatches": microbatches * factor_m, "replayed_ms": step,
            "replayed_bubble": bubble})
    return pd.DataFrame(rows)


def picture(path: Path, origins: list[int], result: lab.workload.ReplayResult, step: int, out: Path) -> None:
    """The stages' compute in ``step``, measured (the recording's clocks, each rank's from its
    ``origins``) above replayed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workload = lab.workload.load(path)
    figure, axes = plt.subplots(2, 1, figsize=(10, 4.5), sharex=True)
    for axis, title, blocks in ((axes[0], "measured", _measured_blocks(workload, origins, step)),
                                (axes[1], "replayed", _replayed_blocks(result, step))):
        for rank, intervals in blocks.items():
            axis.broken_barh([(s / 1e3, (e - s) / 1e3) for s, e in intervals], (rank - 0.4, 0.8),
                             color="tab:blue")
        axis.set_yticks(range(STAGES), [f"stage {r}" for r in range(STAGES)])
        axis.invert_yaxis()
        axis.set_title(f"{title}: compute of step {step} (gaps: bubble and communication)", fontsize=10)
    axes[1].set_xlabel("ms since the step began")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def _measured_blocks(workload: lab.workload.Workload, origins: list[int],
                     step: int) -> dict[int, list[tuple[float, float]]]:
    """Each rank's compute intervals in ``step`` on the machine's clock, from the step's first."""
    blocks = {}
    for rank, events in workload.events.items():
        intervals = []
        for event in events:
            if event.step != step or event.kind == "step":
                continue
            at = event.issued_us if event.kind == "op" else event.waited_us
            if at is not None and event.compute_us > 0:
                at += origins[rank] / 1e3
                intervals.append((at - event.compute_us, at))
        blocks[rank] = intervals
    first = min(start for intervals in blocks.values() for start, _ in intervals)
    return {rank: [(s - first, e - first) for s, e in intervals] for rank, intervals in blocks.items()}


def _replayed_blocks(result: lab.workload.ReplayResult, step: int) -> dict[int, list[tuple[float, float]]]:
    begin = float(sum(result.step_us[:step]))
    end = begin + float(result.step_us[step])
    blocks: dict[int, list[tuple[float, float]]] = {}
    for piece in result.slices:
        if piece["cat"] == "compute" and begin <= piece["start_us"] < end:
            blocks.setdefault(piece["rank"], []).append((piece["start_us"] - begin, piece["end_us"] - begin))
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per case, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32, help="rows of a micro-batch")
    parser.add_argument("--width", type=int, default=512, help="each stage's Linear(width, width)")
    parser.add_argument("--link-gbit", type=float, default=1.0,
                        help="the emulated hosts' links (fitted: 1, 10)")
    parser.add_argument("--out", default="/tmp/pipeline_workload")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_machine(out, machine())  # (the machine and versions beside the figures)
    one_host, one_steps, _ = record("one_host", args, transport="shm")
    hosts, hosts_steps, origins = record("hosts", args, transport="tcp", hosts=STAGES,
                                         link_gbit=args.link_gbit)
    measured = {
        name: measured_stages(lab.workload.load(path), steps)
        for name, path, steps in (("one", one_host, one_steps), ("hosts", hosts, hosts_steps))}
    shm, tcp = lab.sim.calibrated("shm"), lab.sim.calibrated("tcp", hosts=STAGES, link_gbit=args.link_gbit)
    rows, results = [], {}
    for label, path, network, recorded, against in (("one host, replayed there", one_host, shm, shm, "one"),
                                                    (f"{STAGES} hosts, replayed there", hosts, tcp, tcp,
                                                     "hosts"), (f"one host re-targeted to {STAGES} hosts",
                                                                one_host, tcp, shm, "hosts")):
        row, results[label] = compare(label, path, network, recorded, measured[against], args.warmup)
        rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(out / "pipeline.csv", index=False, float_format="%.6g")
    pd.concat([frame.assign(case=name)
               for name, frame in measured.items()]).to_csv(out / "stages.csv", index=False,
                                                            float_format="%.6g")
    formed = predictions(hosts, tcp, args.microbatches, args.warmup)
    formed.to_csv(out / "formed.csv", index=False, float_format="%.6g")
    picture(hosts, origins, results[f"{STAGES} hosts, replayed there"], args.steps - 1, out / "timeline.png")
    shown = {"float_format": lambda v: f"{v:.3g}", "index": False}
    print(f"\n{table.to_string(**shown)}\n\nthe 4 hosts' recording formed again (predicted):\n"
          f"{formed.to_string(**shown)}\n\nWrote {out}/pipeline.csv, stages.csv, formed.csv, timeline.png")


if __name__ == "__main__":
    main()
