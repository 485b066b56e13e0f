"""The allreduce algorithms built for hosts: ring over channels and the chain-and-tree.

Their schedules are checked without processes, on host shapes up to 16 ranks (even, uneven, one
host): every message meets its receive in the same slot at both ends, no rank is stuck even when
no byte can be buffered, the rings and trees leave each host through different ranks; the
simulator counts the docstrings' bytes. Then real runs on shm pools where nothing is eager and
one 4 KiB slot per pair is all the buffering (every message a rendezvous), at N = 1-8 on one to
three host shapes each (even, uneven, one rank per host): exact results (every dtype and op at
N-1 and 2N+3 elements on each world size's first shape; tests/test_collectives.py's wire set,
float32 with every op and int64 and bfloat16 with sum, at 0, 1, N-1, 2N+3 and 1001 elements on
every shape), a large sum and maximum and bit-identical random floats with chain_tree in 30-125
pipeline segments of 64 bytes (``LAB_SEGMENT_BYTES``), and byte counters (all bytes, and those
between hosts) equal to the docstrings' formulas. One host at every N is the generic tests'
(tests/test_sim.py's counters against the simulator, tests/test_more_collectives.py's bitwise ops).

Hosts are emulated without network namespaces: each rank's mesh is told which host every rank
is on (its membership's host list, which ``host_of`` and the between-host counters read), so
the algorithms see hosts exactly as on emulated or real ones while shared memory moves the bytes.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers import (
    DTYPES,
    assert_no_failures,
    describe_mismatch,
    expected_reduction,
    ops_for,
    pool,
    reduction_matches,
    run_without_buffers,
    slow_from_five,
    tensor,
    values,
)

import lab
from lab import sim, tuning
from lab.algorithms import allreduce_chain_tree, allreduce_ring_channels
from lab.algorithms.allreduce_chain_tree import chain_schedule, chain_trees, host_layout
from lab.algorithms.allreduce_ring_channels import channel_count, channel_rings
from lab.algorithms.double_tree_schedule import period_of

ALGORITHMS = {"ring_channels": allreduce_ring_channels, "chain_tree": allreduce_chain_tree}

#: Host shapes (the host of each rank) per world size: the first gets the full dtype x op matrix.
SHAPES = {
    1: [[0]],
    2: [[0, 1], [0, 0]],
    3: [[0, 0, 1], [0, 1, 2]],  # 2 + 1
    4: [[0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 0, 1]],
    5: [[0, 0, 0, 1, 1], [0, 0, 1, 1, 2]],  # 3 + 2, 2 + 2 + 1
    6: [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]],
    7: [[0, 0, 0, 0, 1, 1, 1]],
    8: [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3]]}
ALL_SHAPES = [shape for shapes in SHAPES.values()
              for shape in shapes] + [[0] * 4, [0] * 7, [0, 0, 0, 1, 1, 1, 2, 2], [0] * 8 + [1] * 8, [0] * 12]


def groups(shape: list[int]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each host (what ``lab.algorithms.peers.host_groups`` finds)."""
    found: dict[int, list[int]] = {}
    for rank, host in enumerate(shape):
        found.setdefault(host, []).append(rank)
    return tuple(tuple(g) for g in found.values())


def shape_id(shape: list[int]) -> str:
    return "+".join(str(len(g)) for g in groups(shape))


# -- schedules, without processes ------------------------------------------------------------------


class RecordingPeers:
    """One rank of ``shape`` that writes down its steps: (send (peer, elements) or None, receive)."""
    def __init__(self, rank: int, shape: list[int]) -> None:
        self.rank, self.world_size, self.shape, self.steps = rank, len(shape), shape, []

    def host_of(self, rank: int) -> int:
        return self.shape[rank]

    def send_buffer(self, dst, data) -> None:
        self.steps.append(((dst, data.size), None))

    def recv_buffer(self, src, out, reduction=None) -> None:
        self.steps.append((None, (src, out.size)))

    def sendrecv_buffer(self, dst, data, src, out, reduction=None) -> None:
        self.steps.append(((dst, data.size), (src, out.size)))


class NoReduction:
    def finalize(self, buf, world_size) -> None:
        pass


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=shape_id)
def test_ring_channels_messages_meet_in_the_same_slot(shape):
    """Every rank runs the same number of steps, and in step k rank a's message to b is b's
    receive from a of step k, of the same size: blocking sendrecv steps cannot deadlock."""
    n = len(shape)
    for count in (0, 1, n + 1, 1000):
        ranks = [RecordingPeers(rank, shape) for rank in range(n)]
        for peers in ranks:
            allreduce_ring_channels.allreduce_ring_channels(peers, np.zeros(count, np.float32), NoReduction())
        assert len({len(p.steps) for p in ranks}) == 1
        for k in range(len(ranks[0].steps)):
            for peers in ranks:
                send = peers.steps[k][0]
                assert send is None or ranks[send[0]].steps[k][1] == (peers.rank, send[1]), (count, k,
                                                                                             peers.rank)


def test_channels_leave_each_host_through_different_ranks():
    """C channels (L up to 8 ranks per host; else the largest divisor of L up to 8), each a ring
    over every rank, each entering host 1 from a different rank of host 0."""
    for per_host in range(1, 13):
        for hosts in (1, 2, 3):
            rings = channel_rings([list(g) for g in host_layout(hosts * per_host, hosts)])
            assert len(rings) == {9: 3, 10: 5, 11: 1, 12: 6}.get(per_host, per_host)
            assert all(sorted(ring) == list(range(hosts * per_host)) for ring in rings)
            exits = {ring[per_host - 1] for ring in rings}  # the last rank of host 0 in each ring
            assert hosts == 1 or (len(exits) == len(rings) and max(exits) < per_host)
    assert channel_count({3, 2}) == 1 and channel_count({4, 2}) == 2
    for channels in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="channels must be a positive int that divides every host's"):
            channel_rings([[0, 1], [2, 3]], channels)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=shape_id)
def test_chain_trees_span_the_ranks_and_enter_hosts_through_two_ranks(shape):
    """Each tree: one root, parents and children agree, every rank reached; links between hosts
    join heads only, local rank 0 in tree 0 and the last in tree 1; period at most 5."""
    hosts = groups(shape)
    trees = chain_trees(hosts)
    for tree in range(2):
        roots = [r for r in range(len(shape)) if trees[r][tree][0] < 0]
        reached, frontier = set(roots), list(roots)
        while frontier:
            rank = frontier.pop()
            for child in trees[rank][tree][1]:
                assert trees[child][tree][0] == rank and child not in reached
                reached.add(child)
                frontier.append(child)
        assert len(roots) == 1 and reached == set(range(len(shape)))
        heads = {g[0] if tree == 0 else g[-1] for g in hosts}
        for rank in range(len(shape)):
            parent = trees[rank][tree][0]
            if parent >= 0 and shape[parent] != shape[rank]:
                assert {parent, rank} <= heads, (tree, rank, parent)
    assert period_of(trees) <= 5


@pytest.mark.parametrize("shape", [s for s in ALL_SHAPES if len(s) > 1], ids=shape_id)
def test_chain_tree_schedule_agrees_at_both_ends_and_needs_no_buffering(shape):
    hosts, segments = groups(shape), 3
    steps = [chain_schedule(hosts, rank, segments) for rank in range(len(shape))]
    sent, received = defaultdict(list), defaultdict(list)
    for rank, mine in enumerate(steps):
        slots = [(send or recv).slot for send, recv in mine]
        assert slots == sorted(set(slots)), f"rank {rank}: slots not increasing"
        for send, recv in mine:
            if send is not None:
                sent[rank, send.peer].append((send.slot, send.tree, send.segment))
            if recv is not None:
                received[recv.peer, rank].append((recv.slot, recv.tree, recv.segment))
    assert sent == received
    assert sum(move.finishes for mine in steps for step in mine for move in step if move) == 2 * segments
    run_without_buffers(steps)


@pytest.mark.parametrize("hosts, per_host", [(1, 4), (2, 3), (3, 2), (4, 4), (4, 8)])
def test_simulated_byte_counts_match_the_docstrings(hosts, per_host):
    n = hosts * per_host
    count = 2 * n * channel_count({per_host}) * 3
    network = sim.Network(ranks_per_host=per_host)
    for name, module in ALGORITHMS.items():
        r = sim.simulate("allreduce", name, n, count * 4, network)
        for rank in range(n):
            options = {"hosts": hosts} if name == "chain_tree" else {}
            want, formula = module.bytes_sent(rank, n, count * 4, **options)
            assert r.bytes_sent[rank] == r.bytes_received[rank] == want, (name, rank, formula)


def test_ring_channels_beats_the_ring_on_rails_and_its_closed_form_is_the_simulators():
    """16 hosts x 8 ranks, a NIC per rank: the channels cross hosts on 8 NICs at once; the
    prediction ``auto`` uses is the simulated time on the same terms."""
    rails = sim.Network(alpha_us=5.0, gbit=100.0, ranks_per_host=8, nics_per_host=8, intra_alpha_us=1.0,
                        intra_gbit=1000.0)
    times = sim.compare("allreduce", 128, 64 << 20, rails, candidates=["ring", "ring_channels", "chain_tree"])
    assert times["ring_channels"] < times["ring"] / 2
    models = {
        "shm": {"allreduce": {"ring": {"alpha_step_us": 1.0, "beta_byte_us": 8 / 1e6}}},
        "tcp": {"allreduce": {"ring": {"alpha_step_us": 5.0, "beta_byte_us": 8 / 1e5}}}}
    predicted = tuning.across_hosts_us("ring_channels", 64 << 20, 128, 16, "shm", models, nics_per_host=8)
    assert predicted == pytest.approx(times["ring_channels"], rel=1e-6)


def test_auto_across_hosts_weighs_the_host_algorithms():
    def models(flat_alpha_us: float) -> dict:
        flat = {"alpha_step_us": flat_alpha_us, "beta_byte_us": 8e-5}
        return {
            "shm": {"allreduce": {"ring": {"alpha_step_us": 1.0, "beta_byte_us": 1e-5}}},
            "tcp": {"allreduce": {"ring": {"alpha_step_us": 5.0, "beta_byte_us": 8e-5}, "tree": flat}}}

    # 64 hosts of 2, 1 MiB: the tree across hosts' ⌈log2 H⌉ levels beat hierarchical's 2(H-1) steps
    assert tuning.choose_across_hosts(1 << 20, 128, 64, "shm", models(5.0)) == "chain_tree"
    # ring over channels never beats hierarchical (the same bytes between hosts, more steps)
    for nics in (1, 8):
        assert (tuning.across_hosts_us("ring_channels", 16 << 20, 16, 2, "shm", models(5.0), nics)
                > tuning.across_hosts_us("hierarchical", 16 << 20, 16, 2, "shm", models(5.0), nics))
    assert tuning.across_hosts_us("chain_tree", 1 << 20, 16, 2, "shm", {}) is None  # no fits: None


def test_a_planted_algorithm_that_knows_hosts_is_weighed_across_hosts_by_its_one_registry_line(monkeypatch):
    """One file and one line, as for a flat algorithm: an allreduce registered with a closed form
    across hosts (``across_hosts``) is among what ``auto`` weighs there, with no other edit; it
    wins where its form says so, and the shipped ones again once it is gone."""
    from lab.algorithms import registry

    models = {
        "shm": {"allreduce": {"ring": {"alpha_step_us": 1.0, "beta_byte_us": 1e-5}}},
        "tcp": {"allreduce": {"ring": {"alpha_step_us": 5.0, "beta_byte_us": 8e-5}}}}
    seen = []

    def across_hosts_us(nbytes, world_size, hosts, inside, across, nics_per_host=1):
        seen.append((nbytes, world_size, hosts, inside, across, nics_per_host))
        return 1.0 if nbytes >= 1 << 20 else 1e9  # wins from 1 MiB

    planted = registry.Algorithm("allreduce", "planted_across", print, lambda n: (1, 1.0), 201, auto=False,
                                 across_hosts=across_hosts_us)
    shipped = tuning.choose_across_hosts(4 << 20, 16, 4, "shm", models)
    # the session's registry and wire codes are given back after the test
    monkeypatch.setitem(registry.ALGORITHMS, "allreduce", dict(registry.ALGORITHMS["allreduce"]))
    monkeypatch.setattr(registry.fingerprint, "_ALGORITHM_CODES", dict(registry.fingerprint._ALGORITHM_CODES))
    monkeypatch.setattr(registry.fingerprint, "_ALGORITHM_NAMES", dict(registry.fingerprint._ALGORITHM_NAMES))
    registry.register(planted)
    assert tuning.choose_across_hosts(4 << 20, 16, 4, "shm", models, nics_per_host=2) == "planted_across"
    assert seen[-1] == (4 << 20, 16, 4, (1.0, 1e-5), (5.0, 8e-5), 2)
    assert tuning.choose_across_hosts(1 << 10, 16, 4, "shm", models) != "planted_across"
    assert shipped != "planted_across"


# -- real runs on emulated hosts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def four():
    with pool(4, "shm", segment_bytes=4096, slots=1, eager_bytes=0) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def eight():
    with pool(8, "shm", segment_bytes=4096, slots=1, eager_bytes=0) as cluster:
        yield cluster


def counts(n: int) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by 2N, and enough for many segments."""
    return sorted({0, 1, n - 1, 2 * n + 3, 1001})


def check_results(mesh: lab.Mesh, shape: list[int], algorithm: str, full: bool) -> list[str]:
    """Exact results of ``index * 3 + rank``: the wire set (float32 with every op, int64 and
    bfloat16 with sum) at every count; with ``full``, every dtype and op at N-1 and 2N+3 elements
    and a large sum and maximum in many segments."""
    failures, n = [], mesh.world_size
    cases = {(d, o, c)
             for d in ("float32", "int64", "bfloat16")
             for o in ops_for(d, False)
             for c in counts(n)}
    if full:
        cases |= {(d, o, c) for d in DTYPES for o in ops_for(d) for c in (n - 1, 2 * n + 3)}
        cases |= {("float32", "sum", 2000), ("int64", "max", 2000)}
    for dtype, op, count in sorted(cases):
        os.environ["LAB_SEGMENT_BYTES"] = "64" if count > 1001 else ""  # chain_tree: 63-125 segments
        stack = np.stack([values(count, r, dtype, op) for r in range(n)])
        x = tensor(stack[mesh.rank], dtype)
        lab.allreduce(mesh, x, op=op, algorithm=algorithm)
        want = expected_reduction(stack, op, dtype)
        if not reduction_matches(x, want, stack, op, dtype):
            failures.append(f"rank {mesh.rank} {algorithm} on {shape} {op} {dtype}[{count}]: "
                            f"{describe_mismatch(x, want)}")
    return failures


def check_bits_and_bytes(mesh: lab.Mesh, shape: list[int], algorithm: str, between_hosts: bool) -> list[str]:
    """Random floats bit-identical on every rank; bytes sent and received (and ``between_hosts``,
    on the pool's own mesh, whose counters know the hosts) equal to the docstrings'."""
    failures, n, rank = [], mesh.world_size, mesh.rank
    os.environ["LAB_SEGMENT_BYTES"] = "64"
    noise = torch.rand(1001, generator=torch.Generator().manual_seed(rank))
    lab.allreduce(mesh, noise, algorithm=algorithm)
    everyone = lab.allgather(mesh, noise.view(torch.int32)).view(n, -1)
    if not bool((everyone == everyone[0]).all()):
        failures.append(f"rank {rank} {algorithm} on {shape}: random floats differ between ranks")
    hosts = groups(shape)
    count = 2 * n * channel_count({len(g) for g in hosts}) * 3
    total = count * 4
    mesh.reset_stats()
    lab.allreduce(mesh, torch.arange(float(count)), algorithm=algorithm)
    stats = mesh.stats()
    if algorithm == "ring_channels":
        want, across = 2 * total * (n - 1) // n, 2 * total * (n - 1) // n // len(channel_rings(list(hosts)))
        across = across if len(hosts) > 1 and len({len(g) for g in hosts}) == 1 else None
    else:
        links = [(p, c) for p, children in chain_trees(hosts)[rank] for c in [*children, p] if c >= 0]
        want, across = len(links) * total // 2, sum(shape[c] != shape[rank] for _, c in links) * total // 2
    got = (stats["bytes_sent"], stats["bytes_received"])
    if got != (want, want):
        failures.append(f"rank {rank} {algorithm} on {shape}: sent/received {got}, want {want}")
    if between_hosts and across is not None \
            and (stats["bytes_sent_inter_host"], stats["bytes_received_inter_host"]) != (across, across):
        failures.append(f"rank {rank} {algorithm} on {shape}: between hosts {stats['bytes_sent_inter_host']}/"
                        f"{stats['bytes_received_inter_host']}, want {across}")
    return failures


def check_on_hosts(mesh: lab.Mesh, world_size: int) -> list[str]:
    """Every shape of ``world_size`` ranks (on a sub-mesh of the pool's first ones), both algorithms."""
    sub = mesh.split(0 if mesh.rank < world_size else None)
    if sub is None:
        return []
    membership, failures = mesh._membership, []
    saved_hosts, saved_host = list(membership.hosts), mesh.host
    try:
        for index, shape in enumerate(SHAPES[world_size]):
            membership.hosts[:world_size] = shape  # (the sub-mesh shares the list)
            mesh.exchange.host = shape[mesh.rank]  # (what the pool's own counters between hosts compare with)
            whole = world_size == mesh.world_size
            target = mesh if whole else sub
            for algorithm in ALGORITHMS:
                failures += check_results(target, shape, algorithm, full=index == 0)
                failures += check_bits_and_bytes(target, shape, algorithm, whole)
    finally:
        membership.hosts[:], mesh.exchange.host = saved_hosts, saved_host
        os.environ.pop("LAB_SEGMENT_BYTES", None)
    return failures


@pytest.mark.parametrize("world_size", slow_from_five(range(1, 9)))
def test_results_bits_and_bytes_on_emulated_hosts(request, world_size):
    cluster = request.getfixturevalue("four" if world_size <= 4 else "eight")
    assert_no_failures(cluster.run(check_on_hosts, world_size))


def both_in_flight(mesh: lab.Mesh) -> list[str]:
    """On 2 hosts of 2: ring_channels and chain_tree issued async together (torch's own ReduceOp),
    a plain allreduce issued while they are in flight, then every wait: each exact on this rank."""
    membership, failures = mesh._membership, []
    saved_hosts, saved_host = list(membership.hosts), mesh.host
    try:
        membership.hosts[:] = [0, 0, 1, 1]
        mesh.exchange.host = membership.hosts[mesh.rank]
        os.environ["LAB_SEGMENT_BYTES"] = "64"  # chain_tree in many segments
        n, index = mesh.world_size, torch.arange(3001, dtype=torch.float64)
        x, y, z = (index * 3 + mesh.rank for _ in range(3))
        sum_op, max_op = torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX
        works = [
            lab.allreduce(mesh, x, op=sum_op, algorithm="ring_channels", async_op=True),
            lab.allreduce(mesh, y, op=max_op, algorithm="chain_tree", async_op=True)]
        lab.allreduce(mesh, z, algorithm="ring")  # runs after them, in issue order
        for work in works:
            work.wait()
        for name, got, want in (("ring_channels", x, index * 3 * n + n * (n - 1) / 2),
                                ("chain_tree", y, index * 3 + n - 1), ("ring", z,
                                                                       index * 3 * n + n * (n - 1) / 2)):
            if not torch.equal(got, want):
                failures.append(f"rank {mesh.rank} {name}: {describe_mismatch(got, want)}")
    finally:
        membership.hosts[:], mesh.exchange.host = saved_hosts, saved_host
        os.environ.pop("LAB_SEGMENT_BYTES", None)
    return failures


def test_both_async_in_flight_with_torch_s_reduce_ops(four):
    assert_no_failures(four.run(both_in_flight))
