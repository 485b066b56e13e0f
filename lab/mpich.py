"""MPICH's allreduce as a second reference next to gloo (the optional ``peers`` extra).

``pip install -e '.[peers]'`` brings MPICH (PyPI's ``mpich``: ``mpiexec`` and ``libmpi``) and
``mpi4py``. :func:`measure` starts ``world_size`` ranks with ``mpiexec``, times
``comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)`` on float32 under the same rules as
:func:`lab.benchmark.time_collective` (warm-up calls, a barrier, each call timed inside every rank,
a call's time is the slowest rank's) and returns a row shaped like :func:`lab.benchmark.measure`'s.
Without MPICH, :func:`unavailable` says why and callers skip it, saying so.

    python -m lab.mpich 1024 4        # one measurement by hand: 1 KB on 4 ranks (prints a JSON row)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: How long one measurement may take before it is abandoned (mpiexec and its ranks are killed).
TIMEOUT_S = 300


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")  # the venv's, from PyPI's mpich
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def unavailable() -> str | None:
    """None if MPICH can be measured here, else the reason (for the skip message)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[peers]')"
    if _mpiexec() is None:
        return "mpiexec is not on PATH (pip install -e '.[peers]' brings MPICH's)"
    return None


def measure(world_size: int, nbytes: int, iterations: int | None = None, per_rank: bool = False) -> Any:
    """Run MPICH's allreduce of an ``nbytes`` float32 tensor on ``world_size`` ranks; one row
    (and, with ``per_rank``, every rank's per-call ns as well, for pytest-benchmark)."""
    from lab.benchmark import iterations_for, summarize

    reason = unavailable()
    if reason:
        raise RuntimeError(f"MPICH cannot be measured: {reason}")
    timed, warmup = iterations_for(nbytes)
    timed = timed if iterations is None else iterations
    command = [
        _mpiexec(), "-n",
        str(world_size), sys.executable, "-m", "lab.mpich", "--rank-side",
        str(nbytes),
        str(timed),
        str(warmup)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mpiexec failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    durations = json.loads(done.stdout.strip().splitlines()[-1])
    row = {
        "collective": "allreduce", "impl": "mpich", "algorithm": "mpich", "transport": "mpich",
        "world": world_size, "bytes": nbytes}
    row = {**row, **summarize(durations, "allreduce", nbytes, world_size)}
    return (row, durations) if per_rank else row


def _rank_side(nbytes: int, iterations: int, warmup: int) -> None:
    """Inside each MPI rank: time the calls; rank 0 prints every rank's durations as JSON."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x = np.arange(max(nbytes // 4, 1), dtype=np.float32) * np.float32(1e-6) + comm.rank
    durations = []
    comm.Barrier()
    for i in range(warmup + iterations):
        start = time.perf_counter_ns()
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        elapsed = time.perf_counter_ns() - start
        if i >= warmup:
            durations.append(elapsed)
        x *= np.float32(1.0 / comm.size)  # keep sums bounded across calls
    gathered = comm.gather(durations)
    if comm.rank == 0:
        print(json.dumps(gathered), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-side"]:
        _rank_side(*(int(a) for a in sys.argv[2:5]))
    else:
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[1]))))
