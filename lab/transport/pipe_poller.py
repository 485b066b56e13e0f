"""Waiting on the ``"shm"`` transport's pipes: spin briefly, then block in ``poll``.

On two shared cores, a peer's answer usually comes within a few scheduler slices: a wait that
polls without blocking (each poll followed by ``sched_yield``, which hands the core to that peer)
answers in microseconds, where blocking at once pays a wake-up. ``LAB_SHM_SPIN`` sets how many
such polls come first (see docs/how-it-works.md for the measurement behind the default).

    poller = PipePoller(read_fd, lock)                 # peer -> the fd its pipe is read from
    ready = poller.readable(frozenset({1, 2}), silence)   # [] once the silence's wait is up
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Mapping

from lab import checks
from lab.transport.base import Silence
from lab.transport.waiters import Waiters

#: Non-blocking polls before a wait blocks (``LAB_SHM_SPIN`` overrides).
DEFAULT_SPIN = 50
#: A wait on the pipes looks at the shared memory this often: a peer that took the compiled path
#: or the two-shot for this collective (or left an earlier one's message there) has nothing to send here.
SHARED_LOOK_S = 0.01


class PipePoller:
    """Waits for the pipes of a set of peers: one ``poll`` object per set awaited, and per thread
    (one object must not be polled by two threads at once). ``lock``: the transport's, which the
    waiting thread holds and lets go of while it waits (other threads' calls go on meanwhile:
    :mod:`lab.transport.base`'s Threads); ``waiters``: who to wake when a thread drained what
    another waits for (:mod:`lab.transport.waiters`)."""
    def __init__(self, read_fd: Mapping[int, int], lock: threading.RLock) -> None:
        self._read_fd, self._lock, self.waiters = read_fd, lock, Waiters()
        self._peer_of_fd = {fd: peer for peer, fd in read_fd.items()}
        self._local = _ThreadPollers()
        self._spin = spin_from_env()

    def readable(self, peers: frozenset[int], silence: Silence) -> list[int]:
        """The peers of ``peers`` whose pipes have something (data or end-of-file), or none once
        ``silence``'s next wait is up, or another thread woke this one (its messages may be queued).
        Spin first (``LAB_SHM_SPIN`` polls, each followed by ``sched_yield``), then block in ``poll``."""
        pollers = self._local.by_peers
        poller = pollers.get(peers)
        if poller is None:
            poller = pollers[peers] = select.poll()
            for fd in (*(self._read_fd[peer] for peer in peers), self.waiters.fd):
                poller.register(fd, select.POLLIN)
        events = None
        wake_fd = self.waiters.wait_begins()
        self._lock.release()
        try:
            for _ in range(self._spin):
                events = poller.poll(0)
                if events:
                    break
                os.sched_yield()
            if not events and not silence.expired():
                events = poller.poll(min(silence.wait_s(), SHARED_LOOK_S) * 1000)
        finally:
            self._lock.acquire()
            self.waiters.wait_ends(bool(events) and any(fd == wake_fd for fd, _ in events))
        return [self._peer_of_fd[fd] for fd, _ in events if fd in self._peer_of_fd] if events else []


class _ThreadPollers(threading.local):
    """A thread's ``poll`` objects, by the set of peers they wait for."""
    def __init__(self) -> None:
        self.by_peers: dict[frozenset[int], select.poll] = {}


def spin_from_env() -> int:
    """``LAB_SHM_SPIN``: how many non-blocking polls (each followed by ``sched_yield``) a wait tries
    before it blocks; default 50, which measured fastest at 2, 4 and 8 ranks on 2 quiet cores (see docs/how-it-works.md)."""
    return checks.env_int("LAB_SHM_SPIN", DEFAULT_SPIN)


def write_whole_or_skip(fd: int, frame: bytes) -> None:
    """Write ``frame`` (at most ``PIPE_BUF`` bytes: a pipe takes it whole or not at all) to the
    pipe ``fd`` without blocking; a pipe with no room for it, or whose reader is gone, is skipped
    (what a failing rank tells its peers is best effort)."""
    os.set_blocking(fd, False)
    try:
        os.write(fd, frame)
    except OSError:
        pass
    finally:
        os.set_blocking(fd, True)
