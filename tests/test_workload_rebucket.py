"""Workloads that say which algorithm ran, and a DDP recording re-bucketed at another cap: DDP's
bucket boundaries, the byte totals kept, each new bucket issued where the recorded backward's
timeline puts its last gradient (worked by hand), and the errors that name bucket_mb."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from lab import sim, workload
from lab.workload.rebucket import MIB, ddp_buckets, rebucket
from lab.workload.replay import collective_us

pytestmark = pytest.mark.no_ranks

NET = sim.Network(alpha_us=10.0, gbit=8.0)
#: Gradients of 400, 800, 1,200 and 1,600 bytes; a 2,000-byte cap makes buckets of 2,400 and 1,600.
COUNTS, RECORDED_CAP = [100, 200, 300, 400], 2000


def allreduce(rank: int, index: int, count: int, compute: float, step: int, **extra) -> dict:
    return {
        "rank": rank, "step": step, "kind": "op", "index": index, "op": "allreduce", "group": [0, 1],
        "dim": None, "dtype": "float32", "count": count, "out_count": count, "reduce_op": "sum", "root": None,
        "async": True, "compute_us": compute, **extra}


def wait(rank: int, index: int, compute: float, step: int) -> dict:
    return {"rank": rank, "step": step, "kind": "wait", "index": index, "compute_us": compute}


def ddp_recording(tmp_path, gradients: bool = True) -> workload.Workload:
    """Two ranks of a DDP step recorded twice: step 0 before DDP rebuilt its buckets (one
    allreduce of every gradient), step 1 after (a bucket of 2,400 bytes at 100 µs of compute,
    one of 1,600 at 160 µs, their waits at 170 µs, the step's end at 175 µs)."""
    rows: list[dict] = [{
        "format": "lab-workload", "version": 2, "world_size": 2, "dims": None, "recorded": {}}]
    for rank in range(2):
        if gradients:
            rows.append({
                "rank": rank, "step": 0, "kind": "gradients", "group": [0, 1], "dtype": "float32",
                "counts": COUNTS, "bucket_cap_bytes": RECORDED_CAP, "first_bucket_cap_bytes": RECORDED_CAP})
        rows += [
            allreduce(rank, 0, 1000, 80.0, 0, algorithm="ring"),
            wait(rank, 0, 0.0, 0), {"rank": rank, "step": 0, "kind": "step", "compute_us": 5.0},
            allreduce(rank, 1, 600, 100.0, 1, algorithm="ring"),
            allreduce(rank, 2, 400, 60.0, 1),
            wait(rank, 1, 10.0, 1),
            wait(rank, 2, 0.0, 1), {"rank": rank, "step": 1, "kind": "step", "compute_us": 5.0}]
    path = tmp_path / "ddp.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return workload.load(path)


@pytest.mark.parametrize("caps", [[2000], [1000, 2000], [1]])
def test_buckets_end_where_ddp_ends_them(caps):
    """torch's own assignment (given the order, as DDP's rebuild gives it) ends its buckets alike."""
    counts = [16, 65536, 4096, 262144, 10, 3000, 1, 500]
    tensors = [torch.empty(count) for count in counts]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, caps, [False] * len(counts),
                                                        list(range(len(counts))))
    assert ddp_buckets([4 * count for count in counts], caps) == [bucket[-1] + 1 for bucket in theirs]


def test_a_step_is_rebucketed_by_hand(tmp_path):
    """At a 1,000-byte cap: buckets of 1,200, 1,200 and 1,600 bytes. The recorded backward made
    2,400 bytes by 100 µs and 4,000 by 160 µs (37.5 ns a byte): the first new bucket's last
    gradient is ready at 1,200 bytes, 100 - 1,200 x 0.0375 = 55 µs; the second at 100 µs; the
    third at 160 µs; their waits where the first recorded one was (170 µs)."""
    w = ddp_recording(tmp_path)
    rebucketed = rebucket(w, 1000 / MIB)
    for rank in range(2):
        events = rebucketed.events[rank]
        kept, step = events[:3], events[3:]
        assert [(e.kind, e.count, e.compute_us) for e in kept] == [("op", 1000, 80.0), ("wait", 0, 0.0),
                                                                   ("step", 0, 5.0)]  # before DDP's rebuild
        assert [(e.kind, e.index, e.count, e.compute_us) for e in step] == [("op", 1, 300, 55.0),
                                                                            ("op", 2, 300, 45.0),
                                                                            ("op", 3, 400, 60.0),
                                                                            ("wait", 1, 0, 10.0),
                                                                            ("wait", 2, 0, 0.0),
                                                                            ("wait", 3, 0, 0.0),
                                                                            ("step", -1, 0, 5.0)]
        assert sum(e.nbytes for e in step if e.kind == "op") == sum(4 * c for c in COUNTS)
        assert all(e.algorithm is None for e in step)  # (sizes the lab never ran: the replay picks)
    assert [e.count for e in w.events[0] if e.kind == "op"] == [1000, 600, 400]  # (the loaded one unchanged)
    r = workload.replay(w, network=NET, algorithms={"allreduce": "ring"}, bucket_mb=1000 / MIB)
    step1 = r.breakdown[r.breakdown["step"] == 1]
    assert list(step1["nbytes"]) == [1200, 1200, 1600]
    ring = [collective_us("allreduce", "ring", 2, n, 0, NET)[0] for n in (1200, 1200, 1600)]
    # each starts once issued and the one before ended; the rank waits from 170 µs on the last
    ends = []
    for issued, took in zip((55.0, 100.0, 160.0), ring):
        ends.append(max(issued, ends[-1] if ends else 0.0) + took)
    assert r.step_us[1] == pytest.approx(max(170.0, ends[-1]) + 5.0)


def test_one_recorded_bucket_issues_every_new_one_when_it_was(tmp_path):
    """A cap that made one bucket knows no pace of the backward: at 2 KB every new bucket is
    issued at that bucket's 80 µs."""
    w = ddp_recording(tmp_path)
    w.gradients = {
        rank: workload.Gradients((0, 1), "float32", tuple(COUNTS), 1 << 20, 1 << 20)
        for rank in (0, 1)}
    events = rebucket(w, 2000 / MIB).events[0]
    assert [(e.kind, e.count, e.compute_us) for e in events[:4]] == [("op", 600, 80.0), ("op", 400, 0.0),
                                                                     ("wait", 0, 0.0), ("wait", 0, 0.0)]


def test_the_algorithm_that_ran_is_replayed_at_the_recorded_size(tmp_path):
    """Replayed as recorded, an operation runs what the lab ran; elsewhere, the replay's own choice
    (as algorithms={"allreduce": "auto"} asks), and algorithms= names one over both."""
    w = ddp_recording(tmp_path)
    w.events[0][0].algorithm = w.events[1][0].algorithm = "naive"  # (never auto's: only the file says it)
    rows = workload.replay(w, network=NET).breakdown
    assert list(rows[["algorithm", "recorded_algorithm"]].iloc[0]) == ["naive", "naive"]
    assert rows["recorded_algorithm"].isna().iloc[2] and rows["algorithm"].iloc[2] != "naive"  # (unsaid)
    chosen = workload.replay(w, network=NET, algorithms={"allreduce": "auto"}).breakdown
    assert chosen["algorithm"].iloc[0] == collective_us("allreduce", None, 2, 4000, 0, NET)[1]
    wider = workload.replay(w, world_size=8, network=NET).breakdown
    assert wider["algorithm"].iloc[0] == collective_us("allreduce", None, 8, 4000, 0, NET)[1]
    assert workload.replay(w, network=NET,
                           algorithms={"allreduce": "ring"}).breakdown["algorithm"].iloc[0] == "ring"
    w.events[0][0].algorithm = w.events[1][0].algorithm = "telepathy"
    with pytest.raises(ValueError,
                       match="algorithm 'telepathy', which this lab does not have: name one in algo"):
        workload.replay(w, network=NET)


def test_bucket_mb_errors_name_it(tmp_path):
    with pytest.raises(ValueError,
                       match=r"bucket_mb: .* knows no gradients: call lab.workload.record_gradients"):
        workload.replay(ddp_recording(tmp_path, gradients=False), network=NET, bucket_mb=1)
    w = ddp_recording(tmp_path)
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="bucket_mb must be a finite number of MiB > 0"):
            workload.replay(w, network=NET, bucket_mb=bad)
    for events in w.events.values():  # 2,000 bytes and 2,000: no gradient ends at 2,000
        events[3].count = events[4].count = 500
    with pytest.raises(ValueError,
                       match="bucket_mb: step 1 of rank 0 has allreduces .* do not split its 4 grad"):
        workload.replay(w, network=NET, bucket_mb=1)


@pytest.mark.parametrize(("change", "message"), [
    (lambda row: row.update(counts=[]), "field 'counts' must list each gradient's elements"),
    (lambda row: row.update(bucket_cap_bytes=0), r"field 'bucket_cap_bytes' must be an integer in \[1, "),
    (lambda row: row.update(group=[1]), "field 'group' must list distinct ranks"),
    (lambda row: row.pop("dtype"), "field 'dtype' must be a string"),])
def test_a_bad_gradients_line_names_its_field(tmp_path, change, message):
    path = tmp_path / "ddp.jsonl"
    ddp_recording(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    change(rows[1])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=f"ddp.jsonl:2: {message}"):
        workload.load(path)


def test_the_command_re_buckets(tmp_path, capsys):
    from lab.__main__ import main

    ddp_recording(tmp_path)
    path = str(tmp_path / "ddp.jsonl")
    common = ["workload", "replay", path, "--alpha-us", "10", "--gbit", "8", "--json"]
    assert main([*common, "--bucket-mb", str(1000 / MIB)]) == 0
    rows = json.loads(capsys.readouterr().out)["breakdown"]
    assert [row["nbytes"] for row in rows if row["step"] == 1] == [1200, 1200, 1600]
    assert main(["workload", "export", path, "--goal", str(tmp_path / "w.goal"), "--bucket-mb", "1"]) == 0
    (tmp_path / "plain.jsonl").write_text("".join(
        line + "\n" for line in (tmp_path / "ddp.jsonl").read_text().splitlines()
        if '"gradients"' not in line))
    with pytest.raises(SystemExit):
        main([*common[:2], str(tmp_path / "plain.jsonl"), "--bucket-mb", "4"])
    assert "bucket_mb: " in capsys.readouterr().err
