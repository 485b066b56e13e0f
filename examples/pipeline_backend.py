"""Unmodified pipeline parallelism (``torch.distributed.pipelining``) on the lab, gloo's loss next to it.

    torchrun --nproc-per-node 4 examples/pipeline_backend.py --backend lab --schedule 1f1b

An MLP is cut into stages, one per rank (two per rank for the interleaved and the V schedules);
each step splits a batch into micro-batches that flow forward from stage to stage and their
gradients back, by point-to-point sends on the default group's backend, for one pipeline, and on
a gloo group over the same ranks for its twin (same stages, same weights, same data). A pipeline
only moves activations and gradients, so the two losses are equal to the last bit.
"""

import argparse

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

#: Each schedule, and where its stages sit: one per rank, two looped (rank r holds r and r + n) or
#: two in a V (rank r holds r and 2n - 1 - r: the last stage is back on rank 0).
SCHEDULES = {
    "gpipe": (ScheduleGPipe, "single"), "1f1b": (Schedule1F1B, "single"),
    "interleaved": (ScheduleInterleaved1F1B, "loop"), "zbv": (ScheduleZBVZeroBubble, "v"),
    "dualpipev": (ScheduleDualPipeV, "v")}
WIDTH = 64


def stage_indices(layout: str, rank: int, n: int) -> list[int]:
    return {"single": [rank], "loop": [rank, rank + n], "v": [rank, 2 * n - 1 - rank]}[layout]


def pipeline(name: str, group: dist.ProcessGroup, microbatches: int) -> tuple:
    """This rank's stages of the pipeline over ``group``, its schedule and optimizer."""
    schedule_class, layout = SCHEDULES[name]
    rank, n = dist.get_rank(), dist.get_world_size()
    indices = stage_indices(layout, rank, n)
    modules = []
    for index in indices:
        torch.manual_seed(index)  # stage `index`'s weights, the same in both twins
        modules.append(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()))
    stages = [
        PipelineStage(module, index, n * len(indices), torch.device("cpu"), group=group)
        for module, index in zip(modules, indices)]
    schedule = schedule_class(stages[0] if layout == "single" else stages, microbatches,
                              loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD([p for module in modules for p in module.parameters()], lr=0.05)
    return indices, n * len(indices), schedule, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="lab", choices=["lab", "gloo"],
                        help="the default process group's")
    parser.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    other = "gloo" if args.backend == "lab" else "lab"
    twins = {
        args.backend: pipeline(args.schedule, dist.group.WORLD, args.microbatches),
        other: pipeline(args.schedule, dist.new_group(backend=other), args.microbatches)}
    data = torch.Generator().manual_seed(0)  # the batch is fed to stage 0, the target to the last
    for step in range(args.steps):
        x = torch.randn(4 * args.microbatches, WIDTH, generator=data)
        target = torch.tanh(x.flip(1))
        losses = {}
        for name, (indices, num_stages, schedule, optimizer) in twins.items():
            micro_losses: list[torch.Tensor] = []
            inputs = (x,) if 0 in indices else ()
            last = num_stages - 1 in indices
            schedule.step(*inputs, **({"target": target, "losses": micro_losses} if last else {}))
            optimizer.step()
            optimizer.zero_grad()
            losses[name] = torch.stack(micro_losses).mean().item() if last else None
        if losses["lab"] is not None:  # the rank that holds the last stage
            print(f"step {step}: loss on lab {losses['lab']:.6f}   on gloo {losses['gloo']:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
