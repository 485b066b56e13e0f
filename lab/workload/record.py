"""Recording a workload: each rank's operations as issued, and the compute between them.

A :class:`Recorder` belongs to one rank. The lab calls :meth:`Recorder.operation` when a call
is issued, :meth:`Recorder.wait` when the program waits on one, and :meth:`Recorder.returned`
when control goes back to the program; the time between a return and the next call is compute
(the program's own work: forward, backward, optimizer). :meth:`Recorder.mark_step` ends a step.
Lines are kept in memory and written at each step's end and at :meth:`Recorder.close`, one
``write`` each (``O_APPEND``: the ranks' writes to one file do not interleave within a line),
so a recording costs a few microseconds a call and no system call in between.

    recorder = Recorder("step.jsonl", rank=0, world_size=4)
    index = recorder.operation("allreduce", [0, 1, 2, 3], "float32", 1024, 1024, reduce_op="sum",
                               is_async=True)
    recorder.returned()                # the Work went back to the program
    ...                                # compute
    recorder.wait(index); recorder.returned()
    recorder.mark_step()
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from lab.workload.format import FORMAT, VERSION


def write_header(
    path: str | Path, world_size: int, dims: dict[str, int] | None = None, recorded: dict | None = None
) -> None:
    """Start the workload file at ``path`` (truncating it): its header line. One process does it,
    before any rank records (the pool's parent, or rank 0 under a launcher, before the others)."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "dims": dims,
        "recorded": recorded or {},
    }
    Path(path).write_text(json.dumps(header) + "\n")


class Recorder:
    """One rank's recording into ``path`` (see the module's docstring)."""

    def __init__(self, path: str | Path, rank: int, world_size: int, clock=time.perf_counter_ns) -> None:
        self.path, self.rank, self.world_size, self._clock = str(path), rank, world_size, clock
        self._lock = threading.Lock()  # (two program threads may issue on one mesh)
        self._lines: list[str] = []
        self._start = clock()
        self._returned = self._start  # when the program last got control back
        self._inside = 0  # lab calls in progress (a composite call issues others inside it)
        self.step, self.issued = 0, 0

    def _now_us(self) -> float:
        return (self._clock() - self._start) / 1e3

    def _compute_us(self, now: int) -> float:
        """The program's time since it last got control back, once: what it spent outside the lab."""
        if self._inside:
            return 0.0
        return max(now - self._returned, 0) / 1e3

    def _line(self, row: dict) -> None:
        self._lines.append(json.dumps(row, separators=(",", ":")))

    def operation(
        self,
        op: str,
        group: Sequence[int],
        dtype: str,
        count: int,
        out_count: int,
        *,
        is_async: bool,
        dim: str | None = None,
        reduce_op: str | None = None,
        root: int | None = None,
        peer: int | None = None,
        tag: int = 0,
        split_sizes: dict | None = None,
    ) -> int:
        """Note an operation issued now; returns its index (what :meth:`wait` takes)."""
        with self._lock:
            now = self._clock()
            index, self.issued = self.issued, self.issued + 1
            row = {
                "rank": self.rank,
                "step": self.step,
                "kind": "op",
                "index": index,
                "op": op,
                "group": list(group),
                "dim": dim,
                "dtype": dtype,
                "count": int(count),
                "out_count": int(out_count),
                "reduce_op": reduce_op,
                "root": root,
                "async": bool(is_async),
                "compute_us": self._compute_us(now),
                "issued_us": (now - self._start) / 1e3,
            }
            if peer is not None:
                row.update(peer=peer, tag=tag)
            if split_sizes is not None:
                row["split_sizes"] = split_sizes
            self._line(row)
            self._inside += 1
            return index

    def wait(self, index: int) -> None:
        """The program waits on operation ``index`` now."""
        with self._lock:
            now = self._clock()
            self._line(
                {
                    "rank": self.rank,
                    "step": self.step,
                    "kind": "wait",
                    "index": index,
                    "compute_us": self._compute_us(now),
                    "waited_us": (now - self._start) / 1e3,
                }
            )
            self._inside += 1

    def returned(self) -> None:
        """Control went back to the program (a call returned, or its Work did)."""
        with self._lock:
            self._inside = max(self._inside - 1, 0)
            if not self._inside:
                self._returned = self._clock()

    def mark_step(self) -> None:
        """The end of a training step: its line, and the step's lines written."""
        with self._lock:
            now = self._clock()
            self._line(
                {"rank": self.rank, "step": self.step, "kind": "step", "compute_us": self._compute_us(now)}
            )
            self._returned, self.step = now, self.step + 1
            self._flush()

    def _flush(self) -> None:
        if not self._lines:
            return
        data = ("\n".join(self._lines) + "\n").encode()
        self._lines.clear()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.write(fd, data) != len(data):  # (a regular file takes it whole, or the disk is full)
                raise OSError(f"{self.path}: the workload's lines were written in part (disk full?)")
        finally:
            os.close(fd)

    def close(self) -> None:
        """Write what is left (the events after the last step's end, which a replay leaves out)."""
        with self._lock:
            self._flush()
