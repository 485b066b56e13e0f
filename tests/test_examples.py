"""Every example runs as a user would run it, from a fresh checkout, and says what it shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
