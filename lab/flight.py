"""What a rank remembers of its collectives, for failure reports and the JSONL trace.

:class:`Position` says where a rank is (``allreduce #7 (ring) step 3``) for error messages;
:class:`FlightRecord` is one collective as this rank saw it, kept for the last
``FLIGHT_RECORDER_SIZE``; :class:`TraceFile` appends the trace's rows (``trace=`` / ``LAB_TRACE``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

#: How many collectives each rank remembers for failure reports.
FLIGHT_RECORDER_SIZE = 32


class Position:
    """Where a rank is, for error messages: ``allreduce #7 (ring) step 3``. Formatted lazily."""

    __slots__ = ("collective", "seq", "algorithm", "step", "mesh")

    def __init__(self, mesh: str = "") -> None:
        self.collective, self.seq, self.algorithm, self.step = "send/recv", 0, "", 0
        self.mesh = mesh  # "" on the root mesh; a sub-mesh's description

    def __str__(self) -> str:
        algorithm = f" ({self.algorithm})" if self.algorithm else ""
        return f"{self.collective} #{self.seq}{algorithm} step {self.step}" + (f" on {self.mesh}" if self.mesh else "")


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

    def cell(self) -> str:
        """Compact, for a side-by-side table: ``allreduce float32[1000] sum ring FAILED@3 DeadlineError``."""
        parts = [self.collective, f"{self.dtype}[{self.count}]", self.op, f"root={self.root}" if self.root >= 0 else "",
                 self.algorithm]
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
