"""The time a lab call held the program past what the replay times: from the recording's clocks.

A recording splits a rank's time into compute (``compute_us``: the program's own work between
calls) and time inside the lab's calls. The replay times the part of a call that waits on
communication (until its operation completes, simulated); the rest of the call is the rank's own
and comes from the recording: an asynchronous call's return from its issue, and the return of a
blocking call (a wait, a synchronous operation) after its operation completed. That return is a
hand-off: the communication thread completes the operation, and the program's thread wakes and
takes the interpreter back (on emulated hosts that share two cores, about a millisecond: 1.3 ms
a wait in FSDP2's step on 4 hosts, 7.6 ms of its 186 ms). Each rank's clock says it: the program
got control back at the next event's time less that event's compute.

    {"kind": "wait", "index": 4, "waited_us": 100.0, "compute_us": 0.1}      # op 4 completed at 150.0
    {"kind": "op", "index": 5, "issued_us": 160.0, "compute_us": 8.5, ...}   # back at 151.5
    held_us of the wait: 151.5 - max(100.0, 150.0) = 1.5

None where a time is missing (a hand-written file's: 0), for a wait the recorder inferred (its
time is the program's last return, not a call), and before a wait the recorder found woken by its
completion (it moved the program's last return to that completion: :data:`lab.workload.record.WOKEN_NS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: Two clocks within this many µs are one (the file keeps them to the ns, rounded to 3 decimals).
SAME_US = 0.002


class Timed(Protocol):
    """What :func:`derive_held` reads and writes of an event (:class:`lab.workload.format.Event`)."""

    kind: str
    index: int
    compute_us: float
    is_async: bool
    inferred: bool
    issued_us: float | None
    waited_us: float | None
    completed_us: float | None
    held_us: float


def derive_held(events: Sequence[Timed]) -> None:
    """Set ``held_us`` on each of one rank's ``events`` (in its issue order; see the module's docstring)."""
    completed = {e.index: e.completed_us for e in events if e.kind == "op"}
    back = None  # when the program got control back after the event (from the next timed one)
    for k in range(len(events) - 1, -1, -1):
        event = events[k]
        start = _since(event, completed)
        event.held_us = max(back - start, 0.0) if back is not None and start is not None else 0.0
        at = event.issued_us if event.kind == "op" else event.waited_us if event.kind == "wait" else None
        if event.kind == "step":
            back = None if back is None else back - event.compute_us
        elif at is None or _woken(event, completed):
            back = None
        else:
            back = at - event.compute_us


def _since(event: Timed, completed: dict[int, float | None]) -> float | None:
    """From when the call's time is the rank's own: an asynchronous issue's from its issue, a
    blocking call's from the later of the call and its operation's completion (None: not known)."""
    if event.kind == "op" and event.is_async:
        return event.issued_us
    at = event.issued_us if event.kind == "op" else event.waited_us
    done = completed.get(event.index)
    if event.kind == "step" or event.inferred or at is None or done is None:
        return None
    return max(at, done)


def _woken(event: Timed, completed: dict[int, float | None]) -> bool:
    """A wait whose compute the recorder counted from its operation's completion (woken by it)."""
    done = completed.get(event.index)
    return (event.kind == "wait" and done is not None and event.waited_us is not None and
            abs(event.waited_us - event.compute_us - done) <= SAME_US)
