"""Unmodified FSDP2 (``fully_shard``) on the lab, with gloo's loss printed next to it.

    torchrun --nproc-per-node 4 examples/fsdp2_backend.py --backend lab

Each rank holds a quarter of every parameter; a forward all-gathers a layer's parameters and
the backward reduce-scatters its gradients: on the default group's backend for one model, on a
gloo group over the same ranks for its twin (same initial weights, same data).
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import lab  # noqa: F401 - registers the "lab" backend


def sharded_model(group: dist.ProcessGroup) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one all-gather / reduce-scatter per layer
    return fully_shard(model, mesh=mesh)


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
        args.backend: sharded_model(dist.group.WORLD), other: sharded_model(dist.new_group(backend=other))}
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=1e-3) for name, model in twins.items()}
    data = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        losses = {}
        for name, model in twins.items():
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
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
