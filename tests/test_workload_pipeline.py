"""Pipelines as workloads (lab.workload.pipeline, lab.workload.schedule): a recording of torch's
pipelining keeps each transfer's stage, peer stage and micro-batch; the replay's per-stage bubble is
GPipe's (S - 1) / (M + S - 1) on a hand-made workload, and on GPipe and 1F1B formed again at more
micro-batches or stages; the labels round-trip and bad ones are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lab
from lab.sim import Network
from lab.workload.format import load
from lab.workload.record import Recorder, write_header

FORWARD_US, BACKWARD_US = 100.0, 200.0
#: A network whose messages take no time (64 bytes at 1e9 Gbit/s: 5e-10 µs).
FREE = Network(alpha_us=0.0, gbit=1e9)


def _transfer(rank: int, step: int, index: int, op: str, peer: int, stage: int, peer_stage: int,
              microbatch: int, compute_us: float, is_async: bool) -> dict:
    return {
        "rank": rank, "step": step, "kind": "op", "index": index, "op": op, "group": [rank, peer],
        "dim": None, "dtype": "float32", "count": 16, "out_count": 16, "reduce_op": None, "root": None,
        "peer": peer, "tag": 0, "stage": stage, "peer_stage": peer_stage, "microbatch": microbatch,
        "async": is_async, "compute_us": compute_us}


def gpipe(stages: int, microbatches: int, steps: int) -> list[dict]:
    """GPipe's events, a stage a rank: every forward (a blocking receive from the stage before, the
    forward's compute, an asynchronous send on), then every backward the same way back, then a
    wait on each send; the compute before an event is its ``compute_us``."""
    rows = []
    for s in range(stages):
        index = 0
        for step in range(steps):
            carried, sends = 0.0, []
            for direction, compute, source, target in ((1, FORWARD_US, s - 1, s + 1), (-1, BACKWARD_US, s + 1,
                                                                                       s - 1)):
                for m in range(microbatches):
                    if 0 <= source < stages:
                        rows.append(_transfer(s, step, index, "recv", source, s, source, m, carried, False))
                        index, carried = index + 1, 0.0
                    carried += compute
                    if 0 <= target < stages:
                        rows.append(_transfer(s, step, index, "send", target, s, target, m, carried, True))
                        sends.append(index)
                        index, carried = index + 1, 0.0
            for sent in sends:
                rows.append({"rank": s, "step": step, "kind": "wait", "index": sent, "compute_us": carried})
                carried = 0.0
            rows.append({"rank": s, "step": step, "kind": "step", "compute_us": carried})
    return rows


def write(path: Path, world_size: int, rows: list[dict], version: int = 2) -> Path:
    header = {
        "format": "lab-workload", "version": version, "world_size": world_size, "dims": None, "recorded": {}}
    path.write_text("".join(json.dumps(row) + "\n" for row in [header, *rows]))
    return path


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (2, 4), (3, 5), (4, 8), (5, 3)])
def test_gpipe_bubble_is_exact(tmp_path: Path, stages: int, microbatches: int) -> None:
    steps = 3
    w = load(write(tmp_path / "gpipe.jsonl", stages, gpipe(stages, microbatches, steps)))
    result = lab.workload.replay(w, network=FREE)
    per_stage = result.stages
    assert sorted(per_stage["rank"].unique()) == list(range(stages))
    assert len(per_stage) == stages * steps
    step = (microbatches + stages - 1) * (FORWARD_US + BACKWARD_US)
    np.testing.assert_allclose(result.step_us, step, rtol=1e-9)
    for row in per_stage.itertuples():
        assert row.stages == (row.rank,)
        assert row.compute_us == pytest.approx(microbatches * (FORWARD_US + BACKWARD_US))
        assert row.exposed_us == 0.0
        assert row.bubble_us == pytest.approx((stages - 1) * (FORWARD_US + BACKWARD_US), rel=1e-9)
        assert row.bubble_share == pytest.approx((stages - 1) / (microbatches + stages - 1), rel=1e-9)


def test_slow_links_grow_the_bubble(tmp_path: Path) -> None:
    w = load(write(tmp_path / "gpipe.jsonl", 4, gpipe(4, 8, 2)))
    message_us = 50.0  # each transfer's α: 2 · 3 of them on the critical path of a step
    slow = lab.workload.replay(w, network=Network(alpha_us=message_us, gbit=1e9))
    free = lab.workload.replay(w, network=FREE)
    assert (slow.stages["bubble_us"] > free.stages["bubble_us"] + 1).all()
    assert (slow.stages["compute_us"] == free.stages["compute_us"]).all()


def test_no_pipeline_no_stage_rows(tmp_path: Path) -> None:
    rows = [{
        "rank": r, "step": 0, "kind": "op", "index": 0, "op": "allreduce", "group": [
            0, 1], "dim": None, "dtype": "float32", "count": 4, "out_count": 4, "reduce_op": "sum",
        "root": None, "async": False, "compute_us": 10.0}
            for r in (0, 1)] + [{"rank": r, "step": 0, "kind": "step", "compute_us": 0.0} for r in (0, 1)]
    w = load(write(tmp_path / "ddp.jsonl", 2, rows))  # (a version 2 file without labels)
    assert all(e.stage is None and e.microbatch is None for events in w.events.values() for e in events)
    result = lab.workload.replay(w, network=FREE)
    assert result.stages.empty and list(result.stages.columns)[:3] == ["step", "rank", "stages"]


def test_labels_round_trip_through_a_recording(tmp_path: Path) -> None:
    path = tmp_path / "labels.jsonl"
    write_header(path, 2)
    for rank, peer, op in ((0, 1, "send"), (1, 0, "recv")):
        recorder = Recorder(path, rank, 2)
        label = {"stage": rank + 3, "peer_stage": peer + 3, "microbatch": 7}
        recorder.expect([(op, peer, label), (op, 5, label)])  # (the second's peer is not the call's)
        for _ in range(2):
            recorder.completed(recorder.operation(op, [0, 1], "float32", 8, 8, is_async=False, peer=peer))
            recorder.returned()
        recorder.expect([])
        recorder.mark_step()
        recorder.close()
    w = load(path)
    for rank, peer in ((0, 1), (1, 0)):
        first, second = (e for e in w.events[rank] if e.kind == "op")
        assert (first.stage, first.peer_stage, first.microbatch) == (rank + 3, peer + 3, 7)
        assert (second.stage, second.peer_stage, second.microbatch) == (None, None, None)
        assert first.issued_us is not None and first.completed_us >= first.issued_us


def _pair(send: dict | None = None, receive: dict | None = None) -> list[dict]:
    """A labelled send from rank 0 (stage 0) to rank 1 (stage 1) and its receive, with ``send``'s
    and ``receive``'s fields over theirs."""
    rows = [{**_transfer(0, 0, 0, "send", 1, 0, 1, 2, 1.0, False), **(send or {})},
            {**_transfer(1, 0, 0, "recv", 0, 1, 0, 2, 1.0, False), **(receive or {})}]
    return [{k: v for k, v in row.items() if v != "absent"} for row in rows]


@pytest.mark.parametrize("send, receive, field", [
    ({"stage": -1}, None, "stage"),
    ({"stage": "0"}, None, "stage"),
    ({"microbatch": True}, None, "microbatch"),
    ({"peer_stage": 2**31}, None, "peer_stage"),
    ({"microbatch": "absent"}, None, "microbatch"),
    ({"stage": "absent", "peer_stage": "absent"}, None, "stage"),
    ({"peer_stage": 0}, None, "peer_stage"),
    (None, {"microbatch": 3}, "microbatch"),
    (None, {"peer_stage": 2}, "peer_stage"),])
def test_bad_labels_are_refused_naming_the_field(tmp_path: Path, send: dict, receive: dict,
                                                 field: str) -> None:
    path = write(tmp_path / "bad.jsonl", 2, _pair(send, receive))
    with pytest.raises(ValueError, match=f"'{field}'"):
        load(path)


def test_labels_on_a_collective_are_refused(tmp_path: Path) -> None:
    row = {
        "rank": 0, "step": 0, "kind": "op", "index": 0, "op": "allreduce", "group": [0], "dim": None,
        "dtype": "float32", "count": 4, "out_count": 4, "reduce_op": "sum", "root": None, "async": False,
        "compute_us": 1.0, "microbatch": 0}
    with pytest.raises(ValueError, match="'microbatch' labels a pipeline's send or receive"):
        load(write(tmp_path / "bad.jsonl", 1, [row]))


def test_measured_stages_takes_one_step_time_per_step(tmp_path: Path) -> None:
    from lab.workload.pipeline import measured_stages

    w = load(write(tmp_path / "gpipe.jsonl", 2, gpipe(2, 2, 2)))
    table = measured_stages(w, [2000.0, 1500.0])
    assert len(table) == 4
    first = table[(table["rank"] == 1) & (table["step"] == 0)].iloc[0]
    assert first.compute_us == pytest.approx(2 * (FORWARD_US + BACKWARD_US))
    assert first.bubble_us == pytest.approx(2000.0 - 600.0)
    with pytest.raises(ValueError, match="step_us"):
        measured_stages(w, [1.0])


# -- a recording of torch's pipelining on the lab's backend ---------------------------------------

MICROBATCHES, WIDTH = 4, 8


def _pipeline(mesh: lab.Mesh) -> str:
    """A step of GPipe, then one of 1F1B, a stage a rank, recorded."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    lab.backend.init_process_group(mesh)
    torch.manual_seed(mesh.rank)
    module = torch.nn.Linear(WIDTH, WIDTH)
    for schedule_class in (ScheduleGPipe, Schedule1F1B):
        stage = PipelineStage(module, mesh.rank, mesh.world_size, torch.device("cpu"))
        schedule = schedule_class(stage, MICROBATCHES, loss_fn=lambda out, target:
                                  (out - target).square().mean())
        data = torch.ones(2 * MICROBATCHES, WIDTH)
        if mesh.rank == 0:
            schedule.step(data)
        elif mesh.rank == mesh.world_size - 1:
            schedule.step(target=data)
        else:
            schedule.step()
        lab.workload.mark_step()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_recorded_pipeline_keeps_its_stages(tmp_path: Path, world_size: int) -> None:
    path = tmp_path / "pipeline.jsonl"
    assert lab.spawn(_pipeline, world_size, workload=str(path)) == ["ok"] * world_size
    w = load(path)  # (which checks that each labelled send pairs with the receive of the inverse labels)
    assert w.steps == 2
    for rank in range(world_size):
        events = w.events[rank]
        for step in range(2):
            transfers = [e for e in events if e.kind == "op" and e.step == step and e.stage is not None]
            assert all(e.stage == rank and e.peer == e.peer_stage for e in transfers), (rank, step)
            for op, peer_stage in (("send", rank + 1), ("recv", rank - 1), ("send", rank - 1), ("recv",
                                                                                                rank + 1)):
                mine = [e.microbatch for e in transfers if e.op == op and e.peer_stage == peer_stage]
                expected = list(range(MICROBATCHES)) if 0 <= peer_stage < world_size else []
                assert mine == expected, (rank, step, op, peer_stage, mine)
            # the forward receive of micro-batch m feeds its forward: waited on before its send on
            waited = {}
            for position, event in enumerate(e for e in events if e.step == step):
                if event.kind == "wait":
                    waited.setdefault(event.index, position)
                if event.kind == "op" and not event.is_async:
                    waited.setdefault(event.index, position)
            for send in (e for e in transfers if e.op == "send" and e.peer_stage == rank + 1 and rank > 0):
                feeding = next(
                    e for e in transfers
                    if e.op == "recv" and e.peer_stage == rank - 1 and e.microbatch == send.microbatch)
                send_at = next(p for p, e in enumerate(e for e in events if e.step == step)
                               if e.kind == "op" and e.index == send.index)
                assert waited[feeding.index] < send_at, (rank, step, send.microbatch)
    result = lab.workload.replay(w, network=FREE)
    assert sorted(result.stages["rank"].unique()) == list(range(world_size))
    assert (result.stages["bubble_share"] > 0).all() and (result.stages["bubble_share"] < 1).all()


def _interleaved(mesh: lab.Mesh) -> str:
    """A step of interleaved 1F1B, rank r holding stages r and r + n, recorded."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    lab.backend.init_process_group(mesh)
    n = mesh.world_size
    stages = [
        PipelineStage(torch.nn.Linear(WIDTH, WIDTH), index, 2 * n, torch.device("cpu"))
        for index in (mesh.rank, mesh.rank + n)]
    schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=lambda out, target:
                                       (out - target).square().mean())
    data = torch.ones(2 * MICROBATCHES, WIDTH)
    if mesh.rank == 0:
        schedule.step(data)
    elif mesh.rank == n - 1:
        schedule.step(target=data)
    else:
        schedule.step()
    lab.workload.mark_step()
    dist.destroy_process_group()
    return "ok"


def test_an_interleaved_pipeline_names_each_of_a_ranks_stages(tmp_path: Path) -> None:
    path, n = tmp_path / "interleaved.jsonl", 2
    assert lab.spawn(_interleaved, n, workload=str(path)) == ["ok"] * n
    w = load(path)  # (each labelled send pairs with the receive of the inverse labels, or load refuses it)
    last = 2 * n - 1
    for rank in range(n):
        transfers = [e for e in w.events[rank] if e.kind == "op" and e.stage is not None]
        assert {e.stage for e in transfers} == {rank, rank + n}
        for stage in (rank, rank + n):
            for op, peer_stage in (("send", stage + 1), ("recv", stage - 1), ("send", stage - 1),
                                   ("recv", stage + 1)):
                mine = [
                    e.microbatch for e in transfers
                    if (e.stage, e.op, e.peer_stage) == (stage, op, peer_stage)]
                assert mine == (list(range(MICROBATCHES)) if 0 <= peer_stage <= last else []), (rank, stage,
                                                                                                op)
                assert all(e.peer == peer_stage % n for e in transfers if e.peer_stage == peer_stage)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(1, 3), (2, 1), (3, 5), (4, 8), (6, 2)])
def test_a_formed_schedule_idles_gpipes_bubble(schedule: str, stages: int, microbatches: int) -> None:
    from lab.workload.schedule import pipeline_workload

    per_microbatch = FORWARD_US + BACKWARD_US
    w = pipeline_workload(schedule, [per_microbatch] * stages, microbatches, 64, steps=2)
    result = lab.workload.replay(w, network=FREE)
    np.testing.assert_allclose(result.step_us, (microbatches + stages - 1) * per_microbatch, rtol=1e-9)
    if stages > 1:
        np.testing.assert_allclose(result.stages["bubble_share"], (stages - 1) / (microbatches + stages - 1),
                                   rtol=1e-9)
        np.testing.assert_allclose(result.stages["compute_us"], microbatches * per_microbatch, rtol=1e-9)


def test_a_recording_retargeted_to_more_microbatches_and_stages(tmp_path: Path) -> None:
    from lab.workload.schedule import retarget

    w = load(write(tmp_path / "gpipe.jsonl", 4, gpipe(4, 8, 3)))
    for microbatches, stages in ((16, None), (8, 8), (2, 2)):
        target = retarget(w, microbatches=microbatches, stages=stages)
        s = stages or 4
        per_stage = lab.workload.replay(target, network=FREE).stages
        assert sorted(per_stage["rank"].unique()) == list(range(s)) and len(per_stage) == 3 * s
        # each micro-batch's compute kept, the model's split among the stages
        np.testing.assert_allclose(per_stage["compute_us"], microbatches * (FORWARD_US + BACKWARD_US) * 4 / s)
        np.testing.assert_allclose(per_stage["bubble_share"], (s - 1) / (microbatches + s - 1), rtol=1e-9)
        sent = [e for e in target.events[0] if e.kind == "op"]
        assert {e.nbytes for e in sent} == {64} and {e.microbatch for e in sent} == set(range(microbatches))
    for bad in ({"microbatches": 0}, {"stages": True}, {"microbatches": 2.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            retarget(w, **bad)
    with pytest.raises(ValueError, match="schedule"):
        retarget(w, schedule="zb")


# -- what a transfer held its rank's communication thread (lab.workload.thread_time) --------------


def _hop_and_back() -> list[dict]:
    """Stage 0 sends a micro-batch on to stage 1 and receives its gradient back, with the clocks a
    recording keeps: each send held its rank's thread 500 µs (rank 0) and 300 µs (rank 1) past its
    start; no call held the program past its operation (``held_us`` 0 everywhere)."""
    def op(rank: int, index: int, op: str, compute: float, issued: float, completed: float) -> dict:
        row = _transfer(rank, 0, index, op, 1 - rank, rank, 1 - rank, 0, compute, True)
        return {**row, "issued_us": issued, "completed_us": completed}

    def wait(rank: int, index: int, compute: float, waited: float) -> dict:
        return {
            "rank": rank, "step": 0, "kind": "wait", "index": index, "compute_us": compute,
            "waited_us": waited}

    return [
        op(0, 0, "send", 100.0, 100.0, 600.0),
        op(0, 1, "recv", 50.0, 150.0, 1900.0),
        wait(0, 1, 10.0, 160.0),
        wait(0, 0, 0.0, 1900.0), {"rank": 0, "step": 0, "kind": "step", "compute_us": 0.0},
        op(1, 0, "recv", 20.0, 20.0, 900.0),
        wait(1, 0, 10.0, 30.0),
        op(1, 1, "send", 200.0, 1100.0, 1400.0),
        wait(1, 1, 0.0, 1100.0), {"rank": 1, "step": 0, "kind": "step", "compute_us": 0.0}]


def test_a_transfers_thread_time_is_read_from_the_clocks(tmp_path: Path) -> None:
    w = load(write(tmp_path / "hop.jsonl", 2, _hop_and_back()))
    ops = {(e.rank, e.index): e for events in w.events.values() for e in events if e.kind == "op"}
    # a send's: its completion less its start (its issue; rank 1's send: after its receive, done at 900)
    assert ops[0, 0].thread_us == pytest.approx(500.0) and ops[1, 1].thread_us == pytest.approx(300.0)
    # a receive's: its rank's sends of the same bytes (the median)
    assert ops[0, 1].thread_us == pytest.approx(500.0) and ops[1, 0].thread_us == pytest.approx(300.0)
    assert all(e.held_us == 0.0 for events in w.events.values() for e in events)
    bare = load(write(tmp_path / "bare.jsonl", 4, gpipe(4, 2, 1)))  # (no clocks: none)
    assert all(e.thread_us == 0.0 for events in bare.events.values() for e in events)


@pytest.mark.parametrize(
    "alpha_us, step_us",
    [
        # rank 0's send holds its thread 100 -> 600; rank 1's receive completes 300 after: 900, its
        # send leaves after 200 of compute, 1100 -> 1400; rank 0's receive completes 500 after: 1900
        (0.0, 1900.0),
        # a network slower than the thread: a message takes α (1000), the receive's thread time follows
        # it: 100 -> 1100, + 300 = 1400; + 200 = 1600 -> 2600; + 500 = 3100
        (1000.0, 3100.0)])
def test_a_transfer_holds_its_ranks_thread_as_recorded(tmp_path: Path, alpha_us: float,
                                                       step_us: float) -> None:
    w = load(write(tmp_path / "hop.jsonl", 2, _hop_and_back()))
    result = lab.workload.replay(w, network=Network(alpha_us=alpha_us, gbit=1e9))
    np.testing.assert_allclose(result.step_us, [step_us], rtol=1e-9)
    compute = {0: 160.0, 1: 230.0}
    for row in result.stages.itertuples():
        assert row.compute_us == pytest.approx(compute[row.rank])
        assert row.bubble_us == pytest.approx(step_us - compute[row.rank])


def test_a_send_recorded_on_another_network_keeps_only_its_threads_own_time(tmp_path: Path) -> None:
    w = load(write(tmp_path / "hop.jsonl", 2, _hop_and_back()))
    # recorded where a message took α = 200: a send's thread time less 200 is its own (rank 0's
    # 300, rank 1's 100), then the replay's α = 1000: 100 -> 1400, + 300 = 1700; + 200 = 1900 ->
    # 3000; + 500 = 3500 (the receives' thread times are kept as recorded)
    result = lab.workload.replay(w, network=Network(alpha_us=1000.0, gbit=1e9),
                                 recorded_network=Network(alpha_us=200.0, gbit=1e9))
    np.testing.assert_allclose(result.step_us, [3500.0], rtol=1e-9)
    same = lab.workload.replay(w, network=Network(alpha_us=1000.0, gbit=1e9),
                               recorded_network=Network(alpha_us=1000.0, gbit=1e9))
    np.testing.assert_allclose(same.step_us, [3100.0], rtol=1e-9)  # (as without it)
