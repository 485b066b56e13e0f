"""The "lab" backend under torchrun, made twice per job: what outsiders found (issue 33, items 1, 4, 5,
11, 12, 17, 24), and lab.allreduce's refusal of read-only memory (item 12).

The backend's checks run under torchrun, this file its job (``python -m torch.distributed.run
--standalone --nproc-per-node N tests/test_backend_under_torchrun.py OUT TRANSPORT``): each rank makes the
world twice (``destroy_process_group()`` between: item 11), runs every check of :data:`CHECKS` in
each incarnation on its own data (``index * stride + rank``), checks its own output and writes
``OUT/rank<r>.json``. One launch per module run is torchrun's own (:data:`TORCHRUN_LAUNCH`); the
others fork the same job's ranks from the lab's forkserver with torchrun's environment and an
agent store (tests/torch_ranks.py), as does the DDP case with a dead peer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch_ranks
from helpers import free_port, pool

import lab

HERE = os.path.dirname(os.path.abspath(__file__))
STRIDE = 3
INCARNATIONS = 2
DESTROYED = "destroy closes the world's mesh"
#: More than lab.backend.group.RUN_NOW_MAX_BYTES: an all_reduce of it goes to the communication thread.
QUEUED_NUMEL = 24_000

CHECKS: dict[str, Callable[[int, int], None]] = {}


def check(function: Callable[[int, int], None]) -> Callable[[int, int], None]:
    CHECKS[function.__name__] = function
    return function


def pattern(count: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * STRIDE + rank).to(dtype)


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)} {got.reshape(-1)[:6].tolist()}, "
                             f"want {want.dtype}{list(want.shape)} {want.reshape(-1)[:6].tolist()}")


def expect_refused(words: str, what: str, call: Callable[..., object], *args: object,
                   **kwargs: object) -> None:
    """``call(*args, **kwargs)`` raises a ValueError saying ``words``."""
    try:
        call(*args, **kwargs)
    except ValueError as exc:
        if words not in str(exc):
            raise AssertionError(f"{what}: ValueError without {words!r}: {exc}") from exc
        return
    raise AssertionError(f"{what}: not refused")


def still_in_step(rank: int, n: int, what: str) -> None:
    """An all_reduce after a refused call: right only if the refused call sent nothing."""
    x = pattern(6, rank)
    dist.all_reduce(x)
    expect_equal(x, sum(pattern(6, r) for r in range(n)), f"all_reduce after {what}")


# -- item 1: groups of the same members, each with a context of its own -----------------------


@check
def two_groups_of_the_same_members_keep_their_messages_apart(rank: int, n: int) -> None:
    first, second = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    # rank 0 sends on the first group, then on the second; the others receive in the other order:
    # the second group's receive must wait for its own message, not take the first group's
    if rank == 0:
        for peer in range(1, n):
            dist.send(pattern(5, 100 + peer), dst=peer, group=first)
            dist.send(pattern(5, 200 + peer), dst=peer, group=second)
        return
    on_second, on_first = torch.empty(5), torch.empty(5)
    dist.recv(on_second, src=0, group=second)
    dist.recv(on_first, src=0, group=first)
    expect_equal(on_first, pattern(5, 100 + rank), "received on the first group")
    expect_equal(on_second, pattern(5, 200 + rank), "received on the second group")


# -- item 4: every tensor of a list argument checked, in the caller ----------------------------


@check
def list_arguments_of_the_wrong_size_or_dtype_are_refused(rank: int, n: int) -> None:
    x = pattern(4, rank)
    short = [torch.empty(4) for _ in range(n - 1)] + [torch.empty(3)]
    expect_refused("tensor_list[", "all_gather, a short tensor", dist.all_gather, short, x)
    coalesced = [[torch.empty(4), torch.empty(2)] for _ in range(n)]
    coalesced[-1][1] = torch.empty(1)
    expect_refused("output_tensor_lists", "all_gather_coalesced, a short output", dist.all_gather_coalesced,
                   coalesced, [x, pattern(2, rank)])
    expect_refused("must be torch.float32, as", "all_gather_into_tensor, a float64 output",
                   dist.all_gather_into_tensor, torch.empty(4 * n, dtype=torch.float64), x)
    expect_refused("input_list[", "reduce_scatter, a long input", dist.reduce_scatter, torch.empty(4),
                   [pattern(4, rank)] * (n - 1) + [torch.empty(5)])
    expect_refused("output must hold", "all_to_all_single, a short output", dist.all_to_all_single,
                   torch.empty(2 * n - 1), pattern(2 * n, rank))
    still_in_step(rank, n, "the refused collectives")
    # rooted: only the root holds (and checks) the list; the others would wait, so they skip it
    for root in range(n):
        if rank == root:
            expect_refused("gather_list[", f"gather to {root}, a short tensor", dist.gather, x,
                           gather_list=short, dst=root)
            pieces = [pattern(4, 10 * r) for r in range(n - 1)] + [torch.empty(2)]
            expect_refused("scatter_list[", f"scatter from {root}, a short tensor", dist.scatter,
                           torch.empty(4), scatter_list=pieces, src=root)
        still_in_step(rank, n, f"root {root}'s refused gather and scatter")  # nothing of theirs arrived
        out = torch.empty(4)
        pieces = [pattern(4, 10 * r) for r in range(n)] if rank == root else None
        dist.scatter(out, scatter_list=pieces, src=root)
        expect_equal(out, pattern(4, 10 * rank), f"scatter from {root} after the refused one")


# -- item 5: a non-contiguous input read when the collective runs, after the all_reduce before it


def reduced_behind_a_late_rank(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-contiguous tensor (a transpose) with an async all_reduce of it issued, still queued on
    rank 0 (the others issue theirs 0.3 s later), and what it holds once reduced."""
    x = pattern(QUEUED_NUMEL, rank).reshape(-1, 4).t()
    if rank != 0:
        time.sleep(0.3)
    dist.all_reduce(x, async_op=True)
    return x, sum(pattern(QUEUED_NUMEL, r) for r in range(n)).reshape(-1, 4).t()


@check
def a_non_contiguous_input_is_read_after_the_all_reduce_before_it(rank: int, n: int) -> None:
    x, want = reduced_behind_a_late_rank(rank, n)
    outputs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outputs, x)
    for r in range(n):
        expect_equal(outputs[r], want, f"all_gather from {r}")
    x, want = reduced_behind_a_late_rank(rank, n)
    into = torch.empty(n * x.numel())
    dist.all_gather_into_tensor(into, x)
    expect_equal(into, torch.cat([want.reshape(-1)] * n), "all_gather_into_tensor")
    x, want = reduced_behind_a_late_rank(rank, n)
    block = x.numel() // n
    out = torch.empty(block)
    dist.reduce_scatter_tensor(out, x)
    expect_equal(out, n * want.reshape(-1)[rank * block:(rank + 1) * block], "reduce_scatter_tensor")
    x, want = reduced_behind_a_late_rank(rank, n)
    gathered = [torch.empty_like(x) for _ in range(n)] if rank == n - 1 else None
    dist.gather(x, gather_list=gathered, dst=n - 1)
    for r in range(n if rank == n - 1 else 0):
        expect_equal(gathered[r], want, f"gather from {r}")


# -- item 12: an in-place collective on read-only memory ---------------------------------------


def read_only_tensor(count: int, rank: int, directory: str) -> torch.Tensor:
    """``pattern(count, rank)`` over a read-only np.memmap (torch warns that it is not writable)."""
    path = os.path.join(directory, f"read_only_{rank}.f32")
    pattern(count, rank).numpy().tofile(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r"))


@check
def an_all_reduce_on_read_only_memory_is_refused(rank: int, n: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        dist.all_reduce(pattern(8, rank))  # its lane: the read-only tensor below must not take it
        read_only = read_only_tensor(8, rank, directory)
        expect_refused("read-only memory", "all_reduce", dist.all_reduce, read_only)
        expect_refused("read-only memory", "broadcast", dist.broadcast, read_only, src=0)
        expect_equal(read_only, pattern(8, rank), "the refused tensor")
        still_in_step(rank, n, "the refused all_reduce")


# -- item 24: what docs/backend.md says of monitored_barrier ----------------------------------


@check
def monitored_barrier_is_refused_by_torch(rank: int, n: int) -> None:
    expect_refused("only implemented for GLOO backend", "monitored_barrier", dist.monitored_barrier)
    still_in_step(rank, n, "the refused monitored_barrier")


def refuses_read_only_memory(mesh: lab.Mesh) -> list[str]:
    """lab.allreduce and lab.broadcast on a tensor over a read-only np.memmap: refused before
    anything is sent, after a call on writable memory of the same shape made its lane."""
    wrong = []
    with tempfile.TemporaryDirectory() as directory:
        read_only = read_only_tensor(8, mesh.rank, directory)
        for call in (lab.allreduce, lab.broadcast):
            writable = pattern(8, mesh.rank)
            call(mesh, writable)
            call(mesh, writable)  # the lane's call
            name = call.__name__
            try:
                call(mesh, read_only)
                wrong.append(f"rank {mesh.rank}: {name} on read-only memory was not refused")
            except ValueError as exc:
                if "tensor is over read-only memory" not in str(exc):
                    wrong.append(f"rank {mesh.rank}: {name}: {exc}")
        if not torch.equal(read_only, pattern(8, mesh.rank)):
            wrong.append(f"rank {mesh.rank}: the read-only tensor changed")
        for writable in (pattern(8, mesh.rank), torch.from_numpy(pattern(8, mesh.rank).numpy())):
            lab.allreduce(mesh, writable)  # writable memory torch did not allocate passes
            if not torch.equal(writable, sum(pattern(8, r) for r in range(mesh.world_size))):
                wrong.append(f"rank {mesh.rank}: allreduce after the refused calls: {writable.tolist()}")
    return wrong


def ddp_with_a_dead_peer(rank: int, n: int, init: str) -> None:
    """One rank of a DDP job whose last rank dies before the backward: the others print what
    ``except RuntimeError`` caught (item 17), as ``RESULT <type>: <message>``. The death is seen
    without a deadline: a long one, so that ranks a loaded machine holds up in DDP's constructor
    do not time each other out before it."""
    dist.init_process_group("lab", init_method=init, rank=rank, world_size=n, timeout=timedelta(seconds=120),
                            pg_options=lab.backend.Options(recv_timeout_ms=60_000))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    if rank == n - 1:
        os.kill(os.getpid(), 9)
    try:
        model(pattern(16, rank).reshape(2, 8)).sum().backward()
        print("RESULT no error", flush=True)
    except RuntimeError as exc:
        print(f"RESULT {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    os._exit(0)  # a peer is gone: skip the process group's teardown


def main(out: str, transport: str) -> None:
    results: dict[str, str] = {}
    rank = int(os.environ["RANK"])
    for incarnation in range(INCARNATIONS):
        if incarnation and rank == 0:
            time.sleep(1.0)  # the others read the store first: the last incarnation's keys are there
        try:
            dist.init_process_group("lab", timeout=timedelta(seconds=60),
                                    pg_options=lab.backend.Options(transport=transport))
        except Exception as exc:  # noqa: BLE001 - item 11: reported as this incarnation's failure
            results[f"init #{incarnation}"] = "".join(traceback.format_exception(exc))[-3000:]
            break
        n, world = dist.get_world_size(), dist.group.WORLD
        for name, function in CHECKS.items():
            print(f"rank {rank}, incarnation {incarnation}: {name}", file=sys.stderr, flush=True)
            try:
                function(rank, n)
                results[f"{name} #{incarnation}"] = "ok"
            except Exception as exc:  # noqa: BLE001 - every check reports, the next one still runs
                results[f"{name} #{incarnation}"] = "".join(traceback.format_exception(exc))[-3000:]
            dist.barrier()  # a failed check must not leave a rank behind in the next
        dist.destroy_process_group()
        results[f"{DESTROYED} #{incarnation}"] = "ok" if world.mesh.closed else "still open"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)


# -- the tests ---------------------------------------------------------------------------------

LAUNCHES = [(2, "auto"), (3, "auto"), (2, "tcp"), (3, "tcp")]  # "auto" is shm on one host
#: The launch made by torchrun itself (the others: tests/torch_ranks.py).
TORCHRUN_LAUNCH = (3, "auto")
LAUNCH_TIMEOUT_S = 300  # a launch takes 10-30 s; each check's collectives end within the 60 s deadline


def job_env() -> dict[str, str]:
    """Ranks import the lab under test (this checkout), one thread each."""
    paths = [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[int, str], list[dict[str, str]]]:
    """Each launch's per-rank results: :data:`TORCHRUN_LAUNCH` a real torchrun launch, the others'
    ranks forked with torchrun's environment and an agent store of this process's
    (tests/torch_ranks.py: the same job, without a torch import per rank)."""
    env = job_env()
    outcomes = {}
    for n, transport in LAUNCHES:
        out = tmp_path_factory.mktemp(f"backend{n}{transport}")
        if (n, transport) != TORCHRUN_LAUNCH:
            exits, logs = torch_ranks.run_like_torchrun(main, n, (str(out), transport), out, env,
                                                        LAUNCH_TIMEOUT_S)
            reports = [f"exit {code}:\n{log[-4000:]}" for code, log in zip(exits, logs, strict=True)]
        else:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                os.path.abspath(__file__),
                str(out), transport]
            # its own session: a launch that hangs is killed with its ranks, and its log still reported
            launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, start_new_session=True)
            try:
                _, log = launch.communicate(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(launch.pid, signal.SIGKILL)
                _, log = launch.communicate()
            reports = [f"exit {launch.returncode}:\n{log[-4000:]}"] * n
        outcomes[n, transport] = [
            json.loads((out / f"rank{rank}.json").read_text()) if
            (out /
             f"rank{rank}.json").exists() else {"launch": f"rank {rank} wrote nothing: {reports[rank]}"}
            for rank in range(n)]
    return outcomes


EXPECTED = [f"{name} #{i}" for i in range(INCARNATIONS) for name in [*CHECKS, DESTROYED]]


@pytest.mark.slow
@pytest.mark.parametrize("launch", LAUNCHES, ids=[f"{n}-{transport}" for n, transport in LAUNCHES])
@pytest.mark.parametrize("name", EXPECTED)
def test_every_rank_of_every_incarnation(results, launch, name):
    outcomes = {
        rank: per_rank.get(
            name,
            per_rank.get("launch") or next((v
                                            for k, v in per_rank.items() if k.startswith("init")), "not run"))
        for rank, per_rank in enumerate(results[launch])}
    failures = {rank: outcome for rank, outcome in outcomes.items() if outcome != "ok"}
    assert not failures, "\n".join(f"rank {rank}: {outcome}" for rank, outcome in failures.items())


@pytest.mark.parametrize("transport", ["shm", "tcp", "queue"])
@pytest.mark.parametrize("n", [2, 3])
def test_lab_collectives_refuse_read_only_memory(n, transport):
    with pool(n, transport) as cluster:
        assert cluster.run(refuses_read_only_memory) == [[]] * n


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_backward_with_a_dead_peer_raises_what_the_docs_say_to_catch(n, tmp_path):
    """docs/backend.md: DDP's backward raises a RuntimeError whose message carries the
    DistBackendError and the lab's error (torch's C++ reducer converts it)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    paths = [tmp_path / f"rank{rank}.log" for rank in range(n)]
    processes = [
        torch_ranks.start_forked(ddp_with_a_dead_peer, (rank, n, init), job_env(), paths[rank], f"ddp{rank}")
        for rank in range(n)]
    torch_ranks.end(processes, timeout_s=300)  # a hang guard (three ranks on a loaded machine)
    outputs = [path.read_text() if path.exists() else "" for path in paths]
    assert processes[-1].exitcode == -9, outputs[-1][-2000:]  # the victim
    for output in outputs[:-1]:
        results = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert results, output[-2000:]
        caught = "RESULT RuntimeError: Cannot extract tensors from value: DistBackendError: "
        assert results[0].startswith(caught), results
        assert "PeerLostError" in results[0] or "DeadlineError" in results[0], results


if __name__ == "__main__":
    main(*sys.argv[1:])
