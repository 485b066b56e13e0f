"""The compiled data plane (lab.compiled.plane): a small collective in one Numba call over the shm mailboxes.

The compiled run of each algorithm must give the bits its Python run gives (the same source, two
runs): the root mesh of an shm pool takes the compiled path, a sub-mesh of all its ranks the
Python path, on the same ranks. Every rank checks its own output; inputs are
``index * stride + rank``; world sizes 1-8 are pools of their own (a sub-mesh never runs compiled),
every reducing dtype at N = 1-4 and float32, int64 and bfloat16 from 5 (helpers.matrix_dtypes).
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time

import pytest
import torch
from helpers import enter_together, matrix_dtypes, pool, slow_from_five

import lab
from lab.algorithms import registry
from lab.collectives.prepared import find_lane
from lab.compiled.plane import (
    DEFAULT_SPIN_LIMIT,
    DEFAULT_YIELD_LIMIT,
    OVERSUBSCRIBED_SPIN_LIMIT,
    waiting_policy_from_env,
)
from lab.launch import pool as pool_module
from lab.ops import DTYPES, REDUCE_DTYPES

STRIDE = 3
MAX_BYTES = 4096  # the compiled path's threshold in these pools (LAB_COMPILED_MAX_BYTES): sizes around it stay small
OPS = ("sum", "prod", "min", "max", "avg")


@pytest.fixture(scope="module", params=slow_from_five(range(1, 9)), ids=lambda n: f"N{n}")
def cluster(request):
    with pool(request.param, "shm", env={"LAB_COMPILED_MAX_BYTES": str(MAX_BYTES)}) as running:
        yield running


def pattern(count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * STRIDE + rank).to(dtype)


def counts_around(itemsize: int, world_size: int) -> list[int]:
    """0, 1, fewer than ranks, not divisible by them, and one element either side of the threshold."""
    at = MAX_BYTES // itemsize
    return sorted({0, 1, max(world_size - 1, 1), 2 * world_size + 1, at - 1, at, at + 1})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(-1).view(torch.uint8) if a.numel() else a,
        b.view(-1).view(torch.uint8) if b.numel() else b)


def compiled_equals_python(mesh: lab.Mesh) -> list[str]:
    """Every compilable algorithm, dtype, op and count around the threshold: root mesh (compiled at
    or under the threshold) against a sub-mesh of the same ranks (Python)."""
    everyone = mesh.split(color=0)
    n, rank, wrong = mesh.world_size, mesh.rank, []
    compiled_before = mesh.stats()["collectives_compiled"]
    expected_compiled = 0

    def check(what: str, fast, slow) -> None:
        if not same_bits(torch.as_tensor(fast), torch.as_tensor(slow)):
            wrong.append(f"rank {rank} {what}: compiled {torch.as_tensor(fast).view(-1)[:4].tolist()} "
                         f"python {torch.as_tensor(slow).view(-1)[:4].tolist()}")

    # (the dtypes only moved: tests/test_more_collectives.py)
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in counts_around(dtype.storage.itemsize, n):
            small = count * dtype.storage.itemsize <= MAX_BYTES
            x = pattern(count, rank, dtype.torch_dtype)
            rows = pattern(count, rank, dtype.torch_dtype)
            for op in OPS:
                if op == "avg" and not dtype.is_floating:
                    continue
                for algorithm in registry.compiled("allreduce"):
                    check(f"allreduce {algorithm} {name}[{count}] {op}",
                          lab.allreduce(mesh, x.clone(), op=op, algorithm=algorithm),
                          lab.allreduce(everyone, x.clone(), op=op, algorithm=algorithm))
                check(f"reduce_scatter {name}[{count}] {op}",
                      lab.reduce_scatter(mesh, rows, op=op, algorithm="recursive_halving"),
                      lab.reduce_scatter(everyone, rows, op=op, algorithm="recursive_halving"))
                for root in {0, n - 1}:
                    check(f"reduce {name}[{count}] {op} to {root}",
                          lab.reduce(mesh, x.clone(), dst=root, op=op),
                          lab.reduce(everyone, x.clone(), dst=root, op=op))
                expected_compiled += (len(registry.compiled("allreduce")) + 1 + len({0, n - 1})) * small
            for root in {0, n - 1}:
                check(f"broadcast {name}[{count}] from {root}",
                      lab.broadcast(mesh, x.clone(), src=root, algorithm="binomial"),
                      lab.broadcast(everyone, x.clone(), src=root, algorithm="binomial"))
            check(f"allgather {name}[{count}]", lab.allgather(mesh, x, algorithm="recursive_doubling"),
                  lab.allgather(everyone, x, algorithm="recursive_doubling"))
            check(f"all_to_all {name}[{count}]", lab.all_to_all(mesh, rows, algorithm="pairwise"),
                  lab.all_to_all(everyone, rows, algorithm="pairwise"))
            expected_compiled += (len({0, n - 1}) + 2) * small  # broadcasts, allgather, all_to_all
    lab.barrier(mesh)
    expected_compiled += 1
    ran = mesh.stats()["collectives_compiled"] - compiled_before
    if n == 1:  # one rank has no mailboxes (nothing to exchange): every call is the Python path's no-op
        expected_compiled = 0
    if ran != expected_compiled:
        wrong.append(f"rank {rank}: {ran} collectives ran compiled, expected {expected_compiled}")
    return wrong


def test_compiled_and_python_runs_give_the_same_bits(cluster):
    assert not [w for per_rank in cluster.run(compiled_equals_python) for w in per_rank]


def exact_sums(mesh: lab.Mesh) -> list[str]:
    """The compiled results themselves, against the arithmetic (sum, max of index*stride + rank)."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    for count in (1, 5, 100):
        x = pattern(count, rank, torch.float32)
        total = torch.arange(count, dtype=torch.float32) * STRIDE * n + sum(range(n))
        if not torch.equal(lab.allreduce(mesh, x.clone()), total):
            wrong.append(f"rank {rank} allreduce[{count}]")
        if not torch.equal(lab.allreduce(mesh, x.clone(), op="max"), pattern(count, n - 1, torch.float32)):
            wrong.append(f"rank {rank} allreduce max[{count}]")
        gathered = lab.allgather(mesh, x)
        if not torch.equal(gathered, torch.cat([pattern(count, r, torch.float32) for r in range(n)])):
            wrong.append(f"rank {rank} allgather[{count}]")
        if not torch.equal(lab.broadcast(mesh, x.clone(), src=n - 1), pattern(count, n - 1, torch.float32)):
            wrong.append(f"rank {rank} broadcast[{count}]")
    if n > 1 and mesh.stats()["collectives_compiled"] < 12:  # one rank has no mailboxes
        wrong.append(f"rank {rank}: auto did not take the compiled path ({mesh.stats()})")
    return wrong


def test_auto_takes_the_compiled_path_and_the_results_are_exact(cluster):
    assert not [w for per_rank in cluster.run(exact_sums) for w in per_rank]


def lanes(mesh: lab.Mesh) -> list[str]:
    """A plain allreduce or broadcast like one before, on an exact contiguous CPU torch tensor,
    takes its lane (the tensor by its address): the Python path's bits for every compilable
    algorithm, dtype, op and root, the caller's tensor returned; the tensors a lane must leave to
    the full path get it."""
    everyone = mesh.split(color=0)
    n, rank, wrong = mesh.world_size, mesh.rank, []
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in (0, 1, 2 * n + 1):
            for op in OPS:
                if op == "avg" and not dtype.is_floating:
                    continue
                for algorithm in registry.compiled("allreduce"):
                    expected = lab.allreduce(everyone, pattern(count, rank, dtype.torch_dtype), op=op,
                                             algorithm=algorithm)
                    before = mesh.stats()["collectives_compiled"]
                    for call in range(3):  # the first makes the lane, where it runs compiled
                        x = pattern(count, rank, dtype.torch_dtype)
                        if lab.allreduce(mesh, x, op=op,
                                         algorithm=algorithm) is not x or not same_bits(x, expected):
                            wrong.append(f"rank {rank} call {call} {algorithm} {name}[{count}] {op}: "
                                         f"{x[:4].tolist()} != {expected[:4].tolist()}")
                    compiled = mesh.stats()["collectives_compiled"] - before  # 0 on one rank (no mailboxes)
                    lane = find_lane(mesh, "allreduce", x, op, algorithm)
                    # (no lane for a half type's avg: it divides before the exchange, outside the compiled call)
                    no_lane = n == 1 or (op == "avg" and dtype.family in ("float16", "bfloat16"))
                    if compiled != 3 * (n > 1) or (lane is None) != no_lane:
                        wrong.append(
                            f"rank {rank} {algorithm} {name}[{count}] {op}: lane {lane}, {compiled} compiled")
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for count in (0, 1, 2 * n + 1):
            for root in {0, n - 1}:
                expected = lab.broadcast(everyone, pattern(count, rank, dtype.torch_dtype), src=root)
                before = mesh.stats()["collectives_compiled"]
                for call in range(3):
                    x = pattern(count, rank, dtype.torch_dtype)
                    if lab.broadcast(mesh, x, src=root,
                                     algorithm="binomial") is not x or not same_bits(x, expected):
                        wrong.append(f"rank {rank} call {call} broadcast {name}[{count}] from {root}: "
                                     f"{x[:4].tolist()} != {expected[:4].tolist()}")
                compiled = mesh.stats()["collectives_compiled"] - before
                lane = find_lane(mesh, "broadcast", x, root, "binomial")
                if compiled != 3 * (n > 1) or (lane is None) != (n == 1):
                    wrong.append(
                        f"rank {rank} broadcast {name}[{count}] from {root}: lane {lane}, {compiled} compiled"
                    )
    count = 5
    total = torch.arange(count, dtype=torch.float32) * STRIDE * n + sum(range(n))
    lab.allreduce(mesh, pattern(count, rank, torch.float32))  # (the lane for the tensors below)
    viewed = pattern(count, rank, torch.float32)
    viewed.numpy()  # (numpy viewed it, as the full path does: its storage no longer resizes)
    again = {
        "a tensor numpy viewed": (viewed, total),
        "a tensor of a size not seen before": (pattern(count + 1, rank, torch.float32), None)}
    for what, (x, want) in again.items():
        want = want if want is not None else sum(pattern(count + 1, r, torch.float32) for r in range(n))
        for call in range(3):  # the full path, which finds its memory writable; then its lane
            lane = find_lane(mesh, "allreduce", x, "sum", "auto")
            lab.allreduce(mesh, x)
            if (lane is None) != (call == 0 or n == 1) or not torch.equal(x, want * n**call):
                wrong.append(f"rank {rank} call {call} of {what}: lane {lane}, {x.tolist()}")
    whole = torch.cat([pattern(count, rank, torch.float32), pattern(count, rank, torch.float32)])
    strided = pattern(2 * count, rank, torch.float32)
    shapes = {
        "a view at an offset": (whole[count:],
                                lambda: torch.equal(whole[:count], pattern(count, rank, torch.float32))),
        "a strided view": (strided[::2], lambda: torch.equal(strided[1::2],
                                                             pattern(2 * count, rank, torch.float32)[1::2])),
        "a numpy array": (pattern(count, rank, torch.float32).numpy(), lambda: True),
        "a Parameter": (torch.nn.Parameter(pattern(count, rank, torch.float32),
                                           requires_grad=False), lambda: True),
        "a tensor that requires grad": (pattern(count, rank, torch.float32).requires_grad_(), lambda: True),
        "a 2-d tensor": (pattern(count, rank, torch.float32).reshape(1, count), lambda: True)}
    for what, (x, rest_untouched) in shapes.items():
        got = lab.allreduce(mesh, x)
        values = torch.as_tensor(got).detach().reshape(-1)
        want = torch.arange(count, dtype=torch.float32) * 2 * STRIDE * n + sum(
            range(n)) if "strided" in what else total
        if got is not x or not torch.equal(values, want) or not rest_untouched():
            wrong.append(f"rank {rank} {what}: {values.tolist()}")
    for what, x in {
            "a lazy negative view": torch._neg_view(pattern(count, rank, torch.float32)),
            "a tensor of another dtype": pattern(count, rank, torch.float64).to(torch.complex64)}.items():
        try:
            lab.allreduce(mesh, x)
            wrong.append(f"rank {rank} {what}: no error")
        except (TypeError, ValueError) as exc:
            if not str(exc).startswith("tensor "):
                wrong.append(f"rank {rank} {what}: {exc}")
    return wrong


def test_a_plain_call_like_one_before_takes_its_lane_with_the_python_paths_bits(cluster):
    assert not [w for per_rank in cluster.run(lanes) for w in per_rank]


def byte_pattern(shape: tuple[int, ...], rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``index * stride + rank`` in every byte (mod 251; a bool's 0 or 1): any dtype's bits."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = (torch.arange(math.prod(shape) * itemsize) * STRIDE + rank) % (2 if dtype is torch.bool else 251)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def allgather_lanes(mesh: lab.Mesh) -> list[str]:
    """A plain allgather like one before, of an exact contiguous CPU torch tensor, takes its lane:
    a new result tensor with the caller's block copied in, gathered by the compiled call at its
    address, with the sub-mesh's (Python path's) bits, for every dtype, 0-d to 2-d; a numpy input,
    and a call while an asynchronous one is in flight (the input is read in issue order), take the
    full path and are as right."""
    everyone = mesh.split(color=0)
    n, rank, wrong = mesh.world_size, mesh.rank, []
    for name, dtype in DTYPES.items():
        for shape in ((), (0,), (1,), (2 * n + 1,), (3, 2)):
            x = byte_pattern(shape, rank, dtype.torch_dtype)
            expected = lab.allgather(everyone, x)
            before = mesh.stats()["collectives_compiled"]
            results = [lab.allgather(mesh, x) for _ in range(3)]  # the first makes the lane
            compiled = mesh.stats()["collectives_compiled"] - before
            lane = find_lane(mesh, "allgather", x, "auto", writes=False)
            if any(got is x or not (same_bits(got, expected) if got.numel() else got.shape == expected.shape)
                   for got in results) \
                    or results[1] is results[2]:
                wrong.append(
                    f"rank {rank} allgather {name}{list(shape)}: {results[-1].reshape(-1)[:4].tolist()} "
                    f"!= {expected.reshape(-1)[:4].tolist()}")
            if compiled != 3 * (n > 1) or (lane is None) != (n == 1):  # (one rank: no mailboxes)
                wrong.append(f"rank {rank} allgather {name}{list(shape)}: lane {lane}, {compiled} compiled")
    x = pattern(5, rank, torch.float32)
    want = torch.cat([pattern(5, r, torch.float32) for r in range(n)])
    if not torch.equal(torch.as_tensor(lab.allgather(mesh, x.numpy())), want):
        wrong.append(f"rank {rank} allgather of a numpy array")
    work = lab.allreduce(mesh, x, async_op=True)  # (x becomes the sum: the allgather must see it)
    got = lab.allgather(mesh, x)
    work.wait()
    if not torch.equal(got, torch.cat([sum(pattern(5, r, torch.float32) for r in range(n))] * n)):
        wrong.append(f"rank {rank} allgather after an asynchronous allreduce of its input: {got.tolist()}")
    # Another thread's asynchronous allreduce of the input, still in flight (the other ranks join
    # it late): this thread's allgather, from its lane, reads the input at its turn, after the sum.
    y, works = pattern(5, rank, torch.float32), []
    if rank:
        time.sleep(0.05)
    thread = threading.Thread(target=lambda: works.append(lab.allreduce(mesh, y, async_op=True)))
    thread.start()
    thread.join()  # (issued: its Work returned)
    lane = find_lane(mesh, "allgather", y, "auto", writes=False)
    got = lab.allgather(mesh, y)
    works[0].wait()
    if (lane is None) != (n == 1) \
            or not torch.equal(got, torch.cat([sum(pattern(5, r, torch.float32) for r in range(n))] * n)):
        wrong.append(f"rank {rank} allgather (lane {lane}) after another thread's asynchronous allreduce of "
                     f"its input: {got.tolist()}")
    return wrong


def test_a_plain_allgather_like_one_before_takes_its_lane_with_the_python_paths_bits(cluster):
    assert not [w for per_rank in cluster.run(allgather_lanes) for w in per_rank]


def reduce_scatter_lanes(mesh: lab.Mesh) -> list[str]:
    """A plain reduce_scatter like one before, of an exact contiguous CPU torch tensor, takes its
    lane (a copy reduced at its address, this rank's rows returned) with the sub-mesh's bits, for
    every dtype and op the compiled plane reduces; tensors of one size and different rows each
    get their own blocks; the caller's tensor stays as it was."""
    everyone = mesh.split(color=0)
    n, rank, wrong = mesh.world_size, mesh.rank, []
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        for op in OPS:
            if op == "avg" and not dtype.is_floating:
                continue
            for shape in ((0,), (1,), (2 * n + 1,), (6,), (3, 2), (2, 3)):
                x = pattern(math.prod(shape), rank, dtype.torch_dtype).reshape(shape)
                kept = x.clone()
                expected = lab.reduce_scatter(everyone, x, op=op)
                results = [lab.reduce_scatter(mesh, x, op=op) for _ in range(3)]  # the first makes the lane
                lane = find_lane(mesh, "reduce_scatter", x, op, "auto", shape[0], writes=False)
                if any(not (same_bits(got, expected) if got.numel() else got.shape == expected.shape)
                       for got in results) or not same_bits(x, kept):
                    wrong.append(
                        f"rank {rank} reduce_scatter {name}{list(shape)} {op}: "
                        f"{results[-1].reshape(-1)[:4].tolist()} != {expected.reshape(-1)[:4].tolist()}")
                # (no lane on one rank, nor for a half type's avg: it divides before the exchange)
                no_lane = n == 1 or (op == "avg" and dtype.family in ("float16", "bfloat16"))
                if (lane is None) != no_lane:
                    wrong.append(f"rank {rank} reduce_scatter {name}{list(shape)} {op}: lane {lane}")
    x = pattern(2 * n, rank, torch.float32)
    work = lab.allreduce(mesh, x, async_op=True)  # (x becomes the sum: the reduce_scatter must see it)
    got = lab.reduce_scatter(mesh, x)
    work.wait()
    total = sum(pattern(2 * n, r, torch.float32) for r in range(n)) * n
    if not torch.equal(got, total[2 * rank:2 * rank + 2]):
        wrong.append(
            f"rank {rank} reduce_scatter after an asynchronous allreduce of its input: {got.tolist()}")
    # the same with the allreduce issued by another thread, still in flight (the others join it late)
    y, works = pattern(2 * n, rank, torch.float32), []
    if rank:
        time.sleep(0.05)
    thread = threading.Thread(target=lambda: works.append(lab.allreduce(mesh, y, async_op=True)))
    thread.start()
    thread.join()
    lane = find_lane(mesh, "reduce_scatter", y, "sum", "auto", 2 * n, writes=False)
    got = lab.reduce_scatter(mesh, y)
    works[0].wait()
    if (lane is None) != (n == 1) or not torch.equal(got, total[2 * rank:2 * rank + 2]):
        wrong.append(f"rank {rank} reduce_scatter (lane {lane}) after another thread's asynchronous "
                     f"allreduce of its input: {got.tolist()}")
    return wrong


def test_a_plain_reduce_scatter_like_one_before_takes_its_lane_with_the_python_paths_bits(cluster):
    assert not [w for per_rank in cluster.run(reduce_scatter_lanes) for w in per_rank]


def soak(mesh: lab.Mesh, calls: int, seed: int) -> list[str]:
    """Random collectives of random sizes across the threshold, random algorithms, random ops."""
    rng = random.Random(seed)  # the same sequence on every rank
    n, rank, wrong = mesh.world_size, mesh.rank, []
    for i in range(calls):
        count = rng.choice([0, 1, 7, MAX_BYTES // 4 - 1, MAX_BYTES // 4, MAX_BYTES // 4 + 1, 3000])
        which = rng.choice(["allreduce", "broadcast", "allgather", "barrier"])
        x = pattern(count, rank, torch.float32)
        if which == "allreduce":
            algorithm = rng.choice(registry.names("allreduce")[:6])  # not hierarchical (one host)
            got = lab.allreduce(mesh, x, algorithm=algorithm)
            want = torch.arange(count, dtype=torch.float32) * STRIDE * n + sum(range(n))
        elif which == "broadcast":
            root = rng.randrange(n)
            got, want = lab.broadcast(mesh, x, src=root), pattern(count, root, torch.float32)
        elif which == "allgather":
            got = lab.allgather(mesh, x, algorithm=rng.choice(["ring", "recursive_doubling"]))
            want = torch.cat([pattern(count, r, torch.float32) for r in range(n)])
        else:
            lab.barrier(mesh)
            continue
        if not torch.equal(got, want):
            wrong.append(f"rank {rank} call {i} {which}[{count}]")
    return wrong


@pytest.mark.parametrize("cluster", [3, 4], indirect=True, ids=["N3", "N4"])  # a power of two and not
def test_ten_thousand_random_calls_across_the_threshold(cluster):
    """10,000 calls in all: 5,000 on each pool, each pool with its own seeded sequence."""
    seed = 17 + cluster.world_size
    assert not [w for per_rank in cluster.run(soak, 5_000, seed) for w in per_rank]


# -- failures inside a compiled collective ---------------------------------------------------------


def mismatched(mesh: lab.Mesh, what: str) -> str:
    odd = mesh.rank == mesh.world_size - 1
    # Named, not auto: auto's pick depends on the machine's cores (tree where ranks outnumber them).
    algorithm = "recursive_doubling"
    try:
        if what == "size":
            lab.allreduce(mesh, torch.ones(11 if odd else 10), algorithm=algorithm)
        elif what == "op":
            lab.allreduce(mesh, torch.ones(10), op="max" if odd else "sum", algorithm=algorithm)
        elif what == "op, each from its lane":  # (both calls made in step twice first: #1-#4)
            for op in ("sum", "sum", "max", "max"):
                lab.allreduce(mesh, torch.ones(10), op=op, algorithm=algorithm)
            lab.allreduce(mesh, torch.ones(10), op="max" if odd else "sum", algorithm=algorithm)
        elif what == "collective":
            if odd:
                lab.allgather(mesh, torch.ones(10), algorithm=algorithm)
            else:
                lab.allreduce(mesh, torch.ones(10), algorithm=algorithm)
        elif what == "across the threshold":  # the odd rank's tensor is over it: the Python path
            lab.allreduce(mesh, torch.ones(MAX_BYTES if odd else 10), algorithm=algorithm)
    except lab.CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    except lab.LabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture
def compiled_env(monkeypatch):
    monkeypatch.setenv("LAB_COMPILED_MAX_BYTES", str(MAX_BYTES))  # ranks take the caller's environment


@pytest.mark.slow
@pytest.mark.parametrize("what",
                         ["size", "op", "op, each from its lane", "collective", "across the threshold"])
def test_a_rank_in_another_collective_is_a_mismatch_naming_it(compiled_env, what):
    outputs = lab.spawn(mismatched, 3, args=(what,), recv_timeout_ms=3000)
    assert "no error" not in outputs, outputs
    mismatches = [o for o in outputs if o.startswith("mismatch")]
    # rank 1 exchanges with rank 2 (the odd one out) in recursive doubling at N=3: both see it
    assert len(mismatches) >= 2, outputs
    for message in mismatches:
        number = 5 if "lane" in what else 1
        assert "rank 2" in message and " is in " in message and " sent " in message, message
        assert f"allreduce #{number} " in message, message


def stalled(mesh: lab.Mesh, how: str, out: str) -> str:
    enter_together(mesh, out)  # (a rank started late is not the one that stops)
    if mesh.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.5)  # silent past the others' deadline (1 s), then gone quietly
        return "slept"
    start = time.monotonic()
    try:
        lab.allreduce(mesh, torch.ones(10), algorithm="recursive_doubling")  # named: see mismatched
        message = "no error"
    except (lab.DeadlineError, lab.PeerLostError) as exc:
        message = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    with open(os.path.join(out, f"rank{mesh.rank}"), "w") as file:  # the pool may fail on rank 1's death
        file.write(message)
    return message


def each_compiled(mesh: lab.Mesh, collective: str, count: int) -> None:
    """``collective`` on ``count`` elements per rank through its first compiled algorithm (the
    barrier moves nothing); broadcast and scatter from rank 1, reduce and gather to rank 0 (so
    that some rank waits on rank 1's messages)."""
    x, rows = torch.ones(count), torch.ones(count * mesh.world_size)
    algorithm = {"algorithm": registry.compiled(collective)[0]} if registry.choosable(collective) else {}
    {
        "allreduce": lambda: lab.allreduce(mesh, x, **algorithm),
        "broadcast": lambda: lab.broadcast(mesh, x, src=1, **algorithm),
        "allgather": lambda: lab.allgather(mesh, x, **algorithm),
        "reduce_scatter": lambda: lab.reduce_scatter(mesh, rows, **algorithm),
        "reduce": lambda: lab.reduce(mesh, x), "all_to_all": lambda: lab.all_to_all(mesh, rows, **algorithm),
        "barrier": lambda: lab.barrier(mesh), "gather": lambda: lab.gather(mesh, x, **algorithm),
        "scatter": lambda: lab.scatter(mesh, rows, src=1, **algorithm)}[collective]()


def failing_in_each(mesh: lab.Mesh, collective: str, how: str, out: str) -> str:
    """Rank 1 of 3 stops (sleeps past the deadline), dies, or (``"mismatched"``) calls the
    collective on another size (the barrier: an allreduce instead): what each rank sees."""
    enter_together(mesh, out)  # (a rank started late is not the one that stops)
    if mesh.rank == 1 and how in ("stopped", "killed"):
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2.0)
        return "slept"
    start = time.monotonic()
    try:
        if how == "mismatched" and mesh.rank == 1 and collective == "barrier":
            lab.allreduce(mesh, torch.ones(1), algorithm="recursive_doubling")
        else:
            each_compiled(mesh, collective, 11 if how == "mismatched" and mesh.rank == 1 else 10)
        message = "no error"
    except lab.LabError as exc:
        message = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}"
    with open(os.path.join(out, f"rank{mesh.rank}"), "w") as file:  # the pool may fail on rank 1's death
        file.write(message)
    return message


def names_the_other_side(rank: int, message: str) -> bool:
    """Whether the error names the failing rank, rank 1 (raised on rank 1 itself: another rank)."""
    text = message.split(": ", 1)[1].replace(f"rank {rank}", "")  # (the rank that raised it aside)
    return "rank 1" in text if rank != 1 else "rank " in text


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "killed", "mismatched"])
@pytest.mark.parametrize("collective", list(registry.ALGORITHMS))
def test_each_compiled_collective_names_a_stopped_dead_or_mismatched_rank(compiled_env, collective, how,
                                                                          tmp_path, monkeypatch):
    """Inside every compiled collective: a rank that exchanges with the failing one gets the error
    naming it (DeadlineError after the 1 s deadline, PeerLostError before the 3 s one, or
    CollectiveMismatchError naming the other side); a rank that waits on one of those gets a
    DeadlineError naming whom it waited on; a rank that never depends on it finishes; nobody hangs."""
    # What the survivors see is asked here, not how long the pool waits for them after rank 1's
    # death (1 s, then it ends them): on a loaded machine both were ended before they wrote (-n 3).
    monkeypatch.setattr(pool_module, "FAILURE_GRACE_S", 30.0)
    deadline_ms = 3000 if how == "killed" else 1000
    with lab.launch(3, recv_timeout_ms=deadline_ms) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(failing_in_each, collective, how, str(tmp_path))
        else:
            cluster.run(failing_in_each, collective, how, str(tmp_path))
    expected = {
        "stopped": "DeadlineError", "killed": "PeerLostError", "mismatched": "CollectiveMismatchError"}[how]
    files = {rank: tmp_path / f"rank{rank}" for rank in ((0, 2) if how != "mismatched" else (0, 1, 2))}
    seen = {rank: f.read_text()
            for rank, f in files.items() if f.exists()}  # (a pool torn down by a death: maybe not all)
    assert any(m.startswith(expected) and names_the_other_side(rank, m) for rank, m in seen.items()), seen
    for message in seen.values():
        assert message == "no error" or message.startswith((expected, "DeadlineError")), seen
        if message != "no error":
            assert float(
                message.split(" after ")[1].split(" s")[0]) < 30, seen  # the deadline at most: no hang


#: LAB_COMPILED_SPIN, LAB_COMPILED_YIELD: the waiting policies a deadline and a death must get through.
POLICIES = {"default": None, "spin only": ("1000000000000", "0"), "block at once": ("0", "0")}


@pytest.mark.slow
@pytest.mark.parametrize(("how", "policy"), [("stopped", "default"), ("killed", "default"),
                                             ("stopped", "spin only"), ("killed", "block at once")])
def test_a_silent_or_dead_peer_inside_a_compiled_collective_is_named(compiled_env, monkeypatch, how, policy,
                                                                     tmp_path):
    if POLICIES[policy]:
        monkeypatch.setenv("LAB_COMPILED_SPIN", POLICIES[policy][0])  # ranks take the caller's environment
        monkeypatch.setenv("LAB_COMPILED_YIELD", POLICIES[policy][1])
    deadline_ms = 1000 if how == "stopped" else 60_000  # a death is seen at once, not at the deadline
    with lab.launch(3, recv_timeout_ms=deadline_ms) as cluster:
        if how == "killed":
            with pytest.raises(lab.RankError, match="rank 1"):
                cluster.run(stalled, how, str(tmp_path))
        else:
            cluster.run(stalled, how, str(tmp_path))
    # Rank 0 hands its tensor to rank 1 (the fold at N=3); rank 2 exchanges with rank 1.
    for rank in (0, 2):
        message = (tmp_path / f"rank{rank}").read_text()
        expected = "DeadlineError" if how == "stopped" else "PeerLostError"
        assert message.startswith(expected) and "rank 1" in message, message
        seconds = float(message.split(" after ")[1].split(" s")[0])
        assert seconds < 30, message  # a hang guard: the deadline (1 s) or the death, not the 60 s one


def compiled_counts(mesh: lab.Mesh) -> int:
    lab.barrier(mesh)  # zero bytes: at or under any threshold, so only "off" keeps it out
    lab.allreduce(mesh, torch.empty(0))
    lab.allreduce(mesh, torch.ones(4), algorithm="recursive_doubling")
    return mesh.stats()["collectives_compiled"]


def test_a_zero_threshold_turns_the_compiled_path_off(monkeypatch):
    monkeypatch.setenv("LAB_COMPILED_MAX_BYTES", "0")  # ranks take the caller's environment
    assert lab.spawn(compiled_counts, 2) == [0, 0]
    monkeypatch.setenv("LAB_COMPILED_MAX_BYTES", "64")
    assert lab.spawn(compiled_counts, 2) == [3, 3]


@pytest.mark.parametrize("name", ["LAB_COMPILED_SPIN", "LAB_COMPILED_YIELD"])
def test_a_bad_waiting_policy_is_refused_naming_its_variable(monkeypatch, name):
    monkeypatch.setenv(name, "-1")
    with pytest.raises(ValueError, match=name):
        waiting_policy_from_env()
    monkeypatch.setenv(name, "7")
    assert 7 in waiting_policy_from_env()


def test_oversubscribed_ranks_yield_at_once_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("LAB_COMPILED_SPIN", raising=False)
    monkeypatch.delenv("LAB_COMPILED_YIELD", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert waiting_policy_from_env(cores) == (DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT)
    assert waiting_policy_from_env(cores + 1) == (OVERSUBSCRIBED_SPIN_LIMIT, DEFAULT_YIELD_LIMIT)
    monkeypatch.setenv("LAB_COMPILED_SPIN", "9")  # the variable wins either way
    assert waiting_policy_from_env(cores + 1) == (9, DEFAULT_YIELD_LIMIT)
