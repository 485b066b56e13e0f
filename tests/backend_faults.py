"""One rank of tests/test_backend.py's failure cases: plain processes (no torchrun, which would
stop the others at once) meeting through ``tcp://`` or ``file://``; each prints one line
``RESULT <what happened>``.

``how``: "ok" (an all_reduce), "mismatch" (the last rank's tensor is longer), "killed" and
"ddp-killed" (the last rank SIGKILLs itself before an all_reduce or DDP's backward), "lane-killed"
(the same before an all_reduce like one before, which runs from its lane), "silent" (the
last rank sleeps far past the others' 2 s deadline).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import lab
from lab.collectives.prepared import find_lane


def faulty_rank(rank: int, n: int, init: str, how: str) -> None:
    # the store waits as long as a loaded machine needs to start three torch processes; the lab's
    # silence deadline (pg_options wins over timeout=) is 2 s where a silent rank must be timed out,
    # and 60 s elsewhere: a death or a mismatch is seen without it, and ranks a loaded machine holds
    # up between init and the fault (DDP's constructor) must not time each other out before it
    deadline_ms = 2000 if how == "silent" else 60_000
    dist.init_process_group("lab", init_method=init, rank=rank, world_size=n, timeout=timedelta(seconds=120),
                            pg_options=lab.backend.Options(recv_timeout_ms=deadline_ms))
    odd = rank == n - 1
    start = time.monotonic()
    try:
        if how == "ok":
            x = torch.arange(4.0) + rank
            dist.all_reduce(x)
            print("RESULT ok", x.tolist(), flush=True)
            return
        if how == "mismatch":
            dist.all_reduce(torch.ones(11 if odd else 10))
        elif how in ("killed", "ddp-killed"):
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(
                8, 4)) if how == "ddp-killed" else None
            if odd:
                os.kill(os.getpid(), signal.SIGKILL)
            if model is None:
                dist.all_reduce(torch.ones(10))
            else:
                model(torch.ones(2, 8)).sum().backward()
        elif how == "lane-killed":  # the call after the death runs from the lane the first one made
            x = torch.ones(10)
            dist.all_reduce(x)
            dist.barrier()
            if odd:
                os.kill(os.getpid(), signal.SIGKILL)
            if find_lane(dist.group.WORLD.mesh, "allreduce", x, "sum", "auto") is None:
                print("RESULT no lane for the second all_reduce", flush=True)
                return
            dist.all_reduce(x)
        elif how == "silent":
            if odd:  # silent far past the deadline: the others must end with DeadlineError, not see it go
                time.sleep(60)
                os._exit(0)
            dist.all_reduce(torch.ones(10))
        print("RESULT no error", flush=True)
    except Exception as exc:  # noqa: BLE001 - whatever the fault raised is the result
        text = str(exc).replace(chr(10), " | ")
        print(f"RESULT {type(exc).__name__} after {time.monotonic() - start:.1f} s: {text}", flush=True)
        os._exit(0)  # a peer may be gone: skip the process group's teardown
