"""Run under torchrun with transport="auto" (two "nodes" on one machine in the test): every rank
checks its own allreduce (ring, hierarchical), broadcast and a split, and that only the bytes to
the other node crossed TCP; prints one OK line per rank."""

import os
import sys

import torch

import lab

mesh = lab.Mesh.from_env(recv_timeout_ms=60_000, transport="auto")
n, rank, local = mesh.world_size, mesh.rank, mesh.local_world_size
assert (mesh.host, mesh.local_rank) == (int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]))
count = 12 * 4096
want = torch.arange(count, dtype=torch.float32) * 3 * n + n * (n - 1) // 2
wrong = []
for algorithm in ("ring", "hierarchical", "auto"):
    x = torch.arange(count, dtype=torch.float32) * 3 + rank
    mesh.reset_stats()
    lab.allreduce(mesh, x, algorithm=algorithm)
    if not torch.equal(x, want):
        wrong.append(algorithm)
    if algorithm == "hierarchical":
        hosts, total = n // local, count * 4
        across = 2 * (hosts - 1) * total // hosts // local
        if mesh.stats()["bytes_sent_inter_host"] != across:
            wrong.append(f"hierarchical crossed {mesh.stats()['bytes_sent_inter_host']} B, not {across}")
y = torch.full((5,), float(rank))
lab.broadcast(mesh, y, src=n - 1)
node = mesh.split(mesh.host)  # the ranks of this node, over shared memory only
z = lab.allreduce(node, torch.ones(3))
if not torch.equal(y, torch.full((5,), float(n - 1))) or not torch.equal(z, torch.full((3,), float(local))):
    wrong.append("broadcast or node split")
if wrong:
    sys.exit(f"rank {rank}: wrong: {wrong}")
line = f"OK rank {rank} of {n} on node {mesh.host}: {mesh.transport}\n"
os.write(1, line.encode())  # one write: the ranks share stdout
mesh.close()
