"""Unmodified tensor parallelism with FSDP2 on a 2-D device mesh on the lab, gloo's loss next to it.

    torchrun --nproc-per-node 4 examples/tensor_parallel_backend.py

``init_device_mesh("cpu", (2, 2))`` makes a "dp" and a "tp" dimension (2 at 2 ranks: (1, 2)).
A transformer's MLP block is split over "tp" (``SequenceParallel`` on its LayerNorm,
``ColwiseParallel`` on the up projection, ``RowwiseParallel`` on the down one: the sequence is
all-gathered before the up projection and reduce-scattered after the down one) and sharded over
"dp" by ``fully_shard``; each dp replica trains on its own batch. The default group is the lab's;
a twin does the same on a mesh of gloo groups over the same ranks (``backend_override``), so each
step prints both losses: equal to the last bit. (Not the other way round: a lab group other than
the world, as a mesh dimension is, cannot be made before the lab's world.)
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import lab  # noqa: F401 - registers the "lab" backend

WIDTH, SEQUENCE, BATCH, TP = 64, 16, 8, 2


class Block(torch.nn.Module):
    """``x + down(relu(up(norm(x))))``, the same weights in every process that builds it."""
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def parallel_block(mesh: DeviceMesh) -> torch.nn.Module:
    dp, tp = mesh.mesh_dim_names
    block = parallelize_module(
        Block(),
        mesh[tp],
        {
            "norm": SequenceParallel(),  # the sequence stays sharded here
            "up": ColwiseParallel(input_layouts=Shard(1)),  # all-gathers the sequence, shards the features
            "down": RowwiseParallel(output_layouts=Shard(1))  # reduce-scatters back along the sequence
        })
    return fully_shard(block, mesh=mesh[dp])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("lab")
    shape = (dist.get_world_size() // TP, TP)
    # The twin's dimensions have names of their own: torch takes two meshes of the same ranks and
    # names for one (DeviceMesh's equality ignores the backend), and DTensor would run both on one.
    meshes = {
        "lab": init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")),
        "gloo": init_device_mesh("cpu", shape, mesh_dim_names=("gloo_dp", "gloo_tp"),
                                 backend_override={"gloo_dp": "gloo", "gloo_tp": "gloo"})}
    twins = {name: parallel_block(mesh) for name, mesh in meshes.items()}
    optimizers = {name: torch.optim.Adam(block.parameters(), lr=1e-3) for name, block in twins.items()}
    dp_rank, tp_rank = meshes["lab"].get_coordinate()
    data = torch.Generator().manual_seed(dp_rank)  # each dp replica its own batches
    rows = SEQUENCE // TP
    for step in range(args.steps):
        x = torch.randn(BATCH, SEQUENCE, WIDTH,
                        generator=data)[:, tp_rank * rows:(tp_rank + 1) * rows].contiguous()
        losses = {}
        for name, block in twins.items():
            loss = block(x).pow(2).mean()
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name] = loss.item()
        if dist.get_rank() == 0:
            print(f"step {step}: loss on lab {losses['lab']:.6f}   on gloo {losses['gloo']:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
