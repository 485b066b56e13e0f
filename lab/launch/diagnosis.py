"""Why a run failed: what each rank reported, and which rank is the root cause.

A rank whose ``fn`` raised reports a :class:`RankFailure`; for a rank that died, or never
answered, the parent makes one (:func:`death`, :func:`unresponsive`). :func:`diagnose` turns them
into the one :class:`lab.RankError` the caller sees, and says whether the pool can go on.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from dataclasses import dataclass

from lab.errors import RankError
from lab.flight import FlightRecord
from lab.launch.forkserver import process_state

#: After one rank fails, how long the parent waits for the others to report before ending them.
FAILURE_GRACE_S = 1.0
#: Failures that are usually the consequence of another rank's, least specific last.
_CONSEQUENCES = ("CollectiveMismatchError", "DeadlineError", "PeerLostError")


@dataclass
class RankFailure:
    """What a rank reports when ``fn`` raised (or what the parent saw when it died)."""

    exc_type: str
    message: str
    traceback: str
    at_ns: int  # time.monotonic_ns(), the same clock in every process
    clean: bool  # the mesh holds no half-done transfer: the pool can go on
    exitcode: int | None = None
    records: list[FlightRecord] | None = None  # the rank's flight recorder
    waiting_for: tuple[int, ...] = ()  # a DeadlineError's silent peers
    in_flight: bool = False  # asynchronous collectives had not completed when it failed
    told: bool = False  # its error is what another rank found, passed on in an abort notice


def death(rank: int, process: mp.process.BaseProcess, forkserver_pid: int | None) -> RankFailure:
    """The failure of a rank whose control pipe closed: how its process ended, and whether the
    forkserver that started it went first (ranks die with it)."""
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        how = f"killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    if forkserver_pid is not None and process_state(forkserver_pid) in (None, "Z"):
        how += (f": the forkserver that started it (pid {forkserver_pid}) is gone, and ranks die with it "
                "(the next pool starts a new one)")
    return RankFailure("ProcessDied", f"rank {rank}'s process {how}", "", time.monotonic_ns(), False, code)


def unresponsive(rank: int, failures: dict[int, RankFailure], pid: int | None) -> RankFailure:
    """The failure of a rank that never answered, in the state its process is in now (so call
    this before ending it), naming the ranks that timed out waiting for it."""
    state = process_state(pid) if pid else None
    how = {"T": "stopped (SIGSTOP or a debugger)", "D": "blocked in the kernel"}.get(state, "still running")
    waiters = sorted(r for r, f in failures.items() if f.exc_type == "DeadlineError")
    named = f"rank {waiters[0]}" if len(waiters) == 1 else "ranks " + ", ".join(map(str, waiters))
    message = (f"rank {rank} stopped making progress: its process was {how}, and {named} timed out "
               f"waiting for it (directly or through other ranks); it was ended") if waiters else \
        f"rank {rank} did not answer after its peers failed: its process was {how}; it was ended"
    return RankFailure("Unresponsive", message, "", time.monotonic_ns(), False)


def diagnose(failures: dict[int, RankFailure], waiting: set[int],
             pids: list[int | None]) -> tuple[RankError, str | None]:
    """The error to raise for a failed run (or start-up), and why the pool must be closed (None
    if it can go on). ``failures``: what the ranks reported; ``waiting``: the ranks that never
    answered; ``pids``: every rank's process, still running (their state is part of the story)."""
    if not failures:  # start-up timed out
        return (RankError(min(waiting), "TimeoutError",
                          f"ranks {sorted(waiting)} did not start in time"), "its ranks did not start")
    first = _most_specific(failures)
    cause = failures[first]
    if cause.exc_type in _CONSEQUENCES and waiting:
        # Only consequences, and ranks that never answered: the one they were all waiting for
        # (stopped, or stuck in fn) is the cause, not the first rank whose deadline expired.
        first = _awaited(failures, waiting)
        cause = unresponsive(first, failures, pids[first])
    lines = [f"rank {r}: {f.exc_type}: {f.message}" for r, f in sorted(failures.items()) if r != first]
    lines += [
        f"rank {r}: still running {FAILURE_GRACE_S} s after the first failure; ended" for r in sorted(waiting)
        if r != first]
    records = {r: failures[r].records if r in failures else "still running, ended" for r in range(len(pids))}
    records.update({r: "process died" for r, f in failures.items() if f.records is None})
    error = RankError(first, cause.exc_type, cause.message, cause.traceback, cause.exitcode, "\n".join(lines),
                      records)
    return error, _closed_why(first, cause, failures, waiting)


def _most_specific(failures: dict[int, RankFailure]) -> int:
    """The root cause among the reports: a user exception or a dead process, then a mismatch,
    then a deadline, and a lost peer last (those are usually consequences); of one kind, the
    rank that found it before those it told (which may report first), earliest first."""
    def specificity(rank: int) -> tuple[int, bool, int, int]:
        failure = failures[rank]
        kind = _CONSEQUENCES.index(failure.exc_type) if failure.exc_type in _CONSEQUENCES else -1
        return kind, failure.told, failure.at_ns, rank

    return min(failures, key=specificity)


def _awaited(failures: dict[int, RankFailure], silent: set[int]) -> int:
    """Of the ranks that never answered, the one the timed-out ranks waited for most (directly or
    through ranks that waited on it), lowest rank on a tie."""
    votes = dict.fromkeys(silent, 0)
    for rank, failure in failures.items():
        seen, frontier = {rank}, list(failure.waiting_for)
        while frontier:  # follow who-waited-for-whom to the ranks at the end of the chains
            peer = frontier.pop()
            if peer in seen:
                continue
            seen.add(peer)
            if peer in votes:
                votes[peer] += 1
            elif peer in failures:
                frontier.extend(failures[peer].waiting_for)
    return min(votes, key=lambda r: (-votes[r], r))


def _closed_why(first: int, cause: RankFailure, failures: dict[int, RankFailure],
                waiting: set[int]) -> str | None:
    """None if the pool can go on: every rank answered, and failed cleanly (before sending
    anything, e.g. the same bad argument everywhere) with no asynchronous collective in flight.
    Otherwise what the next ``run`` is told."""
    if not waiting and all(f.clean for f in failures.values()):
        return None
    unfinished = [r for r, f in failures.items() if f.in_flight]
    return (f"rank {first} failed with {cause.exc_type}" +
            (f"; ranks {unfinished} had asynchronous collectives in flight" if unfinished else "") +
            "; start a new pool")
