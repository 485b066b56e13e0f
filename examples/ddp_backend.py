"""Unmodified DDP on the lab: ``init_process_group("lab")``, with gloo's loss printed next to it.

    torchrun --nproc-per-node 4 examples/ddp_backend.py --backend lab

The default process group is the lab's (every collective DDP makes runs on the lab's algorithms,
deadlines and mismatch checks); a gloo group over the same ranks trains a twin of the model on the
same data, so each step prints both losses. They agree to float32 rounding: summation orders differ.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import lab  # noqa: F401 - registers the "lab" backend


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def train(backend: str, steps: int) -> None:
    """Both twins, step by step, each step's losses printed by rank 0."""
    rank = dist.get_rank()
    other = "gloo" if backend == "lab" else "lab"
    twins = {
        backend: DistributedDataParallel(model()),
        other: DistributedDataParallel(model(), process_group=dist.new_group(backend=other))}
    optimizers = {name: torch.optim.SGD(ddp.parameters(), lr=0.01) for name, ddp in twins.items()}
    data = torch.Generator().manual_seed(rank)  # each rank its own shard of every batch
    for step in range(steps):
        x = torch.randn(64, 32, generator=data)
        losses = {}
        for name, ddp in twins.items():
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            optimizers[name].zero_grad()
            loss.backward()  # gradients averaged across ranks by this twin's process group
            optimizers[name].step()
            losses[name] = loss.item()
        if rank == 0:
            print(f"step {step}: loss on lab {losses['lab']:.6f}   on gloo {losses['gloo']:.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="lab", choices=["lab", "gloo"],
                        help="the default process group's")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    # The twins live in train() and go with it, while the process groups still live: a DDP Reducer
    # is freed holding the GIL, and had it held a gloo group's last reference, the group's end would
    # join gloo's worker threads while one of them, freeing a finished work, waits for the GIL
    # (torch 2.13 hung so at exit, seen with py-spy). destroy_process_group ends them without it.
    train(args.backend, args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
