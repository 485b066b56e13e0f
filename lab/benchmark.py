"""The one timing harness behind ``bench/`` and ``python -m lab results`` (nccl-tests' rules).

- Time inside the ranks, around each call of a back-to-back loop (the collective itself keeps
  ranks in step; one gloo barrier aligns them before the loop), after warm-up calls that absorb
  Numba dispatch and first touch of buffers. Process start and task dispatch are never timed.
- A call's time is the slowest rank's; report the median (and p10, p90) over calls.
- Sizes are the full tensor T, as nccl-tests counts them (:mod:`lab.catalog`): allreduce and
  broadcast move a T-byte tensor, allgather and gather gather T/N per rank into T, reduce_scatter
  reduces T into T/N per rank, scatter splits the root's T.
- algbw = T / time; busbw = algbw × the collective's bus factor (:mod:`lab.catalog`: 2(N-1)/N
  for allreduce), comparable with the link bandwidth whatever N is. A barrier moves no bytes: its
  size is 0 and its bandwidths 0.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.collectives import calls as collectives
from lab.collectives import plans
from lab.comm.mesh import Mesh
from lab.reference import ensure_gloo, gloo_collective

#: 1 KB to 16 MB in powers of 4, as the lesson's exercise asks.
SIZES = [1 << k for k in range(10, 25, 2)]
COLLECTIVES = registry.COLLECTIVES
#: Every collective's algorithms, by name (reduce and barrier have one each): the registry's.
ALGORITHMS = registry.ALGORITHMS


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio (:mod:`lab.catalog`'s)."""
    return CATALOG[collective].bus_factor(world_size)


def iterations_for(nbytes: int) -> tuple[int, int]:
    """(timed calls, warm-up calls) for a size: many for small sizes, enough for a stable median."""
    if nbytes <= 64 << 10:
        return 100, 10
    if nbytes <= 1 << 20:
        return 30, 5
    return 10, 2


def _input(collective: str, nbytes: int, world_size: int, rank: int) -> torch.Tensor:
    numel = max(CATALOG[collective].input_bytes(nbytes, world_size) // 4, 1)  # one element at least
    return torch.arange(numel, dtype=torch.float32).mul_(1e-6).add_(rank)


def time_collective(mesh: Mesh, collective: str, impl: str, nbytes: int, algorithm: str = "auto",
                    iterations: int | None = None, warmup: int | None = None) -> list[int]:
    """In one rank: the duration (ns) of each timed call of ``collective`` through ``impl``.

    ``impl`` is ``"lab"`` (the plain call), ``"plan"`` (an allreduce plan, ``lab.allreduce_init``,
    made before the loop) or ``"gloo"``; ``algorithm`` applies to the lab's collectives that
    have several (reduce and barrier have one each).
    """
    default_iterations, default_warmup = iterations_for(nbytes)
    iterations = default_iterations if iterations is None else iterations
    warmup = default_warmup if warmup is None else warmup
    ensure_gloo(mesh)  # for the barrier, and for impl == "gloo"
    x = _input(collective, nbytes, mesh.world_size, mesh.rank)
    plan = None
    if impl == "gloo":

        def call() -> Any:
            return gloo_collective(mesh, collective, x)
    elif impl == "plan":
        if collective != "allreduce":
            raise ValueError(f"impl 'plan' times allreduce plans only; got {collective!r}")
        call = plan = plans.allreduce_init(mesh, x, algorithm=algorithm)
    elif not registry.choosable(collective):  # reduce and barrier: one algorithm, no argument
        call = {
            "reduce": lambda: collectives.reduce(mesh, x, dst=0),
            "barrier": lambda: collectives.barrier(mesh)}[collective]
    else:
        root = CATALOG[collective].root
        options = {root: 0} if root else {}

        def call() -> Any:
            return getattr(collectives, collective)(mesh, x, algorithm=algorithm, **options)

    durations = []
    dist.barrier()
    for i in range(warmup + iterations):
        start = time.perf_counter_ns()
        call()
        elapsed = time.perf_counter_ns() - start
        if i >= warmup:
            durations.append(elapsed)
        if CATALOG[collective].reduces and not CATALOG[collective].returns:
            x.mul_(1.0 / mesh.world_size)  # reduced in place: keep sums bounded across calls
    if plan is not None:
        plan.free()
    return durations


def summarize(per_rank: list[list[int]], collective: str, nbytes: int, world_size: int) -> dict[str, float]:
    """Per-call slowest rank -> median, p10, p90 in µs, algbw and busbw in GB/s of the median."""
    slowest = np.max(np.array(per_rank, dtype=np.float64), axis=0) / 1e3
    median = float(np.median(slowest))
    algbw = nbytes / (median * 1e3)
    return {
        "median_us": median, "p10_us": float(np.percentile(slowest,
                                                           10)), "p90_us": float(np.percentile(slowest, 90)),
        "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(collective, world_size), "calls": len(slowest)}


def measure(cluster: Any, collective: str, impl: str, nbytes: int, algorithm: str = "auto",
            iterations: int | None = None) -> dict[str, Any]:
    """Run one case on a pool (``lab.launch``) and summarize it: the unit every sweep is made of."""
    per_rank = cluster.run(time_collective, collective, impl, nbytes, algorithm, iterations)
    row = {
        "collective": collective, "impl": impl, "algorithm": "gloo" if impl == "gloo" else algorithm,
        "transport": "gloo" if impl == "gloo" else cluster.transport, "world": cluster.world_size,
        "bytes": nbytes if CATALOG[collective].moves_bytes else 0}
    return {**row, **summarize(per_rank, collective, row["bytes"], cluster.world_size)}


def copy_bandwidth(nbytes: int = 16 << 20, repeats: int = 20) -> float:
    """GB/s of one numpy copy of ``nbytes`` in this process (bytes copied per second), median of
    ``repeats``: the memory floor the large-tensor reports measure against."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter_ns()
        np.copyto(dst, src)
        times.append(time.perf_counter_ns() - start)
    return nbytes / float(np.median(times[2:]))


# -- reduction kernels alone (in this process) -----------------------------------------------------


def time_kernel(impl: str, nbytes: int, inputs: int = 2, repeats: int | None = None) -> dict[str, float]:
    """Median time and GB/s (bytes of all inputs read per second) of one float32 sum reduction.

    ``impl``: ``"python"`` (a loop), ``"numpy"`` (``np.add(..., out=)``, chained for more than two
    inputs) or ``"numba"`` (``sum_into``; ``sum3_into`` fuses four inputs into one pass).
    """
    from kernels.python import NUMPY_KERNELS, PYTHON_KERNELS
    from kernels.reduce import sum3_into, sum_into

    numel = nbytes // 4
    rng = np.random.default_rng(0)
    dst, *srcs = (rng.random(numel, dtype=np.float32) for _ in range(inputs))
    if impl == "python":

        def call() -> None:
            for src in srcs:
                PYTHON_KERNELS["sum"](dst, src)
    elif impl == "numpy":

        def call() -> None:
            for src in srcs:
                NUMPY_KERNELS["sum"](dst, src)
    elif inputs == 4:

        def call() -> None:
            sum3_into(dst, *srcs)
    else:

        def call() -> None:
            for src in srcs:
                sum_into(dst, src)

    if repeats is None:
        repeats = 3 if impl == "python" else max(20, min(200, (64 << 20) // max(nbytes, 1)))
    call()  # warm-up: page faults, Numba dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    median_s = float(np.median(times)) / 1e9
    return {"median_us": median_s * 1e6, "GBps": inputs * nbytes / median_s / 1e9}


# -- training patterns: bucketing and overlap --------------------------------------------------------


def transformer_gradients(layers: int = 167, width: int = 64) -> list[torch.Tensor]:
    """A transformer's parameter list, shape for shape: per layer QKV and output projections, two
    LayerNorms and a 4x MLP, weights and biases (12 tensors a layer; 167 layers: 2,004 tensors)."""
    d = width
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,),
              (d,)]
    return [torch.randn(shape) for _ in range(layers) for shape in shapes]


def time_bucketing(mesh: Mesh, bucketed: bool, repeats: int = 3,
                   bucket_bytes: int | None = None) -> list[int]:
    """In one rank: ns per full gradient sync, one allreduce per tensor or one per bucket."""
    from lab.bucketing import DEFAULT_BUCKET_BYTES, allreduce_coalesced

    ensure_gloo(mesh)
    grads = transformer_gradients()
    durations = []
    dist.barrier()
    for i in range(repeats + 1):  # the first is warm-up
        start = time.perf_counter_ns()
        if bucketed:
            allreduce_coalesced(mesh, grads, op="avg", bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
        else:
            for grad in grads:
                collectives.allreduce(mesh, grad, op="avg")
        if i:
            durations.append(time.perf_counter_ns() - start)
    return durations


def time_overlap(mesh: Mesh, mode: str, steps: int = 5, layers: int = 8, width: int = 512,
                 batch: int = 64) -> list[int]:
    """In one rank: ns per backward pass plus gradient averaging of an MLP.

    ``mode``: ``"compute"`` (backward alone, no communication), ``"sequential"`` (backward, then one
    allreduce per gradient) or ``"overlap"`` (each gradient's allreduce starts, asynchronously, the
    moment backward has produced it, as DDP's bucket-ready hooks do; then wait for all).
    """
    ensure_gloo(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)])
    works: list = []
    if mode == "overlap":
        for parameter in model.parameters():
            parameter.register_post_accumulate_grad_hook(lambda p: works.append(
                collectives.allreduce(mesh, p.grad, op="avg", async_op=True)))
    x = torch.randn(batch, width)
    durations = []
    dist.barrier()
    for i in range(steps + 1):  # the first is warm-up
        model.zero_grad()
        loss = model(x).square().mean()
        start = time.perf_counter_ns()
        loss.backward()
        if mode == "sequential":
            for parameter in model.parameters():
                collectives.allreduce(mesh, parameter.grad, op="avg")
        for work in works:
            work.wait()
        works.clear()
        if i:
            durations.append(time.perf_counter_ns() - start)
    return durations
