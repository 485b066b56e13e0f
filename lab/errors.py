"""The lab's exceptions. ``LabError`` is the base of every error a collective raises."""

from __future__ import annotations


class LabError(Exception):
    """Base class of the lab's errors.

    A collective's error that a peer's abort notice told this rank (the peer found the failure,
    this rank raises what it found: :class:`lab.transport.base.AbortNotice`) has ``notice``: the
    rank that found it (``notice.origin``), the kind and the message.
    """


class DeadlineError(LabError, TimeoutError):
    """A receive waited longer than ``recv_timeout_ms``.

    The message names the waiting rank, the peer it waited for, the collective and its step;
    ``peers`` holds the ranks it was waiting for (empty where unknown).
    """
    def __init__(self, message: str = "", peers: tuple[int, ...] | list[int] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(peers)

    def __reduce__(self):
        return type(self), (str(self), self.peers)


class PeerLostError(LabError, ConnectionError):
    """A peer process died or closed its connection while this rank needed it."""


class CollectiveMismatchError(LabError):
    """Two ranks are in different collectives (or dtypes, sizes, ops, roots) at the same point."""


class EmulationUnavailable(LabError):
    """Emulated hosts (``hosts=``) cannot be made here; the message says what is missing and how
    to get it (Linux, iproute2, root or unprivileged user namespaces, veth/bridge/tbf support)."""


class RankError(LabError):
    """A rank failed inside :func:`lab.spawn` or :meth:`lab.Cluster.run`.

    Attributes: ``rank`` (the first rank that failed), ``exc_type`` (the original exception's
    class name), ``exc_message``, ``remote_traceback`` (the traceback text from the rank) and
    ``exitcode`` (set when the process died instead of raising).
    """
    def __init__(self, rank: int, exc_type: str, exc_message: str, remote_traceback: str = "",
                 exitcode: int | None = None, others: str = "", flight_records: dict | None = None) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others = others
        self.flight_records = flight_records or {}
        text = f"rank {rank} failed: {exc_type}: {exc_message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        if others:
            text += f"\n\n--- other ranks ---\n{others.rstrip()}"
        table = format_flight_records(self.flight_records) if self.flight_records else ""
        if table:
            text += "\n\n--- last collectives per rank (flight recorder) ---\n" + table
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.exc_message, self.remote_traceback, self.exitcode,
                             self.others, self.flight_records))


def format_flight_records(records: dict, last: int = 8) -> str:
    """The ranks' last collectives side by side (empty if none ran), one row per sequence number, so the point where
    ranks diverged (different collectives, or one rank stuck at a step) stands out.

    ``records`` maps rank -> list of :class:`lab.flight.FlightRecord`, or a note (a ``str``) when
    the rank could not report (its process died, or it was still busy and was ended).
    """
    seqs = sorted({r.seq for recs in records.values() if not isinstance(recs, str) for r in recs})[-last:]
    if not seqs:
        return ""
    columns = {}
    for rank, recs in sorted(records.items()):
        if isinstance(recs, str):
            columns[rank] = [f"({recs})"] * len(seqs)
        else:
            by_seq = {r.seq: r.cell() for r in recs}
            columns[rank] = [by_seq.get(seq, "-") for seq in seqs]
    width = max([len(f"rank {r}") for r in columns] + [len(c) for col in columns.values() for c in col]) + 2
    seq_width = max(len(str(seqs[-1])) + 2, 6)  # (a long run's numbers pass 6 digits)
    lines = ["seq".ljust(seq_width) + "".join(f"rank {r}".ljust(width) for r in columns)]
    for i, seq in enumerate(seqs):
        lines.append(f"{seq:<{seq_width}}" + "".join(col[i].ljust(width) for col in columns.values()))
    return "\n".join(line.rstrip() for line in lines)
