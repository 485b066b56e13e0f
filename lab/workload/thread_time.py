"""The time a point-to-point transfer held its rank's communication thread: from the recording's clocks.

A rank runs its operations one at a time, in issue order, on its communication thread
(:mod:`lab.comm.issue`): torch's ``isend`` and ``irecv`` are handed to that thread, which wakes,
takes the interpreter and runs the lab's Python send or receive (headers, checks, the copy),
then completes the Work. That costs the thread far more than the network's α + n·β: on emulated
hosts that share two cores, a 64 KiB transfer of a 4-stage 1F1B pipeline holds it about half a
millisecond at the median, several at the tail (0.5 ms on shm, 0.9 ms on tcp at 1 Gbit/s), and a
stage's neighbour waits for it on every micro-batch's hop. The replay charges that time
(``thread_us``) where the rank's thread spends it:

- a send's own: from when it could start (its issue, or its rank's previous operation's
  completion, whichever is later) to its completion. A send is eager: it never waits for its
  receive, so all of that is the thread's (and the network's) time;
- a receive's: the median of its rank's sends of the same bytes (of all its sends where none has
  them; none where the rank sends nothing). A receive's own clocks cannot tell the wait for its
  message from the work after it arrived without the sender's clock, which a recording of another
  process does not line up; a send of the same size on the same thread costs what the receive
  costs once its message is there.

    {"kind": "op", "index": 6, "op": "recv", "issued_us": 50.0, "completed_us": 90.0, ...}
    {"kind": "op", "index": 7, "op": "send", "issued_us": 100.0, "completed_us": 600.0, ...}
    {"kind": "op", "index": 8, "op": "recv", "issued_us": 120.0, "completed_us": 2000.0, ...}
    thread_us of op 7: 600.0 - max(100.0, 90.0) = 500.0; of ops 6 and 8 (the same bytes): 500.0

None (0) for a collective, or where a time is missing (a hand-written file's).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Protocol


class Timed(Protocol):
    """What :func:`derive_thread_time` reads and writes of an event (:class:`lab.workload.format.Event`)."""

    kind: str
    index: int
    op: str
    count: int
    issued_us: float | None
    completed_us: float | None
    thread_us: float

    @property
    def nbytes(self) -> int:
        ...


def derive_thread_time(events: Sequence[Timed]) -> None:
    """Set ``thread_us`` on each send and receive of one rank's ``events`` (see the module's docstring)."""
    completed = {e.index: e.completed_us for e in events if e.kind == "op"}
    sends: dict[int, list[float]] = {}
    for event in events:
        if event.kind != "op" or event.op != "send" or event.issued_us is None or event.completed_us is None:
            continue
        before = completed.get(event.index - 1)
        start = event.issued_us if before is None else max(event.issued_us, before)
        event.thread_us = max(event.completed_us - start, 0.0)
        sends.setdefault(event.nbytes, []).append(event.thread_us)
    if not sends:
        return
    medians = {nbytes: statistics.median(times) for nbytes, times in sends.items()}  # (once, not per receive)
    overall = statistics.median([t for times in sends.values() for t in times])
    for event in events:
        if event.kind == "op" and event.op == "recv" and event.completed_us is not None:
            event.thread_us = medians.get(event.nbytes, overall)
