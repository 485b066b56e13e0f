"""One mesh's books on one rank: what each collective leaves behind.

:class:`Books` numbers a mesh's collectives in its ledger (:mod:`lab.compiled.plane`: ``SEQ``), says
where the rank is, keeps the flight records (a failure's too, shared with the peers where the
channels are left unclean), counts payload bytes (a sub-mesh's also in its ancestors' counters)
and writes the trace rows. :class:`lab.comm.exchange.Exchange` holds one per mesh, ``exchange.books``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from lab.comm.channels import Channels
from lab.comm.counters import BOOKED_KEYS, Counters
from lab.comm.membership import Membership
from lab.compiled.plane import BOOKED, RING, SEQ
from lab.errors import LabError
from lab.flight import FLIGHT_RECORDER_SIZE, FlightRecord, FlightRecorder, Position


class Books:
    """The books of the mesh of ``membership`` over ``channels`` on this rank, in ``ledger`` (the
    compiled plane's, where the mesh has one: compiled calls keep their own books there too);
    ``position`` is where the rank is; ``parents``: the books of the mesh's ancestors, whose
    counters count this mesh's transfers too."""
    def __init__(self, channels: Channels, membership: Membership, ledger: np.ndarray, position: Position,
                 parents: list[Books]) -> None:
        self._channels, self._membership, self._ledger = channels, membership, ledger
        self._trace = channels.trace
        self.position = position
        self.recorder = FlightRecorder(ledger[RING:].reshape(FLIGHT_RECORDER_SIZE, 2))
        self.counters = Counters(ledger[BOOKED:BOOKED + len(BOOKED_KEYS)])
        self._lineage = [self.counters, *(parent.counters for parent in parents)]  # a transfer counts in each

    # -- counters ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Payload bytes and messages since :meth:`reset_stats` (see :meth:`lab.comm.exchange.Exchange.stats`)."""
        return self.counters.snapshot()

    def reset_stats(self) -> None:
        self.counters.reset()

    def count(self, **counts: int) -> None:
        """Count a transfer in this mesh's counters and its ancestors'."""
        for counters in self._lineage:
            counters.add(**counts)

    # -- flight records ------------------------------------------------------------------------

    def enter(self, name: str, algorithm: str, dtype_name: str, count: int, op: str,
              root: int) -> FlightRecord:
        """Number the next collective, say where this rank is, and note it in the flight recorder."""
        self._ledger[SEQ] += 1
        return self.note(int(self._ledger[SEQ]), name, algorithm, dtype_name, count, op, root)

    def refused(self) -> None:
        """Number a collective that was refused before it ran (see :meth:`lab.comm.exchange.Exchange.refused`)."""
        self.enter("(refused)", "", "", 0, "", -1).state = "failed (refused: an earlier failure was raised)"

    def note(self, seq: int, name: str, algorithm: str, dtype_name: str, count: int, op: str, root: int,
             step: int = 0) -> FlightRecord:
        """Say where this rank is (collective ``seq`` at ``step``) and note it in the flight recorder."""
        position = self.position
        position.collective, position.seq, position.algorithm, position.step = name, seq, algorithm, step
        return self.recorder.note(
            FlightRecord(seq, name, algorithm, dtype_name, count, op, root, start_ns=time.time_ns()))

    def failed(self, record: FlightRecord, exc: BaseException) -> None:
        """Record the failure; where the channels are left unclean, tell the peers what this rank
        found, and raise instead the root cause a peer's notice names, if any
        (:meth:`lab.transport.base.Transport.share_failure`)."""
        channels = self._channels
        if self.position.step:  # messages may be in flight: this mesh can't be reused
            channels.clean = False
        cause = exc if channels.clean or not isinstance(exc, LabError) else \
            channels.transport.share_failure(exc, self.position, channels.recv_timeout_ms / 1000)
        record.state, record.step = f"failed ({type(cause).__name__})", self.position.step
        record.end_ns = time.time_ns()
        if cause is not exc:
            raise cause from exc

    def done(self, record: FlightRecord, start_ns: int, before: tuple[int, int, int]) -> None:
        """The collective of ``record`` is done; with a trace on, its row (it started at
        ``start_ns``, with the byte counters then and its tensor's bytes in ``before``)."""
        record.state, record.step, record.end_ns = "done", self.position.step, time.time_ns()
        counters = self.counters
        counters.add(collectives=1)
        if self._trace is not None:
            self.write_trace(kind="collective", op=record.collective, algorithm=record.algorithm,
                             dtype=record.dtype, count=record.count, nbytes=before[2], reduce_op=record.op or
                             None, root=None if record.root < 0 else record.root,
                             bytes_sent=counters["bytes_sent"] - before[0],
                             bytes_received=counters["bytes_received"] - before[1], start_ns=start_ns,
                             duration_ns=time.time_ns() - start_ns, seq=record.seq)

    def flight_records(self) -> list[FlightRecord]:
        """This rank's last collectives, oldest first; a running one shows the step it reached."""
        return self.recorder.records(int(self._ledger[SEQ]), self.position.step)

    # -- trace rows ----------------------------------------------------------------------------

    def write_trace(self, **row: Any) -> None:
        """One trace row of this mesh's (a sub-mesh's says which one, and the global rank)."""
        membership = self._membership
        row = {**membership.trace_fields(), **row}
        self._trace.write(rank=membership.rank, world_size=membership.world_size,
                          transport=self._channels.transport_name, **row)
