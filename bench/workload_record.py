"""What recording a workload costs: a 1 KB allreduce loop, and a DDP step, with and without ``workload=``.

    python bench/workload_record.py                      # 2 ranks, shm, 7 rounds of 2,000 calls
    python bench/workload_record.py --ranks 4 --calls 5000 --rounds 9 --transport tcp

Two pools of the same size run side by side, one recording every rank's calls into a file
(``lab.launch(..., workload=)``), one not; each round runs both, which one first alternating
(timings on shared cores drift; alternating spreads the drift over both alike). Each round every
rank times each call of a loop of ``lab.allreduce`` on 1 KB, after a warm-up; per case, the median
over rounds of the median per call of the slowest rank, as ``lab.benchmark`` reports. The loop
ends its step with ``lab.workload.mark_step()`` once a round, timed apart: it writes the round's
lines.

Two inputs: a torch tensor (a plain call like one before takes its lane, the shortest way, and a
recorded one its lane too) and a numpy array (the full path, checks and choices made each call).

Then a training step, what a recording is for: DDP (``lab.backend.init_process_group`` over the
pool's mesh) of a 1.3 MB MLP in two buckets, a batch of 32; per round, after two warm-up steps,
the median over ``--steps`` steps of the slowest rank's step (forward, backward, optimizer and
``lab.workload.mark_step()``, which writes the step's lines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import lab
from lab.comm.operations import Operation, record
from lab.workload.record import Recorder

INPUTS = ("torch", "numpy")


def timed(mesh: lab.Mesh, kind: str, calls: int, warmup: int) -> tuple[list[int], int]:
    """Each call's ns of ``calls`` 1 KB allreduces of ``kind``'s input, and the step's end's ns."""
    x = torch.ones(256) if kind == "torch" else np.ones(256, np.float32)
    for _ in range(warmup):
        lab.allreduce(mesh, x)
    lab.barrier(mesh)
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        lab.allreduce(mesh, x)
        times.append(time.perf_counter_ns() - start)
    start = time.perf_counter_ns()
    lab.workload.mark_step()
    return times, time.perf_counter_ns() - start


def ddp_steps(mesh: lab.Mesh, steps: int) -> tuple[list[int], int]:
    """Each of ``steps`` DDP steps' ns, after two warm-up steps, and the ns of their step ends
    (``mark_step``) in all."""
    lab.backend.init_process_group(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 16))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    batch = torch.randn(32, 64)
    times, ends = [], 0
    for step in range(steps + 2):
        start = time.perf_counter_ns()
        ddp(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        before_end = time.perf_counter_ns()
        lab.workload.mark_step()
        if step >= 2:
            times.append(time.perf_counter_ns() - start)
            ends += time.perf_counter_ns() - before_end
    dist.destroy_process_group()
    return times, ends


def recorder_us(calls: int, rounds: int = 5) -> tuple[float, float]:
    """In this process, no rank: µs a synchronous call's notes cost (issued, completed, returned,
    as :func:`lab.comm.operations.record` makes them) and µs its line costs at the step's end."""
    path = os.path.join(tempfile.mkdtemp(prefix="lab-workload-"), "micro.jsonl")
    recorder = Recorder(path, 0, 2)
    what = Operation("allreduce", (0, 1), "float32", 4, 256, 256, reduce_op="sum")
    noted, lines = [], []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            record(recorder, what, False, lambda run: run(), lambda: None)
        middle = time.perf_counter_ns()
        recorder.mark_step()
        noted.append((middle - start) / calls / 1e3)
        lines.append((time.perf_counter_ns() - middle) / calls / 1e3)
    return statistics.median(noted), statistics.median(lines)


def median_us(per_rank: list[tuple[list[int], int]]) -> tuple[float, float]:
    """The median over calls of the slowest rank's µs, and the slowest rank's step end in µs."""
    slowest = np.max(np.array([times for times, _ in per_rank]), axis=0)
    return float(np.median(slowest)) / 1e3, max(end for _, end in per_rank) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--steps", type=int, default=10, help="DDP steps timed each round (0: none)")
    args = parser.parse_args()
    noted, line = recorder_us(args.calls)
    print(f"The recorder alone (this process): {noted:.2f} us a call's notes, {line:.2f} us its line")
    path = os.path.join(tempfile.mkdtemp(prefix="lab-workload-"), "bench.jsonl")
    cases = INPUTS + (("ddp",) if args.steps else ())
    results = {(recorded, kind): [] for recorded in (False, True) for kind in cases}
    ends: dict[str, list[float]] = {"calls": [], "ddp": []}
    with lab.launch(args.ranks, transport=args.transport) as plain, \
            lab.launch(args.ranks, transport=args.transport, workload=path) as recording:
        for round_ in range(args.rounds):
            for kind in cases:
                order = ((False, plain), (True, recording))  # (which goes first alternates too)
                for recorded, cluster in order if round_ % 2 else order[::-1]:
                    ran = cluster.run(ddp_steps, args.steps) if kind == "ddp" else \
                        cluster.run(timed, kind, args.calls, args.warmup)
                    median, end = median_us(ran)
                    results[recorded, kind].append(median)
                    if recorded:
                        ends["ddp" if kind == "ddp" else "calls"].append(end)
    print(f"1 KB allreduce, {args.ranks} ranks, {args.transport}: median per call of the slowest rank "
          f"({args.rounds} rounds of {args.calls:,} calls)")
    for kind in cases:
        off, on = (statistics.median(results[recorded, kind]) for recorded in (False, True))
        what = "DDP step" if kind == "ddp" else f"{kind} input"
        print(f"  {what:11s}: unrecorded {off:8.2f} us, recorded {on:8.2f} us, "
              f"cost {on - off:+.2f} us ({on / off - 1:+.1%})")
    calls_end = statistics.median(ends["calls"])
    print(f"  mark_step (writes a round's {args.calls:,} calls' lines): median {calls_end:,.0f} us")
    if args.steps:
        ddp_end = statistics.median(ends["ddp"]) / args.steps
        print(f"  mark_step in a DDP step (its lines, one write): median {ddp_end:,.0f} us")
    print(f"  recorded into {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
