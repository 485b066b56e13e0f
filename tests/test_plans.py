"""Persistent collectives (lab.*_init): the checks once, the result of the plain call at every run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import enter_together, pool

import lab

TRANSPORTS = {"shm": 4, "queue": 3, "tcp": 2}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def cluster(request):
    with pool(TRANSPORTS[request.param], request.param) as running:
        yield running


def inputs(mesh: lab.Mesh, count: int, run: int, dtype=torch.float32) -> torch.Tensor:
    """index * stride + rank, different at every run (all-ones would hide misplaced chunks)."""
    return (torch.arange(count, dtype=torch.float64) * (mesh.world_size + 1) + mesh.rank +
            100 * run).to(dtype)


def reuse_every_plan(mesh: lab.Mesh, count: int) -> list[str]:
    """Each collective's plan, run three times on new contents, against the plain call on a copy."""
    failures = []
    root = mesh.world_size - 1
    x = inputs(mesh, count, 0)
    rows = torch.empty(count)  # split along dim 0 as array_split does: counts not divisible by N too
    plans = {
        "allreduce": (lab.allreduce_init(mesh, x, op="sum"), lambda t: lab.allreduce(mesh, t, op="sum")),
        "broadcast": (lab.broadcast_init(mesh, x, src=root), lambda t: lab.broadcast(mesh, t, src=root)),
        "reduce": (lab.reduce_init(mesh, x, dst=root,
                                   op="max"), lambda t: lab.reduce(mesh, t, dst=root, op="max")),
        "allgather": (lab.allgather_init(mesh, x), lambda t: lab.allgather(mesh, t)),
        "reduce_scatter": (lab.reduce_scatter_init(mesh, rows, op="min"),
                           lambda t: lab.reduce_scatter(mesh, t, op="min")),
        "all_to_all": (lab.all_to_all_init(mesh, rows), lambda t: lab.all_to_all(mesh, t))}
    barrier = lab.barrier_init(mesh)
    for run in range(1, 4):
        for name, (plan, plain) in plans.items():
            target = rows if name in ("reduce_scatter", "all_to_all") else x
            target.copy_(inputs(mesh, target.numel(), run))
            expected_input = target.clone()
            got = plan()
            expected = plain(expected_input)
            if name in ("allreduce", "broadcast", "reduce"):
                got, expected = target, expected_input  # in place, as the plain call
            if not torch.equal(got, expected):
                failures.append(
                    f"rank {mesh.rank} {name} run {run}: {got.tolist()[:6]} != {expected.tolist()[:6]}")
        barrier()
    for plan, _ in plans.values():
        plan.free()
    barrier.free()
    return failures


@pytest.mark.parametrize("count", [0, 1, 3, 1000, 100_003])
def test_plans_reused_with_new_contents_give_the_plain_calls_result(cluster, count):
    assert not [f for per_rank in cluster.run(reuse_every_plan, count) for f in per_rank]


def plan_of_a_parameter(mesh: lab.Mesh) -> list:
    """A plan over torch's own parameter type (a leaf that requires grad), run on new contents."""
    weight = torch.nn.Parameter(torch.zeros(300))
    seen = []
    with lab.allreduce_init(mesh, weight, op="avg") as plan:
        for run in range(3):
            with torch.no_grad():
                weight.copy_(inputs(mesh, 300, run))
            got = plan()
            seen.append((got is weight, weight.requires_grad, weight.detach().tolist()))
    return seen


def test_a_plan_of_a_parameter_averages_it_in_place(cluster):
    for per_rank in cluster.run(plan_of_a_parameter):
        n = cluster.world_size
        for run, (same, requires_grad, got) in enumerate(per_rank):
            expected = [(i * (n + 1) + 100 * run) + (n - 1) / 2 for i in range(300)]
            assert same and requires_grad and got == pytest.approx(expected, rel=1e-6), (run, got[:4])


def plan_on_sub_mesh(mesh: lab.Mesh) -> list[float]:
    pair = mesh.split(color=mesh.rank // 2)
    x = torch.zeros(3)
    with lab.allreduce_init(pair, x) as plan:
        for run in range(3):
            x.copy_(torch.arange(3.0) + mesh.rank + run)
            plan()
    return x.tolist()


def test_a_plan_on_a_sub_mesh_reduces_within_it(cluster):
    outputs = cluster.run(plan_on_sub_mesh)
    n = len(outputs)
    for rank, got in enumerate(outputs):
        members = [r for r in range(n) if r // 2 == rank // 2]
        assert got == [sum(i + r + 2 for r in members) for i in range(3)], (rank, got)


def mismatched_plan(mesh: lab.Mesh, what: str) -> str:
    odd = mesh.rank == mesh.world_size - 1
    count = 11 if odd and what == "count" else 10
    op = "max" if odd and what == "op" else "sum"
    algorithm = "ring" if odd and what == "algorithm" else "tree"
    try:
        lab.allreduce_init(mesh, torch.zeros(count), op=op, algorithm=algorithm)
    except lab.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what", ["count", "op", "algorithm"])
def test_ranks_whose_plans_differ_fail_at_init_naming_both(cluster, what):
    messages = cluster.run(mismatched_plan, what)
    last = len(messages) - 1
    for message in messages:
        assert message.startswith("plans differ"), message
        assert f"rank {last}'s is allreduce" in message, message
    odd_one_out = {"count": "float32[11]", "op": " max ", "algorithm": "(ring)"}[what]
    assert all(odd_one_out in message for message in messages), messages


def bad_plan_arguments(mesh: lab.Mesh) -> list[str]:
    messages = []
    for make in (lambda: lab.allreduce_init(mesh, torch.zeros(3), op="mean"),
                 lambda: lab.broadcast_init(mesh, torch.zeros(3), src=mesh.world_size),
                 lambda: lab.allreduce_init(mesh, torch.zeros(3), algorithm="nope"),
                 lambda: lab.allreduce_init(mesh, [1.0, 2.0])):
        try:
            make()
            messages.append("no error")
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    return messages


def test_bad_arguments_fail_at_init_before_any_message(cluster):
    for messages in cluster.run(bad_plan_arguments):
        assert "op" in messages[0] and "src" in messages[1] and "algorithm" in messages[2], messages
        assert "tensor" in messages[3], messages


def freed_and_forked(mesh: lab.Mesh) -> list[str]:
    plan = lab.allreduce_init(mesh, torch.ones(4))
    plan()
    messages = []
    child = os.fork()
    if child == 0:  # another process with a copy of the plan: it must refuse, not talk on the mesh
        try:
            plan()
        except lab.LabError as exc:
            os._exit(3 if "belongs to the process" in str(exc) else 4)
        os._exit(5)
    messages.append(str(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])))
    plan.free()
    try:
        plan()
    except lab.LabError as exc:
        messages.append(str(exc))
    return messages


def test_a_freed_plan_or_one_copied_into_another_process_refuses_to_run(cluster):
    for exit_code, freed in cluster.run(freed_and_forked):
        assert exit_code == "3"
        assert "was freed" in freed


def async_plan_with_p2p(mesh: lab.Mesh) -> list[float]:
    x = torch.zeros(1000)
    plan = lab.allreduce_init(mesh, x)
    x.copy_(torch.arange(1000.0) + mesh.rank)
    work = plan.start()
    right, left = (mesh.rank + 1) % mesh.world_size, (mesh.rank - 1) % mesh.world_size
    if mesh.world_size > 1:  # point-to-point issued behind the plan: same issue order
        if mesh.rank % 2 == 0:
            mesh.send(right, torch.tensor([float(mesh.rank)]))
            got = mesh.recv(left)
        else:
            got = mesh.recv(left)
            mesh.send(right, torch.tensor([float(mesh.rank)]))
    work.wait()
    return [float(x[0]), float(x[999]), float(got[0])]


def test_an_async_plan_completes_in_issue_order_with_p2p_in_flight(cluster):
    outputs = cluster.run(async_plan_with_p2p)
    n = len(outputs)
    for rank, (first, last, got) in enumerate(outputs):
        assert first == sum(range(n)) and last == 999 * n + sum(range(n))
        assert got == (rank - 1) % n


def plan_behind_async_work(mesh: lab.Mesh, planned: bool) -> list[str]:
    """A plan run (or a plain call, from its lane after the first) synchronously right after an
    async allreduce of its own tensor waits for it (issue order): it reduces the already-reduced
    tensor, so the tensor ends N times the sum."""
    x = torch.zeros(64)
    wrong = []
    with lab.allreduce_init(mesh, x) as plan:
        for run in range(20):
            x.copy_(inputs(mesh, 64, run))
            total = sum(inputs(mesh, 64, run) - mesh.rank + r for r in range(mesh.world_size))
            work = lab.allreduce(mesh, x, async_op=True)
            if planned:
                plan()
            else:
                lab.allreduce(mesh, x)
            work.wait()
            if not torch.equal(x, total * mesh.world_size):
                wrong.append(
                    f"rank {mesh.rank} run {run}: {x[:4].tolist()} != {(total * mesh.world_size)[:4].tolist()}"
                )
    return wrong


@pytest.mark.parametrize("planned", [True, False], ids=["plan", "plain call"])
def test_a_plan_run_behind_async_work_waits_for_it(cluster, planned):
    assert cluster.run(plan_behind_async_work, planned) == [[]] * cluster.world_size


def calls_after_close(mesh: lab.Mesh) -> list[str]:
    x = torch.ones(2)
    plan = lab.allreduce_init(mesh, x)
    lab.allreduce(mesh, x)  # (and its compiled call, made on shm, kept by the mesh)
    mesh.close()
    seen = []
    peer = (mesh.rank + 1) % mesh.world_size
    for call in (plan, lambda: lab.allreduce(mesh, x), lambda: lab.broadcast(mesh, x),
                 lambda: lab.barrier(mesh), lambda: mesh.send(peer, x), lambda: mesh.recv(peer)):
        try:
            call()
            seen.append("no error")
        except lab.LabError as exc:
            seen.append(str(exc))
    return seen


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_plan_a_collective_or_a_send_on_a_closed_mesh_says_so(transport):
    for seen in lab.spawn(calls_after_close, 2, transport=transport):
        assert all("mesh is closed" in message for message in seen), seen


def planned_bookkeeping(mesh: lab.Mesh) -> list:
    """The plain call, then the plan (which on shm runs through the compiled call it made once):
    the counters, flight record and result of each."""
    x = inputs(mesh, 10, 0)
    seen = []
    with lab.allreduce_init(mesh, x.clone()) as plan, lab.broadcast_init(mesh, x.clone(), src=1) as cast, \
            lab.barrier_init(mesh) as barrier:
        for plain, planned in [(lambda: lab.allreduce(mesh, x.clone()), plan),
                               (lambda: lab.broadcast(mesh, x.clone(), src=1), cast),
                               (lambda: lab.barrier(mesh), barrier)]:
            for run in (plain, planned, planned):  # a plan's second run counts as its first
                mesh.reset_stats()
                run()
                seen.append((mesh.stats(), mesh.flight_records()[-1].cell()))
    return seen


def interleaved_numbering(mesh: lab.Mesh) -> tuple[list[tuple[int, str]], dict, list[int]]:
    """A plan's runs between plain calls that take the Python path (a tensor over the compiled
    size), then enough runs to fill the flight recorder: every collective numbered once, in order,
    whichever path kept the books."""
    small, large = inputs(mesh, 16, 0), inputs(mesh, mesh.compiled_max_bytes // 4 + 1, 0)
    with lab.allreduce_init(mesh, small) as plan:
        mesh.reset_stats()  # (after the plans' agreement, an allgather)
        for run in (plan, plan, lambda: lab.allreduce(mesh, large), plan, lambda: lab.barrier(mesh), plan):
            run()
        first = [(r.seq, f"{r.collective} {r.count} {r.state}") for r in mesh.flight_records()[-6:]]
        stats = mesh.stats()
        for _ in range(40):
            plan()
    return first, stats, [r.seq for r in mesh.flight_records()]


def test_plan_runs_and_plain_calls_share_one_numbering_and_one_flight_recorder(cluster):
    for first, stats, last in cluster.run(interleaved_numbering):
        start = first[0][0]
        assert [seq for seq, _ in first] == list(range(start, start + 6)), first
        small, large, barrier = "allreduce 16 done", f"allreduce {first[2][1].split()[1]} done", "barrier 0 done"
        assert [what for _, what in first] == [small, small, large, small, barrier, small], first
        assert stats["collectives"] == 6, stats
        compiled = 5 if cluster.transport == "shm" else 0  # the plan's 4 runs and the barrier
        assert stats["collectives_compiled"] == compiled, stats
        assert last == list(range(start + 46 - 32, start + 46)), last  # the recorder's 32, the newest last


def test_a_compiled_plan_counts_and_records_as_the_plain_call(cluster):
    for per_rank in cluster.run(planned_bookkeeping):
        for plain, plain_record in per_rank[::3]:
            assert plain["collectives"] == 1 and plain_record.endswith(" ok")
            assert plain["collectives_compiled"] == (cluster.transport == "shm"), plain
        for run in (1, 2):
            for (plain, plain_record), (planned, planned_record) in zip(per_rank[::3], per_rank[run::3],
                                                                        strict=True):
                assert planned == plain and planned_record == plain_record, (run, plain, planned)


def plans_run_out_of_step(mesh: lab.Mesh) -> str:
    """Every rank makes the same two plans; rank 1 then runs the second where the others run the first."""
    small, large = lab.allreduce_init(mesh, torch.ones(10)), lab.allreduce_init(mesh, torch.ones(20))
    small()
    try:
        (large if mesh.rank == 1 else small)()
    except lab.CollectiveMismatchError as exc:
        return f"{exc} | {mesh.flight_records()[-1].cell()}"
    except lab.LabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_plans_run_out_of_step_are_a_mismatch_naming_the_rank_and_both_plans(transport):
    outputs = lab.spawn(plans_run_out_of_step, 2, transport=transport, recv_timeout_ms=5000)
    for rank, message in enumerate(outputs):
        assert "no error" not in message and f"rank {1 - rank}" in message, outputs
        if "is in" in message:  # the rank that saw the other's message: both fingerprints, numbered #4
            assert "allreduce #4 float32[10]" in message and "allreduce #4 float32[20]" in message, message
            assert "FAILED" in message, message  # the flight recorder has the run, failed
    assert any("is in" in message for message in outputs), outputs


def silent_during_a_plan(mesh: lab.Mesh, how: str, out: str) -> str:
    """Rank 1 makes the plan, then goes silent (or dies) while the others run it."""
    enter_together(mesh, out)  # (the plan's agreement, under the 1 s deadline, is not the fault)
    plan = lab.allreduce_init(mesh, torch.ones(10), algorithm="recursive_doubling")
    if mesh.rank == 1:
        plan()
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.5)  # silent past the others' deadline (1 s), then gone quietly
        return "slept"
    try:  # (a rank still in the first run when the other survivor's abort notice comes fails there)
        plan()
        plan()
        message = "no error"
    except (lab.DeadlineError, lab.PeerLostError) as exc:
        message = f"{type(exc).__name__}: {exc} | {mesh.flight_records()[-1].cell()}"
    (Path(out) / f"rank{mesh.rank}").write_text(message)  # the pool may fail on rank 1's death
    return message


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_silent_or_dead_peer_during_a_plan_is_named(how, tmp_path):
    deadline_ms = 1000 if how == "stopped" else 60_000  # a death is seen at once, not at the deadline
    with lab.launch(3, transport="shm", recv_timeout_ms=deadline_ms) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(silent_during_a_plan, how, str(tmp_path))
        else:
            cluster.run(silent_during_a_plan, how, str(tmp_path))
    for rank in (0, 2):  # both exchange with rank 1 in recursive doubling at N=3
        message = (tmp_path / f"rank{rank}").read_text()
        expected = "DeadlineError" if how == "stopped" else "PeerLostError"
        assert message.startswith(expected) and "rank 1" in message, message
        assert "allreduce #3" in message or "allreduce #2" in message, message
        assert message.endswith("FAILED@1 " + expected), message


def traced_plan(mesh: lab.Mesh) -> None:
    x = inputs(mesh, 10, 0)
    lab.allreduce(mesh, x.clone())
    with lab.allreduce_init(mesh, x) as plan:
        plan()


def test_a_compiled_plan_writes_the_plain_calls_trace_row(tmp_path):
    path = tmp_path / "trace.jsonl"
    lab.spawn(traced_plan, 2, trace=str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_rank = {rank: [r for r in rows if r["rank"] == rank and r["op"] == "allreduce"] for rank in (0, 1)}
    for plain, planned in by_rank.values():  # (the plan's agreement at init is an allgather of its own)
        varying = {"seq", "start_ns", "duration_ns"}
        assert {k: v for k, v in plain.items() if k not in varying} == \
            {k: v for k, v in planned.items() if k not in varying}, (plain, planned)
        assert planned["seq"] > plain["seq"] and planned["bytes_sent"] > 0


def test_the_flight_recorder_table_keeps_its_columns_past_six_digit_numbers():
    """A long run's collective numbers (a plan run a million times) stay in their own column."""
    from lab.errors import format_flight_records
    from lab.flight import FlightRecord

    records = {
        rank: [
            FlightRecord(seq, "allreduce", "tree", "float32", 256, "sum", -1, state="done")
            for seq in (999_999, 1_000_000)]
        for rank in (0, 1)}
    header, *rows = format_flight_records(records).splitlines()
    assert header.index("rank 0") == rows[0].index("allreduce") == rows[1].index("allreduce") > len("1000000")
