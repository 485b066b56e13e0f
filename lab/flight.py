"""What a rank remembers of its collectives, for failure reports and the JSONL trace.

:class:`Position` says where a rank is (``allreduce #7 (ring) step 3``) for error messages;
:class:`FlightRecord` is one collective as this rank saw it, kept for the last
``FLIGHT_RECORDER_SIZE`` by :class:`FlightRecorder`; :class:`TraceFile` appends the trace's rows (``trace=`` / ``LAB_TRACE``).
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

#: How many collectives each rank remembers for failure reports.
FLIGHT_RECORDER_SIZE = 32


class Position:
    """Where a rank is, for error messages: ``allreduce #7 (ring) step 3``. Formatted lazily."""

    __slots__ = ("algorithm", "collective", "mesh", "seq", "step")

    def __init__(self, mesh: str = "") -> None:
        self.collective, self.seq, self.algorithm, self.step = "send/recv", 0, "", 0
        self.mesh = mesh  # "" on the root mesh; a sub-mesh's description

    def __str__(self) -> str:
        algorithm = f" ({self.algorithm})" if self.algorithm else ""
        return f"{self.collective} #{self.seq}{algorithm} step {self.step}" + (f" on {self.mesh}"
                                                                               if self.mesh else "")


@dataclass
class FlightRecord:
    """One collective as this rank saw it: kept for the last ``FLIGHT_RECORDER_SIZE`` collectives."""

    seq: int
    collective: str
    algorithm: str
    dtype: str
    count: int
    op: str
    root: int
    state: str = "running"  # running, done, or failed (ExceptionType)
    step: int = 0  # transfers (sends/receives) started; the step a failure happened at
    start_ns: int = 0  # time.time_ns() when it began and ended (0: not known, a compiled call's)
    end_ns: int = 0

    def cell(self) -> str:
        """Compact, for a side-by-side table: ``allreduce float32[1000] sum ring FAILED@3 DeadlineError``."""
        parts = [
            self.collective, f"{self.dtype}[{self.count}]", self.op,
            f"root={self.root}" if self.root >= 0 else "", self.algorithm]
        if self.state == "done":
            parts.append("ok")
        elif self.state == "running":
            parts.append(f"RUNNING@{self.step}")
        else:
            parts.append(f"FAILED@{self.step} {self.state.removeprefix('failed (').rstrip(')')}")
        return " ".join(p for p in parts if p)

    def __str__(self) -> str:
        what = f"{self.collective} #{self.seq} {self.dtype}[{self.count}]"
        what += f" {self.op}" if self.op else ""
        what += f" root={self.root}" if self.root >= 0 else ""
        what += f" ({self.algorithm})" if self.algorithm else ""
        return f"{what}: {self.state}" + ("" if self.state == "done" else f" at step {self.step}")


class FlightRecorder:
    """The last ``FLIGHT_RECORDER_SIZE`` collectives of one mesh on this rank: those noted here
    (:meth:`note`), merged with those that compiled calls noted themselves in ``ring``, an int64
    array of (seq, record) rows at ``seq % FLIGHT_RECORDER_SIZE``, where ``record`` is the number
    :meth:`book` gave the record's fields; such a collective is done at its one step.

    A number is booked per compiled call that keeps its own books and is given back by
    :meth:`release` when that call goes (a plan freed, a plain call's template forgotten), so the
    books hold the live calls' fields and at most ``FLIGHT_RECORDER_SIZE`` released ones the ring
    still shows: a released number is reused only once no row of the ring holds it."""
    def __init__(self, ring: Any) -> None:
        self._records: deque[FlightRecord] = deque(maxlen=FLIGHT_RECORDER_SIZE)
        self._ring = ring
        self._booked: list[tuple] = []  # by number: a record's fields, after its seq
        self._released: list[int] = []  # numbers no call notes any more
        self._lock = threading.Lock()  # (two threads may make calls on one mesh)

    def note(self, record: FlightRecord) -> FlightRecord:
        self._records.append(record)
        return record

    def book(self, fields: tuple) -> int:
        """The number under which a compiled call notes ``fields`` (a record's, after its seq)."""
        with self._lock:
            in_ring = set(self._ring[:, 1].tolist())
            for index, number in enumerate(self._released):
                if number not in in_ring:
                    del self._released[index]
                    self._booked[number] = fields
                    return number
            self._booked.append(fields)
            return len(self._booked) - 1

    def release(self, number: int) -> None:
        """The call that noted under ``number`` is gone: the number may be booked again. (No
        lock: it may run from the garbage collector inside :meth:`book`; an append is atomic.)"""
        self._released.append(number)

    def records(self, last_seq: int, running_step: int) -> list[FlightRecord]:
        """Oldest first, up to collective ``last_seq``; a running one shows ``running_step``."""
        if self._records and self._records[-1].state == "running":
            self._records[-1].step = running_step
        booked = [
            FlightRecord(seq, *self._booked[record], state="done", step=1)
            for seq, record in self._ring.tolist() if seq > max(0, last_seq - FLIGHT_RECORDER_SIZE)]
        return sorted([*self._records, *booked], key=lambda r: r.seq)[-FLIGHT_RECORDER_SIZE:]


class TraceFile:
    """The JSONL trace at ``path``: one row per collective (and per step with ``steps``)."""
    def __init__(self, path: str, steps: bool) -> None:
        self.path, self.steps = path, steps

    def write(self, **row: Any) -> None:
        line = json.dumps(row)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write per row: appends stay whole across ranks
        finally:
            os.close(fd)
