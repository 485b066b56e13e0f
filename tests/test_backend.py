"""The "lab" torch.distributed backend (lab.backend): torch programs, unmodified, on the lab.

Every operation runs at 2, 3 and 4 ranks (tests/backend_job.py: one job per world size, under
torchrun at 3 ranks, with torchrun's environment in ranks forked from the lab's forkserver at the
others, tests/torch_ranks.py; each rank checks its own output against a formula or a gloo group
over the same ranks); DDP and FSDP2 against one process training on the whole batch. The
failures (a mismatch, a killed peer, a silent one) run as plain processes (tests/backend_faults.py,
forked likewise) meeting through ``tcp://``, and
every surviving rank's call must end in ``DistBackendError`` naming what happened, within the
timeout, with no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import backend_faults
import backend_job
import pytest
import torch.distributed as dist
import torch_ranks

import lab

HERE = os.path.dirname(os.path.abspath(__file__))
#: Child processes import the lab under test (this checkout), not another installed copy.
CHILD_ENV = {
    **os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                 os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
WORLD_SIZES = (2, 3, 4)
#: The world size launched by torchrun itself (the others: tests/torch_ranks.py).
TORCHRUN_SIZE = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict[str, str]]]:
    """Each world size's per-rank results: a real torchrun launch at :data:`TORCHRUN_SIZE`, the
    other sizes' ranks forked with torchrun's environment (tests/torch_ranks.py: the same job,
    without an agent and a torch import per rank)."""
    outcomes = {}
    for n in WORLD_SIZES:
        out = tmp_path_factory.mktemp(f"backend{n}")
        if n == TORCHRUN_SIZE:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                os.path.join(HERE, "backend_job.py"),
                str(out)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=CHILD_ENV)
            reports = [f"exit {done.returncode}:\n{done.stderr[-4000:]}"] * n
        else:
            exits, logs = torch_ranks.run_like_torchrun(backend_job.main, n, (str(out),), out, CHILD_ENV, 600)
            reports = [f"exit {code}:\n{log[-4000:]}" for code, log in zip(exits, logs, strict=True)]
        ranks = []
        for rank in range(n):
            path = out / f"rank{rank}.json"
            ranks.append(
                json.loads(path.read_text()) if path.exists(
                ) else {"launch": f"rank {rank} wrote nothing: {reports[rank]}"})
        outcomes[n] = ranks
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", list(backend_job.CHECKS))
def test_every_operation_on_every_rank(results, n, name):
    failures = {
        rank: per_rank.get(name, per_rank.get("launch", "not run"))
        for rank, per_rank in enumerate(results[n])}
    failures = {rank: outcome for rank, outcome in failures.items() if outcome != "ok"}
    assert not failures, "\n".join(f"rank {rank}: {outcome}" for rank, outcome in failures.items())


def test_import_lab_registers_the_backend():
    assert "LAB" in dist.Backend._plugins
    lab.backend.register()  # idempotent
    with pytest.raises(ValueError, match="algorithms has no collective 'allsum'"):
        lab.backend.Options(algorithms={"allsum": "ring"})
    with pytest.raises(ValueError, match="algorithm"):
        lab.backend.Options(algorithms={"allreduce": "carrier_pigeon"})


# -- failures: plain processes meeting through tcp:// (torchrun would stop the others at once) --


def run_ranks(n: int, how: str, init: str | None = None) -> list[str]:
    """Each rank's ``RESULT`` line of tests/backend_faults.py's ``how`` (or its exit and output),
    its ``n`` ranks forked from the forkserver that imported torch and the lab."""
    init = init or f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"rank{rank}.log" for rank in range(n)]
        processes = [
            torch_ranks.start_forked(backend_faults.faulty_rank, (rank, n, init, how), CHILD_ENV, paths[rank],
                                     f"faulty{rank}") for rank in range(n)]
        if how == "silent":  # the others end first (they were waiting for it): its sleep is not waited out
            torch_ranks.end(processes[:-1], timeout_s=300)  # a hang guard: three ranks on a loaded machine
            processes[-1].kill()
        torch_ranks.end(processes, timeout_s=300)
        return torch_ranks.result_lines(processes, paths, 2000)


@pytest.mark.slow
@pytest.mark.parametrize("init", ["tcp", "file"])
def test_init_methods(init, tmp_path):
    method = f"tcp://127.0.0.1:{free_port()}" if init == "tcp" else f"file://{tmp_path / 'store'}"
    assert run_ranks(3, "ok", method) == ["ok [3.0, 6.0, 9.0, 12.0]"] * 3


@pytest.mark.slow  # a torch job of its own, waiting for its ranks to agree they failed
def test_a_mismatch_ends_every_rank_s_call_with_the_lab_s_error():
    """gloo aborts the process with ``terminate called`` on a size mismatch; the lab raises."""
    outputs = run_ranks(3, "mismatch")
    assert all(o.startswith("DistBackendError") for o in outputs), outputs
    assert any("CollectiveMismatchError" in o and "float32[11]" in o and "float32[10]" in o
               for o in outputs), outputs
    assert all("flight recorder" in o for o in outputs), outputs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "ddp-killed", "lane-killed"])
def test_a_dead_peer_ends_every_surviving_call(how):
    outputs = run_ranks(3, how)
    assert outputs[2].startswith("exit -9"), outputs  # the victim
    for output in outputs[:2]:  # in DDP's backward too: an exception, never a crash or a hang
        assert "DistBackendError" in output and ("PeerLostError" in output or
                                                 "DeadlineError" in output), outputs
        assert float(
            output.split(" after ")[1].split(" s")[0]) < 60, output  # not a hang: seen before the deadline


@pytest.mark.slow
def test_a_silent_peer_ends_every_surviving_call_within_the_timeout():
    outputs = run_ranks(3, "silent")
    for output in outputs[:2]:
        assert output.startswith("DistBackendError") and "DeadlineError" in output, outputs
        assert "recv_timeout_ms=2000" in output, output
        assert float(output.split(" after ")[1].split(" s")[0]) < 60, output  # before the silent rank woke


# -- torch's own DistributedTest, a chosen subset (tests/torch_suite.py runs all of it, by hand) --

#: One collective and DDP: each case starts three fresh torch processes (~5 s of CPU each on a slow
#: machine); every operation is checked by tests/backend_job.py above, and the whole suite by hand.
TORCH_SUITE_SUBSET = ["test_all_reduce_sum", "test_DistributedDataParallelCPU"]


@pytest.mark.slow
def test_torch_s_own_distributed_tests_pass_on_the_lab():
    """torch's DistributedTest cases, unmodified, at WORLD_SIZE=3 against BACKEND=lab: each must
    run and pass (a skip would hide that it no longer runs here)."""
    command = [
        sys.executable,
        os.path.join(HERE, "torch_suite.py"), "-v",
        *(f"TestLabBackend.{name}" for name in TORCH_SUITE_SUBSET)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**CHILD_ENV, "WORLD_SIZE": "3"})
    report = done.stderr + done.stdout
    # unittest -v: "name (class) ... " then the ranks' log lines, then "ok" (or FAIL, ERROR, skipped ...)
    starts = [
        (m.start(), m.group(1)) for m in re.finditer(r"^(test_\w+) \(.*?\) \.\.\. ", report, re.MULTILINE)]
    assert starts, f"torch_suite.py ran no test (exit {done.returncode}):\n{report[-4000:]}"
    outcome = {}
    for (start, name), (end, _) in zip(starts, [*starts[1:], (len(report), "")], strict=True):
        lines = [line.strip() for line in report[start:end].splitlines()]
        outcome[name] = "ok" if lines[0].endswith("... ok") or "ok" in lines[1:] else "\n".join(lines[-20:])
    for name in TORCH_SUITE_SUBSET:
        assert outcome.get(name) == "ok", f"{name}: {outcome.get(name, 'did not run')}\n{report[-3000:]}"
    assert done.returncode == 0, report[-4000:]
