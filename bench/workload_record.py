"""What recording a workload costs a call: a 1 KB allreduce loop with and without ``workload=``.

    python bench/workload_record.py                      # 2 ranks, shm, 7 rounds of 2,000 calls
    python bench/workload_record.py --ranks 4 --calls 5000 --rounds 9 --transport tcp

Two pools of the same size run side by side, one recording every rank's calls into a file
(``lab.launch(..., workload=)``), one not, and rounds alternate between them (timings on shared
cores drift; alternating spreads the drift over both alike). Each round every rank times each
call of a loop of ``lab.allreduce`` on 1 KB, after a warm-up; per case, the median over rounds of
the median per call of the slowest rank, as ``lab.benchmark`` reports. The loop ends its step
with ``lab.workload.mark_step()`` once a round, timed apart: it writes the round's lines.

Two inputs: a torch tensor (unrecorded, a plain call like one before takes its lane, the
shortest way; a recorded one takes the full path, which notes it), and a numpy array (the full
path either way): so the cost of recording itself is told from the lane's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import lab

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
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="lab-workload-"), "bench.jsonl")
    results = {(recorded, kind): [] for recorded in (False, True) for kind in INPUTS}
    ends = []
    with lab.launch(args.ranks, transport=args.transport) as plain, \
            lab.launch(args.ranks, transport=args.transport, workload=path) as recording:
        for _ in range(args.rounds):
            for kind in INPUTS:
                for recorded, cluster in ((False, plain), (True, recording)):
                    median, end = median_us(cluster.run(timed, kind, args.calls, args.warmup))
                    results[recorded, kind].append(median)
                    if recorded:
                        ends.append(end)
    print(f"1 KB allreduce, {args.ranks} ranks, {args.transport}: median per call of the slowest rank "
          f"({args.rounds} rounds of {args.calls:,} calls)")
    for kind in INPUTS:
        off, on = (statistics.median(results[recorded, kind]) for recorded in (False, True))
        print(f"  {kind:5s} input: unrecorded {off:6.2f} us, recorded {on:6.2f} us, "
              f"cost {on - off:+.2f} us a call ({on / off - 1:+.0%})")
    print(f"  mark_step (writes a round's {args.calls:,} calls' lines): median {statistics.median(ends):,.0f} us")
    print(f"  recorded into {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
