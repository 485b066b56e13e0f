"""torch DistributedDataParallel with the lab's allreduce for its gradients.

    python examples/ddp_hook.py

DDP keeps its own gloo process group (parameter broadcast, bookkeeping); the comm hook sends
every gradient bucket through ``lab.allreduce`` instead.
"""

import torch

import lab
import lab.ddp
from lab.reference import ensure_gloo


def train(mesh, steps=20):
    ensure_gloo(mesh)  # the pool's gloo group, for DDP itself
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(mesh, lab.ddp.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(mesh.rank)  # each rank its own shard
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item(), float(sum(p.detach().sum() for p in model.parameters()))


if __name__ == "__main__":
    for rank, (loss, checksum) in enumerate(lab.spawn(train, 3)):
        print(f"rank {rank}: last loss {loss:.4f}, parameter checksum {checksum:.6f}")
    print("identical checksums: the replicas stayed in sync through the lab's allreduce")
