"""What the torch.distributed backend costs: ``python -m lab results --backend``.

Two measurements, each in the same rank processes (started by torchrun), each against gloo in
the same run, at 2 ranks (each its own core on a 2-core machine) and at ``--ranks`` (default 4):

- the per-call cost of torch's call on the ``"lab"`` process group against the lab's own call on
  the same mesh and against gloo: ``all_reduce`` at 1 KB and 16 MB, ``broadcast``,
  ``all_gather_single`` and ``reduce_scatter_single`` (torch 2.13's names of
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor``) at 1 KB (of output, of input): rounds
  of calls, each timed inside every rank, the slowest rank's per-call time per round, the median
  over rounds (algbw and busbw as nccl-tests reports them);
- torch's own layer: ``all_reduce`` and ``broadcast`` at 1 KB on a process group whose backend
  does nothing (returns a completed Work at once), the floor under any backend's call;
- a DDP training step (a ~10 M-parameter MLP) on the lab against its twin on gloo: the same
  model, data and optimizer, steps alternating between the two, median step time; and a third
  twin whose communication hook communicates nothing (the compute alone, under both).

Writes ``OUT/backend.csv`` and splices the section "torch.distributed on the lab" into
``OUT/REPORT.md``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

import lab
from lab.backend.work import DoneWork
from lab.catalog import COLLECTIVES as CATALOG
from lab.report_sections import splice

SIZES = (1024, 16 * 1024 * 1024)
MARKER = "backend"
#: torch's collectives as the lab's catalog names them (their bus factors).
LAB_NAMES = {
    "all_reduce": "allreduce", "broadcast": "broadcast", "all_gather_single": "allgather",
    "reduce_scatter_single": "reduce_scatter"}


def _bus_factor(collective: str, world_size: int) -> float:
    return CATALOG[LAB_NAMES[collective]].bus_factor(world_size)


def _slowest(seconds: float, gloo: dist.ProcessGroup) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=gloo)
    return float(value)


#: How long a timed round lasts at least: a round of microsecond calls much shorter than this is
#: one timer tick or preemption away from doubling.
ROUND_SECONDS = 0.05


def _per_call(run, calls: int, rounds: int, gloo: dist.ProcessGroup) -> float:
    """The median over rounds of the slowest rank's time per call, after one warm-up round of
    ``calls`` calls; each timed round makes at least ``calls`` calls and lasts about
    :data:`ROUND_SECONDS` (every rank makes the same number: the slowest rank's warm-up decides)."""
    dist.barrier(group=gloo)
    start = time.perf_counter()
    for _ in range(calls):  # (warms up Numba, buffers, connections)
        run()
    warm = _slowest((time.perf_counter() - start) / calls, gloo)
    calls = max(calls, min(math.ceil(ROUND_SECONDS / warm), 100 * calls))
    times = []
    for _ in range(rounds):
        dist.barrier(group=gloo)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append(_slowest((time.perf_counter() - start) / calls, gloo))
    return statistics.median(times)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 512))


class _DoingNothing(dist.ProcessGroup):
    """A backend whose calls do nothing and return a completed Work: what torch's own layer (its
    Python call, the dispatch to the backend, the Work) costs, under any backend's call."""
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return DoneWork(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist._Work:
        return DoneWork(tensors)

    def getBackendName(self) -> str:
        return "nothing"


def _nothing_group() -> dist.ProcessGroup:
    """A process group of every rank on :class:`_DoingNothing`."""
    if "nothing" not in dist.Backend.backend_list:
        dist.Backend.register_backend("nothing", lambda store, rank, size, timeout: _DoingNothing(rank, size),
                                      devices=["cpu"])
    return dist.new_group(backend="nothing")


def _calls(mesh: object, gloo: dist.ProcessGroup, nothing: dist.ProcessGroup,
           nbytes: int) -> dict[str, tuple[str, Callable]]:
    """Each collective's calls on ``nbytes`` (torch's on the lab, the lab's own, torch's on gloo;
    at 1 KB, torch's on ``nothing`` for all_reduce and broadcast), by collective; a call's tensors
    are made once, as a training loop's are."""
    n = dist.get_world_size()
    x, block = torch.ones(nbytes // 4), torch.ones(max(nbytes // 4 // n, 1))
    whole = torch.empty(block.numel() * n)
    calls = {
        "all_reduce": {
            "dist (lab)": lambda: dist.all_reduce(x), "lab": lambda: lab.allreduce(mesh, x),
            "dist (gloo)": lambda: dist.all_reduce(x, group=gloo)}}
    if nbytes < 65536:  # (the small collectives: the backend's own cost is what shows)
        calls["all_reduce"]["dist (nothing)"] = lambda: dist.all_reduce(x, group=nothing)
        calls["broadcast"] = {
            "dist (lab)": lambda: dist.broadcast(x, 0), "lab": lambda: lab.broadcast(mesh, x, 0),
            "dist (gloo)": lambda: dist.broadcast(x, 0, group=gloo),
            "dist (nothing)": lambda: dist.broadcast(x, 0, group=nothing)}
        calls["all_gather_single"] = {
            "dist (lab)": lambda: dist.all_gather_single(whole, block),
            "lab": lambda: lab.allgather(mesh, block),
            "dist (gloo)": lambda: dist.all_gather_single(whole, block, group=gloo)}
        calls["reduce_scatter_single"] = {
            "dist (lab)": lambda: dist.reduce_scatter_single(block, whole),
            "lab": lambda: lab.reduce_scatter(mesh, whole),
            "dist (gloo)": lambda: dist.reduce_scatter_single(block, whole, group=gloo)}
    return calls


def _bucket_as_it_is(state, bucket):  # (no annotations: DDP checks the hook's, and these would be strings)
    """A DDP communication hook that communicates nothing: the step's compute alone, the floor
    under both backends' steps."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def measure(out: str, steps: int, rounds: int) -> None:
    """One rank's part (under torchrun); rank 0 writes ``out/backend.json``."""
    dist.init_process_group("lab")
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo, nothing = dist.new_group(backend="gloo"), _nothing_group()
    mesh = dist.distributed_c10d._get_default_group().mesh  # the lab group's own mesh
    rows = []
    for nbytes in SIZES:
        for collective, impls in _calls(mesh, gloo, nothing, nbytes).items():
            for impl, run in impls.items():
                seconds = _per_call(run, 200 if nbytes < 65536 else 5, rounds, gloo)
                rows.append({
                    "part": "per call", "collective": collective, "what": impl, "ranks": n, "bytes": nbytes,
                    "median_us": seconds * 1e6, "algbw_GBps": nbytes / seconds / 1e9,
                    "busbw_GBps": nbytes / seconds / 1e9 * _bus_factor(collective, n)})
    # The DDP models live in _ddp_steps and go with it, while the groups still live: a Reducer is freed
    # holding the GIL, and had it held a gloo group's last reference, the group's end would join
    # gloo's threads while one of them, freeing a finished work, waits for the GIL (a rank hung so at
    # exit, torch 2.13). destroy_process_group ends the groups without the GIL.
    rows += _ddp_steps(gloo, steps)
    if rank == 0:
        Path(out, "backend.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _ddp_steps(gloo: dist.ProcessGroup, steps: int) -> list[dict]:
    """The DDP step on the lab, on gloo and communicating nothing, alternating, ``steps`` each after
    two warm-up steps: one row each, the median of the slowest rank's step."""
    rank, n, rows = dist.get_rank(), dist.get_world_size(), []
    models = {
        "lab": torch.nn.parallel.DistributedDataParallel(_mlp()),
        "gloo": torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=gloo),
        "no communication": torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=gloo)}
    models["no communication"].register_comm_hook(None, _bucket_as_it_is)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in models.items()}
    data = torch.Generator().manual_seed(rank)
    step_times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(steps + 2):  # two warm-up steps
        x = torch.randn(32, 1024, generator=data)
        for name, model in models.items():  # alternating: both see the same load
            dist.barrier(group=gloo)
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            if step >= 2:
                step_times[name].append(_slowest(time.perf_counter() - start, gloo))
    parameters = sum(p.numel() for p in models["lab"].parameters())
    for name, times in step_times.items():
        rows.append({
            "part": "DDP step", "collective": "DDP", "what": f"DDP on {name}", "ranks": n,
            "bytes": parameters * 4, "median_us": statistics.median(times) * 1e6, "algbw_GBps": float("nan"),
            "busbw_GBps": float("nan")})
    return rows


def section(table: pd.DataFrame) -> str:
    """REPORT.md's "torch.distributed on the lab"."""
    from lab.results.report import markdown

    lines = [
        "## torch.distributed on the lab", "",
        "`dist.init_process_group(\"lab\")` (`python -m lab results --backend`, `backend.csv`): the per-call "
        "cost of torch's call through the backend against the lab's own call on the same mesh and against "
        "gloo, and a DDP step of a ~10 M-parameter MLP on each, in the same ranks (median of the slowest "
        "rank's time); `dist (nothing)`: torch's call on a backend that does nothing (torch's own layer, "
        f"the floor under any backend's call), measured at load average {table['load_average'].iloc[0]} on "
        f"{table['cores'].iloc[0]} cores.", ""]
    calls = table[table["part"] == "per call"].set_index(["ranks", "collective", "bytes",
                                                          "what"])["median_us"]
    wide = calls.unstack("what").reset_index()
    wide["size"] = wide["bytes"].map(lambda b: f"{b // 1024} KB" if b < 2**20 else f"{b // 2**20} MB")
    wide["lab backend / lab"] = wide["dist (lab)"] / wide["lab"]
    wide["gloo / lab backend"] = wide["dist (gloo)"] / wide["dist (lab)"]
    wide["(lab + nothing) / lab"] = (wide["lab"] +
                                     wide["dist (nothing)"]) / wide["lab"]  # the best ratio torch allows
    columns = [
        "ranks", "collective", "size", "dist (lab)", "lab", "dist (gloo)", "dist (nothing)",
        "lab backend / lab", "(lab + nothing) / lab", "gloo / lab backend"]
    lines += [markdown(wide[columns].round(2)), ""]
    steps = table[table["part"] == "DDP step"].set_index(["ranks", "what"])["median_us"].unstack("what")
    for ranks, step in steps.iterrows():
        lines.append(
            f"- DDP step ({int(table[table['part'] == 'DDP step']['bytes'].iloc[0]) // 4:,} parameters, "
            f"{ranks} ranks): lab {step['DDP on lab'] / 1e3:.1f} ms, gloo {step['DDP on gloo'] / 1e3:.1f} "
            f"ms (the lab {step['DDP on gloo'] / step['DDP on lab']:.2f}x gloo's speed); the same step "
            f"communicating nothing {step['DDP on no communication'] / 1e3:.1f} ms (at most "
            f"{step['DDP on gloo'] / step['DDP on no communication']:.2f}x gloo's speed).")
    return "\n".join([*lines, ""])


def main(out_dir: str = "results", ranks: Sequence[int] = (2, 4), steps: int = 10, rounds: int = 7) -> int:
    """Launch the ranks under torchrun at each of ``ranks``, write ``backend.csv``, splice the
    report's section."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = []
    for n in ranks:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m",
            "lab.results.backend",
            str(out),
            str(steps),
            str(rounds)]
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
        if done.returncode:
            return done.returncode
        table = pd.DataFrame(json.loads((out / "backend.json").read_text()))
        table["load_average"], table["cores"] = round(os.getloadavg()[0], 1), os.cpu_count()  # noise context
        (out / "backend.json").unlink()
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    table.to_csv(out / "backend.csv", index=False)
    print(table.to_string(index=False))
    splice(out / "REPORT.md", section(table), MARKER)
    return 0


if __name__ == "__main__":
    measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
