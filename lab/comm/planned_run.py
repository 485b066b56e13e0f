"""A compiled collective made once (by a plan, or by a plain call's template), and the error of a
compiled call that failed.

A :class:`PlannedRun` needs of its mesh only the narrow interface :class:`Exchanging` names (the
context id, the flight recorder, whether it traces, how to run, note and fail a collective, and
the mismatch checks), which :class:`lab.comm.exchange.Exchange` provides::

    run = exchange.compiled_call(signature, algorithm, args)   # a PlannedRun, or None
    run(run.operands(args))                                    # one Numba call; raises on failure
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from kernels import doorbell as wait_status
from lab import fingerprint
from lab.comm import unread
from lab.compiled.plane import SEQ, CompiledCall, Report
from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError
from lab.fingerprint import Signature
from lab.flight import FlightRecord, FlightRecorder, Position
from lab.transport.base import silence_error


class Exchanging(Protocol):
    """What a planned run and a compiled call's failure use of their mesh's exchange."""

    rank: int
    recv_timeout_ms: float
    clean: bool
    context: int
    recorder: FlightRecorder
    tracing: bool
    position: Position

    def collective(self, name: str, algorithm: str, dtype: Any, count: int, op: str, root: int,
                   compiled: bool = ...) -> Any:
        ...

    def run_compiled(self, call: CompiledCall, operands: tuple) -> None:
        ...

    def note(self, seq: int, name: str, algorithm: str, dtype_name: str, count: int, op: str, root: int,
             step: int = 0) -> FlightRecord:
        ...

    def failed(self, record: FlightRecord, exc: BaseException) -> None:
        ...

    def mismatch(self, src: int, got: bytes, expected: bytes | None = None) -> CollectiveMismatchError:
        ...

    def raise_if_mismatched(self, tag: bytes | None = None) -> None:
        ...


class PlannedRun:
    """One compiled collective of a fixed signature, made once (by a plan, or by a plain call's
    template): :meth:`lab.comm.exchange.Exchange.collective` and :meth:`lab.comm.exchange.Exchange.run` in one Numba call. Its
    compiled call has a config of its own, with the fingerprint and deadline written in, and keeps
    its own books (:meth:`lab.compiled.plane.CompiledCall.keeping_books`): it takes the collective's number
    from the mesh's ledger and, where it succeeds, adds its counts and flight record there, so a
    run that succeeds runs no Python of ours after the call. One that fails is recorded and raised
    here; with a trace on, a run takes the full path (its row needs the clock and the counters)."""
    def __init__(self, exchange: Exchanging, signature: Signature, call: CompiledCall) -> None:
        self._exchange, self._signature = exchange, signature
        self._traced = call  # (the full path's: it numbers nothing itself)
        self._call = call.copy()
        name, algorithm, dtype, count, op, root, _ = signature
        self._call.prepare(
            fingerprint.pack(exchange.context, 0, name, algorithm, dtype.code, op, root, count),
            exchange.recv_timeout_ms)
        self._record = (name, algorithm, dtype.name, count, op, root)
        number = exchange.recorder.book(self._record)
        self._entry = self._call.keeping_books(number)
        weakref.finalize(self, exchange.recorder.release, number)  # booked while this run lives
        self._region, self._config, self._ledger = self._call.region, self._call.config, self._call.ledger

    def operands(self, args: tuple) -> tuple:
        """``args`` (the algorithm's arguments after the peers) as the compiled call takes them."""
        return self._call.operands(args)

    def __call__(self, operands: tuple) -> None:
        """Run the collective on ``operands`` (from :meth:`operands`)."""
        if self._exchange.tracing:
            with self._exchange.collective(*self._signature):
                self._exchange.run_compiled(self._traced, operands)
            return
        try:
            status = self._entry(self._region, self._config, self._ledger, *operands)
        except BaseException as exc:  # raised by a long wait's hook (a signal handler's, a mismatch)
            exchange = self._exchange
            exchange.failed(exchange.note(int(self._ledger[SEQ]), *self._record, step=1), exc)
            raise
        if status != wait_status.OK:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """The run that just returned a status other than OK: its flight record, failed at its
        one step, and its error."""
        exchange = self._exchange
        record = exchange.note(int(self._ledger[SEQ]), *self._record, step=1)
        try:
            raise_compiled_failure(exchange, self._call, self._call.tag())  # (the error describes its tag)
        except BaseException as exc:
            exchange.failed(record, exc)
            raise


def raise_compiled_failure(exchange: Exchanging, call: CompiledCall, tag: bytes | None = None) -> None:
    """Raise the failure of the compiled call that just returned a status other than OK, in the
    collective of ``tag`` (default: the exchange's current one)."""
    report = call.report()
    exchange.clean = False
    if report.status not in (wait_status.MISMATCH, wait_status.STRAY):
        exchange.raise_if_mismatched(tag)  # the peer may be elsewhere because we disagree
    raise _compiled_failure(exchange, report, tag)


def _compiled_failure(exchange: Exchanging, report: Report, tag: bytes | None) -> LabError:
    """The error of a compiled call that reported ``report.status`` (not OK)."""
    peer = report.failed_peer
    if report.status == wait_status.MISMATCH:
        return exchange.mismatch(peer, report.peer_tag, tag)
    if report.status == wait_status.STRAY:
        return unread.stray_error(exchange, peer, report.peer_tag, tag)
    if report.status == wait_status.SILENCE:
        return DeadlineError(
            f"{silence_error(exchange.rank, [peer], exchange.position)} "
            f"(recv_timeout_ms={exchange.recv_timeout_ms:g})", [peer])
    if report.status == wait_status.PEER_LOST:
        return PeerLostError(f"rank {exchange.rank}: rank {peer} is gone (waiting in {exchange.position})")
    return LabError(f"rank {exchange.rank}: the compiled path refused a transfer with rank {peer} "
                    f"(status {report.status}) in {exchange.position}")
