"""Two torch groups used at once on the "lab" backend: each progresses on its own, as gloo's do.

Async collectives on groups of the same ranks issued in opposite orders on different ranks, and
two threads each driving its own group, complete with every rank's result exact (inputs
``index * STRIDE + rank``); a silent peer in one group holds up only that group's calls, until
their deadline, and a dead one hangs none. The world is made two ways: by the backend through
``tcp://`` (``transport`` "tcp", and "auto": shared memory on one host, shm and TCP across two
torchrun-like "nodes"), and as a pool's mesh lent to torch (``lab.backend.init_process_group``:
shm, tcp, queue). Under it, ``lab.Mesh.sub_mesh(own_order=True)`` and its issue order.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch_ranks
from helpers import child_env, free_port

import lab
from lab.comm.issue import IssueQueue

STRIDE = 3
#: Small (run on the caller's thread where it may be), and past lab.backend.group.RUN_NOW_MAX_BYTES
#: and the shm transport's segments (the communication thread; several segments a message).
COUNTS = (5, 70_000)


def pattern(count: int, rank: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float64) * STRIDE + rank + offset


def same(got: torch.Tensor | list, want: torch.Tensor | list) -> bool:
    stacked = [torch.stack(t) if isinstance(t, list) else t for t in (got, want)]
    return torch.equal(*stacked)


def opposite_orders(rank: int, n: int) -> str:
    """Async all_reduce, all_gather and broadcast on three groups (A and B: every rank; C: the
    first and the last), issued A, B, C by even ranks and C, B, A by odd ones, each result checked
    on this rank: "ok", or what was wrong."""
    groups = {"A": list(range(n)), "B": list(range(n)), "C": [0, n - 1]}
    made = {name: dist.new_group(members) for name, members in groups.items()}  # (every rank, same order)
    wrong = []
    for count in COUNTS:
        works, checks = [], []
        for name in groups if rank % 2 == 0 else reversed(groups):
            members, group, offset = groups[name], made[name], 1000 * "ABC".index(name)
            if rank not in members:
                continue
            reduced, broadcast = pattern(count, rank, offset), pattern(count, rank, offset + 7)
            gathered = [torch.empty(count, dtype=torch.float64) for _ in members]
            works += [
                dist.all_reduce(reduced, group=group, async_op=True),
                dist.all_gather(gathered, pattern(count, rank, offset), group=group, async_op=True),
                dist.broadcast(broadcast, src=members[-1], group=group, async_op=True)]
            inputs = [pattern(count, r, offset) for r in members]
            checks += [(f"{name} all_reduce[{count}]", reduced, sum(inputs)),
                       (f"{name} all_gather[{count}]", gathered, inputs),
                       (f"{name} broadcast[{count}]", broadcast, pattern(count, members[-1], offset + 7))]
        for work in works:
            work.wait()
        wrong += [what for what, got, want in checks if not same(got, want)]
    return "ok" if not wrong else f"rank {rank} wrong: {', '.join(wrong)}"


def two_threads(rank: int, n: int, rounds: int = 12) -> str:
    """Two threads, each looping on its own group of every rank, and a third on the world's
    (synchronous and async calls, small and large), each result checked: "ok", or what was wrong."""
    groups = [dist.new_group(list(range(n))) for _ in range(2)] + [None]
    wrong: list[str] = []

    def loop(which: int) -> None:
        try:
            for i in range(rounds):
                count, offset = COUNTS[(i + which) % len(COUNTS)], 10_000 * which + i
                x = pattern(count, rank, offset)
                if i % 3 == 2:
                    dist.all_reduce(x, group=groups[which], async_op=True).wait()
                else:
                    dist.all_reduce(x, group=groups[which])
                if not same(x, sum(pattern(count, r, offset) for r in range(n))):
                    wrong.append(f"thread {which} round {i}")
        except Exception as exc:  # noqa: BLE001 - reported as this rank's result
            wrong.append(f"thread {which}: {type(exc).__name__}: {exc}"[:1500])

    threads = [threading.Thread(target=loop, args=(which,)) for which in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return "ok" if not wrong else f"rank {rank}: {'; '.join(wrong)}"


# -- the backend's own world, through tcp:// ---------------------------------------------------


def world_rank(rank: int, n: int, init: str, how: str, transport: str, nodes: int) -> None:
    """A rank of a world made by init_process_group("lab"), printing its ``RESULT`` line.
    "silent"/"dead": A = [0, 1] is healthy; B = [0, 2], whose rank 2 never enters it (alive, or gone)."""
    if nodes > 1:  # as torchrun describes ranks on `nodes` machines (shm inside one, TCP between)
        per_node = n // nodes
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank % per_node),
                          LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
    timeout_ms = 4000 if how in ("silent", "dead") else 20_000
    dist.init_process_group("lab", init_method=init, rank=rank, world_size=n, timeout=timedelta(seconds=120),
                            pg_options=lab.backend.Options(recv_timeout_ms=timeout_ms, transport=transport))
    try:
        if how in ("orders", "threads"):
            print("RESULT", (opposite_orders if how == "orders" else two_threads)(rank, n), flush=True)
            dist.destroy_process_group()
            sys.exit(0)
        a, b = dist.new_group([0, 1]), dist.new_group([0, 2])
        if rank == 2:
            if how == "dead":
                os._exit(0)
            time.sleep(30)  # silent past the deadline; the parent kills it once the others ended
        x, start = pattern(5, rank), time.monotonic()
        on_b = dist.all_reduce(torch.ones(3), group=b, async_op=True) if rank == 0 else None
        try:
            dist.all_reduce(x, group=a, async_op=True).wait()
            on_a = "ok" if torch.equal(x, pattern(5, 0) + pattern(5, 1)) else f"wrong {x.tolist()}"
        except Exception as exc:  # noqa: BLE001 - a dead peer's loss, told by rank 0, may end it
            on_a = type(exc).__name__
        b_pending, b_ended = on_b is not None and not on_b.is_completed(), "-"
        if on_b is not None:
            try:
                on_b.wait()
                b_ended = "no error"
            except Exception as exc:  # noqa: BLE001 - what ended it is the result
                text = str(exc)
                b_ended = f"{type(exc).__name__} {'DeadlineError' in text} {'PeerLostError' in text}"
        took = time.monotonic() - start
        print(f"RESULT A {on_a} B pending after A {b_pending} B {b_ended} after {took:.1f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as this rank's result
        print("RESULT", type(exc).__name__, str(exc).replace(chr(10), " | ")[:3000], flush=True)
    os._exit(0)  # (a peer may be gone or stuck: no teardown)


def run_world(n: int, how: str, transport: str, nodes: int = 1) -> list[str]:
    """Each rank's RESULT line of :func:`world_rank` run as ``how`` in a world of ``n`` ranks (forked
    from the lab's forkserver, which imported torch and the lab: tests/torch_ranks.py)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = child_env(OMP_NUM_THREADS="1", LAB_TCP_SECRET="b" * 64)
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"rank{rank}.log" for rank in range(n)]
        processes = [
            torch_ranks.start_forked(world_rank, (rank, n, init, how, transport, nodes), env, paths[rank],
                                     f"world{rank}") for rank in range(n)]
        try:
            if how == "silent":  # the others end first: its sleep is not waited out
                torch_ranks.end(processes[:2], timeout_s=180)
                processes[2].kill()
            torch_ranks.end(processes, timeout_s=180)
        except TimeoutError as exc:
            return [f"{exc}: rank {rank}: {path.read_text()[-3000:]}" for rank, path in enumerate(paths)]
        return torch_ranks.result_lines(processes, paths, 3000)


WORLDS = [("tcp", 2, 1), ("tcp", 3, 1), ("auto", 2, 1), ("auto", 3, 1), ("auto", 4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("transport, n, nodes", WORLDS)
def test_async_collectives_on_groups_issued_in_opposite_orders(transport, n, nodes):
    assert run_world(n, "orders", transport, nodes) == ["ok"] * n


@pytest.mark.slow
@pytest.mark.parametrize("transport, n, nodes", WORLDS)
def test_two_threads_each_driving_its_own_group(transport, n, nodes):
    assert run_world(n, "threads", transport, nodes) == ["ok"] * n


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_silent_peer_in_one_group_holds_up_only_that_group(transport):
    """Rank 0 issues its call on B (whose rank 2 never comes) before its call on A: A completes
    while B still waits, and B then ends at its deadline, naming it."""
    outputs = run_world(3, "silent", transport)
    assert outputs[0].startswith("A ok B pending after A True B DistBackendError True"), outputs
    assert outputs[1].startswith("A ok B pending after A False B -"), outputs
    assert float(outputs[0].split(" after ")[-1].split(" s")[0]) < 60, outputs  # the 4 s deadline, not a hang


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_dead_peer_in_one_group_ends_its_call_and_hangs_no_other(transport):
    """B's rank 2 is gone: rank 0's call on B fails (the peer lost, or its deadline); its call on
    A, issued after it, ends too, exact or with an error (rank 0 tells its peers what it found)."""
    outputs = run_world(3, "dead", transport)
    assert " B DistBackendError " in outputs[0] and "True" in outputs[0].split(" B ")[-1], outputs
    for output in outputs[:2]:
        assert output.startswith(("A ok", "A DistBackendError")), outputs
        assert float(output.split(" after ")[-1].split(" s")[0]) < 60, outputs


# -- a pool's mesh lent to torch, and the lab's own sub-meshes with an order of their own --------


@pytest.fixture(scope="module", params=[(t, n) for t in ("shm", "tcp", "queue") for n in (2, 3)],
                ids=lambda param: f"{param[0]}-{param[1]}")
def cluster(request):
    transport, n = request.param
    with lab.launch(n, transport=transport, recv_timeout_ms=30_000) as pool:
        yield pool


def lent(mesh: lab.Mesh, how: str) -> str:
    """``how`` ("orders", "threads") on torch's world over this rank's mesh."""
    lab.backend.init_process_group(mesh, timeout=timedelta(seconds=60))
    try:
        return (opposite_orders if how == "orders" else two_threads)(mesh.rank, mesh.world_size)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["orders", "threads"])
def test_groups_at_once_over_a_pool_s_mesh(cluster, how):
    assert cluster.run(lent, how) == ["ok"] * cluster.world_size


def own_orders_in_opposite_orders(mesh: lab.Mesh, count: int) -> bool:
    """Two sub-meshes of every rank, each with an issue order of its own: async allreduces on
    the first then the second on even ranks, the other way round on odd ones."""
    everyone = list(range(mesh.world_size))
    subs = [mesh.sub_mesh(everyone, context=2**20 + k, own_order=True) for k in range(2)]
    tensors = [pattern(count, mesh.rank, 1000 * k) for k in range(2)]
    order = [0, 1] if mesh.rank % 2 == 0 else [1, 0]
    works = [lab.allreduce(subs[k], tensors[k], async_op=True) for k in order]
    for work in works:
        work.wait()
    for sub in subs:
        sub.issue_queue.close()
    return all(same(tensors[k], sum(pattern(count, r, 1000 * k) for r in everyone)) for k in range(2))


@pytest.mark.slow
@pytest.mark.parametrize("count", COUNTS)
def test_sub_meshes_with_orders_of_their_own_issued_in_opposite_orders(cluster, count):
    assert all(cluster.run(own_orders_in_opposite_orders, count))


# -- the issue orders themselves --------------------------------------------------------------


def test_an_order_of_its_own_records_where_its_root_does_and_closes_with_it():
    root = IssueQueue(0)
    assert root.alone
    order = root.own_order()
    assert not root.alone and not order.alone
    root.recorder = recorder = object()
    assert order.recorder is recorder
    root.recorder = None  # (nothing to close)
    other = root.own_order()
    other.close()
    assert other.closed and not order.closed and not root.alone
    root.close()
    assert order.closed and root.alone
    assert root.own_order().closed  # (made after its root closed: refused as the root's calls are)
