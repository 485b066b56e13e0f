"""4-rank jobs whose ranks part, each rank leaving a flight-recorder dump in torch's format.

    python tests/scripts/flight_job.py BACKEND CASE OUT   # BACKEND gloo or lab; CASE skip, size or hang
    python tests/scripts/flight_job.py --all tests/data/flight   # the committed fixtures: OUT/BACKEND/CASE/rank_R

Every rank calls ``all_reduce`` on float32[8] four times with a 3 s timeout, except rank 1:
``skip``: it leaves out the third; ``size``: its third is float32[9]; ``hang``: it stops before
the third and waits (until the others have dumped, at most 60 s). torch 2.13's gloo keeps flight
records (``TORCH_FR_BUFFER_SIZE=100``); a gloo rank dumps what ``_dump_fr_trace`` returns (without
stacks: symbolizing them takes seconds) when its collective fails or its calls are done. A lab rank
dumps by itself when its collective fails (``TORCH_FR_DUMP_TEMP_FILE``), and on request
(:func:`lab.backend.flight_dumps.write_fr_trace`) when its calls are done. On gloo's size mismatch gloo
aborts every process, so there each rank dumps right after issuing the third call (rank 1 issues
its own once the others have dumped: they meet the mismatch first). Files: OUT/rank_<rank>.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 4
CASES = ("skip", "size", "hang")
ODD_RANK = 1


def _dump(backend: str, out: str, rank: int) -> None:
    """This rank's flight records to OUT/rank_<rank>, on request."""
    if backend == "lab":
        import lab.backend.flight_dumps

        lab.backend.flight_dumps.write_fr_trace()  # (TORCH_FR_DUMP_TEMP_FILE names OUT/rank_)
        return
    data = torch._C._distributed_c10d._dump_fr_trace(True, False, False)
    with open(os.path.join(out, f"rank_{rank}.partial"), "wb") as file:
        file.write(data)
    os.replace(os.path.join(out, f"rank_{rank}.partial"), os.path.join(out, f"rank_{rank}"))


def _wait_for_dumps(out: str, ranks: list[int]) -> None:
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out, f"rank_{r}"))
                  for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)


def rank_main(rank: int, backend: str, case: str, out: str, port: int) -> None:
    # torch reads both when the rank's first group is made (a forkserver's rank has the server's environment)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(out, "rank_")
    if backend == "lab":
        import lab  # noqa: F401 - registers the "lab" backend
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=3))
    others = [r for r in range(WORLD_SIZE) if r != ODD_RANK]
    failed = False
    try:
        for call in range(4):
            odd = rank == ODD_RANK and call == 2
            if odd and case == "skip":
                continue
            if odd and case == "hang":
                _wait_for_dumps(out, others)
                break
            tensor = torch.ones(9 if odd and case == "size" else 8)
            if case == "size" and call == 2 and backend == "gloo":  # gloo aborts on the mismatch
                if rank == ODD_RANK:
                    _wait_for_dumps(out, others)
                work = dist.all_reduce(tensor, async_op=True)
                _dump(backend, out, rank)
                work.wait()
            else:
                dist.all_reduce(tensor)
    except Exception:  # noqa: BLE001 - the job parts on purpose: its failure is what is dumped
        failed = True
    if not failed or backend == "gloo":  # (a failed lab rank has dumped by itself)
        _dump(backend, out, rank)
    if rank == ODD_RANK:  # the others' dumps first: its exit would end their wait early
        _wait_for_dumps(out, others)


def run_job(backend: str, case: str, out: str, start_method: str = "spawn") -> None:
    """Run the job of ``case`` on ``backend``; its dumps land in ``out`` (made if missing). The
    tests start its ranks from the forkserver that has imported torch and lab already."""
    os.makedirs(out, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        mp.start_processes(rank_main, args=(backend, case, out, port), nprocs=WORLD_SIZE,
                           start_method=start_method)
    except mp.ProcessExitedException:  # gloo aborts every process on a size mismatch
        pass
    missing = [r for r in range(WORLD_SIZE) if not os.path.exists(os.path.join(out, f"rank_{r}"))]
    if missing:
        raise RuntimeError(f"{backend} {case}: no dump from rank(s) {missing} in {out}")


if __name__ == "__main__":
    if sys.argv[1] == "--all":
        for backend in ("gloo", "lab"):
            for case in CASES:
                run_job(backend, case, os.path.join(sys.argv[2], backend, case))
    else:
        run_job(*sys.argv[1:4])
