"""Every example runs as a user would run it, from a fresh checkout, and says what it shows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch_ranks
from helpers import require_hosts

import lab

# Slow, the whole module: each example run as a user runs it, DDP and FSDP2 among them.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: The torch example launched by torchrun itself (the others: tests/torch_ranks.py).
TORCHRUN_EXAMPLE = "ddp_backend.py"


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_trace_timeline(tmp_path):
    out = run_example("trace_timeline.py", str(tmp_path))
    assert "trace rows" in out and (tmp_path / "timeline.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").exists()


def test_async_overlap():
    lines = run_example("async_overlap.py").splitlines()
    assert len(lines) == 4 and all("issued in" in line for line in lines)


def test_bucketing():
    assert "tensors: one by one" in run_example("bucketing.py")


def test_ddp_hook():
    out = run_example("ddp_hook.py")
    checksums = {line.rsplit(" ", 1)[1] for line in out.splitlines() if line.startswith("rank")}
    assert len(checksums) == 1, out  # every replica ends with the same parameters


def run_under_torchrun(name: str, ranks: int, *args: str) -> str:
    """What the example printed under torchrun (:data:`TORCHRUN_EXAMPLE` under torchrun itself; the
    others' ranks forked from the lab's forkserver with torchrun's environment, tests/torch_ranks.py:
    the same script, without an agent and a torch import per rank)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    if name != TORCHRUN_EXAMPLE:
        with tempfile.TemporaryDirectory() as logs:
            exits, outputs = torch_ranks.run_like_torchrun(torch_ranks.run_script,
                                                           ranks, (str(EXAMPLES / name), list(args)),
                                                           Path(logs), env)
        assert exits == [0] * ranks, f"{name}: exits {exits}\n" + "\n".join(o[-3000:] for o in outputs)
        return "\n".join(outputs)
    # A session of its own: on a timeout torchrun and its ranks end together (SIGKILL to torchrun
    # alone would leave the ranks running).
    with subprocess.Popen([
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            str(EXAMPLES / name), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            stdout, stderr = launcher.communicate()
            raise AssertionError(f"{name} ran past 300 s:\n{stderr[-3000:]}") from None
    assert launcher.returncode == 0, stderr[-3000:]
    return stdout


def losses(out: str) -> list[tuple[float, float]]:
    """Each ``step k: loss on lab X   on gloo Y`` line as (X, Y)."""
    rows = [line.split() for line in out.splitlines() if line.startswith("step ")]
    return [(float(row[5]), float(row[8])) for row in rows]


def test_ddp_and_fsdp2_on_the_lab_backend_match_gloo():
    """The backend examples, as the README runs them (fewer ranks and steps): the lab's loss
    equals gloo's at every step (the same model and data; averaged gradients agree to rounding)."""
    for example in ("ddp_backend.py", "fsdp2_backend.py"):
        steps = losses(run_under_torchrun(example, 2, "--backend", "lab", "--steps", "3"))
        assert len(steps) == 3, example
        assert all(
            abs(lab_loss - gloo_loss) <= 1e-5 * max(1.0, abs(gloo_loss))
            for lab_loss, gloo_loss in steps), steps


@pytest.mark.parametrize("example", [("pipeline_backend.py", "--backend", "lab", "--schedule", "interleaved"),
                                     ("tensor_parallel_backend.py",)])
def test_pipeline_and_tensor_parallel_on_the_lab_backend_equal_gloo(example):
    """As the README runs them, at 2 ranks and 3 steps: the lab's loss is gloo's at every step."""
    steps = losses(run_under_torchrun(example[0], 2, *example[1:], "--steps", "3"))
    assert len(steps) == 3 and all(lab_loss == gloo_loss for lab_loss, gloo_loss in steps), steps


def test_workload_examples_record_on_emulated_hosts_and_replay_at_scale(tmp_path):
    """Each records a few steps on two emulated hosts (fewer than the example's four: 2 cores) and
    prints the measured and replayed step there, then the step on 64 ranks (the example's 1,024
    take about 20 s each; bench/workload_accuracy.py times them) and what dominates."""
    require_hosts()
    for example, ops in (("workload_ddp.py", {"allreduce"}), ("workload_fsdp2.py",
                                                              {"allgather", "reduce_scatter"})):
        path = tmp_path / f"{example}.jsonl"
        out = run_example(example, "--hosts", "2", "--steps", "3", "--ranks", "64", "--out", str(path))
        assert "on 2 hosts: measured" in out and "64 ranks on" in out, out
        assert "step 2:" in out and "dominates:" in out, out
        assert ("MB buckets instead of 1 MB: step" in out) == (example == "workload_ddp.py"), out
        w = lab.workload.load(path)
        assert w.steps == 3 and w.recorded["hosts"] == 2 and w.recorded["link_gbit"] == 1.0
        assert {e.op
                for e in w.events[0] if e.kind == "op" and e.step == 2} == ops  # (step 0: the setup's too)
