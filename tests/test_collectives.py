"""Every collective over world sizes 1-8, all transports, every dtype, op, algorithm and root.

Each case runs inside the ranks: every rank builds every rank's input (``index * stride + rank``,
never all ones, so a misplaced chunk shows), runs the collective, and checks its own output
against the exact expected values, counting wrong elements. Values are chosen so the exact
result is representable in every dtype (half types included), so checks are bit-exact. The
pools use tiny shm segments (256 bytes, 2 slots) so even small tensors cross many segments and
exercise flow control, and double tree's pipeline segments are 256 bytes (``LAB_SEGMENT_BYTES``)
so 2053 elements cross many segments. The first algorithms (ring, tree, naive, binomial, auto) run
the full dtype x op matrix at N = 1-4, the ones added later (recursive doubling, halving-doubling,
double tree, ...) at N = 3 and 4 (a fold with an extra rank, and a power of two); every other case,
N = 5-8 included, runs every op on three dtypes (float32, int64, bfloat16: each width and kernel
family; helpers.matrix_dtypes says why that covers N = 5-8), to keep the suite fast.

The dtype x op matrix runs on shm (at N = 1-4); queue and
tcp run the *wire set* (:func:`dtypes_for`, :func:`ops_for` with ``full=False``): every collective,
algorithm, element count, root and shape at every world size, in float32 with every op and in
int64 and bfloat16 with sum (4-, 8- and 2-byte elements: each storage width and kernel family).
Coverage holds because a transport never sees the op, nor the dtype beyond its width: it moves
bytes and calls the ``combine`` the op's kernel hands it in a ``Recv`` (lab/transport/*), and the
op reaches the wire only as a field of the fixed-size fingerprint. What differs between transports
(message sizes, segments, flow control, order of arrival) depends on the algorithm, count, root
and element width, which every transport runs in full. What depends on the op and dtype runs in
full on shm: the kernels of lab.ops (one per op and dtype, whichever algorithm calls them; every
algorithm that is not compilable takes them on shm too, and tests/test_kernels.py checks them
alone), the compiled plane's coded kernels (lab.compiled.plane: the compilable algorithms under its
threshold, which every count here is), and where an algorithm finishes ``avg`` (float32 ``avg``
runs on every transport, as half-type ``avg`` divides before any message).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers import (
    ALGORITHMS,
    assert_no_failures,
    check_all_to_all,
    check_allgather,
    check_allreduce,
    check_broadcast,
    check_other_inputs,
    check_reduce,
    check_reduce_scatter,
    describe_mismatch,
    expected_reduction,
    pool,
    slow_from_five,
    tensor,
    values,
)

import lab
import lab.lesson
from lab.algorithms.double_tree_schedule import double_trees
from lab.transport.shm import DEFAULT_EAGER_BYTES

# -- rank-side checks (run in every rank's process) ----------------------------------------------


def check_eager_boundary(mesh: lab.Mesh) -> list[str]:
    """Every collective and algorithm with messages of threshold - 2, threshold and threshold + 2
    bytes (float16: the finest step a dtype allows; tests/test_transport.py steps by one byte), as
    whole tensors and as per-rank blocks, around the shm eager threshold of this pool."""
    failures = []
    n, rank = mesh.world_size, mesh.rank
    threshold = getattr(mesh._transport, "eager_bytes", DEFAULT_EAGER_BYTES)
    dtype = "float16"
    for message in (threshold - 2, threshold, threshold + 2):
        for count in sorted({max(message // 2, 0), n * max(message // 2, 0)}):
            stack = np.stack([values(count, r, dtype) for r in range(n)])
            want_sum = expected_reduction(stack, "sum", dtype)
            for algorithm in ALGORITHMS["allreduce"]:
                x = tensor(stack[rank], dtype)
                lab.allreduce(mesh, x, algorithm=algorithm)
                if not torch.equal(x, want_sum):
                    failures.append(
                        f"rank {rank} allreduce {algorithm} [{count}]: {describe_mismatch(x, want_sum)}")
            for algorithm in ALGORITHMS["broadcast"]:
                x = tensor(stack[rank], dtype)
                lab.broadcast(mesh, x, src=n - 1, algorithm=algorithm)
                if not torch.equal(x, tensor(stack[n - 1], dtype)):
                    failures.append(f"rank {rank} broadcast {algorithm} [{count}]")
            for algorithm in ALGORITHMS["allgather"]:
                got = lab.allgather(mesh, tensor(stack[rank], dtype), algorithm=algorithm)
                if not torch.equal(got, torch.cat([tensor(v, dtype) for v in stack])):
                    failures.append(f"rank {rank} allgather {algorithm} [{count}]")
            for algorithm in ALGORITHMS["reduce_scatter"]:
                got = lab.reduce_scatter(mesh, tensor(stack[rank], dtype), algorithm=algorithm)
                if not torch.equal(got, torch.tensor_split(want_sum, n)[rank]):
                    failures.append(f"rank {rank} reduce_scatter {algorithm} [{count}]")
            for algorithm in ALGORITHMS["all_to_all"]:
                got = lab.all_to_all(mesh, tensor(stack[rank], dtype), algorithm=algorithm)
                want = torch.cat([torch.tensor_split(tensor(v, dtype), n)[rank] for v in stack])
                if not torch.equal(got, want):
                    failures.append(f"rank {rank} all_to_all {algorithm} [{count}]")
            x = tensor(stack[rank], dtype)
            lab.reduce(mesh, x, dst=0)
            if not torch.equal(x, want_sum if rank == 0 else tensor(stack[rank], dtype)):
                failures.append(f"rank {rank} reduce [{count}]")
    return failures


def check_barrier(mesh: lab.Mesh) -> list[str]:
    """Nobody leaves before the last has entered (ranks enter 30 ms apart), sync and async."""
    failures = []
    for async_op in (False, True):
        time.sleep(0.03 * mesh.rank)
        entered = time.monotonic()
        work = lab.barrier(mesh, async_op=async_op)
        if async_op:
            work.wait()
        left = time.monotonic()
        entries = lab.allgather(mesh, torch.tensor([entered], dtype=torch.float64))
        if left < float(entries.max()):
            failures.append(f"rank {mesh.rank} left the barrier (async_op={async_op}) before rank "
                            f"{int(entries.argmax())} entered")
    return failures


def check_lesson_and_arguments(mesh: lab.Mesh) -> list[str]:
    """The lesson's wrappers for the new rows, async handles, and bad arguments before any message."""
    failures = []
    n, rank = mesh.world_size, mesh.rank
    x = torch.arange(2.0 * n) + rank
    total = sum(torch.arange(2.0 * n) + r for r in range(n))
    for name in ["recursive_doubling_allreduce", "halving_doubling_allreduce", "double_tree_allreduce"]:
        if not torch.equal(getattr(lab.lesson, name)(mesh, rank, n, x.clone()), total):
            failures.append(f"rank {rank} lesson {name}")
    got = lab.lesson.reduce(mesh, rank, n, x.clone(), n - 1)
    if not torch.equal(got, total if rank == n - 1 else x):
        failures.append(f"rank {rank} lesson reduce")
    if not torch.equal(lab.lesson.all_to_all(mesh, rank, n, x.clone()),
                       torch.cat([(torch.arange(2.0 * n) + r)[2 * rank:2 * rank + 2] for r in range(n)])):
        failures.append(f"rank {rank} lesson all_to_all")
    lab.lesson.barrier(mesh, rank, n)
    works = [
        lab.reduce(mesh, x.clone(), dst=0, async_op=True),
        lab.all_to_all(mesh, x, async_op=True),
        lab.broadcast(mesh, x.clone(), src=0, algorithm="scatter_allgather", async_op=True)]
    if not torch.equal(works[0].result(), total if rank == 0 else x) or not torch.equal(
            works[2].result(), torch.arange(2.0 * n)):
        failures.append(f"rank {rank} async reduce/broadcast")
    bad = [
        (lambda: lab.reduce(mesh, x, dst=n), "dst must be a rank"),
        (lambda: lab.reduce(mesh, x, op="mean"), "op must be one of"),
        (lambda: lab.all_to_all(mesh, torch.tensor(1.0)), "at least one dimension"),
        (lambda: lab.all_to_all(mesh, x, algorithm="ring"), "algorithm must be one of"),
        (lambda: lab.broadcast(mesh, x, algorithm="ring"), "algorithm must be one of"),
        (lambda: lab.allgather(mesh, x, algorithm="bruck"), "algorithm must be one of"),
        (lambda: lab.reduce_scatter(mesh, x, algorithm="tree"), "algorithm must be one of"),
        (lambda: lab.allreduce(mesh, x, algorithm="butterfly"), "algorithm must be one of"),
        (lambda: lab.lesson.barrier(mesh, rank + 1, n), "rank must be"),]
    for call, message in bad:
        try:
            call()
            failures.append(f"rank {rank}: no error, expected {message!r}")
        except ValueError as error:
            if message not in str(error):
                failures.append(f"rank {rank}: {error!r}, expected {message!r}")
    if not torch.equal(lab.allreduce(mesh, x.clone()), total):  # the mesh is still usable
        failures.append(f"rank {rank} allreduce after bad arguments")
    return failures


def byte_model(collective: str, algorithm: str, rank: int, n: int, total: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank``, from the algorithm's docstring, for a T-byte call
    whose element count every block split divides (T: the tensor; the result for allgather)."""
    p = 1 << (n.bit_length() - 1)
    extra, lp = n - p, p.bit_length() - 1
    sits_out, folded = rank < 2 * extra and rank % 2 == 0, rank < 2 * extra and rank % 2 == 1
    vrank = rank // 2 if rank < 2 * extra else rank - extra
    block = total // n

    def size(v: int) -> int:  # bytes of the blocks virtual rank v speaks for
        return 2 * block if v < extra else block

    def group(v: int, k: int) -> int:  # bytes of v's aligned group of 2^k virtual ranks
        first = v - v % (1 << k)
        return sum(size(u) for u in range(first, first + (1 << k)))

    fold = (total, total) if folded else (0, 0)
    if collective == "allreduce":
        if algorithm == "ring":
            return (2 * total * (n - 1) // n,) * 2
        if algorithm == "double_tree":
            links = sum(len(children) + (parent >= 0) for parent, children in double_trees(n, rank))
            return (links * total // 2,) * 2
        if sits_out:
            return total, total
        core = lp * total if algorithm == "recursive_doubling" else 2 * total * (p - 1) // p
        return core + fold[0], core + fold[1]
    if algorithm == "pat":  # each rank's N-1 blocks but its own leave it once, and N-1 blocks arrive
        return (total * (n - 1) // n,) * 2
    if collective == "reduce_scatter":  # recursive_halving
        if sits_out:
            return total, block
        return (total - size(vrank) + (block if folded else 0),
                sum(group(vrank, k) for k in range(lp)) + (total if folded else 0))
    if collective == "allgather":  # recursive_doubling
        if sits_out:
            return block, total
        return (sum(group(vrank, k) for k in range(lp)) + (total if folded else 0),
                total - size(vrank) + (block if folded else 0))
    if collective == "broadcast":  # scatter_allgather from src 0: relative rank = rank
        run = total if rank == 0 else block * min(rank & -rank, n - rank)
        return run - block + total - block, (run if rank else 0) + total - block
    if collective == "reduce":  # binomial to dst 0
        children = sum(1 for k in range(n.bit_length()) if rank % (1 << (k + 1)) == 0 and rank + (1 << k) < n)
        return total * (rank != 0), children * total
    if algorithm == "pairwise":
        return (total * (n - 1) // n,) * 2
    return (block * sum((i).bit_count() for i in range(n)),) * 2  # bruck


BYTE_CASES = [("allreduce", a) for a in ("ring", "recursive_doubling", "halving_doubling", "double_tree")] + [
    ("reduce_scatter", "recursive_halving"), ("allgather", "recursive_doubling"), ("reduce_scatter", "pat"),
    ("allgather", "pat"), ("broadcast", "scatter_allgather"), ("reduce", "binomial"),
    ("all_to_all", "pairwise"), ("all_to_all", "bruck")]


def byte_counts_every_algorithm(mesh: lab.Mesh, numel: int) -> list[str]:
    """One float32 call per algorithm; this rank's counters against ``byte_model``."""
    failures = []
    n = mesh.world_size
    for collective, algorithm in BYTE_CASES:
        mesh.reset_stats()
        x = torch.arange(float(numel))
        if collective == "allgather":
            lab.allgather(mesh, x[:numel // n], algorithm=algorithm)
        elif collective == "broadcast":
            lab.broadcast(mesh, x, src=0, algorithm=algorithm)
        elif collective == "reduce":
            lab.reduce(mesh, x, dst=0)
        else:
            getattr(lab, collective)(mesh, x, algorithm=algorithm)
        stats = mesh.stats()
        want = byte_model(collective, algorithm, mesh.rank, n, numel * 4)
        if (stats["bytes_sent"], stats["bytes_received"]) != want:
            failures.append(f"rank {mesh.rank} {collective} {algorithm}: sent/received "
                            f"{stats['bytes_sent']}/{stats['bytes_received']}, model {want[0]}/{want[1]}")
    mesh.reset_stats()
    lab.barrier(mesh)
    rounds = (n - 1).bit_length()
    stats = mesh.stats()
    if (stats["bytes_sent"], stats["messages_sent"], stats["messages_received"]) != (0, rounds, rounds):
        failures.append(f"rank {mesh.rank} barrier: {stats}, model {rounds} empty messages each way")
    return failures


def byte_counts(mesh: lab.Mesh, numel: int) -> dict[str, dict[str, int]]:
    """Payload byte counters of one allreduce per algorithm, float32[numel]."""
    counts_by_algorithm = {}
    for algorithm in ["ring", "tree", "naive"]:
        mesh.reset_stats()
        lab.allreduce(mesh, torch.ones(numel), algorithm=algorithm)
        counts_by_algorithm[algorithm] = mesh.stats()
    return counts_by_algorithm


# -- the pools -----------------------------------------------------------------------------------

# (transport, N, shm eager threshold): the default threshold (4,048 bytes), and a tiny forced one
# (16: one or two float64 elements travel eager, three do not) so every count crosses it. The shm
# pools come first: SHM_POOLS is a prefix of POOLS, so a test parametrized over SHM_POOLS alone
# shares the same pools (same params, same indices) instead of starting its own.
#
# shm runs every world size 1-8; queue and tcp split them between them, each with one rank, a power
# of two and non-powers of two whose recursive-doubling fold has one extra rank and more (queue:
# 1, 3, 4, 7; tcp: 1, 2, 5, 6, 8), so every world size runs on a second transport too. A transport
# only moves each message, and which messages an algorithm sends at a world size is the same on
# every transport (the shm pools check them all); tests/test_gloo.py runs queue and tcp at 1, 2, 3,
# 4 and 7 against gloo, and tests/test_groups.py sub-meshes of sizes 1-5 on tcp and 1-3 on queue.
SHM_POOLS = slow_from_five([*(("shm", n, None) for n in range(1, 9)), ("shm", 5, 16)], lambda p: p[1])
WIRE_WORLDS = {"queue": (1, 3, 4, 7), "tcp": (1, 2, 5, 6, 8)}
POOLS = [
    *SHM_POOLS,
    *slow_from_five([(t, n, None) for t, worlds in WIRE_WORLDS.items() for n in worlds], lambda p: p[1])]


def pool_id(p: tuple) -> str:
    return f"{p[0]}-N{p[1]}" + (f"-eager{p[2]}" if p[2] is not None else "")


@pytest.fixture(scope="module", params=POOLS, ids=pool_id)
def cluster(request):
    transport, world_size, eager_bytes = request.param
    options = {} if eager_bytes is None else {"eager_bytes": eager_bytes}
    with pool(world_size, transport, segment_bytes=256, slots=2, env={"LAB_SEGMENT_BYTES": "256"},
              **options) as c:
        yield c


def full_matrix(cluster: lab.Cluster) -> bool:
    """The dtype x op matrix on shm; the wire set on queue and tcp (see the module's docstring)."""
    return cluster.transport == "shm"


def test_allreduce_every_dtype_op_algorithm_count(cluster):
    assert_no_failures(cluster.run(check_allreduce, full_matrix(cluster)))


def test_broadcast_every_root_dtype_count(cluster):
    assert_no_failures(cluster.run(check_broadcast, full_matrix(cluster)))


def test_allgather_every_dtype_count_shape(cluster):
    assert_no_failures(cluster.run(check_allgather, full_matrix(cluster)))


def test_reduce_scatter_every_dtype_op_count_shape(cluster):
    assert_no_failures(cluster.run(check_reduce_scatter, full_matrix(cluster)))


def test_reduce_every_root_dtype_op_count_leaves_others_untouched(cluster):
    assert_no_failures(cluster.run(check_reduce, full_matrix(cluster)))


def test_all_to_all_every_algorithm_dtype_count_shape(cluster):
    assert_no_failures(cluster.run(check_all_to_all, full_matrix(cluster)))


@pytest.mark.parametrize("cluster", SHM_POOLS, indirect=True, ids=pool_id)
def test_every_collective_across_the_eager_threshold(cluster):
    """On the shm pools: the threshold is shm's (queue and tcp have none; the sizes around it are
    ordinary message sizes there, which the matrix above covers)."""
    assert_no_failures(cluster.run(check_eager_boundary))


def test_barrier_waits_for_the_last_rank(cluster):
    assert_no_failures(cluster.run(check_barrier))


def test_lesson_wrappers_async_and_bad_arguments_of_the_new_collectives(cluster):
    assert_no_failures(cluster.run(check_lesson_and_arguments))


def test_byte_counters_of_every_algorithm_match_their_docstrings(cluster):
    """840 elements: every block split (N, p, halves) divides it, so each formula is exact."""
    assert_no_failures(cluster.run(byte_counts_every_algorithm, 840))


@pytest.mark.parametrize("n", range(1, 34))
def test_double_trees_are_spanning_trees_of_depth_log_n_with_leaves_swapped(n):
    """Each tree: one root, parent and child links agree, every rank reaches the root within
    ⌈log2 N⌉ hops. With N even every rank is a leaf in exactly one of the two."""
    for which in range(2):
        links = {r: double_trees(n, r)[which] for r in range(n)}
        assert [r for r in range(n)
                if links[r][0] < 0] == [0 if which == 0 else (n - 1 if n % 2 == 0 else 1 % n)]
        for r, (parent, children) in links.items():
            assert len(children) <= 2 and all(links[c][0] == r for c in children)
            assert parent < 0 or r in links[parent][1]
            hops = 0
            while links[r][0] >= 0:
                r, hops = links[r][0], hops + 1
            assert hops <= (n - 1).bit_length()
    if n % 2 == 0:
        assert all(sum(not tree[1] for tree in double_trees(n, r)) == 1 for r in range(n))


def test_numpy_noncontiguous_and_scalar_inputs(cluster):
    assert_no_failures(cluster.run(check_other_inputs))


def test_byte_counters_match_the_cost_model(cluster):
    """Ring: exactly 2T(N-1)/N each way on every rank; tree and naive: as their docstrings say."""
    n = cluster.world_size
    numel = 60 * n  # N divides the element count
    total = numel * 4
    per_rank = cluster.run(byte_counts, numel)
    for rank, by_algorithm in enumerate(per_rank):
        ring = by_algorithm["ring"]
        assert ring["bytes_sent"] == ring["bytes_received"] == 2 * total * (n - 1) // n
        assert ring["messages_sent"] == ring["messages_received"] == 2 * (n - 1)
        children = sum(1 for k in range(n.bit_length())
                       if not rank & ((1 << k) - 1) and rank + (1 << k) < n and not rank & (1 << k))
        tree_messages = children + (rank != 0)
        tree = by_algorithm["tree"]
        assert tree["bytes_sent"] == tree["bytes_received"] == tree_messages * total
        naive = by_algorithm["naive"]
        assert naive["bytes_sent"] == naive["bytes_received"] == (n - 1 if rank == 0 else 1) * total * (n > 1)
