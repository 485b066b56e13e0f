"""Sub-meshes (mesh.split), transport="auto" across emulated hosts, hierarchical allreduce.

Every rank checks its own output; inputs are ``index * 7 + global rank`` (float64: sums exact).
Pools start once per module. Emulated-host cases are skipped, saying why, where namespaces
cannot be made (see tests/test_hosts.py).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch_ranks
from helpers import (
    assert_no_failures,
    check_all_to_all,
    check_allgather,
    check_allreduce,
    check_broadcast,
    check_reduce,
    check_reduce_scatter,
    child_env,
    free_port,
    pool,
    require_hosts,
)

import lab
from lab import sim
from lab.collectives.choice import ALGORITHMS


def inputs(count: int, global_rank: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float64) * 7 + global_rank


def members_of(mesh: lab.Mesh, color: int | None, key: int) -> list[int] | None:
    """What split(color, key) must give, from every rank's (color, key), in sub-mesh rank order."""
    everyone = lab.allgather(mesh, torch.tensor([-1 if color is None else color, key], dtype=torch.int64))
    pairs = everyone.view(mesh.world_size, 2).tolist()
    return None if color is None else [
        r for _, r in sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)]


def sub_cases() -> list[tuple[str, str, int]]:
    """(collective, algorithm, count) for every collective and algorithm; count < 0: a root index."""
    cases = [("allreduce", a, c) for a in ALGORITHMS["allreduce"] for c in (0, 1, 13, 1000)]
    cases += [(coll, a, c) for coll in ("broadcast", "allgather", "reduce_scatter", "all_to_all")
              for a in ALGORITHMS[coll] for c in (1, 13, 1000)]
    cases += [("reduce", "binomial", c) for c in (1, 1000)] + [("barrier", "", 0), ("send/recv", "", 5)]
    return cases


def run_case(sub: lab.Mesh, members: list[int], case: tuple[str, str, int], step: int) -> str | None:
    """One collective on ``sub``; a description of what was wrong, or None."""
    collective, algorithm, count = case
    k, me = len(members), members[sub.rank]
    x = inputs(count, me)
    total = sum(inputs(count, m) for m in members)
    root = step % k  # roots rotate over the sub-mesh
    if collective == "allreduce":
        got, want = lab.allreduce(sub, x, algorithm=algorithm), total
    elif collective == "broadcast":
        got, want = lab.broadcast(sub, x, src=root, algorithm=algorithm), inputs(count, members[root])
    elif collective == "allgather":
        got, want = lab.allgather(sub, x, algorithm=algorithm), torch.cat([inputs(count, m) for m in members])
    elif collective == "reduce_scatter":
        got, want = lab.reduce_scatter(sub, x, algorithm=algorithm), torch.tensor_split(total, k)[sub.rank]
    elif collective == "all_to_all":
        got = lab.all_to_all(sub, x, algorithm=algorithm)
        want = torch.cat([torch.tensor_split(inputs(count, m), k)[sub.rank] for m in members])
    elif collective == "reduce":
        got, want = lab.reduce(sub, x, dst=root), total if sub.rank == root else inputs(count, me)
    elif collective == "barrier":
        lab.barrier(sub)
        return None
    else:  # point-to-point round the sub-mesh: even ranks send first
        if k == 1:
            return None
        right, left = (sub.rank + 1) % k, (sub.rank - 1) % k
        if sub.rank % 2 == 0:
            sub.send(right, x)
            got = sub.recv(left)
        else:
            got = sub.recv(left)
            sub.send(right, x)
        want = inputs(count, members[left])
    if not torch.equal(got, want):
        return f"global rank {me} (sub rank {sub.rank} of {k}) {collective} {algorithm} count={count}: {got} != {want}"
    return None


def every_collective_on_every_size(mesh: lab.Mesh) -> list[str]:
    """For each size s: ranks [0, s) form one sub-mesh (reversed by key when s is even), the others
    another or opt out; every collective runs on it, each followed by a parent allreduce."""
    failures, n = [], mesh.world_size
    for size in range(1, n + 1):
        inside = mesh.rank < size
        color = 0 if inside else (1 if size % 2 else None)
        key = -mesh.rank if size % 2 == 0 else 0
        members = members_of(mesh, color, key)
        sub = mesh.split(color, key)
        if (sub is None) != (color is None) or (sub is not None and (sub.world_size, sub.rank)
                                                != (len(members), members.index(mesh.rank))):
            failures.append(f"rank {mesh.rank} size {size}: split gave {sub and (sub.rank, sub.world_size)}")
            continue
        for step, case in enumerate(sub_cases()):
            if sub is not None:
                failures.append(run_case(sub, members, case, step))
            y = torch.tensor([step, mesh.rank], dtype=torch.int64)
            lab.allreduce(mesh, y, algorithm="ring" if step % 2 else "tree")
            if y.tolist() != [step * n, n * (n - 1) // 2]:
                failures.append(f"rank {mesh.rank} size {size} parent allreduce after {case}: {y.tolist()}")
    return [f for f in failures if f]


@pytest.fixture(scope="module", params=[("shm", 6), ("tcp", 5), ("queue", 3)], ids=lambda p: f"{p[0]}-{p[1]}")
def cluster(request):
    transport, world_size = request.param
    with pool(world_size, transport, segment_bytes=4096) as c:
        yield c


def test_every_collective_on_sub_meshes_of_every_size_interleaved_with_the_parent(cluster):
    assert_no_failures(cluster.run(every_collective_on_every_size))


def overlapping_and_async(mesh: lab.Mesh) -> list[str]:
    """Rows and columns (overlapping), a split of a split, async work in flight on all of them."""
    n, failures = mesh.world_size, []
    rows_members = members_of(mesh, mesh.rank // 2, 0)
    rows = mesh.split(mesh.rank // 2)
    cols_members = members_of(mesh, mesh.rank % 2, -mesh.rank)
    cols = mesh.split(mesh.rank % 2, key=-mesh.rank)
    for count in (3, 5000):
        a, b, c = inputs(count, mesh.rank), inputs(count, mesh.rank) * 2, inputs(count, mesh.rank) * 3
        works = [
            lab.allreduce(rows, a, async_op=True),
            lab.allreduce(cols, b, async_op=True),
            lab.allreduce(mesh, c, async_op=True)]
        assert mesh.in_flight or all(w.is_completed() for w in works)
        g = lab.allgather(cols, torch.tensor([float(mesh.rank)]))  # synchronous: after the three
        for w in works:
            w.wait()
        checks = [(a, sum(inputs(count, m) for m in rows_members)),
                  (b, sum(inputs(count, m) * 2 for m in cols_members)),
                  (c, sum(inputs(count, m) * 3 for m in range(n))),
                  (g, torch.tensor(cols_members, dtype=torch.float32))]
        failures += [
            f"rank {mesh.rank} count {count} check {i}" for i, (got, want) in enumerate(checks)
            if not torch.equal(got, want)]
    # A split of a split, made while an asynchronous collective is in flight on the parent.
    x = inputs(7, mesh.rank)
    work = lab.allreduce(mesh, x, async_op=True)
    inner_members = [cols_members[i] for i in range(len(cols_members)) if i % 2 == cols.rank % 2]
    inner = cols.split(cols.rank % 2)
    y = lab.allreduce(inner, inputs(7, mesh.rank))
    work.wait()
    if not torch.equal(y, sum(inputs(7, m) for m in inner_members)) or not torch.equal(
            x, sum(inputs(7, m) for m in range(n))):
        failures.append(f"rank {mesh.rank}: split of a split or the async parent allreduce")
    return failures


def test_overlapping_splits_one_after_another_with_async_work_in_flight(cluster):
    assert_no_failures(cluster.run(overlapping_and_async))


def out_of_order(mesh: lab.Mesh, count: int) -> list[str]:
    """Rank 0, the root of both broadcasts, enters the sub-mesh's first; every other rank the
    parent's first. So a sub-mesh message reaches each rank while it waits for the parent's, and
    must be parked, not refused as a mismatch. The sub-mesh's receivers (ranks 1 and 2) are the
    root's children in the parent's binomial tree too, so they read from rank 0 while they wait:
    a large message (segments through slots, like MPI's rendezvous) needs that; an eager one not."""
    sub = mesh.split(0 if mesh.rank < 3 else None)
    x, y = inputs(count, mesh.rank), inputs(count, mesh.rank) * 2
    calls = [lambda: lab.broadcast(mesh, y, src=0, algorithm="binomial")]
    if sub is not None:
        calls.append(lambda: lab.broadcast(sub, x, src=0, algorithm="binomial"))
    for call in calls[::-1] if mesh.rank == 0 else calls:
        call()
    ok = torch.equal(x, inputs(count, 0) if sub is not None else x) and torch.equal(y, inputs(count, 0) * 2)
    return [] if ok else [f"rank {mesh.rank} count {count}: {x[:3]} {y[:3]}"]


@pytest.mark.parametrize("count", [5, 100_000])
def test_messages_of_another_sub_mesh_wait_aside(cluster, count):
    assert_no_failures(cluster.run(out_of_order, count))


def counters(mesh: lab.Mesh) -> tuple[dict, dict]:
    sub = mesh.split(0 if mesh.rank < 2 else 1)
    mesh.reset_stats()
    lab.allreduce(sub, torch.zeros(120, dtype=torch.float32), algorithm="ring")
    parent_only = mesh.stats()
    lab.allreduce(mesh, torch.zeros(120, dtype=torch.float32), algorithm="ring")
    return sub.stats(), parent_only


def test_a_sub_mesh_counts_its_own_bytes_and_its_parent_counts_them_too(cluster):
    for rank, (sub, parent) in enumerate(cluster.run(counters)):
        k = 2 if rank < 2 else cluster.world_size - 2
        ring = 2 * (k - 1) * 480 // k  # 480 bytes: 120 elements, divisible by every k here
        assert sub["bytes_sent"] == ring and sub["collectives"] == 1, (rank, sub)
        assert parent["bytes_sent"] == ring and parent["collectives"] == 0, (rank, parent)


def bad_split(mesh: lab.Mesh, color, key) -> None:
    mesh.split(color, key)


@pytest.mark.parametrize("color, key, match", [(-1, None, r"color must be an int in \[0, 2\*\*63\)"),
                                               (1.5, None, "color must be"), (True, None, "color must be"),
                                               (0, "a", "key must be an int"), (0, 2**63, "key must be")])
def test_bad_split_arguments_raise_before_any_communication(cluster, color, key, match):
    with pytest.raises(lab.RankError, match=match) as caught:
        cluster.run(bad_split, color, key)
    assert caught.value.exc_type == "ValueError"
    assert cluster.run(counters)  # the pool is still usable


# -- failures inside a sub-mesh --------------------------------------------------------------------


def disagree(mesh: lab.Mesh) -> None:
    sub = mesh.split(mesh.rank % 2)  # {0, 2} and {1, 3}
    x = torch.ones(10)
    if mesh.rank == 3:
        lab.broadcast(sub, x, src=0, algorithm="binomial")
    else:
        lab.allreduce(sub, x, algorithm="ring")


def test_a_mismatch_inside_a_sub_mesh_names_it_and_the_global_ranks():
    with pytest.raises(lab.RankError) as caught:
        lab.spawn(disagree, 4, recv_timeout_ms=20_000)
    text = str(caught.value)
    assert caught.value.exc_type == "CollectiveMismatchError", text
    assert "sub-mesh" in text and "(global rank 1)" in text and "(global rank 3)" in text, text


def one_stays_away(mesh: lab.Mesh) -> None:
    sub = mesh.split(0 if mesh.rank else None)  # ranks 1, 2, 3
    if mesh.rank in (1, 2):
        lab.allreduce(sub, torch.ones(10), algorithm="ring")  # rank 3 never comes


def test_a_deadline_inside_a_sub_mesh_names_it_and_the_silent_global_rank():
    with pytest.raises(lab.RankError) as caught:
        lab.spawn(one_stays_away, 4, recv_timeout_ms=500)
    text = str(caught.value)
    assert caught.value.exc_type == "DeadlineError", text
    assert "on sub-mesh" in text and "global ranks 1, 2, 3" in text and "waiting for rank 3" in text, text


def traced(mesh: lab.Mesh) -> None:
    sub = mesh.split(mesh.rank % 2)
    lab.allreduce(sub, torch.ones(4), algorithm="ring")


def test_trace_rows_of_a_sub_mesh_name_it_and_the_global_rank(tmp_path):
    path = tmp_path / "run.jsonl"
    lab.spawn(traced, 4, trace=str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    subs = [r for r in rows if "sub_mesh" in r]
    assert sorted((r["global_rank"], r["rank"], r["world_size"]) for r in subs) == [(0, 0, 2), (1, 0, 2),
                                                                                    (2, 1, 2), (3, 1, 2)]
    assert len({r["sub_mesh"] for r in subs}) == 2 and all(r["op"] == "allreduce" for r in subs)


# -- transport="auto" across emulated hosts ---------------------------------------------------------

LAYOUTS = [(2, 4), (2, 6), (3, 6)]  # (hosts, world_size): 2x2, 2x3, 3x2


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}x{p[1] // p[0]}")
def hosts_cluster(request):
    require_hosts()
    hosts, world_size = request.param
    with lab.launch(world_size, hosts=hosts, link_gbit=10.0, transport="auto", recv_timeout_ms=60_000,
                    segment_bytes=4096) as c:
        yield c


@pytest.mark.slow
def test_the_collective_matrix_across_hosts_with_auto(hosts_cluster):
    """The wire set of tests/test_collectives.py (every collective, algorithm, count, root and
    shape; each element width): "auto" routes each message to shm or tcp by its peer's host and
    passes the op's combine through untouched, so the dtype x op matrix (on shm there) adds
    nothing here."""
    for check in (check_allreduce, check_broadcast, check_allgather, check_reduce_scatter, check_reduce,
                  check_all_to_all):
        assert_no_failures(hosts_cluster.run(check, False))


def allreduce_bytes(mesh: lab.Mesh, count: int, algorithm: str) -> tuple[bool, dict]:
    x = torch.arange(count, dtype=torch.float32) * 3 + mesh.rank
    mesh.reset_stats()
    lab.allreduce(mesh, x, algorithm=algorithm)
    want = torch.arange(
        count, dtype=torch.float32) * 3 * mesh.world_size + mesh.world_size * (mesh.world_size - 1) // 2
    return torch.equal(x, want), mesh.stats()


def test_hierarchical_byte_counts_are_exact(hosts_cluster):
    n, h = hosts_cluster.world_size, len(hosts_cluster.hosts)
    per_host = n // h
    count = 12 * 8192  # every L, H and N here divides it; shards of at least 64 KiB cross by ring
    total = count * 4
    hier = hosts_cluster.run(allreduce_bytes, count, "hierarchical")
    ring = hosts_cluster.run(allreduce_bytes, count, "ring")
    assert all(ok for ok, _ in hier + ring)
    for rank, (_, stats) in enumerate(hier):
        across = 2 * (h - 1) * total // h // per_host
        assert stats["bytes_sent"] == 2 * (per_host - 1) * total // per_host + across, (rank, stats)
        assert stats["bytes_sent_inter_host"] == stats["bytes_received_inter_host"] == across, (rank, stats)
    for host in range(h):
        on_host = range(host * per_host, (host + 1) * per_host)
        # Each host link carries 2T(H-1)/H each way, against 2T(N-1)/N for the flat ring.
        assert sum(hier[r][1]["bytes_sent_inter_host"] for r in on_host) == 2 * (h - 1) * total // h
        assert sum(ring[r][1]["bytes_sent_inter_host"] for r in on_host) == 2 * (n - 1) * total // n
    # Small shards cross by recursive doubling: the counts equal the simulator's, rank by rank.
    for count in (0, 1, n + 1, 1000):
        small = hosts_cluster.run(allreduce_bytes, count, "hierarchical")
        r = sim.simulate("allreduce", "hierarchical", n, count * 4, sim.Network(ranks_per_host=per_host))
        assert all(ok for ok, _ in small)
        assert [s["bytes_sent"] for _, s in small] == r.bytes_sent.tolist(), count
        assert [s["bytes_received"] for _, s in small] == r.bytes_received.tolist(), count


def host_split(mesh: lab.Mesh) -> tuple[int, int, int, int, list[float]]:
    """A sub-mesh per local rank (one rank on each host) and one per host."""
    across = mesh.split(mesh.local_rank)
    inside = mesh.split(mesh.host)
    x = lab.allreduce(across, torch.full((3,), float(mesh.rank)), algorithm="ring")
    lab.allreduce(inside, x, algorithm="hierarchical")
    return across.host_count, inside.host_count, inside.local_world_size, across.local_rank, x.tolist()


def test_sub_meshes_know_their_hosts_and_reduce_across_them(hosts_cluster):
    n, h = hosts_cluster.world_size, len(hosts_cluster.hosts)
    for rank, (across_hosts, inside_hosts, local_size, local_rank,
               x) in enumerate(hosts_cluster.run(host_split)):
        assert (across_hosts, inside_hosts, local_size, local_rank) == (h, 1, n // h, 0), rank
        assert x == [float(n * (n - 1) // 2)] * 3, rank


# -- torchrun: two "nodes" on one machine -----------------------------------------------------------

TORCHRUN_SCRIPT = Path(__file__).parent / "scripts" / "torchrun_groups.py"


@pytest.mark.slow
def test_torchrun_nodes_with_auto_transport():
    """Two torchrun processes with --nnodes 2 (a node each) as two machines would run them: shm
    inside a node, TCP between (with the LAB_TCP_SECRET that several hosts need)."""
    nodes, per_node = 2, 2
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    port = free_port()
    env = child_env(LAB_TCP_SECRET=secrets.token_hex(32))
    jobs = [
        subprocess.Popen([
            torchrun, "--nnodes",
            str(nodes), "--node-rank",
            str(node), "--nproc-per-node",
            str(per_node), "--master-addr", "127.0.0.1", "--master-port",
            str(port),
            str(TORCHRUN_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for node in range(nodes)]
    outputs = [job.communicate(timeout=180) for job in jobs]
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, out[-2000:] + err[-4000:]
    lines = sorted(line for out, _ in outputs for line in out.splitlines() if line.startswith("OK"))
    assert lines == [
        f"OK rank {r} of {nodes * per_node} on node {r // per_node}: auto" for r in range(nodes * per_node)]


@pytest.mark.slow
def test_one_torchrun_node_with_auto_transport(tmp_path):
    """The same script on one node of 3 ranks, needing no secret and no TCP: its ranks forked with
    torchrun's environment (tests/torch_ranks.py; the test above keeps the real torchrun)."""
    exits, logs = torch_ranks.run_like_torchrun(torch_ranks.run_script, 3, (str(TORCHRUN_SCRIPT), []),
                                                tmp_path, child_env(), 180)
    assert exits == [0] * 3, "\n".join(log[-3000:] for log in logs)
    lines = sorted(line for log in logs for line in log.splitlines() if line.startswith("OK"))
    assert lines == [f"OK rank {r} of 3 on node 0: auto" for r in range(3)]


def uneven_hierarchical(mesh: lab.Mesh, count: int) -> bool:
    """Sub-meshes whose ranks sit unevenly on hosts: {0, 1, 2} of 2x2 is 2 + 1."""
    sub = mesh.split(0 if mesh.rank < 3 else None)
    if sub is None:
        return True
    x = inputs(count, mesh.rank)
    lab.allreduce(sub, x, algorithm="hierarchical")
    return torch.equal(x, sum(inputs(count, m) for m in range(3)))


@pytest.mark.parametrize("count", [0, 1, 5, 70_000])
def test_hierarchical_on_hosts_of_different_sizes(hosts_cluster, count):
    assert all(hosts_cluster.run(uneven_hierarchical, count))


def test_auto_picks_hierarchical_across_hosts_when_the_model_says():
    from lab import tuning

    def models(shm_alpha_us: float) -> dict:
        flat = {"alpha_step_us": 50.0, "beta_byte_us": 8e-3}  # a slow link: 1 Gbit/s
        return {
            "shm": {"allreduce": {"ring": {"alpha_step_us": shm_alpha_us, "beta_byte_us": 1e-4}}},
            "tcp": {"allreduce": {"ring": flat, "tree": flat}}}

    # Cheap shared memory: hierarchical's 2(H-1) link steps and 2T(H-1)/H link bytes win at every size.
    for nbytes in (1 << 10, 16 << 20):
        assert tuning.choose_across_hosts(nbytes, 8, 2, "shm", models(5.0)) == "hierarchical", nbytes
    # Expensive steps inside the host (α = 500 µs): the flat tree's 6 link steps win at 1 KB.
    assert tuning.choose_across_hosts(1 << 10, 8, 2, "shm", models(500.0)) == "tree"
    assert tuning.across_hosts_us("hierarchical", 1 << 10, 8, 2, "shm", {}) is None  # no fits: None
    # Without fits: hierarchical from AUTO_LARGE_MIN_BYTES up.
    assert tuning.choose_across_hosts(tuning.AUTO_LARGE_MIN_BYTES, 8, 2, "shm", {}) == "hierarchical"


def test_flat_algorithms_across_hosts_are_weighed_on_the_link_not_on_their_own_fits():
    """tcp fits made on one machine (2 shared cores) give the tree a quarter of the ring's per-byte
    cost; across hosts a link moves every byte alike, so at 64 MB on 4 hosts the ring (its
    2(N-1)/N·T against the tree's 2·log2(N)·T) is auto's pick, not the tree."""
    from lab import tuning

    models = {
        "shm": {"allreduce": {"ring": {"alpha_step_us": 50.0, "beta_byte_us": 1e-3}}}, "tcp": {
            "allreduce": {
                "ring": {"alpha_step_us": 236.0, "beta_byte_us": 1.9e-3},
                "tree": {"alpha_step_us": 98.0, "beta_byte_us": 5.5e-4}}}}
    assert tuning.choose(64 << 20, 4, "tcp", "allreduce", models) == "tree"  # on one machine
    assert tuning.choose_across_hosts(64 << 20, 4, 4, "tcp", models) == "ring"
    times = tuning.flat_across_hosts_us(64 << 20, 4, models)
    assert times["tree"] == pytest.approx(4 * 236.0 + 4 * (64 << 20) * 1.9e-3)  # 2·log2(4) steps and T
    assert tuning.flat_across_hosts_us(1 << 20, 4, {}) == {}  # no fits: nothing to weigh


def test_sub_mesh_arguments_are_checked_and_ranks_translated():
    """``Mesh.sub_mesh``'s numbering (:class:`lab.comm.membership.Membership`), without processes: bad
    members or context raise naming the argument; ranks and hosts translate both ways."""
    from lab.comm.membership import Membership, agree_split

    world = Membership(global_rank=3, hosts=[0, 0, 1, 1, 1])
    pair = world.sub([4, 3], context=7)
    assert (pair.rank, pair.world_size, pair.to_global(0), pair.from_global(3)) == (1, 2, 4, 1)
    assert (pair.host_of(0), pair.host_count, pair.local_placement(1)) == (1, 1, (1, 2))
    assert pair.who() == "rank 1 of sub-mesh 00000007 (global rank 3)" and pair.who(0) == "global rank 0"
    nested = pair.sub([1], context=8)  # a sub-mesh of a sub-mesh: pair's rank 1 is global rank 3
    assert (nested.members, nested.rank) == ([3], 0)
    for members, context, message in [([0, 1], 7, "members must include this rank"),
                                      ([3, 3], 7, "members must be distinct ranks"),
                                      ([3, 5], 7, "members must be distinct ranks in"),
                                      ([3], 0, "context must be an int"),
                                      ([3], 2**32, "context must be an int"),
                                      ([3], True, "context must be an int")]:
        with pytest.raises(ValueError, match=message):
            world.sub(members, context)
    with pytest.raises(TypeError, match="members must be a list"):
        world.sub(3, 7)
    # split's agreement: colours in sorted order get base + i; opted-out ranks still move past them
    everyone = [[5, 0, 1], [2, 1, 4], [5, -1, 3], [-1, 0, 2]]
    assert agree_split(everyone, 5) == ([2, 0], 5, 6)
    assert agree_split(everyone, 2) == ([1], 4, 6)
    assert agree_split(everyone, None) == (None, 0, 6)
