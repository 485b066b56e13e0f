"""How rank processes are started, and how they die with their job.

Ranks start from a forkserver that has already imported ``lab`` (torch, numba, the compiled
kernels), so a pool starts in well under a second and no rank compiles anything. The forkserver is
also each rank's parent: a rank dies with it, and it exits with the user's process.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
from multiprocessing import forkserver as mp_forkserver

from lab.errors import LabError

#: How ranks may be started (``LAB_START_METHOD``). Not "fork": every rank would inherit every
#: other rank's channel ends, so a dead rank's pipes would never read end-of-file.
START_METHODS = ("forkserver", "spawn")
_PR_SET_PDEATHSIG = 1


def start_context() -> mp.context.BaseContext:
    """The multiprocessing context that starts ranks (``LAB_START_METHOD``, checked)."""
    method = os.environ.get("LAB_START_METHOD", "forkserver")
    if method not in START_METHODS:
        why = " (with 'fork' every rank inherits the others' channel ends, so a dead rank goes unnoticed)"
        methods = ", ".join(map(repr, START_METHODS))
        raise ValueError(f"environment variable LAB_START_METHOD must be one of {methods}; got {method!r}" +
                         (why if method == "fork" else ""))
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["lab"])
        _check_forkserver()
    return context


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, Z zombie), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def forkserver_pid() -> int | None:
    """The forkserver's pid, or None before the first pool (or with ``LAB_START_METHOD=spawn``)."""
    return getattr(getattr(mp_forkserver, "_forkserver", None), "_forkserver_pid", None)


def _check_forkserver() -> None:
    """A stopped forkserver would block the start of every rank without limit: say so instead.
    (A dead one is restarted by multiprocessing.)"""
    pid = forkserver_pid()
    if pid is not None and process_state(pid) == "T":
        raise LabError(f"the forkserver that starts ranks (pid {pid}) is stopped (SIGSTOP or a debugger); "
                       f"resume it with `kill -CONT {pid}`, or kill it and the next pool starts a new one")


def die_with_parent() -> None:
    """In a rank: ask Linux to SIGKILL it when its parent dies (even by SIGKILL), so no rank
    outlives its job. The parent is the forkserver, which exits once every holder of its "alive"
    pipe is gone: the user's process, and every process it forked, which inherit the pipe. A rank
    drops its copy, so the forkserver (and then the rank) ends when the user's process does."""
    server = getattr(mp_forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)
