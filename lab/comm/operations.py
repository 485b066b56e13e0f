"""What a rank's issue order tells a recording of its calls, and how a recording starts.

Every collective and point-to-point call of a rank passes once through its issue order
(:class:`lab.comm.issue.IssueQueue`): a mesh's call, a plan's run, the torch backend's operations. Where
the rank records (``lab.spawn(..., workload=)``, ``LAB_WORKLOAD``,
``lab.backend.Options(workload=)``), the queue holds a :class:`Recording`, and each call that
comes with an :class:`Operation` (what the program issued, as global ranks) is noted as issued,
as completed and, where the program waits on its Work, as waited on (:func:`record`). A call made
inside another one's run (the backend's send running the mesh's) is part of it: it is not noted
again.

The recorder and the file's format are :mod:`lab.workload`'s, a higher layer than the mesh's: ``import lab``
hands this module how to write a file's header and how to make a rank's recorder
(:func:`register`), small shims that load :mod:`lab.workload` when a rank first records. This module only calls them,
and keeps the recordings this process makes (:func:`current`).

    what = Operation("allreduce", (0, 1), "float32", 4, 256, 256, reduce_op="sum")
    attach(mesh.issue_queue, "step.jsonl", rank=0, world_size=2)   # the header written already
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from lab.errors import LabError


class Operation(NamedTuple):
    """A call as the program issued it: ``group`` and ``root``/``peer`` as global ranks, element
    counts of the input and of the output, ``itemsize`` bytes an element. ``peer`` None on a
    receive from any source; ``algorithm``: the one the lab runs it with (``auto``'s pick
    resolved; None for a send or receive); and ``learn``: what the call's result adds to the line
    once it completes (the source, the dtype and size a receive learns from its message)."""

    op: str
    group: tuple[int, ...]
    dtype: str
    itemsize: int
    count: int
    out_count: int
    dim: str | None = None
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    tag: int = 0
    split_sizes: dict | None = None
    algorithm: str | None = None
    learn: Callable[[Any], dict] | None = None


class Recording(Protocol):
    """What the issue order asks of a rank's recorder (:class:`lab.workload.record.Recorder`)."""
    def issue(self, what: Operation, is_async: bool) -> int:
        """Note ``what`` issued now; its index."""

    def completed(self, index: int, learned: dict | None = None) -> None:
        """Operation ``index`` completed now (on whichever thread ran it)."""

    def wait(self, index: int) -> None:
        """The program waits on operation ``index`` now."""

    def returned(self) -> None:
        """Control went back to the program."""

    def close(self) -> None:
        """Write what is kept in memory."""


def record(recorder: Recording, what: Operation, is_async: bool, issue: Callable[[Callable[[], Any]], Any],
           run: Callable[[], Any]) -> Any:
    """``issue(run)``, noted in ``recorder`` as ``what``: issued now, completed when ``run`` ends
    (before any waiter wakes), the return to the program when ``issue`` returns; an asynchronous
    call's Work notes its waits (``Work.recorded``)."""
    index = recorder.issue(what, is_async)

    def noted() -> Any:
        learned = None
        try:
            result = run()
            learned = what.learn(result) if what.learn is not None else None
            return result
        finally:
            recorder.completed(index, learned)

    try:
        result = issue(noted)
    finally:
        recorder.returned()
    if is_async:
        result.recorded = (recorder, index)
    return result


# -- starting a recording: the high layer's makers, registered -----------------------------------

#: "header": ``header(path, world_size, recorded=...)``; "recorder": ``recorder(path, rank, world_size)``.
_makers: dict[str, Callable[..., Any]] = {}
#: The recordings this process makes, by absolute path; "current": the latest (what mark_step ends).
_recordings: dict[str, Recording] = {}
#: Header hand-overs through a store this process took part in (each one's key is new).
_handovers = [0]


def register(header: Callable[..., None], recorder: Callable[[str, int, int], Recording]) -> None:
    """How to start a file (``header(path, world_size, recorded=...)``) and how to make a rank's
    recorder: :mod:`lab.workload`'s."""
    _makers.update(header=header, recorder=recorder)


def _maker(name: str) -> Callable[..., Any]:
    if name not in _makers:
        raise LabError("recording a workload needs lab.workload's recorder, which import lab registers")
    return _makers[name]


def write_header(path: str, world_size: int, recorded: dict) -> None:
    """Start the workload file at ``path`` (truncated): its header, before any rank records."""
    _maker("header")(path, world_size, recorded=recorded)


def current() -> Recording | None:
    """The recording this process made last (None: it records nothing)."""
    return _recordings.get("current")


def attach(queue: Any, path: str, rank: int, world_size: int, store: Any = None,
           recorded: dict | None = None) -> None:
    """Record the calls of ``queue`` (a rank's issue order) into ``path`` as rank ``rank``.

    A process that records into ``path`` already goes on with that recording (a torch group made
    over a pool's mesh). Otherwise, with ``store`` (a launcher's ranks), rank 0 writes the header
    and the other ranks wait for it there before they record, so no line comes before it; without
    one, the header was written already (by the pool's parent).

        attach(mesh.issue_queue, "step.jsonl", mesh.rank, mesh.world_size, store, {"transport": "tcp"})
    """
    path = os.path.abspath(path)
    recorder = _recordings.get(path)
    if recorder is None:
        if store is not None:
            _header_in_order(store, path, rank, world_size, recorded or {})
        recorder = _recordings[path] = _maker("recorder")(path, rank, world_size)
    _recordings["current"] = recorder
    queue.recorder = recorder


def _header_in_order(store: Any, path: str, rank: int, world_size: int, recorded: dict) -> None:
    """Rank 0 writes the header, then says so in ``store``; every other rank waits for that."""
    key = f"lab/workload/{_handovers[0]}"
    _handovers[0] += 1
    if rank == 0:
        write_header(path, world_size, recorded)
        store.set(key, "1")
    else:
        store.wait([key])
