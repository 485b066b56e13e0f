"""How close a workload's replay comes to the step it recorded: DDP and FSDP2 on emulated hosts.

    sudo python bench/workload_accuracy.py                      # writes results/workloads/
    sudo python bench/workload_accuracy.py --steps 8 --warmup 3 --out /tmp/accuracy

Each case trains a two-layer MLP (width 768, 4.7 MB of float32 parameters) with torch's DDP
(2 MB buckets) or FSDP2 (``fully_shard`` per layer) on the lab's backend, on 2 and on 4 emulated
hosts (tcp, 1 Gbit/s links, one rank a host), recording every rank (``workload=``). Two batches: 16
rows, a step dominated by its communication, and ``--balanced-batch`` rows (default 256), whose
compute is about as long as its communication. Measured: the median over the steps after
``--warmup`` of the slowest rank's step (forward, backward, optimizer, ``mark_step``). Replayed:
the recording's same steps, on the network the lab fitted for those hosts
(``lab.sim.calibrated("tcp", hosts=H, link_gbit=1.0)``), at the recorded size (target: within
10 %) and, for a 2-host recording, at 4 ranks against the 4-host measurement (target: within 20 %).
The emulated hosts are namespaces of one machine: every rank shares its cores (on a 2-core
machine, 4 ranks take turns), as the fitted network assumes.

Then the replay of the 4-host DDP recording (communication-bound) on 1,024 ranks, each host its own
cores, is timed (target: under a minute). Writes ``accuracy.csv``, ``replay_1024.csv`` and
``machine.json`` into ``--out``, prints the table as markdown and, where ``--out`` is a results
folder's ``workloads/``, puts its section into that folder's ``REPORT.md``
(:mod:`lab.results.workloads`; ``python -m lab results --report-only`` renders it again).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import lab
from lab.collectives.choice import pick
from lab.results import workloads
from lab.results.sweeps import machine, save_machine
from lab.workload.format import DTYPE_BYTES

WIDTH, LINK_GBIT = 768, 1.0
CORES = os.cpu_count() or 1
TARGETS = {"recorded size": 0.10, "2 -> 4 hosts": 0.20}


def train(mesh: lab.Mesh, parallelism: str, batch: int, steps: int) -> list[float]:
    """``steps`` steps of the MLP under ``parallelism`` (ddp, fsdp2) on ``batch`` rows: each one's ms."""
    torch.set_num_threads(1)  # (ranks share the machine's cores: one thread each)
    lab.backend.init_process_group(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    if parallelism == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2)
        lab.workload.record_gradients(model)  # (the recording can be replayed at another bucket size)
    else:
        for layer in (model[0], model[2], model):
            fully_shard(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(mesh.rank)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(torch.randn(batch, WIDTH, generator=data)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        lab.workload.mark_step()
        times.append((time.perf_counter() - started) * 1e3)
    dist.destroy_process_group()
    return times


def measure(parallelism: str, batch: int, hosts: int, steps: int, warmup: int,
            folder: Path) -> tuple[Path, float]:
    """Record the case on ``hosts`` emulated hosts: the file, and its measured step in ms."""
    path = folder / f"{parallelism}_b{batch}_h{hosts}.jsonl"
    times = lab.spawn(train, hosts, args=(parallelism, batch, steps), hosts=hosts, link_gbit=LINK_GBIT,
                      transport="tcp", workload=str(path))
    return path, statistics.median(max(step) for step in list(zip(*times))[warmup:])


def lab_algorithms(w: lab.workload.Workload, world_size: int) -> dict[str, str]:
    """The algorithm ``auto`` runs for each collective of ``w`` on ``world_size`` emulated hosts
    (tcp), at each call's total (what :func:`lab.collectives.choice.pick` weighs): the recording
    says what ran on its own hosts, not on ``world_size``, and the replay's own choice elsewhere is
    the least simulated."""
    # (tcp has no mailboxes, so no compiled path: compiled_max_bytes 0, as its meshes report)
    hosts = SimpleNamespace(world_size=world_size, transport="tcp", host_count=world_size,
                            compiled_max_bytes=0)
    picks: dict[str, set[str]] = {}
    for event in w.events[0]:
        if event.kind == "op":
            total = event.out_count * DTYPE_BYTES[event.dtype] if event.op == "allgather" else event.nbytes
            picks.setdefault(event.op, set()).add(pick(hosts, event.op, "auto", total))
    return {op: chosen.pop() for op, chosen in picks.items() if len(chosen) == 1}


def replayed(path: Path, world_size: int, warmup: int,
             compute_scale: float = 1.0) -> tuple[float, float, str]:
    """The replay of ``path`` on ``world_size`` emulated hosts' fitted network, with the algorithms
    the lab ran there (where one a collective) and its compute times ``compute_scale``: the median
    step and compute in ms over the steps after ``warmup``, and the algorithms named."""
    w = lab.workload.load(path)
    algorithms = lab_algorithms(w, world_size)
    network = lab.sim.calibrated("tcp", hosts=world_size, link_gbit=LINK_GBIT)
    result = lab.workload.replay(w, world_size=world_size, network=network, algorithms=algorithms,
                                 compute_scale=compute_scale, timeline=False)
    step, compute = (float(statistics.median(values[warmup:])) / 1e3
                     for values in (result.step_us, result.compute_us))
    return step, compute, " ".join(f"{op}={name}" for op, name in sorted(algorithms.items()))


def compare(case: dict, recorded: dict[int, tuple[Path, float]], source: int, target: int,
            warmup: int) -> dict:
    """The replay of the ``source``-host recording on ``target`` hosts against the ``target``-host
    measurement; and again with the compute scaled as the shared cores scale it (on a 2-core
    machine, a rank of 4 computes half as fast as a rank of 2), what the plain replay cannot know."""
    comparison = "recorded size" if source == target else f"{source} -> {target} hosts"
    step, compute, algorithms = replayed(recorded[source][0], target, warmup)
    scale = max(target / CORES, 1.0) / max(source / CORES, 1.0)
    scaled = replayed(recorded[source][0], target, warmup, scale)[0] if scale != 1 else step
    measured = recorded[target][1]
    error = step / measured - 1
    print(
        f"{case['parallelism']} {case['model']} {comparison} ({source} -> {target}): "
        f"measured {measured:.1f} ms, replayed {step:.1f} ms ({error:+.1%})", flush=True)
    return {
        **case, "comparison": comparison, "recorded_hosts": source, "replayed_hosts": target,
        "measured_ms": measured, "replayed_ms": step, "compute_ms": compute, "algorithms": algorithms,
        "error": error, "target": TARGETS[comparison], "meets": abs(error) <= TARGETS[comparison],
        "cores_scaled_ms": scaled, "cores_scaled_error": scaled / measured - 1}


def cases(args: argparse.Namespace, folder: Path) -> pd.DataFrame:
    """Every case measured, recorded and replayed: one row per comparison."""
    rows = []
    for parallelism in ("ddp", "fsdp2"):
        for model, batch in (("communication-bound", 16), ("balanced", args.balanced_batch)):
            recorded = {
                hosts: measure(parallelism, batch, hosts, args.steps, args.warmup, folder)
                for hosts in (2, 4)}
            case = {"parallelism": parallelism, "model": model, "batch": batch}
            rows += [
                compare(case, recorded, source, target, args.warmup)
                for source, target in ((2, 2), (4, 4), (2, 4))]
    return pd.DataFrame(rows)


def replay_time(path: Path, ranks: int) -> dict:
    """Seconds the replay of ``path`` on ``ranks`` ranks takes (this process's first at that size),
    each host with its own cores (as ``examples/workload_ddp.py`` replays it)."""
    network = dataclasses.replace(lab.sim.calibrated("tcp", hosts=4, link_gbit=LINK_GBIT), ranks_per_cpu=1)
    started = time.perf_counter()
    result = lab.workload.replay(lab.workload.load(path), world_size=ranks, network=network, timeline=False)
    return {
        "recording": path.name, "ranks": ranks, "seconds": time.perf_counter() - started,
        "step_ms": float(result.step_us[-1]) / 1e3, "operations": len(result.breakdown)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per case, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--balanced-batch", type=int, default=256, help="rows a step of the balanced model")
    parser.add_argument("--ranks", type=int, default=1024, help="the world the DDP step's replay is timed at")
    parser.add_argument("--out", default="results/workloads")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    folder = out / "recordings"
    folder.mkdir(exist_ok=True)
    table = cases(args, folder)
    timing = replay_time(folder / "ddp_b16_h4.jsonl", args.ranks)
    table.to_csv(out / "accuracy.csv", index=False, float_format="%.6g")
    pd.DataFrame([timing]).to_csv(out / "replay_1024.csv", index=False, float_format="%.6g")
    save_machine(out, info)
    spliced = workloads.splice_section(out.parent) if out.name == workloads.FOLDER else False
    print(f"\n{workloads.accuracy_table(table)}\n")
    print(f"replay of {timing['recording']} on {timing['ranks']:,} ranks: {timing['seconds']:.1f} s "
          f"({timing['operations']} operations, last step {timing['step_ms']:,.1f} ms)")
    if spliced:
        print(f"Wrote its section into {out.parent / 'REPORT.md'}")


if __name__ == "__main__":
    main()
