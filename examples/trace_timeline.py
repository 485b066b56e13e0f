"""Trace a few collectives to JSONL, then see them as a per-rank timeline.

    python examples/trace_timeline.py          # writes run.jsonl, timeline.json, timeline.png
    # open timeline.json in https://ui.perfetto.dev: one track per rank, ring steps inside
"""

import os
import sys

import torch

import lab
from lab.timeline import plot_timeline, read_trace, to_chrome_trace


def step(mesh):
    for numel in (256, 65_536):
        lab.allreduce(mesh, torch.randn(numel), algorithm="ring")
        lab.allreduce(mesh, torch.randn(numel), algorithm="tree")
    lab.broadcast(mesh, torch.randn(1000), src=1)
    return mesh.stats()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    trace = os.path.join(out, "run.jsonl")
    if os.path.exists(trace):
        os.remove(trace)
    os.environ["LAB_TRACE_STEPS"] = "1"  # also one row per transfer
    for rank, stats in enumerate(lab.spawn(step, 4, trace=trace)):
        print(f"rank {rank}: sent {stats['bytes_sent']:,} B, received {stats['bytes_received']:,} B")
    rows = read_trace(trace)
    with open(os.path.join(out, "timeline.json"), "w") as f:
        import json

        json.dump(to_chrome_trace(rows), f)
    plot_timeline(rows, os.path.join(out, "timeline.png"))
    print(f"{len(rows)} trace rows -> {out}/timeline.json (Perfetto) and {out}/timeline.png")
