"""Workloads: the file format's checks, re-targeting by hand, and replays against step times
computed by hand (compute, overlap, a blocking wait, a straggler)."""

from __future__ import annotations

import json

import pytest

from lab import sim, workload
from lab.workload.retarget import Layout

pytestmark = pytest.mark.no_ranks

NET = sim.Network(alpha_us=10.0, gbit=8.0)  # 1 byte = 1e-3 µs: a message of n bytes costs 10 + n/1000 µs


def header(world_size: int, dims: dict | None = None) -> dict:
    return {"format": "lab-workload", "version": 1, "world_size": world_size, "dims": dims, "recorded": {}}


def op(rank: int, index: int, name: str, group: list[int], count: int, compute: float, is_async: bool = False,
       step: int = 0, **extra) -> dict:
    return {
        "rank": rank, "step": step, "kind": "op", "index": index, "op": name, "group": group, "dim": None,
        "dtype": "float32", "count": count, "out_count": extra.pop("out_count", count),
        "reduce_op": "sum" if name in ("allreduce", "reduce_scatter", "reduce") else None, "root": None,
        "async": is_async, "compute_us": compute, **extra}


def wait(rank: int, index: int, compute: float, step: int = 0) -> dict:
    return {"rank": rank, "step": step, "kind": "wait", "index": index, "compute_us": compute}


def step_end(rank: int, compute: float, step: int = 0) -> dict:
    return {"rank": rank, "step": step, "kind": "step", "compute_us": compute}


def written(tmp_path, rows: list[dict], name: str = "w.jsonl") -> workload.Workload:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return workload.load(path)


def ring_us(world_size: int, nbytes: int) -> float:
    """Ring allreduce's closed form on NET (N dividing the count)."""
    return 2 * (world_size - 1) * (10.0 + nbytes / world_size / 1000)


def ddp_like(world_size: int, compute: tuple[float, float, float] = (100.0, 50.0, 20.0)) -> list[dict]:
    """Per rank: 100 µs of compute, an async allreduce of 4000 floats, 50 µs more, its wait, 20 µs
    more, the end of the step."""
    group = list(range(world_size))
    rows = [header(world_size)]
    for rank in range(world_size):
        rows += [
            op(rank, 0, "allreduce", group, 4000, compute[0], is_async=True),
            wait(rank, 0, compute[1]),
            step_end(rank, compute[2])]
    return rows


def test_an_async_allreduce_overlaps_compute_until_its_wait(tmp_path):
    w = written(tmp_path, ddp_like(4))
    r = workload.replay(w, network=NET, algorithms={"allreduce": "ring"})
    comm = ring_us(4, 16000)  # 6 · (10 + 4) = 84 µs, from 100 to 184; the wait at 150 blocks 34 µs
    assert comm == pytest.approx(84.0)
    assert r.step_us.tolist() == pytest.approx([100 + comm + 20])
    assert r.compute_us.tolist() == pytest.approx([170.0])
    assert r.exposed_comm_us.tolist() == pytest.approx([comm - 50])
    row = r.breakdown.iloc[0]
    assert (row["op"], row["group_size"], row["nbytes"], row["algorithm"]) == ("allreduce", 4, 16000, "ring")
    assert row["predicted_us"] == pytest.approx(comm) and row["exposed_us"] == pytest.approx(comm - 50)


def test_a_synchronous_call_blocks_and_the_last_member_starts_it(tmp_path):
    rows = [header(2)]
    for rank, compute in ((0, 10.0), (1, 70.0)):
        rows += [op(rank, 0, "allreduce", [0, 1], 2000, compute), step_end(rank, 5.0)]
    r = workload.replay(written(tmp_path, rows), network=NET, algorithms={"allreduce": "ring"})
    comm = ring_us(2, 8000)  # 2 · (10 + 4) = 28 µs, from 70 (rank 1's issue)
    assert r.step_us.tolist() == pytest.approx([70 + comm + 5])
    assert r.breakdown.iloc[0]["exposed_us"] == pytest.approx(60 + comm)  # rank 0 waited from 10 to 98


def test_a_straggler_delays_exactly_the_collectives_it_joins(tmp_path):
    rows = [header(4)]
    for rank in range(4):
        pair = [0, 1] if rank < 2 else [2, 3]
        rows += [op(rank, 0, "allreduce", pair, 2000, 100.0), step_end(rank, 0.0)]
    w = written(tmp_path, rows)
    even = workload.replay(w, network=NET, algorithms={"allreduce": "ring"}, dims=None)
    slow = workload.replay(w, network=NET, algorithms={"allreduce": "ring"}, stragglers={3: 2.0},
                           timeline=True)
    comm = ring_us(2, 8000)
    assert even.step_us.tolist() == pytest.approx([100 + comm])
    assert slow.step_us.tolist() == pytest.approx([200 + comm])  # ranks 2 and 3 finish late
    ends = {s["rank"]: s["end_us"] for s in slow.slices if s["cat"] == "communication"}
    assert ends[0] == ends[1] == pytest.approx(100 + comm) and ends[2] == ends[3] == pytest.approx(200 + comm)


def test_operations_of_one_rank_run_one_after_another(tmp_path):
    """Two async allreduces issued back to back: the second starts when the first ends."""
    rows = [header(2)]
    for rank in range(2):
        rows += [
            op(rank, 0, "allreduce", [0, 1], 2000, 0.0, True),
            op(rank, 1, "allreduce", [0, 1], 2000, 0.0, True),
            wait(rank, 0, 0.0),
            wait(rank, 1, 0.0),
            step_end(rank, 0.0)]
    r = workload.replay(written(tmp_path, rows), network=NET, algorithms={"allreduce": "ring"})
    assert r.step_us.tolist() == pytest.approx([2 * ring_us(2, 8000)])


def test_the_hand_off_back_to_the_program_after_each_wait_is_the_rank_s(tmp_path):
    """FSDP2's step on CPU: each collective issued and waited on at once, and the program back
    some µs after it completed (the communication thread hands it over: rank 0 6 µs then 3, rank 1
    2 then 5; read from the clocks: the next event's time less its compute). The replay charges
    each rank its hand-offs: the second collective starts when the later one is back."""
    lags = {0: (6.0, 3.0), 1: (2.0, 5.0)}
    rows = [header(2)]
    for rank, (first, second) in lags.items():
        issued = 130.0 + first + 40.0  # op 0 completed at 130 (the rank's clock), back at 130 + first
        rows += [
            op(rank, 0, "allreduce", [0, 1], 2000, 100.0, True, issued_us=100.0,
               completed_us=130.0), {**wait(rank, 0, 1.0), "waited_us": 101.0},
            op(rank, 1, "allreduce", [0, 1], 2000, 40.0, True, issued_us=issued, completed_us=issued + 30),
            {**wait(rank, 1, 1.0), "waited_us": issued + 1},
            step_end(rank, 10.0),
            op(rank, 2, "barrier", [0, 1], 0, 7.0, step=1, issued_us=issued + 30 + second + 10 + 7)]
    w = written(tmp_path, rows)
    assert [[e.held_us for e in w.events[rank][:4]] for rank in lags] == [[0, 6, 0, 3], [0, 2, 0, 5]]
    r = workload.replay(w, network=NET, algorithms={"allreduce": "ring"})
    comm = ring_us(2, 8000)  # 28 µs: op 0 from 100 to 128, rank 0 back at 134 and rank 1 at 130
    second = 128 + max(6, 2) + 40  # op 1 starts when rank 0 issues it, 40 µs after it is back
    assert r.step_us.tolist() == pytest.approx([second + comm + max(3, 5) + 10])  # 217 (without: 206)
    assert r.compute_us.tolist() == pytest.approx([152.0])
    # exposed: the longest a rank waited on each, its hand-off included (rank 1 waits on op 1 from 171)
    assert r.breakdown["exposed_us"].tolist() == pytest.approx([comm - 1 + 6, second + comm + 5 - 171])
    from lab.workload.goal import export_goal

    export_goal(w, tmp_path / "s.goal", network=NET, algorithms={"allreduce": "ring"})
    rank0 = (tmp_path / "s.goal").read_text().split("rank 1 {")[0]
    assert "calc 6000\n" in rank0 and "calc 3000\n" in rank0  # (the GOAL schedule holds them too)


def test_held_times_leave_out_what_the_clocks_do_not_say(tmp_path):
    """A synchronous call's return after its completion is held; an inferred wait's time is the
    program's last return, not a call (none); before a wait the recorder found woken by its
    completion, the program's return is not known (none); a file without clocks holds nothing."""
    rows = [
        header(1),
        op(0, 0, "allreduce", [0], 4, 10.0, issued_us=10.0, completed_us=40.0),  # back at 50 - 7
        op(0, 1, "allreduce", [0], 4, 7.0, True, issued_us=50.0, completed_us=500.0),
        {**wait(0, 1, 0.4), "waited_us": 500.4},  # woken: compute from the completion; back at 501
        op(0, 2, "allreduce", [0], 4, 2.0, True, issued_us=503.0, completed_us=520.0),
        {**wait(0, 2, 0.0), "waited_us": 503.5, "inferred": True},  # (back at 503.5, the inferred wait's)
        step_end(0, 30.0),
        op(0, 3, "allreduce", [0], 4, 5.0, step=1, issued_us=560.0)]  # the step ended at 555
    w = written(tmp_path, rows)
    assert [e.held_us for e in w.events[0]] == pytest.approx([3.0, 0.0, 0.6, 0.5, 0.0, 0.0, 0.0])
    plain = written(tmp_path, ddp_like(2), "plain.jsonl")
    assert all(e.held_us == 0 for events in plain.events.values() for e in events)


def test_replay_retargets_an_allreduce_keeping_its_bytes(tmp_path):
    w = written(tmp_path, ddp_like(4))
    r = workload.replay(w, world_size=16, network=NET, algorithms={"allreduce": "ring"})
    comm = ring_us(16, 16000)  # 30 · (10 + 1) = 330 µs
    assert r.breakdown.iloc[0]["nbytes"] == 16000 and r.breakdown.iloc[0]["group_size"] == 16
    assert r.step_us.tolist() == pytest.approx([100 + comm + 20])


def test_retargeting_by_hand():
    """An FSDP allgather's shard shrinks M ways (strong) or stays (weak); reduce_scatter keeps its
    input; a 2-D mesh re-targets each dimension by name."""
    rows = [header(4)]
    gather = workload.Event(0, 0, "op", 0.0, 0, "allgather", (0, 1, 2, 3), None, "float32", 1000, 4000)
    scatter = workload.Event(0, 0, "op", 0.0, 1, "reduce_scatter", (0, 1, 2, 3), None, "float32", 4000, 1000)
    w = workload.Workload(4, None, {}, {r: [] for r in range(4)})
    strong, weak = Layout.of(w, 16), Layout.of(w, 16, shard="weak")
    assert strong.nbytes(gather, 16) == 1000 and weak.nbytes(gather, 16) == 4000
    assert strong.nbytes(scatter, 16) == 16000 and weak.nbytes(scatter, 16) == 64000
    odd = workload.Event(0, 0, "op", 0.0, 0, "allgather", (0, 1, 2, 3), None, "float32", 257, 1028)
    assert Layout.of(w, 1024).nbytes(odd, 1024) == 8  # 1,028 floats 1,024 ways: 2 a shard (padded)
    bytes_ = workload.Event(0, 0, "op", 0.0, 0, "broadcast", (0, 1, 2, 3), None, "uint8", 1025, 1025)
    assert strong.nbytes(bytes_, 16) == 1028  # whole 4-byte words, as the simulator takes them
    assert len(rows) == 1
    mesh = workload.Workload(8, {"dp": 4, "tp": 2}, {}, {r: [] for r in range(8)})
    layout = Layout.of(mesh, dims={"dp": 128, "tp": 8})
    tp_group = workload.Event(2, 0, "op", 0.0, 0, "allreduce", (2, 3), "tp", "float32", 10, 10)
    dp_group = workload.Event(2, 0, "op", 0.0, 1, "allreduce", (0, 2, 4, 6), "dp", "float32", 10, 10)
    assert layout.spanned(tp_group) == (False, True) and layout.spanned(dp_group) == (True, False)
    rank = 8 * 5 + 3  # dp 5, tp 3
    assert layout.template(rank) == 2 * 1 + 1  # dp 5 % 4 = 1, tp 3 % 2 = 1
    assert layout.group_of(rank, tp_group, (False, True)) == ((5, None), 8)
    assert layout.group_of(rank, dp_group, (True, False)) == ((None, 3), 128)
    with pytest.raises(ValueError, match="dims="):
        Layout.of(mesh, world_size=1024)
    with pytest.raises(ValueError, match="dims must give"):
        Layout.of(mesh, dims={"tp": 8, "dp": 128})


def test_a_2d_mesh_replays_each_dimension_at_its_new_size(tmp_path):
    rows = [header(4, {"dp": 2, "tp": 2})]
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        rows += [
            op(rank, 0, "allreduce", [2 * dp, 2 * dp + 1], 2000, 0.0),  # tp group
            op(rank, 1, "allreduce", [tp, 2 + tp], 4000, 0.0),  # dp group
            step_end(rank, 0.0)]
    r = workload.replay(written(tmp_path, rows), dims={"dp": 8, "tp": 4}, network=NET,
                        algorithms={"allreduce": "ring"})
    sizes = r.breakdown.set_index("index")["group_size"].to_dict()
    assert sizes == {0: 4, 1: 8}
    assert r.step_us.tolist() == pytest.approx([ring_us(4, 8000) + ring_us(8, 16000)])


@pytest.mark.parametrize(("change", "message"), [
    (lambda rows: rows[0].update(version=3), "field 'version' is 3; this lab reads versions 1, 2"),
    (lambda rows: rows[1].update(count="many"), "field 'count' must be an integer; got 'many'"),
    (lambda rows: rows[1].update(group=[0, 0, 1, 2]), "field 'group' must list distinct ranks"),
    (lambda rows: rows[1].update(op="allsum"), "field 'op' must be one of"),
    (lambda rows: rows[1].update(compute_us=-1), "field 'compute_us' must be a finite number >= 0"),
    (lambda rows: rows[2].update(index=3), "waits on operation 3, which it has not issued"),
    (lambda rows: rows[1].update(index=1), "field 'index' must be 0"),
    (lambda rows: rows[0].update(dims={"dp": 3}), "field 'dims'"),
    (lambda rows: rows[1].pop("async"), "field 'async' must be true or false"),])
def test_a_bad_file_is_an_error_naming_the_line_and_the_field(tmp_path, change, message):
    rows = ddp_like(4)
    change(rows)
    with pytest.raises(ValueError, match=message) as info:
        written(tmp_path, rows)
    assert str(tmp_path / "w.jsonl") + ":" in str(info.value)


def test_bad_arguments_are_named(tmp_path):
    w = written(tmp_path, ddp_like(4))
    with pytest.raises(ValueError, match=r"algorithms\['allreduce'\]"):
        workload.replay(w, network=NET, algorithms={"allreduce": "fastest"})
    with pytest.raises(ValueError, match=r"stragglers\[1\]"):
        workload.replay(w, network=NET, stragglers={1: 0})
    with pytest.raises(ValueError, match="network 'pigeon': transport must be one of"):
        workload.replay(w, network="pigeon")
    with pytest.raises(ValueError, match="compute_scale"):
        workload.replay(w, network=NET, compute_scale=-1.0)
    (tmp_path / "empty.jsonl").write_text(json.dumps(header(2)) + "\n")
    with pytest.raises(ValueError, match="no whole step"):
        workload.replay(workload.load(tmp_path / "empty.jsonl"), network=NET)


def test_ranks_that_disagree_or_never_join_are_named(tmp_path):
    rows = [header(2), op(0, 0, "allreduce", [0, 1], 10, 0.0), step_end(0, 0.0), step_end(1, 0.0)]
    with pytest.raises(ValueError, match="rank 0 waits on its op of step 0"):
        workload.replay(written(tmp_path, rows), network=NET)
    rows = [
        header(2),
        op(0, 0, "allreduce", [0, 1], 10, 0.0),
        step_end(0, 0.0),
        op(1, 0, "allreduce", [0, 1], 20, 0.0),
        step_end(1, 0.0)]
    with pytest.raises(ValueError, match="disagree"):
        workload.replay(written(tmp_path, rows, "b.jsonl"), network=NET)


def test_a_timeline_is_written(tmp_path):
    r = workload.replay(written(tmp_path, ddp_like(2)), network=NET, algorithms={"allreduce": "ring"})
    r.timeline(tmp_path / "sim.json")
    trace = json.loads((tmp_path / "sim.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert names == {"compute", "allreduce ring"}


def test_what_dominates_leaves_the_first_step_out_when_steps_repeat(tmp_path):
    """Step 0 holds a large setup broadcast; the ranking and "dominates" name step 1's allreduce."""
    from lab.workload.cli import summary

    rows = [header(2)]
    for rank in range(2):
        rows += [
            op(rank, 0, "broadcast", [0, 1], 1_000_000, 10.0),
            step_end(rank, 1.0),
            op(rank, 1, "allreduce", [0, 1], 1000, 10.0, step=1),
            step_end(rank, 1.0, step=1)]
    r = workload.replay(written(tmp_path, rows), network=NET, algorithms={"allreduce": "ring"})
    assert r.breakdown.sort_values("exposed_us").iloc[-1]["op"] == "broadcast"  # step 0's, the largest
    out = summary(r)
    assert "what exposes the most, step 1:" in out and "broadcast" not in out.split("step 1:")[-1], out
    assert "dominates: allreduce #1 of step 1 on 2 ranks (4,000 bytes" in out, out


def test_the_command_prints_the_step_and_what_dominates(tmp_path, capsys):
    from lab.__main__ import main

    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ddp_like(4)))
    assert (main([
        "workload", "replay",
        str(path), "--ranks", "16", "--alpha-us", "10", "--gbit", "8", "--algorithm", "allreduce=ring",
        "--timeline",
        str(tmp_path / "sim.json")]) == 0)
    out = capsys.readouterr().out
    comm = ring_us(16, 16000)
    assert f"step 0: {100 + comm + 20:,.1f} µs = compute 170.0 µs" in out
    assert "dominates: allreduce #0 of step 0 on 16 ranks (16,000 bytes, ring)" in out
    assert (tmp_path / "sim.json").exists()
    assert (main([
        "workload", "replay",
        str(path), "--alpha-us", "10", "--gbit", "8", "--json", "--algorithm", "allreduce=ring"]) == 0)
    result = json.loads(capsys.readouterr().out)
    assert result["step_us"] == pytest.approx([100 + ring_us(4, 16000) + 20])
    assert result["breakdown"][0]["algorithm"] == "ring"
    with pytest.raises(SystemExit):
        main(["workload", "replay", str(path), "--algorithm", "allreduce"])
    assert "--algorithm takes NAME=VALUE pairs" in capsys.readouterr().err


def test_goal_export_writes_the_lab_s_messages_with_their_dependencies(tmp_path, capsys):
    """Two ranks, ring allreduce of 16,000 bytes: a reduce-scatter step and an allgather step of
    8,000 bytes each way, between the compute before it and the wait after the next compute."""
    from lab.__main__ import main

    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ddp_like(2)))
    assert (main([
        "workload", "export",
        str(path), "--goal",
        str(tmp_path / "s.goal"), "--algorithm", "allreduce=ring"]) == 0)
    assert (capsys.readouterr().out ==
            f"Wrote {tmp_path / 's.goal'} (2 operations across its ranks; LogGOPSim's txt2bin reads it)\n")
    text = (tmp_path / "s.goal").read_text()
    assert text.startswith("num_ranks 2\n")
    rank0 = text.split("rank 0 {\n")[1].split("\n}")[0].splitlines()
    assert rank0 == [
        "l1: calc 100000", "l2: send 8000b to 1 tag 1", "l2 requires l1", "l3: recv 8000b from 1 tag 1",
        "l3 requires l1", "l4: send 8000b to 1 tag 1", "l4 requires l2", "l4 requires l3",
        "l5: recv 8000b from 1 tag 1", "l5 requires l2", "l5 requires l3", "l6: calc 50000", "l6 requires l1",
        "l7: calc 20000", "l7 requires l6", "l7 requires l4", "l7 requires l5"]
    assert "rank 1 {\nl1: calc 100000\nl2: send 8000b to 0 tag 1" in text


def test_goal_export_retargets_like_the_replay(tmp_path):
    from lab.workload.goal import export_goal

    w = written(tmp_path, ddp_like(2))
    assert export_goal(w, tmp_path / "s.goal", 8, network=NET, algorithms={"allreduce": "ring"}) == 8
    text = (tmp_path / "s.goal").read_text()
    assert text.startswith("num_ranks 8\n") and text.count("rank ") == 8
    rank3 = text.split("rank 3 {\n")[1].split("\n}")[0]
    assert rank3.count(": send 2000b to 4 tag 1") == 14 and rank3.count(": recv 2000b from 2 tag 1") == 14


def test_a_recording_counts_the_compute_between_calls_and_replays(tmp_path):
    """A fake clock (ns): 100 µs of compute, an async allreduce whose issue holds the program 5 µs,
    50 µs, its wait (blocked 30 µs), 20 µs, the step's end; the replay at the recorded size
    reproduces the compute, and the issue's 5 µs are the rank's (lab.workload.held)."""
    from lab.workload.record import Recorder, write_header

    path = tmp_path / "rec.jsonl"
    write_header(path, 2)
    for rank in range(2):
        now = [0]
        recorder = Recorder(path, rank, 2, clock=lambda now=now: now[0])
        now[0] += 100_000
        index = recorder.operation("allreduce", [0, 1], "float32", 2000, 2000, reduce_op="sum", is_async=True)
        now[0] += 5_000  # inside the lab: not compute
        recorder.returned()
        now[0] += 50_000
        recorder.wait(index)
        now[0] += 30_000
        recorder.returned()
        now[0] += 20_000
        recorder.mark_step()
        recorder.operation("barrier", [0, 1], "float32", 0, 0,
                           is_async=False)  # after the last step: left out
        recorder.close()
    w = workload.load(path)
    assert w.steps == 1 and [e.compute_us for e in w.events[0]] == [100.0, 50.0, 20.0, 0.0]
    r = workload.replay(w, network=NET, algorithms={"allreduce": "ring"})
    assert r.compute_us.tolist() == pytest.approx([170.0])
    assert [e.held_us for e in w.events[0]] == [5.0, 0.0, 0.0,
                                                0.0]  # (no completion recorded: the wait's unknown)
    assert ring_us(2, 8000) < 50  # done at 128: the wait at 155 finds it done, the step is its compute
    assert r.step_us.tolist() == pytest.approx([175.0]) and r.exposed_comm_us.tolist() == pytest.approx([5.0])


@pytest.mark.slow  # a real 2-D DeviceMesh recording: 4 ranks under torch
def test_a_2d_mesh_s_dims_are_derived_from_its_operations(tmp_path):
    """A recording's header says ``"dims": null``; its operations' ``dim`` and groups give the mesh,
    outermost first, and a replay re-targets each dimension by name."""
    rows = [header(8)]
    for rank in range(8):
        dp, tp = divmod(rank, 2)
        rows += [
            op(rank, 0, "allreduce", [2 * dp, 2 * dp + 1], 2000, 0.0, dim="tp"),
            op(rank, 1, "allreduce", [tp, 2 + tp, 4 + tp, 6 + tp], 4000, 0.0, dim="dp"),
            op(rank, 2, "allreduce", list(range(8)), 100, 0.0),  # the default group: no dimension
            step_end(rank, 0.0)]
    w = written(tmp_path, rows)
    assert w.dims == {"dp": 4, "tp": 2}
    r = workload.replay(w, dims={"dp": 128, "tp": 8}, network=NET, algorithms={"allreduce": "ring"})
    assert r.breakdown.set_index("index")["group_size"].to_dict() == {0: 8, 1: 128, 2: 1024}
    halves = [header(4)] + [
        op(r, 0, "allreduce", [r - r % 2, r - r % 2 + 1], 10, 0.0, dim="tp") for r in range(4)]
    assert written(tmp_path, halves, "halves.jsonl").dims is None  # one dimension of 2 is no mesh of 4
    apart = [header(4)] + [op(r, 0, "allreduce", sorted({r, 3 - r}), 10, 0.0, dim="tp") for r in range(4)]
    assert written(tmp_path, apart, "apart.jsonl").dims is None  # groups [0, 3] and [1, 2]: no one step
