"""Abort notices over the ``"shm"`` transport's pipes (:class:`lab.transport.base.AbortNotice`):
what a failing rank tells its peers, what a rank has heard, and the root cause it raises for
them. :class:`PipeNotices` is a part of :class:`lab.transport.shm.ShmTransport`, whose pipes,
poller and drain it uses.

    transport.send_notice(AbortNotice.of(error, rank))   # one frame a pipe, whole or not at all
    heard = transport.notices(awaited=[2], grace_s=0.5)
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable

from lab.errors import PeerLostError
from lab.transport.base import AbortNotice, Silence, locked, root_cause
from lab.transport.pipe_poller import PipePoller, write_whole_or_skip
from lab.transport.shm_endpoints import ABORT, DESCRIPTOR


class PipeNotices:
    """The abort notices of an shm transport's rank."""

    rank: int
    _closed: bool
    _notices: list[AbortNotice]  # what failing peers told this rank, in arrival order (its drain keeps them)
    _write_fd: dict[int, int]
    _arrived: dict[int, deque]
    _poller: PipePoller

    def _raise_if_told(self, where: object) -> None:
        """A peer's abort notice has come of a failure other than a deadline: its root cause,
        raised now (the wait is in vain; see :func:`lab.transport.base.root_cause`)."""
        cause = root_cause(self._notices, self.rank, deadlines=False)
        if cause is not None:
            raise cause.error(self.rank, where)

    def send_notice(self, notice: AbortNotice) -> None:
        """One frame per peer, written whole (at most ``PIPE_BUF`` bytes) or not at all: a pipe
        with no room for it, or whose reader is gone, is skipped."""
        if self._closed:
            return
        frame = DESCRIPTOR.pack(ABORT, 0, len(payload := notice.encode()), b"") + payload
        for fd in self._write_fd.values():
            write_whole_or_skip(fd, frame)

    @locked
    def notices(self, awaited: Iterable[int], grace_s: float) -> list[AbortNotice]:
        if self._closed:
            return []
        awaited, grace = frozenset(awaited), Silence(grace_s)
        while True:
            for peer in self._arrived:
                with contextlib.suppress(PeerLostError):  # (what it sent before it went is read)
                    self._drain(peer, "a failure")
            if not awaited or grace.expired() or any(notice.via in awaited for notice in self._notices):
                return list(self._notices)
            self._poller.readable(awaited, grace)
