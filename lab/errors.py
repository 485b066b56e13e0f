"""The lab's exceptions. ``LabError`` is the base of every error a collective raises."""

from __future__ import annotations


class LabError(Exception):
    """Base class of the lab's errors."""


class DeadlineError(LabError, TimeoutError):
    """A receive waited longer than ``recv_timeout_ms``.

    The message names the waiting rank, the peer it waited for, the collective and its step.
    """


class PeerLostError(LabError, ConnectionError):
    """A peer process died or closed its connection while this rank needed it."""


class CollectiveMismatchError(LabError):
    """Two ranks are in different collectives (or dtypes, sizes, ops, roots) at the same point."""


class RankError(LabError):
    """A rank failed inside :func:`lab.spawn` or :meth:`lab.Cluster.run`.

    Attributes: ``rank`` (the first rank that failed), ``exc_type`` (the original exception's
    class name), ``exc_message``, ``remote_traceback`` (the traceback text from the rank) and
    ``exitcode`` (set when the process died instead of raising).
    """

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        remote_traceback: str = "",
        exitcode: int | None = None,
        others: str = "",
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others = others
        text = f"rank {rank} failed: {exc_type}: {exc_message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        if others:
            text += f"\n\n--- other ranks ---\n{others.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (
            type(self),
            (self.rank, self.exc_type, self.exc_message, self.remote_traceback, self.exitcode, self.others),
        )
