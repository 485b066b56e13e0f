"""Run under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set): every collective over
lab.Mesh.from_env(), each rank checking its own output against gloo; prints one OK line per rank."""

import os
import sys

import torch
import torch.distributed as dist

import lab
from lab.reference import gloo_collective

mesh = lab.Mesh.from_env(recv_timeout_ms=60_000)
n, rank = mesh.world_size, mesh.rank
assert (rank, n) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
x = torch.arange(1001, dtype=torch.float32) * 3 + rank
checks = {
    "allreduce ring": (lab.allreduce(mesh, x.clone(),
                                     algorithm="ring"), gloo_collective(mesh, "allreduce", x.clone())),
    "allreduce tree": (lab.allreduce(mesh, x.clone(),
                                     algorithm="tree"), gloo_collective(mesh, "allreduce", x.clone())),
    "broadcast": (lab.broadcast(mesh, x.clone(),
                                src=n - 1), gloo_collective(mesh, "broadcast", x.clone(), src=n - 1)),
    "allgather": (lab.allgather(mesh, x), gloo_collective(mesh, "allgather", x)),
    "reduce_scatter": (lab.reduce_scatter(mesh, x), gloo_collective(mesh, "reduce_scatter", x))}
wrong = [name for name, (got, want) in checks.items() if not torch.equal(got, want)]
if wrong:
    sys.exit(f"rank {rank}: differs from gloo: {wrong}")
stats = mesh.stats()
line = f"OK rank {rank} of {n}: sent {stats['bytes_sent']} B over tcp, local rank {os.environ.get('LOCAL_RANK')}\n"
os.write(1, line.encode())  # one write: the ranks share stdout
mesh.close()
dist.destroy_process_group()  # exiting with a live gloo group can abort the process
