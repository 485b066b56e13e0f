"""Every torch.distributed operation a CPU training job uses, on the "lab" backend, against gloo.

Run by tests/test_backend.py under torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node N tests/backend_job.py OUT``): each rank runs every check of :data:`CHECKS`
on its own data (``index * stride + rank``), checks its own output, and writes
``OUT/rank<r>.json``: ``{check: "ok" or what went wrong}``. A gloo group over the same ranks
gives the reference where gloo has the operation.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# (torch.distributed does not export these)
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

import lab  # registers the "lab" backend
from lab.backend.work import DoneWork

STRIDE = 3
COUNTS = (0, 1, 2, 7, 1000)  # zero, one, fewer than ranks (at 3-4), not divisible, large-ish
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
MOVED_DTYPES = (torch.float32, torch.int64, torch.uint8, torch.int8, torch.int16, torch.bool, torch.complex64)

CHECKS: dict[str, Callable[[int, int, dist.ProcessGroup], None]] = {}


def check(function: Callable[[int, int, dist.ProcessGroup], None]) -> Callable:
    CHECKS[function.__name__] = function
    return function


def pattern(count: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = torch.arange(count, dtype=torch.float64) * STRIDE + rank
    if dtype == torch.bool:
        return (values.to(torch.int64) % 2).to(torch.bool)
    if dtype in (torch.uint8, torch.int8):
        return (values.to(torch.int64) % 100).to(dtype)
    return values.to(dtype)


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)} {got.reshape(-1)[:6].tolist()}, "
                             f"want {want.dtype}{list(want.shape)} {want.reshape(-1)[:6].tolist()}")


# -- collectives ------------------------------------------------------------------------------


@check
def all_reduce_every_op_and_dtype(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    ops = {
        dist.ReduceOp.SUM: lambda xs: sum(xs), dist.ReduceOp.PRODUCT: None,
        dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
        dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0)}
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for count in COUNTS:
            # the inputs as the dtype holds them
            inputs = [pattern(count, r, dtype).to(torch.float64) for r in range(n)]
            for op, reference in ops.items():
                x = pattern(count, rank, dtype)
                dist.all_reduce(x, op=op)
                # product, and sums of half types (rounded at every step, in an order of their
                # own): gloo's result, within the dtype's tolerance
                if reference is None or (op == dist.ReduceOp.SUM and
                                         dtype in (torch.bfloat16, torch.float16)):
                    want = pattern(count, rank, dtype)
                    dist.all_reduce(want, op=op, group=gloo)
                    torch.testing.assert_close(x, want, msg=f"{op} {dtype}[{count}] against gloo")
                    continue
                expect_equal(x, reference(inputs).to(dtype), f"{op} {dtype}[{count}]")


@check
def all_reduce_bitwise_against_gloo(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        for dtype in INT_DTYPES:
            x = pattern(7, rank, dtype) * 7
            want = x.clone()
            dist.all_reduce(x, op=op)
            dist.all_reduce(want, op=op, group=gloo)
            expect_equal(x, want, f"{op} {dtype}")


@check
def all_reduce_avg_and_premul_sum(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for count in COUNTS:
        x = pattern(count, rank)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        want = sum(pattern(count, r, torch.float64) for r in range(n)) / n
        torch.testing.assert_close(x, want.float(), msg=f"avg [{count}]")
        y = pattern(count, rank)
        dist.all_reduce(y, op=dist._make_nccl_premul_sum(0.5))
        torch.testing.assert_close(y, (sum(pattern(count, r, torch.float64) for r in range(n)) * 0.5).float())


@check
def all_reduce_random_floats_match_gloo_and_are_bit_identical(rank: int, n: int,
                                                              gloo: dist.ProcessGroup) -> None:
    generator = torch.Generator().manual_seed(100 + rank)
    for count in (5, 4097, 100_000):
        x = torch.randn(count, generator=generator)
        want = x.clone()
        dist.all_reduce(x)
        dist.all_reduce(want, group=gloo)
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5 * n)
        everyone = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(everyone, x, group=gloo)
        if not all(torch.equal(e.view(torch.int32), x.view(torch.int32)) for e in everyone):
            raise AssertionError(f"allreduce of {count} floats differs across ranks")


@check
def all_reduce_coalesced_and_async(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    tensors = [pattern(c, rank) for c in (3, 0, 17)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for work in works:
        work.wait()
        if not work.is_completed() or not work.is_success():
            raise AssertionError("a waited work is not complete and successful")
    for t, c in zip(tensors, (3, 0, 17), strict=True):
        expect_equal(t, sum(pattern(c, r) for r in range(n)), f"async allreduce [{c}]")
    future_work = dist.all_reduce(pattern(4, rank), async_op=True)
    value = future_work.get_future().wait()
    expect_equal(value[0], sum(pattern(4, r) for r in range(n)), "get_future's value")


@check
def small_all_reduce_on_one_host_runs_compiled(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    # torchrun on one host: transport "auto" is the shm transport with its mailboxes, so a 1 KB
    # all_reduce is one Numba call (lab.compiled.plane), as under lab.launch
    mesh = dist.group.WORLD.mesh
    before = mesh.stats()["collectives_compiled"]
    x = pattern(256, rank)
    dist.all_reduce(x)
    expect_equal(x, sum(pattern(256, r) for r in range(n)), "1 KB all_reduce")
    if mesh.stats()["collectives_compiled"] != before + 1:
        raise AssertionError(f"a 1 KB all_reduce on one host did not take the compiled plane: {mesh.stats()}")
    # and the two-shot reads the peers' memory in place (the scratch came with the mailboxes)
    if mesh.exchange.scratch is None:
        raise AssertionError("the shm transport under torchrun has no shared scratch")
    y = pattern(100_003, rank)
    lab.allreduce(mesh, y, algorithm="two_shot")
    expect_equal(y, sum(pattern(100_003, r) for r in range(n)), "two_shot allreduce")


@check
def a_call_like_one_before_runs_from_its_lane(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    # the same small tensor again: its all_reduce, broadcast, all_gather_single or reduce_scatter_single runs from its lane
    # made (complete before the call returns: a DoneWork), on the world and on a group of its own;
    # called as dist.all_reduce calls the group (synchronous: other groups of this job are open)
    group, opts = dist.new_group(list(range(n))), dist.AllreduceOptions()
    opts.asyncOp = False
    for dtype in (torch.float32, torch.float64, torch.int64):  # 1 KB each: auto's pick compiles
        count = 1024 // dtype.itemsize
        x, total = pattern(count, rank, dtype), sum(pattern(count, r, dtype) for r in range(n))
        for call in range(3):
            work = dist.group.WORLD.allreduce([x], opts)
            work.wait()
            expect_equal(x, total * n**call, f"all_reduce {dtype} call {call}")
            if call and (type(work) is not DoneWork or work.get_future().wait()[0] is not x):
                raise AssertionError(f"all_reduce {dtype} call {call} did not run from its lane: {work}")
        for root in range(n):
            options = dist.BroadcastOptions()
            options.rootRank, options.asyncOp = root, False
            for call in range(2):
                x.copy_(pattern(count, rank, dtype))
                work = dist.group.WORLD.broadcast([x], options)
                work.wait()
                expect_equal(x, pattern(count, root, dtype), f"broadcast {dtype} from {root} call {call}")
                if call and type(work) is not DoneWork:
                    raise AssertionError(f"broadcast {dtype} from {root} did not run from its lane: {work}")
                x.copy_(pattern(count, rank, dtype))
                dist.broadcast(x, src=root, group=group)
                expect_equal(x, pattern(count, root, dtype), f"broadcast {dtype} from {root} on a new group")
        # all_gather_single: the lane writes the output, the input copied into its block first
        gathered, gather_options = torch.empty(count * n, dtype=dtype), AllgatherOptions()
        gather_options.asyncOp = False
        for call in range(3):
            gathered.zero_()
            work = dist.group.WORLD.all_gather_single(gathered, pattern(count, rank, dtype), gather_options)
            work.wait()
            expect_equal(gathered, torch.cat([pattern(count, r, dtype) for r in range(n)]),
                         f"all_gather_single {dtype} call {call}")
            if call and type(work) is not DoneWork:
                raise AssertionError(
                    f"all_gather_single {dtype} call {call} did not run from its lane: {work}")
        # reduce_scatter_single: the lane reduces a copy of the input, its block copied into the output
        block, scatter_options = torch.empty(count, dtype=dtype), ReduceScatterOptions()
        scatter_options.asyncOp = False
        whole = torch.cat([pattern(count, rank, dtype)] * n)
        for call in range(3):
            block.zero_()
            work = dist.group.WORLD.reduce_scatter_single(block, whole, scatter_options)
            work.wait()
            expect_equal(block, total,
                         f"reduce_scatter_single {dtype} call {call}")  # (block r: rank r's input)
            expect_equal(whole, torch.cat([pattern(count, rank, dtype)] * n), "reduce_scatter_single's input")
            if call and type(work) is not DoneWork:
                raise AssertionError(
                    f"reduce_scatter_single {dtype} call {call} did not run from its lane: {work}")


@check
def broadcast_every_root_and_dtype(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for root in range(n):
        for dtype in MOVED_DTYPES:
            for count in (0, 1, 7):
                x = pattern(count, rank, dtype)
                dist.broadcast(x, src=root)
                expect_equal(x, pattern(count, root, dtype), f"broadcast root {root} {dtype}[{count}]")


@check
def reduce_every_root(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for root in range(n):
        for count in (1, 7):
            x = pattern(count, rank, torch.int64)
            dist.reduce(x, dst=root, op=dist.ReduceOp.SUM)
            want = sum(pattern(count, r, torch.int64)
                       for r in range(n)) if rank == root else pattern(count, rank, torch.int64)
            expect_equal(x, want, f"reduce root {root} [{count}]")


@check
def all_gather_list_tensor_and_every_dtype(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for dtype in MOVED_DTYPES:
        for count in (0, 1, 7):
            outputs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(outputs, pattern(count, rank, dtype))
            for r in range(n):
                expect_equal(outputs[r], pattern(count, r, dtype), f"all_gather {dtype}[{count}] from {r}")
            into = torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(into, pattern(count, rank, dtype))
            expect_equal(into, torch.cat([pattern(count, r, dtype) for r in range(n)]),
                         f"into tensor {dtype}")


@check
def all_gather_coalesced_against_gloo(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    inputs = [pattern(c, 10 * rank + c) for c in (3, 0, 5)]
    got = [[torch.empty_like(t) for t in inputs] for _ in range(n)]
    want = [[torch.empty_like(t) for t in inputs] for _ in range(n)]
    dist.all_gather_coalesced(got, inputs)
    dist.all_gather_coalesced(want, inputs, group=gloo)
    for r in range(n):
        for i in range(len(inputs)):
            expect_equal(got[r][i], want[r][i], f"all_gather_coalesced rank {r} input {i}")


@check
def reduce_scatter_list_and_tensor(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for count in (0, 1, 7):
        inputs = [pattern(count, rank * n + j) for j in range(n)]
        out = torch.empty(count)
        dist.reduce_scatter(out, inputs)
        expect_equal(out, sum(pattern(count, r * n + rank) for r in range(n)), f"reduce_scatter [{count}]")
        whole = pattern(n * count, rank)
        out = torch.empty(count)
        dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.MAX)
        expect_equal(out,
                     pattern(n * count, n - 1)[rank * count:(rank + 1) * count],
                     f"reduce_scatter_tensor [{count}]")


@check
def all_to_all_single_even_and_uneven(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for dtype in (torch.float32, torch.complex64, torch.bool):
        x = pattern(2 * n, rank, dtype)
        out = torch.empty(2 * n, dtype=dtype)
        dist.all_to_all_single(out, x)
        want = torch.empty_like(out)
        dist.all_to_all_single(want, x, group=gloo) if dtype != torch.bool else \
            want.copy_(torch.cat([pattern(2 * n, r, dtype)[2 * rank:2 * rank + 2] for r in range(n)]))
        expect_equal(out, want, f"all_to_all_single {dtype}")
    # uneven: rank r sends (r + j) % 3 rows to rank j, rows of 2 elements (zeros included)
    sends = [(rank + j) % 3 for j in range(n)]
    receives = [(r + rank) % 3 for r in range(n)]
    x = pattern(2 * sum(sends), rank).reshape(-1, 2)
    out = torch.empty(sum(receives), 2)
    dist.all_to_all_single(out, x, output_split_sizes=receives, input_split_sizes=sends)
    want = torch.empty_like(out)
    dist.all_to_all_single(want, x, output_split_sizes=receives, input_split_sizes=sends, group=gloo)
    expect_equal(out, want, "uneven all_to_all_single")


@check
def all_to_all_lists_of_different_sizes(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    inputs = [pattern(rank + j + 1, 10 * rank + j) for j in range(n)]
    outputs = [torch.empty(r + rank + 1) for r in range(n)]
    dist.all_to_all(outputs, inputs)
    for r in range(n):
        expect_equal(outputs[r], pattern(r + rank + 1, 10 * r + rank), f"all_to_all from {r}")


@check
def gather_and_scatter_every_root(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    for root in range(n):
        for dtype in (torch.float32, torch.uint8):
            outputs = [torch.empty(5, dtype=dtype) for _ in range(n)] if rank == root else None
            dist.gather(pattern(5, rank, dtype), gather_list=outputs, dst=root)
            if rank == root:
                for r in range(n):
                    expect_equal(outputs[r], pattern(5, r, dtype), f"gather root {root} from {r}")
            out = torch.empty(4, dtype=dtype)
            pieces = [pattern(4, 10 * root + r, dtype) for r in range(n)] if rank == root else None
            dist.scatter(out, scatter_list=pieces, src=root)
            expect_equal(out, pattern(4, 10 * root + rank, dtype), f"scatter root {root}")


@check
def barrier_and_monitored_barrier(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    dist.barrier()
    dist.barrier(async_op=True).wait()


# -- point-to-point ---------------------------------------------------------------------------


@check
def send_recv_isend_irecv_and_batch(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    for count in (0, 1, 1000):
        if rank % 2 == 0:
            dist.send(pattern(count, rank), dst=right)
            got = torch.empty(count)
            dist.recv(got, src=left)
        else:
            got = torch.empty(count)
            dist.recv(got, src=left)
            dist.send(pattern(count, rank), dst=right)
        expect_equal(got, pattern(count, left), f"send/recv [{count}]")
    got = torch.empty(9)
    works = [dist.isend(pattern(9, rank), dst=right), dist.irecv(got, src=left)]
    for work in works:
        work.wait()
    expect_equal(got, pattern(9, left), "isend/irecv")
    got = torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, pattern(3, rank, torch.int64), right), dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    expect_equal(got, pattern(3, left, torch.int64), "batch_isend_irecv")


@check
def send_recv_with_tags(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    """As torch's test_send_recv_with_tag and test_batch_isend_irecv_gloo_tags: tags match sends
    to receives, whatever order they are posted in."""
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    sends = [dist.isend(pattern(5, rank + 10 * tag), dst=right, tag=tag) for tag in (1, 2, 3)]
    for tag in (3, 1, 2):  # received in another order than sent
        got = torch.empty(5)
        dist.recv(got, src=left, tag=tag)
        expect_equal(got, pattern(5, left + 10 * tag), f"recv tag={tag}")
    for work in sends:
        work.wait()
    got = torch.empty(2, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.irecv, got, left, tag=left),
        dist.P2POp(dist.isend, pattern(2, rank, torch.int64), right, tag=rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    expect_equal(got, pattern(2, left, torch.int64), "batch_isend_irecv with tags")
    if rank == 0:  # any source, by tag: the tag-8 tensors first, though they were sent second
        firsts = {dist.recv(got := torch.empty(1), tag=8): got for _ in range(n - 1)}
        seconds = {dist.recv(got := torch.empty(1), tag=7): got for _ in range(n - 1)}
        for r in range(1, n):
            expect_equal(firsts[r], torch.tensor([r + 0.5]), f"any source tag=8 from {r}")
            expect_equal(seconds[r], torch.tensor([float(r)]), f"any source tag=7 from {r}")
    else:
        dist.send(torch.tensor([float(rank)]), dst=0, tag=7)
        dist.send(torch.tensor([rank + 0.5]), dst=0, tag=8)
    # A send queued behind a collective never overtakes it to serve a waiting receive: rank 0's
    # isend would reach rank 1 inside the all_reduce.
    got, total = torch.empty(1), torch.ones(
        100_000)  # past the compiled path: over the channels the send uses
    if rank == 0:
        works = [
            dist.irecv(got, src=1),
            dist.all_reduce(total, async_op=True),
            dist.isend(torch.ones(1), dst=1)]
    else:
        time.sleep(0.2 if rank == 1 else 0)  # rank 0's receive waits, with the send behind it
        works = [dist.isend(torch.full((1,), 2.0), dst=0)] if rank == 1 else []
        works.append(dist.all_reduce(total, async_op=True))
        works += [dist.irecv(got, src=0)] if rank == 1 else []
    for work in works:
        work.wait()
    expect_equal(total, torch.full((100_000,), float(n)), "all_reduce between the receive and the send")
    if rank in (0, 1):
        expect_equal(got, torch.full((1,), 2.0 - rank), "the send behind a collective")


@check
def recv_from_any_source(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    if n == 1:
        return
    if rank == 0:
        seen = {}
        for _ in range(2 * (n - 1)):  # two messages from each rank, in order per sender
            got = torch.empty(4)
            src = dist.recv(got)
            seen.setdefault(src, []).append(got)
        for r in range(1, n):
            if len(seen.get(r, [])) != 2:
                raise AssertionError(f"rank 0 got {len(seen.get(r, []))} messages from rank {r}, sent 2")
            expect_equal(seen[r][0], pattern(4, r), f"first from {r}")
            expect_equal(seen[r][1], pattern(4, 100 + r), f"second from {r}")
    else:
        dist.send(pattern(4, rank), dst=0)
        dist.send(pattern(4, 100 + rank), dst=0)


# -- objects, groups, functional collectives, device meshes ------------------------------------


@check
def object_collectives(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    if objects != [{"rank": r, "text": "x" * r} for r in range(n)]:
        raise AssertionError(f"all_gather_object: {objects}")
    payload = [f"from {n - 1}", n - 1] if rank == n - 1 else [None, None]
    dist.broadcast_object_list(payload, src=n - 1)
    if payload != [f"from {n - 1}", n - 1]:
        raise AssertionError(f"broadcast_object_list: {payload}")
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    if rank == 0 and gathered != [("g", r) for r in range(n)]:
        raise AssertionError(f"gather_object: {gathered}")
    out = [None]
    dist.scatter_object_list(out, [{"to": r} for r in range(n)] if rank == 0 else None, src=0)
    if out != [{"to": rank}]:
        raise AssertionError(f"scatter_object_list: {out}")


@check
def new_group_with_ranks_outside(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    evens = list(range(0, n, 2))
    group = dist.new_group(evens)  # every rank calls it; the odd ones are outside
    everyone = dist.new_group(list(range(n)))  # a second group of all ranks: its own context
    if rank in evens:
        x = pattern(5, rank)
        dist.all_reduce(x, group=group)
        expect_equal(x, sum(pattern(5, r) for r in evens), "all_reduce on the evens")
        if dist.get_rank(group) != evens.index(rank) or dist.get_world_size(group) != len(evens):
            raise AssertionError("group rank or size is wrong")
        y = pattern(2, rank)
        dist.broadcast(y, src=evens[-1], group=group)  # a global rank, as torch takes it
        expect_equal(y, pattern(2, evens[-1]), "broadcast on the evens")
    z = pattern(3, rank)
    dist.all_reduce(z, group=everyone)
    expect_equal(z, sum(pattern(3, r) for r in range(n)), "all_reduce on a second group of every rank")


@check
def functional_collectives(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    world = dist.group.WORLD
    reduced = funcol.all_reduce(pattern(6, rank), "sum", world)
    expect_equal(funcol.wait_tensor(reduced), sum(pattern(6, r) for r in range(n)), "funcol.all_reduce")
    gathered = funcol.all_gather_tensor(pattern(2, rank), 0, world)
    expect_equal(funcol.wait_tensor(gathered), torch.cat([pattern(2, r) for r in range(n)]),
                 "funcol.all_gather_tensor")
    scattered = funcol.reduce_scatter_tensor(pattern(2 * n, rank), "sum", 0, world)
    want = sum(pattern(2 * n, r) for r in range(n))[2 * rank:2 * rank + 2]
    expect_equal(funcol.wait_tensor(scattered), want, "funcol.reduce_scatter_tensor")


@check
def device_mesh_two_dimensions(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    if n % 2:
        return  # a 2-D mesh needs an even world here
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        members = dist.get_process_group_ranks(group)
        x = pattern(3, rank)
        dist.all_reduce(x, group=group)
        expect_equal(x, sum(pattern(3, r) for r in members), f"all_reduce over {dim}")


# -- training ---------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(steps: int, n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(4 * n, 16, generator=generator) for _ in range(steps)]


def _train(model: torch.nn.Module, batches: list[torch.Tensor], rows: slice) -> torch.nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in batches:
        model(batch[rows]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@check
def ddp_matches_one_process(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    batches = _batches(4, n)
    reference = _train(_model(), batches, slice(None))  # the whole batch in one process
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    _train(ddp, batches, slice(4 * rank, 4 * rank + 4))
    for (name, got), want in zip(ddp.module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"DDP parameter {name}")


@check
def fsdp2_matches_one_process(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    batches = _batches(4, n)
    reference = _train(_model(), batches, slice(None))
    model = _model()
    mesh = init_device_mesh("cpu", (n,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, batches, slice(4 * rank, 4 * rank + 4))
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6,
                                   msg=f"FSDP2 parameter {name}")


def main(out: str) -> None:
    # a check that fails on one rank leaves the others in a collective: the deadline ends it (60 s:
    # a rank descheduled on a loaded machine is not a failure)
    dist.init_process_group("lab", timeout=timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name, function in CHECKS.items():
        if os.environ.get("BACKEND_JOB_VERBOSE"):
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            function(rank, n, gloo)
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - every check reports, the next one still runs
            results[name] = "".join(traceback.format_exception(exc))[-3000:]
        dist.barrier(group=gloo)  # a failed check must not leave a rank behind in the next
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
