"""torch's tensor parallelism with FSDP2 on a 2-D device mesh, unmodified, on the "lab" backend
against gloo.

Run by tests/test_tensor_parallel_backend.py under torchrun at 2 and 4 ranks (``python -m
torch.distributed.run --standalone --nproc-per-node N tests/tensor_parallel_job.py OUT``): a block
(LayerNorm, an up and a down projection) is parallelized over the mesh's "tp" dimension
(``SequenceParallel`` on the norm, ``ColwiseParallel`` up, ``RowwiseParallel`` down: an all-gather
of the sequence before the up projection and a reduce-scatter after the down one) and sharded by
``fully_shard`` over its "dp" dimension, once on ``init_device_mesh("cpu", (2, 2))`` of the default
group's backend, the lab (``(1, 2)`` at 2 ranks), and once on the same mesh of gloo groups
(``backend_override``). Each
rank requires its losses, gradients and parameters after every step to be bit-equal to its gloo
twin's, and writes ``OUT/rank<r>.json``: ``{check: "ok" or what went wrong}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

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

WIDTH = 16
SEQUENCE = 8
BATCH = 4
STEPS = 3
TP = 2
NAMES = ("dp", "tp")


class Block(torch.nn.Module):
    """A transformer's MLP block: ``x + down(relu(up(norm(x))))``."""
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def parallel_block(mesh: DeviceMesh, names: tuple[str, str]) -> torch.nn.Module:
    """The block, tensor-parallel over the mesh's dimension ``names[1]`` with its sequence sharded
    outside the projections, then fully sharded over ``names[0]``."""
    dp, tp = names
    block = parallelize_module(
        Block(),
        mesh[tp],
        {
            "norm": SequenceParallel(),  # input and output sharded along the sequence
            "up": ColwiseParallel(input_layouts=Shard(1)),  # all-gathers the sequence, shards the features
            "down": RowwiseParallel(output_layouts=Shard(1))  # reduce-scatters back along the sequence
        })
    return fully_shard(block, mesh=mesh[dp])


def local_batches(mesh: DeviceMesh, names: tuple[str, str]) -> list[torch.Tensor]:
    """This rank's input of each step: its dp replica's batch (``index * stride + dp rank``,
    squashed), its tp rank's slice of the sequence."""
    dp, tp = (mesh[name].get_local_rank() for name in names)
    rows = SEQUENCE // TP
    batches = []
    for step in range(STEPS):
        values = torch.arange(BATCH * SEQUENCE * WIDTH, dtype=torch.float32).reshape(BATCH, SEQUENCE, WIDTH)
        batch = torch.sin(values * 0.3 + dp + 10 * step)
        batches.append(batch[:, tp * rows:(tp + 1) * rows].contiguous())
    return batches


def train(mesh: DeviceMesh, names: tuple[str, str]) -> list[dict]:
    """``STEPS`` steps of the block on ``mesh`` (its dimensions ``names``: dp, tp); each step's loss,
    local gradients and parameters."""
    block = parallel_block(mesh, names)
    optimizer = torch.optim.Adam(block.parameters(), lr=1e-2)
    seen = []
    for x in local_batches(mesh, names):
        loss = block(x).pow(2).mean()
        loss.backward()
        grads = {name: p.grad.to_local().clone() for name, p in block.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        seen.append({
            "loss": loss.detach().clone(), "grads": grads,
            "parameters": {name: p.detach().to_local().clone()
                           for name, p in block.named_parameters()}})
    return seen


def lab_messages() -> int:
    """Messages this rank's lab mesh has sent (its sub-meshes' included: they share its channels)."""
    return dist.group.WORLD.mesh.stats()["messages_sent"]


def tensor_and_fsdp2_on_a_2d_mesh(n: int) -> None:
    shape = (n // TP, TP)
    lab_mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    # The twin's dimensions are named apart: torch takes two meshes of the same ranks and names for
    # one (DeviceMesh.__eq__ ignores the backend), and DTensor's caches would run both on one.
    gloo_names = tuple(f"gloo_{name}" for name in NAMES)
    gloo_mesh = init_device_mesh("cpu", shape, mesh_dim_names=gloo_names,
                                 backend_override=dict.fromkeys(gloo_names, "gloo"))
    for mesh, backend in ((lab_mesh, "lab"), (gloo_mesh, "gloo")):
        for name in mesh.mesh_dim_names:
            if dist.get_backend(mesh[name].get_group()) != backend:
                raise AssertionError(
                    f"mesh {name!r} is on {dist.get_backend(mesh[name].get_group())}, not {backend}")
    before = lab_messages()
    lab_run = train(lab_mesh, NAMES)
    between = lab_messages()
    gloo_run = train(gloo_mesh, gloo_names)
    if between == before or lab_messages() != between:
        raise AssertionError(f"the lab sent {between - before} messages in the lab's run, "
                             f"{lab_messages() - between} in gloo's")
    for step, (got, want) in enumerate(zip(lab_run, gloo_run, strict=True)):
        if not torch.equal(got["loss"], want["loss"]):
            raise AssertionError(
                f"step {step}: loss {got['loss'].item()!r} on the lab, {want['loss'].item()!r} on gloo")
        for kind in ("grads", "parameters"):
            if sorted(got[kind]) != sorted(want[kind]) or len(want[kind]) != 6:
                raise AssertionError(f"step {step}: {kind} of {sorted(got[kind])} vs {sorted(want[kind])}")
            for name, tensor in want[kind].items():
                if not torch.equal(got[kind][name], tensor):
                    raise AssertionError(
                        f"step {step}: {kind} {name} differs from gloo's: "
                        f"{got[kind][name].reshape(-1)[:4].tolist()} vs {tensor.reshape(-1)[:4].tolist()}")


def main(out: str) -> None:
    dist.init_process_group("lab", timeout=timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    if n % TP:
        raise SystemExit(f"tensor_parallel_job runs on a (n / {TP}, {TP}) mesh; got {n} ranks")
    results = {}
    try:
        tensor_and_fsdp2_on_a_2d_mesh(n)
        results["tensor_and_fsdp2_on_a_2d_mesh"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the rank reports what went wrong
        results["tensor_and_fsdp2_on_a_2d_mesh"] = "".join(traceback.format_exception(exc))[-3000:]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
