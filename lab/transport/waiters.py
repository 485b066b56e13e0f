"""Waking a thread that waits in a transport when another thread did what it waits for.

Several threads may drive one transport at once (:mod:`lab.transport.base`'s Threads). A thread
waits in ``poll``/``select`` on its peers' descriptors with the transport's lock let go; another
thread may meanwhile take in what it waits for (drain its messages out of a pipe, park its frame,
finish the frame whose turn it waits for), and the descriptor then says nothing more: the waiter
would see it only at the end of its slice (up to 10 ms on shm, 50 ms on tcp). So each waiting
thread also waits on an eventfd of its own, which the thread that did so sets. Both sides hold the
transport's lock around :meth:`Waiters.wait_begins` and :meth:`Waiters.wake_others`, so no wake-up
is lost: a thread that takes in a message either does so before the waiter looked (who then sees
it) or after it began to wait (and wakes it).

    wake_fd = waiters.wait_begins()     # under the lock; then poll the peers and wake_fd, unlocked
    waiters.wait_ends(woken)            # under the lock again; woken: the poll found wake_fd set
    waiters.wake_others()               # under the lock, having taken in what another may wait for
"""

from __future__ import annotations

import contextlib
import os
import threading


class Waiters:
    """The threads waiting in one transport now, each with its eventfd."""
    def __init__(self) -> None:
        self._waiting: dict[int, int] = {}  # thread ident -> its eventfd, while it waits
        self._own = _ThreadEventFd()

    @property
    def fd(self) -> int:
        """This thread's eventfd (made at its first use, closed when the thread ends)."""
        return self._own.fd

    def wait_begins(self) -> int:
        """This thread waits from now on (until :meth:`wait_ends`): its eventfd, to wait on too."""
        fd = self._waiting[threading.get_ident()] = self._own.fd
        return fd

    def wait_ends(self, woken: bool) -> None:
        """This thread waits no more; ``woken``: its eventfd was found set, and is cleared (the
        wake-up has done its work; one set after its wait ended only wakes its next wait early)."""
        self._waiting.pop(threading.get_ident(), None)
        if woken:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._own.fd)

    def wake_others(self) -> None:
        """Wake every other thread waiting now: what it waits for may have come in."""
        if len(self._waiting) > (threading.get_ident() in self._waiting):
            me = threading.get_ident()
            for ident, fd in list(self._waiting.items()):
                if ident != me:
                    os.eventfd_write(fd, 1)


class _ThreadEventFd(threading.local):
    """Each thread's eventfd (``fd``), made at its first use."""
    def __init__(self) -> None:
        self.own = _EventFd()

    @property
    def fd(self) -> int:
        return self.own.fd


class _EventFd:
    """An eventfd, closed when this goes (a thread's, when the thread ends and its locals go)."""
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def __del__(self) -> None:
        os.close(self.fd)
