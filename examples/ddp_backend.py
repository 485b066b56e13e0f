"""Unmodified DDP on the lab: ``init_process_group("lab")``, with gloo's loss printed next to it.

    torchrun --nproc-per-node 4 examples/ddp_backend.py --backend lab

The default process group is the lab's (every collective DDP makes runs on the lab's algorithms,
deadlines and mismatch checks); a gloo group over the same ranks trains a twin of the model on the
same data, so each step prints both losses. They agree to float32 rounding: summation orders differ.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import lab  # noqa: F401 - registers the "lab" backend


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="lab", choices=["lab", "gloo"],
                        help="the default process group's")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    other = "gloo" if args.backend == "lab" else "lab"
    twins = {
        args.backend: DistributedDataParallel(model()),
        other: DistributedDataParallel(model(), process_group=dist.new_group(backend=other))}
    optimizers = {name: torch.optim.SGD(ddp.parameters(), lr=0.01) for name, ddp in twins.items()}
    data = torch.Generator().manual_seed(rank)  # each rank its own shard of every batch
    for step in range(args.steps):
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
    dist.destroy_process_group()
    # torch 2.13 can hang at exit when the twins free the gloo group: its destructor joins gloo's
    # worker threads holding the GIL while a worker, still dropping a finished work, waits for the
    # GIL (seen with py-spy under load). Let the workers finish first: sleeping releases the GIL.
    time.sleep(0.5)


if __name__ == "__main__":
    main()
