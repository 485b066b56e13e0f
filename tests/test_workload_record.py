"""Recording a workload (issue 35, item 1): every collective and point-to-point call of each rank
as issued, with its waits and the compute between calls, through ``lab.spawn(..., workload=)``,
``LAB_WORKLOAD`` and ``lab.backend.Options(workload=)``; torch's DDP on a pool's mesh
(``lab.backend.init_process_group``) records one allreduce per bucket with the bucket's bytes.

Rank-side functions are module-level (the ranks unpickle them by name).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import child_env, free_port, require_hosts

import lab
from lab import workload
from lab.collectives.prepared import find_lane
from lab.comm import operations as recording
from lab.hosts.rendezvous import pool_store
from lab.workload import record
from lab.workload.record import Recorder, write_header

NET = lab.sim.Network(alpha_us=10, gbit=8)


def lines(path) -> tuple[dict, list[dict]]:
    """The file's header and its events."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return rows[0], rows[1:]


def of(rows: list[dict], rank: int, **match) -> list[dict]:
    """``rank``'s events whose fields are ``match``'s."""
    return [r for r in rows if r["rank"] == rank and all(r.get(k) == v for k, v in match.items())]


# -- torch's DDP on a pool's mesh ------------------------------------------------------------------


def ddp_steps(mesh: lab.Mesh, steps: int) -> tuple[dict, list[int], list[tuple]]:
    """DDP of a model of about 1.3 MB with 0.1 MB buckets (two after its rebuild), ``steps`` steps,
    its gradients recorded: DDP's bucket sizes (bytes) after them, its parameters' sizes, and the
    allreduces the rank ran (elements and algorithm, from its flight records)."""
    lab.backend.init_process_group(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 16))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    assert lab.workload.record_gradients(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(steps):
        loss = ddp(torch.randn(8, 64)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lab.workload.mark_step()
    data = ddp._get_ddp_logging_data()
    ran = [(r.count, r.algorithm) for r in mesh.flight_records() if r.collective == "allreduce"]
    dist.destroy_process_group()  # (the mesh stays open: the pool's)
    return data, [p.numel() for p in model.parameters()], ran


def test_a_ddp_step_records_one_allreduce_per_bucket_with_its_bytes(tmp_path):
    """... with the algorithm each ran, and the model's gradients in the order DDP reduces them."""
    path = tmp_path / "ddp.jsonl"
    (data, parameters, ran), _ = lab.spawn(ddp_steps, 2, args=(3,), workload=str(path))
    buckets = [int(b) for b in data["rebuilt_bucket_sizes"].split(",")]  # (rebuilt after step 0)
    assert len(buckets) == 2, data[0]
    header, rows = lines(path)
    assert header["world_size"] == 2 and header["recorded"]["transport"] == "shm"
    for rank in range(2):
        for step in (1, 2):
            allreduces = of(rows, rank, step=step, kind="op", op="allreduce")
            assert [r["count"] * 4 for r in allreduces] == buckets
            assert all(
                r["group"] == [0, 1] and r["dtype"] == "float32" and r["reduce_op"] == "sum" and r["async"]
                for r in allreduces)
            waited = {r["index"] for r in of(rows, rank, step=step, kind="wait")}
            assert {r["index"] for r in allreduces} <= waited  # (a wait line, seen or inferred, each)
            # the backend reading an outcome as it completes is no wait of the program's: none
            # comes between the buckets, whose compute is the backward's between them
            step_rows, buckets_of = of(rows, rank, step=step), {r["index"] for r in allreduces}
            assert step_rows.index(allreduces[-1]) < min(
                step_rows.index(r) for r in step_rows if r["kind"] == "wait" and r["index"] in buckets_of)
    assert [(r["count"], r["algorithm"]) for r in of(rows, 0, kind="op", op="allreduce")] == ran[-6:]
    w = workload.load(path)  # the file loads, and replays at the recorded size
    assert w.steps == 3 and w.world_size == 2
    for rank in range(2):
        assert w.gradients[rank] == workload.Gradients((0, 1), "float32", tuple(reversed(parameters)),
                                                       int(0.1 * 2**20), int(0.1 * 2**20))
    r = workload.replay(w, network=NET, algorithms={"allreduce": "ring"})
    assert len(r.step_us) == 3 and (r.step_us > 0).all()
    assert list(r.breakdown[r.breakdown["step"] == 2]["nbytes"]) == buckets
    as_recorded = workload.replay(w, network=NET, timeline=False).breakdown  # what the lab ran
    assert (as_recorded["algorithm"] == as_recorded["recorded_algorithm"]).all()
    rebucketed = workload.replay(w, network=NET, bucket_mb=2, timeline=False).breakdown  # all in one
    assert list(rebucketed[rebucketed["step"] == 2]["nbytes"]) == [sum(buckets)]


def fsdp_steps(mesh: lab.Mesh, steps: int) -> None:
    """FSDP2 (``fully_shard``) of two layers, ``steps`` steps, on the pool's mesh."""
    from torch.distributed.fsdp import fully_shard

    lab.backend.init_process_group(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        lab.workload.mark_step()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_on_emulated_hosts_records_its_allgathers_and_reduce_scatters(tmp_path):
    """torch's world over a pool's mesh on two emulated hosts (tcp, 1 Gbit/s links): each layer's
    shard gathered (forward, backward) and its gradient reduce-scattered, each waited on."""
    require_hosts()
    path = tmp_path / "fsdp.jsonl"
    lab.spawn(fsdp_steps, 2, args=(2,), hosts=2, link_gbit=1.0, transport="tcp", workload=str(path))
    header, rows = lines(path)
    assert header["recorded"] == {
        "launcher": "lab.launch", "transport": "tcp", "hosts": 2, "ranks_per_host": 1, "link_gbit": 1.0}
    for rank in range(2):
        ops = of(rows, rank, step=1, kind="op")
        gathers, scatters = [r for r in ops
                             if r["op"] == "allgather"], [r for r in ops if r["op"] == "reduce_scatter"]
        assert len(gathers) == 4 and len(scatters) == 2 and len(ops) == 6  # (2 layers: forward and backward)
        assert all(r["async"] and r["out_count"] == 2 * r["count"] for r in gathers)
        assert sorted(r["count"] for r in scatters) == sorted(2 * r["count"] for r in gathers[:2])
        assert {r["index"] for r in of(rows, rank, step=1, kind="wait")} == {r["index"] for r in ops}
    assert workload.load(path).steps == 2


def device_mesh_steps(mesh: lab.Mesh) -> None:
    """A step of a 2-D DeviceMesh (dp 2 x tp 2): an allreduce on each dimension's group."""
    from torch.distributed.device_mesh import init_device_mesh

    lab.backend.init_process_group(mesh)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.ones(1000)
    dist.all_reduce(x, group=device_mesh.get_group("tp"))
    dist.all_reduce(x[:500], group=device_mesh.get_group("dp"))
    lab.workload.mark_step()
    dist.destroy_process_group()


def test_a_2d_device_mesh_recording_replays_each_dimension_by_name(tmp_path):
    """The header's dims are null (written before the mesh is built); load derives them from the
    operations' dim and groups, and a replay re-targets each dimension by name."""
    path = tmp_path / "mesh2d.jsonl"
    lab.spawn(device_mesh_steps, 4, workload=str(path))
    header, rows = lines(path)
    assert header["dims"] is None
    assert [(r["dim"], r["group"]) for r in of(rows, 3, kind="op")] == [("tp", [2, 3]), ("dp", [1, 3])]
    w = workload.load(path)
    assert w.dims == {"dp": 2, "tp": 2}
    r = workload.replay(w, dims={"dp": 128, "tp": 8}, network=NET, algorithms={"allreduce": "ring"})
    assert r.world_size == 1024
    assert r.breakdown.set_index("index")[["group_size", "nbytes"]].to_dict("list") == {
        "group_size": [8, 128], "nbytes": [4000, 2000]}


# -- a mesh's own calls, recorded through LAB_WORKLOAD ----------------------------------------------


def mesh_calls(mesh: lab.Mesh) -> tuple[bool, list[str]]:
    """A step of a mesh's calls: an allreduce, and again (the second takes its lane), an async
    allgather and its wait, a send and its receive, a plan's run; then a step's end. And the
    algorithms its collectives ran (its flight records)."""
    x = torch.ones(256)
    lab.allreduce(mesh, x)
    lab.allreduce(mesh, x)
    lab.allgather(mesh, x[:4], async_op=True).wait()
    if mesh.rank == 0:
        mesh.send(1, torch.arange(8.0), tag=3)
    else:
        mesh.recv(0, tag=3)
    with lab.allreduce_init(mesh, x, op="max") as plan:
        plan()
    ran = [r.algorithm for r in mesh.flight_records() if r.collective in ("allreduce", "allgather")]
    return lab.workload.mark_step(), ran[-4:]


def test_lab_workload_records_a_mesh_s_calls_their_waits_and_peers(tmp_path, monkeypatch):
    path = tmp_path / "mesh.jsonl"
    monkeypatch.setenv("LAB_WORKLOAD", str(path))
    (marked, ran), _ = lab.spawn(mesh_calls, 2)
    assert marked
    header, rows = lines(path)
    assert header["format"] == "lab-workload" and header["world_size"] == 2
    for rank in range(2):
        mine = of(rows, rank)
        assert [(r["kind"], r.get("op")) for r in mine] == [("op", "allreduce"), ("op", "allreduce"),
                                                            ("op", "allgather"), ("wait", None),
                                                            ("op", "send" if rank == 0 else "recv"),
                                                            ("op", "allreduce"), ("step", None)]
        assert mine[0]["count"] == mine[1]["count"] == 256 and mine[1]["reduce_op"] == "sum"
        gather, wait, p2p, plan = mine[2], mine[3], mine[4], mine[5]
        assert gather["async"] and (gather["count"], gather["out_count"]) == (4, 8) and wait["index"] == 2
        assert (p2p["peer"], p2p["tag"], p2p["dtype"], p2p["count"]) == (1 - rank, 3, "float32", 8)
        assert plan["reduce_op"] == "max" and not plan["async"]
        assert all(r["compute_us"] >= 0 for r in mine) and all("completed_us" in r
                                                               for r in mine if r["kind"] == "op")
        # what each collective ran: the full path's, the lane's, the plan's; a send says none
        assert [r.get("algorithm") for r in mine if r["kind"] == "op"] == [*ran[:3], None, ran[3]]
    assert workload.load(path).steps == 1


def gathers_and_scatters(mesh: lab.Mesh) -> tuple[bool, list[int]]:
    """Two plain allgathers and two plain reduce_scatters of one tensor of 7 rows (the second of
    each runs from its lane); whether both lanes were made, and the rows each call returned."""
    x = torch.arange(7.0)
    returned = []
    for _ in range(2):
        returned += [len(lab.allgather(mesh, x)), len(lab.reduce_scatter(mesh, x))]
    lanes = (find_lane(mesh, "allgather", x, "auto",
                       writes=False), find_lane(mesh, "reduce_scatter", x, "sum", "auto", 7, writes=False))
    lab.workload.mark_step()
    return all(lane is not None for lane in lanes), returned


def test_a_lane_s_call_is_recorded_as_the_full_path_s_with_what_it_returns(tmp_path, monkeypatch):
    path = tmp_path / "lanes.jsonl"
    monkeypatch.setenv("LAB_WORKLOAD", str(path))
    results = lab.spawn(gathers_and_scatters, 2)
    _, rows = lines(path)
    for rank, (lanes, returned) in enumerate(results):
        assert lanes and returned == [14, 4 - rank] * 2  # (7 rows in blocks of 4 and 3)
        ops = [(r["op"], r["count"], r["out_count"], r["reduce_op"] if r["op"] == "reduce_scatter" else None)
               for r in of(rows, rank) if r["kind"] == "op"]
        assert ops == [("allgather", 7, 14, None), ("reduce_scatter", 7, 4 - rank, "sum")] * 2


def symmetric_calls(mesh: lab.Mesh) -> list[tuple[str, str]]:
    """lab.symm_mem's one-shot out of place from a registered input: its first call, again (from
    its lane) and one over the compiled plane's threshold (its Python path); a step's end. And the
    algorithm each ran with (its flight records)."""
    for count in (16, 16, 40_000):
        source = lab.symm_mem.empty(mesh, (count,), torch.float32)
        source.fill_(mesh.rank + 1)
        lab.symm_mem.one_shot_all_reduce_out(source, "max", mesh, torch.empty(count))
    lab.workload.mark_step()
    return [r.algorithm for r in mesh.flight_records() if r.collective == "allreduce"]


def test_symmetric_memory_s_one_shot_is_recorded_as_the_allreduce_it_is(tmp_path, monkeypatch):
    path = tmp_path / "symm.jsonl"
    monkeypatch.setenv("LAB_WORKLOAD", str(path))
    results = lab.spawn(symmetric_calls, 2)
    _, rows = lines(path)
    for rank, ran in enumerate(results):
        ops = [(r["op"], r["count"], r["out_count"], r["reduce_op"], r["algorithm"]) for r in of(rows, rank)
               if r["kind"] == "op" and r["op"] == "allreduce"]
        assert ran[-3:] == ["one_shot"] * 3
        assert ops == [("allreduce", 16, 16, "max", "one_shot")] * 2 + [
            ("allreduce", 40_000, 40_000, "max", "one_shot")]


TORCHRUN_RANK = """
import lab, torch
mesh = lab.Mesh.from_env(recv_timeout_ms=60_000)
lab.allreduce(mesh, torch.ones(10))
assert lab.workload.mark_step()
mesh.close()
"""


@pytest.mark.slow
def test_lab_workload_under_torchrun(tmp_path):
    """Ranks under torchrun (``Mesh.from_env``): rank 0 writes the header through the launcher's
    store, each rank its lines."""
    script, path = tmp_path / "rank.py", tmp_path / "torchrun.jsonl"
    script.write_text(TORCHRUN_RANK)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([
        torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()),
        str(script)], check=False, capture_output=True, text=True, timeout=180,
                          env=child_env(LAB_WORKLOAD=str(path)))
    assert done.returncode == 0, done.stderr[-3000:]
    header, rows = lines(path)
    assert header["world_size"] == 2 and header["recorded"]["transport"] == "tcp"
    assert sorted((r["rank"], r["kind"]) for r in rows) == [(0, "op"), (0, "step"), (1, "op"), (1, "step")]


# -- torch's process group with Options(workload=): rank 0 writes the header ------------------------


def torch_calls(mesh: lab.Mesh, path: str) -> tuple[bool, bool]:
    """Outside any recording mark_step does nothing; then a lab group that records (rank 0 writes
    the header, through the store): a coalesced allreduce (one lab allreduce), a send and its
    receive (torch's, which runs the mesh's inside), an async allreduce waited on."""
    before = lab.workload.mark_step()
    store = dist.PrefixStore("options-test", pool_store())
    dist.init_process_group("lab", store=store, rank=mesh.rank, world_size=mesh.world_size,
                            pg_options=lab.backend.Options(workload=path))
    dist.all_reduce_coalesced([torch.ones(3), torch.ones(5)])
    if mesh.rank == 0:
        dist.send(torch.arange(4.0), dst=1, tag=7)
    else:
        dist.recv(torch.empty(4), src=0, tag=7)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    after = lab.workload.mark_step()
    dist.destroy_process_group()
    return before, after


def test_options_workload_records_torch_s_calls_once(tmp_path):
    path = tmp_path / "torch.jsonl"
    assert lab.spawn(torch_calls, 2, args=(str(path),)) == [(False, True)] * 2
    header, rows = lines(path)
    assert header["world_size"] == 2 and header["recorded"]["transport"] == "auto"
    for rank in range(2):
        ops = of(rows, rank, kind="op")
        # the coalesced call is one allreduce of both tensors; torch's send, which runs the
        # mesh's send inside it, is one send
        assert [(r["op"], r["count"]) for r in ops] == [
            ("allreduce", 8), ("send" if rank == 0 else "recv", 4), ("allreduce", 2)]
        assert ops[1]["peer"] == 1 - rank and ops[1]["tag"] == 7
        assert of(rows, rank, kind="wait", index=2)  # the async allreduce's wait
    assert workload.load(path).steps == 1


# -- the recorder itself ------------------------------------------------------------------------------


def test_an_unwaited_async_operation_is_waited_at_the_step_s_end(tmp_path):
    """DDP may wait on a future in C++, where the lab cannot see it: an async operation that
    completed unwaited gets a wait right after the program's last call, and the time until it
    completed is no compute (fake clock, ns)."""
    path = tmp_path / "inferred.jsonl"
    write_header(path, 1)
    now = [0]
    recorder = Recorder(path, 0, 1, clock=lambda: now[0])
    now[0] += 100_000
    what = recording.Operation("allreduce", (0,), "float32", 4, 10, 10, reduce_op="sum")
    index = recorder.issue(what, True)
    recorder.returned()
    now[0] += 40_000
    recorder.completed(index)  # blocked on its future meanwhile
    now[0] += 10_000
    recorder.mark_step()
    recorder.wait(index)  # a later wait on it (torch's second) writes nothing
    recorder.returned()
    recorder.close()
    _, rows = lines(path)
    assert [(r["kind"], r["compute_us"]) for r in rows] == [("op", 100.0), ("wait", 0.0), ("step", 10.0)]
    assert rows[1]["inferred"] and rows[0]["completed_us"] == 140.0


def test_a_wait_woken_by_its_completion_counts_no_compute_before_it(tmp_path):
    """A program that blocks on a future in C++, then waits on its Work as it completes: a wait
    within 1 ms of its operation's completion was woken by it, and the time until the completion
    is no compute; a wait later than that keeps its compute (fake clock, ns)."""
    path = tmp_path / "woken.jsonl"
    write_header(path, 1)
    now = [0]
    recorder = Recorder(path, 0, 1, clock=lambda: now[0])
    what = recording.Operation("allreduce", (0,), "float32", 4, 10, 10, reduce_op="sum")
    for after_completion_ns in (30_000, 5_000_000):  # 30 µs: woken; 5 ms: the program computed
        index = recorder.issue(what, True)
        recorder.returned()
        now[0] += 50_000_000  # 50 ms blocked (or computing) while it runs
        recorder.completed(index)
        now[0] += after_completion_ns
        recorder.wait(index)
        recorder.returned()
    recorder.mark_step()
    recorder.close()
    _, rows = lines(path)
    waits = [r["compute_us"] for r in rows if r["kind"] == "wait"]
    assert waits == [30.0, 55_000.0] and not any(r.get("inferred") for r in rows)


def test_a_recording_without_mark_step_holds_a_bounded_number_of_lines(tmp_path):
    """10,000 calls and no mark_step: every line was held until the end (some 650 bytes a call);
    now at most MAX_HELD lines are held, the rest written as it goes, in order."""
    path = tmp_path / "long.jsonl"
    write_header(path, 2)
    recorder = Recorder(path, 0, 2)
    what = recording.Operation("allreduce", (0, 1), "float32", 4, 256, 256, reduce_op="sum")
    held = []
    for _ in range(10_000):
        index = recorder.issue(what, False)
        recorder.completed(index)
        recorder.returned()
        held.append(len(recorder._rows))
    assert max(held) < record.MAX_HELD and path.stat().st_size > 9_000 * 200
    recorder.close()
    w = workload.load(path)
    assert [e.index for e in w.events[0]] == list(range(10_000))


def test_lines_after_an_operation_still_running_wait_for_it_and_unwaited_ones_are_bounded(tmp_path):
    """An async operation's line is written once it completes (its completion fills it in): those
    after it wait with it. Completed async operations never waited on get their waits inferred
    once MAX_HELD of them are held."""
    path = tmp_path / "async.jsonl"
    write_header(path, 2)
    recorder = Recorder(path, 0, 2)
    what = recording.Operation("allreduce", (0, 1), "float32", 4, 256, 256, reduce_op="sum")
    first = recorder.issue(what, True)
    recorder.returned()
    for _ in range(2 * record.MAX_HELD):
        index = recorder.issue(what, True)
        recorder.returned()
        recorder.completed(index)
        assert len(recorder._open) <= record.MAX_HELD + 1  # (+1: the first, still running)
    assert path.read_text().count("\n") == 1 and len(recorder._rows) > 2 * record.MAX_HELD
    recorder.completed(first)
    recorder.issue(what, False)
    assert len(recorder._rows) < record.MAX_HELD
    recorder.mark_step()
    recorder.close()
    events = workload.load(path).events[0]
    assert [e.index for e in events if e.kind == "op"] == list(range(2 * record.MAX_HELD + 2))
    assert sum(e.kind == "wait" for e in events) == 2 * record.MAX_HELD + 1  # every async one, once


def test_mark_step_without_a_recording_does_nothing():
    assert recording.current() is None
    assert lab.workload.mark_step() is False


def test_a_bad_workload_path_is_named(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="workload: the directory of"):
        lab.spawn(mesh_calls, 2, workload=str(tmp_path / "missing" / "w.jsonl"))
    monkeypatch.setenv("LAB_WORKLOAD", str(tmp_path))
    with pytest.raises(ValueError, match="LAB_WORKLOAD must be a file"):
        lab.spawn(mesh_calls, 2)
    assert not os.listdir(tmp_path)
