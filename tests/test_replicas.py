"""Replicas that must not drift: ``Options(check_replicas=...)`` on DDP (lab/backend/replicas.py).

One rank's allreduce result is perturbed where DDP's bucket allreduce reaches the backend
(``LabProcessGroup.allreduce`` -> ``lab.collectives.calls.prepare_allreduce``): every rank's
backward must fail, naming that rank and the parameter, before the optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lab
import lab.backend
from lab.backend.replicas import ReplicaCheck, content_hash, replicas_every
from lab.collectives import calls

#: The model's parameters: with bucket_cap_mb=0 DDP gives each its own bucket from the second
#: step on (numels 4, 64, 16, 128: "2.weight" is the bucket of 64).
PERTURBED_NUMEL, PERTURBED_NAME, ELEMENT = 64, "2.weight", 5


def _train(mesh: lab.Mesh, perturbed_rank: int | None, as_view: bool, every: bool | int) -> dict:
    """Three DDP steps; on ``perturbed_rank``, the third step's allreduce of the "2.weight" bucket
    is left with one element off by 1 on that rank alone."""
    torch.manual_seed(0)
    lab.backend.init_process_group(mesh, pg_options=lab.backend.Options(check_replicas=every))
    step = [0]
    real = calls.prepare_allreduce

    def perturbing(mesh_: lab.Mesh, tensor: torch.Tensor, *args: object) -> calls.Prepared:
        prepared = real(mesh_, tensor, *args)
        if step[0] != 3 or tensor.numel() != PERTURBED_NUMEL:
            return prepared

        def run() -> object:
            out = prepared.run()
            tensor.view(-1)[ELEMENT] += 1.0  # this rank's result, alone
            return out

        return prepared._replace(run=run)

    if mesh.rank == perturbed_rank:
        calls.prepare_allreduce = perturbing
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    error = ""
    try:
        for step[0] in (1, 2, 3):
            optimizer.zero_grad()
            ddp(torch.arange(16, dtype=torch.float32).reshape(2, 8) * (mesh.rank + 1)).sum().backward()
            optimizer.step()
    except RuntimeError as exc:
        error = str(exc)
    finally:
        calls.prepare_allreduce = real
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    checked = "replica_check" in vars(dist.group.WORLD)
    dist.destroy_process_group()
    return {"error": error, "steps": step[0], "params": params, "checked": checked}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("as_view", [False, True], ids=["bucket copies", "gradient_as_bucket_view"])
def test_a_rank_whose_gradient_differs_is_named_with_its_parameter(world_size: int, as_view: bool) -> None:
    odd = world_size - 1  # (at 2 ranks a tie: the side without rank 0 is the odd one)
    outs = lab.spawn(_train, world_size, args=(odd, as_view, True), recv_timeout_ms=30_000)
    for rank, out in enumerate(outs):
        error = out["error"]
        assert "ReplicaMismatchError" in error, (rank, error)
        assert f"left rank {odd} with other bits" in error
        assert f"parameter {PERTURBED_NAME!r} (its elements {ELEMENT}-{ELEMENT}" in error
        assert f"1 element differs, from {ELEMENT} to {ELEMENT}" in error
    # the optimizer never stepped on the third step's gradients: every rank's parameters agree
    for out in outs[1:]:
        assert torch.equal(out["params"], outs[0]["params"])


@pytest.mark.parametrize("every", [True, 3])
def test_agreeing_replicas_train_as_without_the_check(every: bool | int) -> None:
    checked = lab.spawn(_train, 2, args=(None, False, every))
    plain = lab.spawn(_train, 2, args=(None, False, False))
    assert [out["error"] for out in checked] == ["", ""] and [out["checked"]
                                                              for out in checked] == [True, True]
    assert plain[0]["checked"] is False
    for out, reference in zip(checked, plain, strict=True):
        assert torch.equal(out["params"], reference["params"])


def test_every_kth_allreduce_of_a_size_and_dtype() -> None:
    check = ReplicaCheck(None, 3)
    a, b = torch.zeros(4), torch.zeros(5)
    assert [check.due(a) for _ in range(7)] == [True, False, False, True, False, False, True]
    assert check.due(b) and check.due(torch.zeros(4, dtype=torch.float64))  # sizes and dtypes counted apart


def test_options_check_replicas_is_checked() -> None:
    assert (replicas_every(True), replicas_every(False), replicas_every(4)) == (1, 0, 4)
    for bad in (-1, 1.5, "yes"):
        with pytest.raises(ValueError, match="check_replicas must be True, False or a whole number"):
            lab.backend.Options(check_replicas=bad)


def test_the_hash_is_of_the_bits() -> None:
    x = torch.arange(6, dtype=torch.float32)
    assert content_hash(x) == content_hash(x.clone().reshape(2, 3)) == content_hash(x.reshape(3, 2).t().t())
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(10.0))
    assert content_hash(y) != content_hash(x)
    assert content_hash(torch.tensor([float("nan")])) == content_hash(torch.tensor([float("nan")]))
    assert content_hash(torch.zeros(0)) == content_hash(torch.zeros(0, dtype=torch.int64))
