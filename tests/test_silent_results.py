"""Regression tests for the round-2 defects that returned wrong numbers without an error (issue 17).

1. an input read before the asynchronous collectives ahead of it finished;
2. two live sub-meshes with one context id;
3. recursive doubling's min/max (and any NaN) leaving ranks with different bits;
4. float16/bfloat16 ``avg`` overflowing although the average is representable;
13. ``split(color=2**63)``: an ``OverflowError`` that did not name ``color``.

Every rank checks its own output; inputs are ``index * stride + rank``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from helpers import matrix_dtypes, pool, slow_from_five

import lab
from lab.collectives.choice import ALGORITHMS

STRIDE = 3


@pytest.fixture(scope="module", params=["shm", "queue", "tcp"])
def cluster(request):
    with pool(3, request.param) as c:
        yield c


@pytest.fixture(scope="module")
def eight():
    """8 ranks over shm: world sizes 1-8 are its sub-meshes (no new processes per size)."""
    with pool(8, "shm") as c:
        yield c


def pattern(count: int, rank: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) * STRIDE + rank


def reduced(count: int, n: int) -> torch.Tensor:
    """The sum over ranks of ``pattern(count, rank)``."""
    return torch.arange(count, dtype=torch.float32) * STRIDE * n + sum(range(n))


# -- 1. a later call reads its input after the async work ahead of it -----------------------------


def later_calls_read_after_async(mesh: lab.Mesh, count: int) -> list[str]:
    n, rank, wrong = mesh.world_size, mesh.rank, []
    total = reduced(count, n)

    def expect(what: str, got, want) -> None:
        if not torch.equal(torch.as_tensor(got), torch.as_tensor(want)):
            wrong.append(f"rank {rank} {what}: got {torch.as_tensor(got)[:4].tolist()}... "
                         f"want {torch.as_tensor(want)[:4].tolist()}...")

    x = pattern(count, rank)
    lab.allreduce(mesh, x, async_op=True)
    expect("allgather after async allreduce", lab.allgather(mesh, x), total.repeat(n))

    x = pattern(count, rank)
    lab.allreduce(mesh, x, async_op=True)
    got = lab.reduce_scatter(mesh, x)
    expect("reduce_scatter after async allreduce", got, torch.tensor_split(total * n, n)[rank])

    x = pattern(count, rank)
    lab.allreduce(mesh, x, async_op=True)
    got = lab.all_to_all(mesh, x)
    expect("all_to_all after async allreduce", got, torch.tensor_split(total, n)[rank].repeat(n))

    x = pattern(count, rank)
    lab.allreduce(mesh, x, async_op=True)
    work = lab.allgather(mesh, x, async_op=True)  # async after async: issue order too
    expect("async allgather after async allreduce", work.result(), total.repeat(n))

    def send_after_async(what: str, tensor) -> None:
        """mesh.send of a tensor with an async allreduce on it in flight: rank 1 gets the sum."""
        lab.allreduce(mesh, tensor, async_op=True)
        if rank == 0:
            mesh.send(1, tensor)
        elif rank == 1:
            expect(what, mesh.recv(0), total)
        mesh.wait_all()

    send_after_async("send after async allreduce", pattern(count, rank))

    # non-contiguous inputs: the copy is taken when the collective runs, not when it is called
    base = pattern(2 * count, rank).reshape(count, 2)
    column = base[:, 0]  # non-contiguous
    lab.allreduce(mesh, column, async_op=True)
    lab.allreduce(mesh, column)
    want = (torch.arange(count, dtype=torch.float32) * 2 * STRIDE * n + sum(range(n))) * n
    expect("non-contiguous allreduce after async allreduce", column, want)
    expect("the other column untouched", base[:, 1], pattern(2 * count, rank).reshape(count, 2)[:, 1])

    fortran = np.asfortranarray(pattern(2 * count, rank).numpy().reshape(2, count))
    lab.allreduce(mesh, fortran, async_op=True)
    gathered = lab.allgather(mesh, fortran)
    want = np.concatenate([np.stack([r.numpy() for r in reduced(2 * count, n).reshape(2, count)])] * n)
    expect("F-order numpy allgather after async allreduce", torch.from_numpy(gathered),
           torch.from_numpy(want))

    x = pattern(count, rank)
    send_after_async("non-contiguous send after async allreduce", torch.stack([x, x], dim=1)[:, 1])

    grads = [pattern(count, rank), pattern(count, rank)[::2]]
    lab.allreduce(mesh, grads[0], async_op=True)
    lab.bucketing.allreduce_coalesced(mesh, grads)
    expect("allreduce_coalesced after async allreduce (its tensor)", grads[0], total * n)
    expect("allreduce_coalesced after async allreduce (the other)", grads[1], total[::2])
    return wrong


@pytest.mark.parametrize("count", [1, 2, 7, 5000])
def test_a_later_call_reads_its_input_after_the_async_work_before_it(cluster, count):
    assert cluster.run(later_calls_read_after_async, count) == [[]] * 3


# -- 2. sub-mesh contexts are unique by construction ---------------------------------------------


def two_splits_used_in_different_orders(mesh: lab.Mesh, first: int, second: int) -> tuple:
    """A valid program: rank 0 broadcasts on sub-mesh A, then on B, and sends to rank 1 on A, then
    on B (small messages: the sends complete without the receiver); the other ranks take them in
    different orders. Their messages wait aside only if A and B have different contexts."""
    a = mesh.split(color=first)  # both colours hashed to one context id before the fix
    b = mesh.split(color=second)
    x, y = torch.tensor([float(mesh.rank + 1)]), torch.tensor([100.0 * (mesh.rank + 1)])
    steps = [
        lambda: lab.broadcast(a, x, src=0, algorithm="binomial"),
        lambda: lab.broadcast(b, y, src=0, algorithm="binomial")]
    got = []
    if mesh.rank == 0:
        steps[0](), steps[1](), a.send(1, torch.tensor([3.0])), b.send(1, torch.tensor([300.0]))
    elif mesh.rank == 1:
        steps[1](), steps[0](), got.append(b.recv(0).item()), got.append(a.recv(0).item())
    else:
        steps[0](), steps[1]()
    return x.item(), y.item(), got, a.name != b.name


def test_two_live_sub_meshes_never_share_a_context(cluster):
    for first, second in [(45342, 6437), (0, 0), (7, 7)]:
        results = cluster.run(two_splits_used_in_different_orders, first, second)
        assert results == [(1.0, 100.0, [], True), (1.0, 100.0, [300.0, 3.0], True), (1.0, 100.0, [], True)]


def nested_and_sibling_contexts(mesh: lab.Mesh) -> list[str]:
    """Every sub-mesh this rank is in (nested splits, siblings, repeated colours) has its own name,
    and broadcasts from each one's rank 0, received in a rank-dependent order, are exact."""
    halves = mesh.split(color=mesh.rank % 2)
    everyone = mesh.split(color=0)
    inner = everyone.split(color=0)
    again = halves.split(color=5)
    meshes = [mesh, halves, everyone, inner, again]
    names = [m.name for m in meshes]
    wrong = []
    order = meshes[::-1] if mesh.rank == 2 else meshes  # rank 2 receives in the reverse order
    results = {}
    for m in order:
        x = torch.tensor([float(mesh.rank + 10 * meshes.index(m))])
        lab.broadcast(m, x, src=0, algorithm="binomial")
        results[m.name] = x.item()
    for m in meshes:
        root = lab.allgather(m, torch.tensor([mesh.rank])).tolist()[0]
        if results[m.name] != root + 10 * meshes.index(m):
            wrong.append(f"rank {mesh.rank} on {m.name or 'the root'}: {results[m.name]}")
    if len(set(names)) != len(names):
        wrong.append(f"rank {mesh.rank}: repeated names {names}")
    return wrong


def test_nested_and_sibling_sub_meshes_have_distinct_contexts(cluster):
    assert cluster.run(nested_and_sibling_contexts) == [[]] * 3


# -- 3. every algorithm gives every rank the same bits ------------------------------------------


def awkward_values(count: int, rank: int, dtype: str, seed: int) -> torch.Tensor:
    """Signed zeros, NaNs of both signs and several payloads, infinities, subnormals and ordinary
    values, mixed differently on every rank (float dtypes; integers get extremes and signs)."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype in ("int32", "int64"):
        info = np.iinfo(dtype)
        choices = np.array([0, -1, 1, info.min, info.max, 7, -7], dtype)
        return torch.from_numpy(rng.choice(choices, count) + (np.arange(count) * STRIDE + rank).astype(dtype))
    if dtype in ("float32", "float64"):
        bits, width = (np.uint32, 32) if dtype == "float32" else (np.uint64, 64)
        nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFF00001 & 0xFFFFFFFF, 0x7F800123], bits) \
            if width == 32 else np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000123,
                                          0xFFF0000000000001], bits)
        special = np.concatenate([
            np.array([
                0.0, -0.0, np.inf, -np.inf, 1e-40 if width == 32 else 5e-324,
                -1e-45 if width == 32 else -5e-324], dtype),
            nans.view(dtype)])
    else:
        nans = np.array(
            [0x7E00, 0xFE00, 0x7E01, 0xFC01] if dtype == "float16" else [0x7FC0, 0xFFC0, 0x7FC1, 0xFF81],
            np.uint16)
        subnormal = [0x0001, 0x8003]  # the same bits are subnormal in float16 and bfloat16
        special_bits = np.concatenate([
            np.array([0x0000, 0x8000], np.uint16), nans,
            np.array(subnormal, np.uint16),
            np.array([0x7C00, 0xFC00] if dtype == "float16" else [0x7F80, 0xFF80], np.uint16)])
        torch_dtype = getattr(torch, dtype)
        ordinary = torch.from_numpy(rng.normal(size=count).astype(np.float32)).to(torch_dtype).view(
            torch.int16).numpy()
        mixed = np.where(rng.random(count) < 0.6, rng.choice(special_bits, count).view(np.int16), ordinary)
        return torch.from_numpy(mixed.astype(np.int16)).view(torch_dtype)
    ordinary = rng.normal(size=count).astype(dtype)
    return torch.from_numpy(np.where(rng.random(count) < 0.6, rng.choice(special, count), ordinary))


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def bits_agree(mesh: lab.Mesh, world: int, seed: int) -> list[tuple]:
    """Allreduce awkward values on a sub-mesh of ``world`` ranks with every algorithm, op and
    dtype (from N = 5 float32, int64 and bfloat16: helpers.matrix_dtypes); return (case, digest)
    pairs for the driver to compare across ranks."""
    sub = mesh.split(color=0 if mesh.rank < world else None)
    if sub is None:
        return []
    out = []
    for dtype in matrix_dtypes(world, ["float32", "float64", "float16", "bfloat16", "int32", "int64"]):
        ops = ["sum", "prod", "min", "max"] + (["avg"] if dtype not in ("int32", "int64") else [])
        for count in (1, world + 1, 67):
            for op in ops:
                mine = awkward_values(count, sub.rank, dtype, seed)
                for algorithm in ALGORITHMS["allreduce"]:
                    got = lab.allreduce(sub, mine.clone(), op=op, algorithm=algorithm)
                    out.append(((dtype, count, op, algorithm), digest(got)))
                # the reference, from every rank's input, on this rank: min/max are exact
                if op in ("min", "max"):
                    reference = reference_digest(lab.allgather(sub, mine.reshape(1, -1)), op)
                    out.append(((dtype, count, op, "reference"), reference))
                    out.append(((dtype, count, op, "recursive_doubling vs reference"),
                                digest(lab.allreduce(sub, mine.clone(), op=op,
                                                     algorithm="recursive_doubling")) == reference))
    return out


def reference_digest(stack: torch.Tensor, op: str) -> str:
    """min/max over ranks with the documented rules: NaN wins and is canonical; -0.0 < +0.0.
    One rank combines nothing: its input comes back as it was."""
    if len(stack) == 1:
        return digest(stack[0])
    if stack.dtype in (torch.int32, torch.int64):
        return digest(stack.amin(0) if op == "min" else stack.amax(0))
    wide = stack.double()
    # -0.0 below +0.0: order by (value, sign) with the sign bit breaking ties (as Python floats,
    # read once: the same keys as each element's .item(), without a tensor per element)
    keys = torch.stack([wide, -torch.signbit(wide).double()], -1).tolist()
    has_nan = stack.isnan().any(0).tolist()
    result = []
    for column in range(stack.shape[1]):
        if has_nan[column]:
            result.append(torch.tensor(float("nan"), dtype=stack.dtype))
            continue
        order = sorted(range(len(stack)), key=lambda r: (keys[r][column][0], keys[r][column][1]))
        result.append(stack[order[0] if op == "min" else order[-1], column])
    return digest(torch.stack(result) if result else stack[0])


@pytest.mark.parametrize("world", slow_from_five(range(1, 9)))
def test_every_algorithm_gives_every_rank_the_same_bits(eight, world):
    per_rank = [dict(r) for r in eight.run(bits_agree, world, 17) if r]
    assert len(per_rank) == world
    for case, value in per_rank[0].items():
        if case[3] == "recursive_doubling vs reference":
            assert all(r[case] is True for r in per_rank), f"{case} differs from the reference"
            continue
        differing = [rank for rank, r in enumerate(per_rank) if r[case] != value]
        assert not differing, f"N={world} {case}: ranks {differing} hold other bits than rank 0"


def test_the_kernels_are_commutative_in_bits():
    """The reason it holds: a ⊕ b and b ⊕ a are the same bits for every input (the kernels, alone)."""
    from lab.ops import DTYPES, ReduceOp, reduction

    for name in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
            dtype = DTYPES[name]
            a = awkward_values(4096, 0, name, 3).view(getattr(torch, name))
            b = awkward_values(4096, 1, name, 3).view(getattr(torch, name))
            flat_a = a.view(torch.int16).numpy().view(np.uint16) if dtype.storage == np.uint16 else a.numpy()
            flat_b = b.view(torch.int16).numpy().view(np.uint16) if dtype.storage == np.uint16 else b.numpy()
            ab, ba = flat_a.copy(), flat_b.copy()
            combine = reduction(op, dtype).combine
            combine(ab, flat_b)
            combine(ba, flat_a)
            assert ab.tobytes() == ba.tobytes(), f"{op.value} {name}: a ⊕ b != b ⊕ a in bits"


# -- 4. avg of half types: a representable average comes out finite ------------------------------

HALF_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
HALF_SUBNORMAL_HALF_STEP = {"float16": 2.0**-25, "bfloat16": 2.0**-134}


def half_average(mesh: lab.Mesh, world: int, seed: int) -> list[str]:
    sub = mesh.split(color=0 if mesh.rank < world else None)
    if sub is None:
        return []
    n, wrong = sub.world_size, []
    for dtype, big in (("float16", 30_000.0), ("bfloat16", 3e38)):
        torch_dtype = getattr(torch, dtype)
        near_max = torch.full((5,), big, dtype=torch_dtype)
        for algorithm in ALGORITHMS["allreduce"]:
            got = lab.allreduce(sub, near_max.clone(), op="avg", algorithm=algorithm)
            error = (got.double() - big).abs()
            if not torch.isfinite(got).all() or bool((error > n * HALF_UNIT_ROUNDOFF[dtype] * big).any()):
                wrong.append(f"rank {sub.rank} N={n} {dtype} avg {algorithm} of {big:g}: {got.tolist()}")
        rng = np.random.default_rng([seed, sub.rank])
        # values across the whole range, near the largest finite too
        scale = 60_000.0 if dtype == "float16" else 3e38
        mine = torch.from_numpy(rng.uniform(-1, 1, 999) * scale).to(torch_dtype)
        everyone = lab.allgather(sub, mine.reshape(1, -1)).double()
        mean = everyone.mean(0)
        bound = n * HALF_UNIT_ROUNDOFF[dtype] * everyone.abs().mean(0) + n * HALF_SUBNORMAL_HALF_STEP[dtype]
        results = {
            a: lab.allreduce(sub, mine.clone(), op="avg", algorithm=a)
            for a in ALGORITHMS["allreduce"]}
        results["reduce_scatter"] = lab.reduce_scatter(sub, mine.clone(), op="avg")
        reduced_here = lab.reduce(sub, mine.clone(), dst=0, op="avg")
        if sub.rank == 0:
            results["reduce"] = reduced_here
        elif not torch.equal(reduced_here.view(torch.int16), mine.view(torch.int16)):
            wrong.append(f"rank {sub.rank} {dtype}: reduce(avg) changed a non-root rank's tensor")
        for what, got in results.items():
            want, limit = mean, bound
            if what == "reduce_scatter":
                want, limit = torch.tensor_split(mean, n)[sub.rank], torch.tensor_split(bound, n)[sub.rank]
            error = (got.double() - want).abs()
            if not torch.isfinite(got).all() or bool((error > limit).any()):
                worst = int((error - limit).argmax())
                wrong.append(f"rank {sub.rank} N={n} {dtype} avg {what}: |error| {float(error[worst]):.3g} "
                             f"> bound {float(limit[worst]):.3g}")
    return wrong


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_half_precision_avg_is_finite_and_within_the_documented_bound(eight, world):
    assert eight.run(half_average, world, 5) == [[]] * 8


# -- 13. split(color=2**63) names color ----------------------------------------------------------


def split_with(mesh: lab.Mesh, color) -> str:
    try:
        mesh.split(color=color)
    except ValueError as error:
        # the mesh is still usable: nothing was sent
        x = torch.ones(2)
        lab.allreduce(mesh, x)
        return f"{error} | {x.tolist()}"
    return "no error"


@pytest.mark.parametrize("color", [2**63, 2**64, -1, 1.5, True])
def test_a_color_out_of_range_is_a_value_error_naming_color(cluster, color):
    for said in cluster.run(split_with, color):
        assert said.startswith("color") and said.endswith("| [3.0, 3.0]"), said
