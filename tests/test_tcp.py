"""The TCP transport on its own: torchrun, a real network interface, strangers and bad frames."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_job.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_torchrun_three_local_processes():
    """Mesh.from_env() under torchrun: every collective matches gloo on every rank."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(SCRIPT)],
        capture_output=True, text=True, timeout=180, env=child_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert sorted(line.split(" of ")[0] for line in done.stdout.splitlines() if line.startswith("OK")) == [
        "OK rank 0", "OK rank 1", "OK rank 2"]
