"""The command line a user runs first: the validation table, green, and its exit status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab.validate import DTYPES, byte_algorithms, cases


def run_lab(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.slow
def test_validation_table_is_green():
    done = run_lab("--world-sizes", "2", "3", "--transports", "shm", "queue")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.rstrip().endswith(("PASS", "FAIL"))]
    per_mesh = len(cases()) * len(
        DTYPES)  # per transport and world size; then one byte row per algorithm and rank
    assert len(rows) == 2 * 2 * per_mesh + 4 * len(byte_algorithms()) and all(row.rstrip().endswith("PASS")
                                                                              for row in rows)
    assert "2T(N-1)/N" in done.stdout and ", 0 failed" in done.stdout


def test_bad_option_is_refused():
    done = run_lab("validate", "--transports", "pigeon")
    assert done.returncode == 2 and "invalid choice" in done.stderr


@pytest.mark.slow
def test_a_first_run_says_it_compiles_and_a_later_one_does_not(tmp_path, monkeypatch):
    """The cache test behind ``python -m lab``'s first line: an empty Numba cache is a first run
    (a minute of compiling, announced), one holding the mailboxes' index is not; and every run's
    first line says how long the compiled plane took."""
    import numba

    from lab.warmup import cache_is_cold

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    assert cache_is_cold()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "mailbox._exchange-833.py311.nbi").write_bytes(b"")
    assert not cache_is_cold()
    done = run_lab("--world-sizes", "2", "--transports", "queue")
    assert done.returncode == 0 and "Compiled data plane ready (" in done.stdout.splitlines()[0]
