"""bench/small_messages.py's timing modes run end to end at a few calls and print their table:
each call after a barrier beside back to back (``--compare --parts timing``), and the same with a
busy loop taking a core under named waiting policies (``--burn``, ``--compiled-wait``). No timing
is asserted: the figures are docs/compiled.md's, measured on a quiet machine. Each runs a script
that starts its own pools and MPICH: slow, so the fast loop leaves them to CI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import mpich

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "small_messages.py"


def run_script(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def table_rows(out: str) -> dict[tuple[str, str, str], list[str]]:
    """The table's rows by (impl, algorithm, wait): the cells after those three."""
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ")]
    assert rows[0][:4] == ["impl", "algorithm", "wait", "back to back"], out
    return {tuple(cells[:3]): cells[3:] for cells in rows[1:] if not cells[0].startswith("---")}


@pytest.mark.slow
def test_the_timing_part_prints_both_timings_of_every_case_beside_mpich():
    out = run_script("--compare", "--parts", "timing", "--calls", "5", "--rounds", "1")
    rows = table_rows(out)
    expected = {("lab", "auto", "-"), ("lab", "one_shot", "-"), ("plan", "auto", "-"),
                ("plan", "one_shot", "-"), ("symm", "one_shot", "-")}
    reason = mpich.unavailable()
    if reason is None:
        expected.add(("mpich", "mpich", "-"))
        assert rows["mpich", "mpich", "-"][1] == rows["mpich", "mpich", "-"][3] == "1.00x", out
    else:  # said, not silently left out
        assert f"# MPICH skipped: {reason}" in out
    assert set(rows) == expected, out
    for cells in rows.values():  # back to back, ratio, after a barrier, ratio, own time: all measured
        assert len(cells) == 5 and float(cells[0]) > 0 and float(cells[2]) > 0 and float(cells[4]) > 0, cells
        assert (cells[1] == "-") == (cells[3] == "-") == (reason is not None), cells
        # last start to last return never exceeds the longest own time (which holds the barrier's exit skew)
        assert float(cells[2]) <= float(cells[4]), cells
    # the after-barrier rows: every call compiled once (the barrier's own compiled calls not counted)
    after = out[out.index("# 2 ranks, each call after a barrier"):].splitlines()
    plan = next(line for line in after if line.split()[2:4] == ["plan", "auto"])
    assert plan.split()[10] == "1.00", plan


@pytest.mark.slow
def test_a_busy_loop_runs_beside_each_named_waiting_policy():
    out = run_script("--ranks", "2", "--impls", "plan", "--algorithms", "auto", "--timing", "back-to-back",
                     "after-barrier", "--burn", "1", "--compiled-wait", "spin", "sleep", "--calls", "5",
                     "--rounds", "1")
    assert "1 busy loop(s) running" in out.splitlines()[0], out
    rows = table_rows(out)
    assert set(rows) == {("plan", "auto", policy) for policy in ("spin", "sleep")}, out
    assert all(cells[1] == cells[3] == "-" for cells in rows.values()), out  # no MPICH asked for


def test_the_busy_loops_run_while_the_block_runs_and_are_reaped_after_it():
    spec = importlib.util.spec_from_file_location("small_messages", SCRIPT)
    small_messages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(small_messages)
    with pytest.raises(RuntimeError, match="the block failed"), small_messages.burning(2) as burners:
        assert len(burners) == 2 and all(burner.poll() is None for burner in burners)
        raise RuntimeError("the block failed")  # however the block ends
    assert all(burner.returncode is not None for burner in burners)
