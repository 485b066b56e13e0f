"""One rank under any launcher (mpiexec, srun, torchrun): ``lab.Mesh.from_env(transport=argv[1])``,
an allreduce of ``index * stride + rank`` checked against its closed form, and one OK line naming
the launcher and the placement ``launch_env`` read."""

import os
import sys

import torch

import lab
from lab.hosts.launchers import launch_env

transport = sys.argv[1]
env = launch_env()
mesh = lab.Mesh.from_env(transport=transport, recv_timeout_ms=30_000)
n, rank = mesh.world_size, mesh.rank
assert (rank, n) == (env.rank, env.world_size), (rank, n, env)
stride, count = 1000, 1001
x = torch.arange(count, dtype=torch.float64) * stride + rank
lab.allreduce(mesh, x, algorithm="ring")
want = torch.arange(count, dtype=torch.float64) * stride * n + n * (n - 1) // 2
wrong = int((x != want).sum())
if wrong:
    sys.exit(f"rank {rank}: {wrong} wrong elements")
line = (f"OK rank {rank} of {n} launcher {env.launcher} local {mesh.local_rank}/{mesh.local_world_size} "
        f"host {mesh.host} port {env.master_port}\n")
os.write(1, line.encode())  # one write: the ranks share stdout
mesh.close()
