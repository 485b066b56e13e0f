"""The JSONL trace: one row per collective per rank, with the byte counters of that collective."""

from __future__ import annotations

import itertools
import json
import os

import torch

import lab
from lab.timeline import plot_timeline, read_trace, to_chrome_trace

REQUIRED = {
    "rank", "world_size", "op", "algorithm", "transport", "nbytes", "bytes_sent", "bytes_received",
    "start_ns", "duration_ns"}


def traced_work(mesh: lab.Mesh) -> dict[str, int]:
    mesh.reset_stats()
    x = torch.arange(12, dtype=torch.float32) + mesh.rank
    lab.allreduce(mesh, x.clone(), algorithm="ring")
    lab.allreduce(mesh, x.clone(), algorithm="tree")
    lab.broadcast(mesh, x.clone(), src=1)
    lab.allgather(mesh, x)
    lab.reduce_scatter(mesh, x)
    return mesh.stats()


def read_rows(path) -> list[dict]:
    with open(path) as trace:
        return [json.loads(line) for line in trace]


def test_every_rank_writes_one_row_per_collective(tmp_path):
    path = tmp_path / "run.jsonl"
    stats = lab.spawn(traced_work, 3, trace=str(path))
    rows = read_rows(path)
    assert len(rows) == 3 * 5
    for row in rows:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["world_size"] == 3 and row["transport"] == "shm" and row["duration_ns"] > 0
    for rank in range(3):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["seq"])
        assert [r["op"]
                for r in mine] == ["allreduce", "allreduce", "broadcast", "allgather", "reduce_scatter"]
        assert [r["algorithm"] for r in mine[:2]] == ["ring", "tree"]
        assert mine[0]["nbytes"] == 48 and mine[0]["bytes_sent"] == 2 * 48 * 2 // 3  # 2T(N-1)/N
        assert sum(r["bytes_sent"] for r in mine) == stats[rank]["bytes_sent"]
        assert sum(r["bytes_received"] for r in mine) == stats[rank]["bytes_received"]
        assert all(a["start_ns"] + a["duration_ns"] <= b["start_ns"] for a, b in itertools.pairwise(mine))


def test_lab_trace_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("LAB_TRACE", str(path))
    lab.spawn(traced_work, 2, transport="queue")
    rows = read_rows(path)
    assert len(rows) == 2 * 5 and {r["transport"] for r in rows} == {"queue"}
    assert os.path.getsize(path) > 0


def test_step_rows_and_the_perfetto_timeline(tmp_path, monkeypatch):
    """With LAB_TRACE_STEPS=1 each transfer is a row inside its collective; the converter makes one
    track per rank with every row as a slice, and draws the PNG."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LAB_TRACE_STEPS", "1")
    lab.spawn(traced_work, 3, trace=str(path))
    rows = read_trace(path)
    steps = [r for r in rows if r["kind"] == "step"]
    ring = [r for r in steps if r["rank"] == 0 and r["op"] == "allreduce" and r["algorithm"] == "ring"]
    assert len(ring) == 2 * (3 - 1)  # reduce-scatter and allgather steps
    assert all(r["sends"] == [[1, 16]] and r["recvs"] == [[2, 16]] for r in ring)  # right, left; 4 floats
    collectives = {(r["rank"], r["seq"]): r for r in rows if r["kind"] == "collective"}
    for step in steps:
        outer = collectives[step["rank"], step["seq"]]
        assert outer["start_ns"] <= step["start_ns"] <= outer["start_ns"] + outer["duration_ns"]
    trace = to_chrome_trace(rows)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert len(slices) == len(rows) and names == {"rank 0", "rank 1", "rank 2"}
    assert min(e["ts"] for e in slices) == 0 and all(e["dur"] > 0 for e in slices)
    plot_timeline(rows, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
