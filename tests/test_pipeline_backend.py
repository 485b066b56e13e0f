"""torch's pipeline parallelism on the "lab" backend (issue 43, item 1): GPipe, 1F1B, interleaved
1F1B and the two zero-bubble V schedules (ZBV, DualPipeV), unmodified, at 2 and 4 ranks, their
losses, outputs and gradients bit-equal to the same pipeline on gloo; and what pipelining asks of
the backend (objects, batched sends and receives with tags) with asynchronous work in flight.

One job per world size (a torchrun launch at 2 ranks; at 4, ranks forked from the lab's forkserver
with torchrun's environment, tests/torch_ranks.py) runs tests/pipeline_job.py, whose every rank compares its own
stages against their gloo twins and writes what it found. The fix behind it, every operation
writing into a leaf tensor that requires grad, is checked directly under ``lab.spawn``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pipeline_job
import pytest
import torch
import torch.distributed as dist
import torch_ranks

import lab

HERE = os.path.dirname(os.path.abspath(__file__))
#: Child processes import the lab under test (this checkout), not another installed copy.
CHILD_ENV = {
    **os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                 os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
WORLD_SIZES = (2, 4)
#: The world size launched by torchrun itself (the other: tests/torch_ranks.py).
TORCHRUN_SIZE = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Callable:
    """Each world size's per-rank results, made when first asked: a real torchrun launch at
    :data:`TORCHRUN_SIZE`, the other size's ranks forked with torchrun's environment
    (tests/torch_ranks.py: the same job, without an agent and a torch import per rank)."""
    launched: dict[int, list[dict[str, str]]] = {}

    def of(n: int) -> list[dict[str, str]]:
        if n not in launched:
            out = tmp_path_factory.mktemp(f"pipeline{n}")
            exits, logs = torch_ranks.launch(os.path.join(HERE, "pipeline_job.py"), pipeline_job.main, n, out,
                                             CHILD_ENV, torchrun=n == TORCHRUN_SIZE)
            reports = [f"exit {code}:\n{log}" for code, log in zip(exits, logs, strict=True)]
            launched[n] = [
                json.loads((out / f"rank{rank}.json").read_text()) if
                (out /
                 f"rank{rank}.json").exists() else {"launch": f"rank {rank} wrote nothing: {reports[rank]}"}
                for rank in range(n)]
        return launched[n]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", list(pipeline_job.CHECKS))
def test_every_pipelining_check_on_every_rank(results, n, name):
    """A schedule: losses, outputs and gradients bit-equal to gloo's; the p2p check: its values."""
    outcomes = {
        rank: per_rank.get(name, per_rank.get("launch", "not run"))
        for rank, per_rank in enumerate(results(n))}
    failures = {rank: outcome for rank, outcome in outcomes.items() if outcome != "ok"}
    assert not failures, "\n".join(f"rank {rank}: {outcome}" for rank, outcome in failures.items())


# -- the receive that pipelining needs: into a tensor that requires grad -------------------------


def write_into_leaves_that_require_grad(mesh: lab.Mesh) -> list[str]:
    """Every operation that writes its output into a leaf tensor requiring grad (pipelining's
    receive buffers, a broadcast parameter), small (7 elements: a collective runs on the caller's
    thread) and large (40,000: on the communication thread): gloo writes them; the lab must too,
    values as the pattern says."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    lab.backend.init_process_group(mesh)
    right, left = (rank + 1) % n, (rank - 1) % n
    try:
        for count in (7, 40_000):
            wrong += write_every_output(count, rank, n, left, right)
    finally:
        dist.destroy_process_group()  # (the mesh stays open: the pool's)
    return wrong


def write_every_output(count: int, rank: int, n: int, left: int, right: int) -> list[str]:
    def pattern(r: int, scale: int = 1) -> torch.Tensor:
        return torch.arange(count * scale, dtype=torch.float32) * 3 + r

    def leaf(scale: int = 1, like: torch.Tensor | None = None) -> torch.Tensor:
        tensor = torch.zeros(count * scale, requires_grad=True)
        if like is not None:
            with torch.no_grad():
                tensor.copy_(like)
        return tensor

    try:
        received = leaf()
        for work in [dist.irecv(received, src=left), dist.isend(pattern(rank), dst=right)]:
            work.wait()
        outputs = {"irecv": (received, pattern(left))}
        reduced = leaf(like=pattern(rank))
        dist.all_reduce(reduced)
        outputs["all_reduce"] = (reduced, sum(pattern(r) for r in range(n)))
        broadcast = leaf(like=pattern(rank))
        dist.broadcast(broadcast, src=n - 1)
        outputs["broadcast"] = (broadcast, pattern(n - 1))
        gathered = leaf(n)
        dist.all_gather_into_tensor(gathered, pattern(rank))
        outputs["all_gather_into_tensor"] = (gathered, torch.cat([pattern(r) for r in range(n)]))
        scattered = leaf()
        dist.reduce_scatter_tensor(scattered, pattern(rank, n))
        outputs["reduce_scatter_tensor"] = (scattered, sum(pattern(r, n)
                                                           for r in range(n))[rank * count:][:count])
    except RuntimeError as exc:
        return [f"rank {rank}, {count} elements: {type(exc).__name__}: {exc}"]
    return [
        f"rank {rank}, {name} of {count}: {got[:4].tolist()} instead of {want[:4].tolist()}"
        for name, (got, want) in outputs.items() if not torch.equal(got.detach(), want)]


@pytest.mark.parametrize("n", [2, 3])
def test_operations_write_into_leaves_that_require_grad(n):
    assert lab.spawn(write_into_leaves_that_require_grad, n, recv_timeout_ms=20_000) == [[]] * n
