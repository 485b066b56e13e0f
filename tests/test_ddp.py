"""DDP with the lab's allreduce as its comm hook trains exactly like DDP over gloo."""

from __future__ import annotations

import pytest
import torch

import lab
import lab.ddp
from lab.reference import ensure_gloo


def train(mesh: lab.Mesh, use_lab: bool, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """A few SGD steps of a small MLP on rank-specific data, from the same seed on every rank."""
    ensure_gloo(mesh)  # DDP's own process group (parameter broadcast, bookkeeping)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    if use_lab:
        ddp.register_comm_hook(mesh, lab.ddp.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + mesh.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_lab_hook_matches_gloo_ddp():
    with lab.launch(3) as cluster:
        with_lab = cluster.run(train, True, 5)
        with_gloo = cluster.run(train, False, 5)
    for rank in range(3):
        lab_losses, lab_params = with_lab[rank]
        gloo_losses, gloo_params = with_gloo[rank]
        assert lab_losses == pytest.approx(gloo_losses, rel=1e-5)
        for a, b in zip(lab_params, gloo_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # replicas stay identical: every rank ends with the same parameters
    for params in zip(*(with_lab[r][1] for r in range(3))):
        assert all(torch.equal(params[0], p) for p in params[1:])
