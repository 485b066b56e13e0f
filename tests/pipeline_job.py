"""torch's pipeline parallelism (``torch.distributed.pipelining``), unmodified, on the "lab" backend
against gloo.

Run by tests/test_pipeline_backend.py under torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node N tests/pipeline_job.py OUT``): each rank runs every check of :data:`CHECKS` and
writes ``OUT/rank<r>.json``: ``{check: "ok" or what went wrong}``. A schedule's check trains twin
pipelines, one over the lab's world group and one over a gloo group of the same ranks (the same
stages, weights and data), for :data:`STEPS` optimizer steps, and requires every rank's losses,
outputs and gradients of the lab's run to be bit-equal to gloo's: a pipeline only moves
activations and gradients from stage to stage, so any difference is the backend's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

import lab  # noqa: F401 - registers the "lab" backend

WIDTH = 16
STEPS = 3
#: Micro-batches per step: a multiple of 2 and 4 ranks, and at least twice the stages of a V schedule.
MICROBATCHES = 8
#: Elements of the all_reduce kept in flight beside the pipeline: more than
#: ``lab.backend.group.RUN_NOW_MAX_BYTES``, so it runs on the communication thread.
IN_FLIGHT_NUMEL = 64_000

CHECKS: dict[str, Callable[[int, int, dist.ProcessGroup], None]] = {}


def check(function: Callable[[int, int, dist.ProcessGroup], None]) -> Callable:
    CHECKS[function.__name__] = function
    return function


def stage_indices(layout: str, rank: int, n: int) -> list[int]:
    """The stages this rank holds: one (``"single"``), two looped (``"loop"``: rank r holds r and
    r + n) or two in a V (``"v"``: r and 2n - 1 - r, so the last stage is on rank 0)."""
    if layout == "single":
        return [rank]
    if layout == "loop":
        return [rank, rank + n]
    return [rank, 2 * n - 1 - rank]


def stage_module(index: int) -> torch.nn.Module:
    """Stage ``index``'s layers, the same in every process that builds them."""
    torch.manual_seed(1000 + index)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's input and target (``index * stride + rank``-like, then squashed: the same on
    every rank that feeds or ends the pipeline, whichever rank that is)."""
    rows = 2 * MICROBATCHES
    values = torch.arange(STEPS * rows * WIDTH, dtype=torch.float32).reshape(STEPS, rows, WIDTH)
    inputs, targets = torch.sin(values * 0.37), torch.cos(values * 0.11)
    return list(zip(inputs, targets, strict=True))


def train(schedule_class: type, layout: str, group: dist.ProcessGroup, rank: int, n: int,
          beside: dist.ProcessGroup | None = None) -> list:
    """``STEPS`` steps of the pipeline over ``group``; what this rank saw at each: the losses and
    output where it holds the last stage, the gradients of its stages' parameters. ``beside``: a
    group of the same backend on which an asynchronous all_reduce is in flight through each step."""
    indices = stage_indices(layout, rank, n)
    num_stages = n * len(indices)
    modules = [stage_module(index) for index in indices]
    stages = [
        PipelineStage(module, index, num_stages, torch.device("cpu"), group=group)
        for module, index in zip(modules, indices, strict=True)]
    schedule = schedule_class(stages if layout != "single" else stages[0], MICROBATCHES,
                              loss_fn=torch.nn.functional.mse_loss)
    parameters = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    seen = []
    for step, (x, target) in enumerate(batches(rank)):
        in_flight = None
        if beside is not None:
            reduced = torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32) * 3 + rank
            in_flight = dist.all_reduce(reduced, group=beside, async_op=True)
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in indices else ()
        kwargs = {"target": target, "losses": losses} if num_stages - 1 in indices else {}
        output = schedule.step(*args, **kwargs)
        if in_flight is not None:
            in_flight.wait()
            want = sum(torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32) * 3 + r for r in range(n))
            if not torch.equal(reduced, want):
                raise AssertionError(f"step {step}: the all_reduce in flight beside the pipeline is wrong")
        seen.append({
            "losses": [loss.detach().clone() for loss in losses],
            "output": None if output is None else output.detach().clone(),
            "grads": [p.grad.clone() for p in parameters]})
        optimizer.step()
        optimizer.zero_grad()
    return seen


def expect_bit_equal(lab_run: list, gloo_run: list, what: str) -> None:
    for step, (got, want) in enumerate(zip(lab_run, gloo_run, strict=True)):
        if not want["grads"] or (not want["losses"]) != (not got["losses"]):
            raise AssertionError(f"{what} step {step}: nothing to compare ({len(want['grads'])} gradients)")
        for name in ("losses", "grads"):
            for i, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
                if not torch.equal(g, w):
                    raise AssertionError(f"{what} step {step}: {name}[{i}] differs from gloo's: "
                                         f"{g.reshape(-1)[:4].tolist()} vs {w.reshape(-1)[:4].tolist()}")
        if (got["output"] is None) != (want["output"]
                                       is None) or (want["output"] is not None and
                                                    not torch.equal(got["output"], want["output"])):
            raise AssertionError(f"{what} step {step}: the last stage's output differs from gloo's")


def lab_messages() -> int:
    """Messages this rank's lab mesh has sent (its sub-meshes' included: they share its channels)."""
    return dist.group.WORLD.mesh.stats()["messages_sent"]


def against_gloo(schedule_class: type, layout: str, rank: int, n: int, gloo: dist.ProcessGroup,
                 beside: dist.ProcessGroup | None = None) -> None:
    before = lab_messages()
    lab_run = train(schedule_class, layout, dist.group.WORLD, rank, n, beside)
    between = lab_messages()
    gloo_run = train(schedule_class, layout, gloo, rank, n)
    if between == before or lab_messages() != between:  # each twin on its own backend
        raise AssertionError(f"the lab sent {between - before} messages in the lab's run, "
                             f"{lab_messages() - between} in gloo's")
    expect_bit_equal(lab_run, gloo_run, schedule_class.__name__)


@check
def gpipe(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    against_gloo(ScheduleGPipe, "single", rank, n, gloo)


@check
def one_f_one_b(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    against_gloo(Schedule1F1B, "single", rank, n, gloo)


@check
def interleaved_one_f_one_b(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    against_gloo(ScheduleInterleaved1F1B, "loop", rank, n, gloo)


@check
def zero_bubble_v(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    against_gloo(ScheduleZBVZeroBubble, "v", rank, n, gloo)


@check
def dual_pipe_v(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    against_gloo(ScheduleDualPipeV, "v", rank, n, gloo)


@check
def one_f_one_b_beside_an_all_reduce_in_flight(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    """Data and pipeline parallelism's overlap: an asynchronous all_reduce on another lab group of
    the same ranks is in flight while the pipeline's batched sends and receives run."""
    against_gloo(Schedule1F1B, "single", rank, n, gloo, beside=dist.new_group())


@check
def p2p_with_async_work_in_flight(rank: int, n: int, gloo: dist.ProcessGroup) -> None:
    """What pipelining asks of the backend, behind a queued all_reduce on the same group: objects
    sent and received (its shape inference), batched sends and receives with tags, received in
    another order than sent."""
    right, left = (rank + 1) % n, (rank - 1) % n
    queued = torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32) * 3 + rank
    in_flight = dist.all_reduce(queued, async_op=True)
    # objects around the ring: even ranks send first, odd ranks receive first (n is even)
    received: list = [None]
    mine = {"rank": rank, "shape": (rank, WIDTH)}
    for send_first in (rank % 2 == 0, rank % 2 == 1):
        if send_first:
            dist.send_object_list([mine], dst=right)
        else:
            dist.recv_object_list(received, src=left)
    if received[0] != {"rank": left, "shape": (left, WIDTH)}:
        raise AssertionError(f"recv_object_list: got {received[0]}")
    got = {tag: torch.empty(5) for tag in (1, 2, 3)}
    ops = [dist.P2POp(dist.irecv, got[tag], left, tag=tag) for tag in (3, 1, 2)]
    ops += [
        dist.P2POp(dist.isend,
                   torch.arange(5.0) * 3 + rank + 10 * tag, right, tag=tag) for tag in (1, 2, 3)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for tag, tensor in got.items():
        if not torch.equal(tensor, torch.arange(5.0) * 3 + left + 10 * tag):
            raise AssertionError(f"batch_isend_irecv tag={tag}: got {tensor.tolist()}")
    in_flight.wait()
    if not torch.equal(queued,
                       sum(torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32) * 3 + r for r in range(n))):
        raise AssertionError("the all_reduce in flight is wrong")


def main(out: str) -> None:
    # a check that fails on one rank leaves the others waiting: the deadline ends it
    dist.init_process_group("lab", timeout=timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    if n % 2:
        raise SystemExit(f"pipeline_job runs at an even number of ranks (its ring of objects); got {n}")
    gloo = dist.new_group(backend="gloo")
    only = os.environ.get("PIPELINE_JOB_CHECKS", "").split(",")
    results = {}
    for name, function in CHECKS.items():
        if only != [""] and name not in only:
            continue
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
