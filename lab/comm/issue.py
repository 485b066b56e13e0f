"""One issue order per mesh: collectives and point-to-point run in the order they were called.

A root mesh and all its sub-meshes share one :class:`IssueQueue`: one communication thread for
``async_op=True`` calls, one lock so that exactly one thread drives the mesh at a time, and the
rule that a synchronous call first waits for the asynchronous ones before it (so it reads its
input after them, and its messages follow theirs on every channel).

A torch group (:mod:`lab.backend`'s ``new_group``) has an order of its own instead
(:meth:`IssueQueue.own_order`): its own thread, lock and pending calls, so that it progresses
whatever the other groups do, as gloo's groups do; the transports take several threads' calls
at once, each context's messages kept apart (:mod:`lab.transport.parking`).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lab import checks
from lab.comm.operations import Operation, Recording, record
from lab.errors import LabError


def this_process() -> int:
    """This process's pid, read without a system call (``os.getpid`` is one): kept up to date
    across ``fork``. A child of a rank must not use the rank's channels, and every call checks."""
    return _pid[0]


_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class Work:
    """The handle of a collective issued with ``async_op=True`` (like ``torch.distributed.Work``).

        work = lab.allreduce(mesh, grads, async_op=True)   # returns at once
        ...                                                # compute meanwhile
        work.wait()                                        # grads now hold the sum
    """
    def __init__(self, future: Future) -> None:
        self._future = future
        self.raised = False  # its failure reached the program (wait, result): no later call raises it again
        #: (the recording, the operation's index) where the rank records: the program's waits are noted
        self.recorded: tuple[Recording, int] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective completes; re-raise its error if it failed (the program has
        it then: a later call on the mesh does not raise it again). Returns True."""
        self._waited(timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """Call ``callback(work)`` once the collective completed or failed (at once if it has),
        on the thread that completed it."""
        self._future.add_done_callback(lambda _: callback(self))

    def result(self) -> Any:
        """What the synchronous call would have returned (waits first; raises as :meth:`wait`)."""
        return self._waited(None)

    def _waited(self, timeout: float | None) -> Any:
        """:meth:`outcome`, a wait of the program's: noted where the rank records."""
        if self.recorded is None:
            return self.outcome(timeout)
        recorder, index = self.recorded
        recorder.wait(index)
        try:
            return self.outcome(timeout)
        finally:
            recorder.returned()

    def outcome(self, timeout: float | None = None) -> Any:
        """What the call returned (waiting for it; raises as :meth:`wait`), read by the lab itself:
        no wait of the program's, so a recording notes none (the backend completing torch's future)."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done():  # (not our wait's own limit)
                self.raised = True
            raise


class IssueQueue:
    """The issue order of rank ``rank``'s meshes, owned by the process that made it."""

    #: Where the rank records its calls (lab.comm.operations): set by the layer that starts a recording.
    recorder: Recording | None = None

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._owner_pid = this_process()  # a forked child must not touch the channels
        self._driving = threading.Lock()  # exactly one thread drives this order's calls at a time
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[Work] = []
        self._local = _ThreadState()
        # Point-to-point sends a waiting receive may run ahead of their turn (run_sends_behind),
        # each with the number of other calls issued before it: it never overtakes one of those.
        self.issued = 0
        self._sends: deque[tuple[int, _Send]] = deque()
        self._counting = threading.Lock()  # (two user threads may issue at once: no lost count)
        self.closed = False  # the mesh was closed: every later call is refused, on every transport
        self._orders: weakref.WeakSet[IssueQueue] = weakref.WeakSet()  # own_order's, closed with this one

    def issue(self, run: Callable[[], Any], async_op: bool, p2p: str = "",
              refused: Callable[[], None] | None = None, what: Operation | None = None) -> Any:
        """Run ``run`` (a collective's communication) now, or on the communication thread.

        A call made by a ``run`` that is being driven (the torch backend's composite operations,
        on the communication thread) runs inline: it is already in its place in the order (and in
        a recording, part of the call that made it). ``p2p="send"``, ``"recv"``: a point-to-point
        call; a receive issued before an asynchronous send may run it while waiting
        (:meth:`run_sends_behind`). ``refused``: what numbers the collective of ``run`` where an
        earlier failure is raised in its place (see :meth:`wait_all`). ``what``: the call as the
        program issued it, noted where the rank records (:mod:`lab.comm.operations`)."""
        if what is not None and self.recorder is not None and not self._local.driving:
            return record(self.recorder, what, checks.flag(async_op, "async_op"),
                          lambda noted: self.issue(noted, async_op, p2p, refused), run)
        if async_op is False and not p2p:
            return self.run_collective(run, refused)
        self.check_owner()
        if self._local.driving:
            result = run()
            if not async_op:
                return result
            done: Future = Future()
            done.set_result(result)
            return Work(done)
        if not p2p or (p2p == "send" and async_op):
            run = self._count(run, p2p)
        if async_op is not False and checks.flag(async_op, "async_op"):
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lab-comm-{self._rank}")
            work = Work(self._thread.submit(self._drive, run))
            self._pending.append(work)
            return work
        if self._pending:
            self.wait_all()
        return self._drive(run)

    def run_collective(self, run: Callable[[], Any], refused: Callable[[], None] | None = None,
                       what: Operation | None = None) -> Any:
        """``issue(run, async_op=False, refused=refused, what=what)`` for a collective, written out:
        a small collective's whole cost is a few microseconds, and this is on its path."""
        if what is not None and self.recorder is not None and not self._local.driving:
            return record(self.recorder, what, False, lambda noted: self.run_collective(noted, refused), run)
        if self.closed or _pid[0] != self._owner_pid:
            self.check_owner()
        local = self._local
        if local.driving:
            return run()
        with self._counting:
            self.issued += 1
        if self._pending:
            self._wait_all_before(refused)
        with self._driving:
            local.driving = True
            try:
                return run()
            except Exception as exc:
                if self.closed:  # (the closed channels fail it at once, in whatever way they happen to)
                    raise self._closed_error(exc) from exc
                raise
            finally:
                local.driving = False

    def run_alone(self, run: Callable[..., Any], *args: Any, refused: Callable[[], None] | None = None,
                  what: Operation | None = None) -> Any:
        """:meth:`run_collective` of ``run(*args)``, a run that issues no call of its own (one
        compiled collective): where nothing is pending and no thread drives, it runs at once,
        uncounted in :attr:`issued` (no asynchronous send is held back, so none can be run ahead
        of it). A call to record (``what``, and a recorder) takes :meth:`run_collective`."""
        if self._pending or self.closed or _pid[0] != self._owner_pid or (what and self.recorder) \
                or not self._driving.acquire(False):  # (this thread driving: inline; another: wait)
            return self.run_collective(functools.partial(run, *args), refused, what)
        try:
            return run(*args)
        finally:
            self._driving.release()

    def issue_now(self, run: Callable[[], Any], refused: Callable[[], None] | None = None,
                  what: Operation | None = None) -> Work:
        """``issue(run, async_op=True)``, run on this thread when nothing is in flight: for a small
        collective the hand-off to the communication thread costs more than the collective. The
        Work returned is complete, with the result or the failure (raised by ``wait``)."""
        if what is not None and self.recorder is not None and not self._local.driving:
            return record(self.recorder, what, True, lambda noted: self.issue_now(noted, refused), run)
        self.check_owner()
        if self._local.driving or self.in_flight:
            return self.issue(run, async_op=True)
        self._count(run, "")
        done: Future = Future()
        try:
            self._wait_all_before(refused)  # an earlier async failure surfaces here, as in a synchronous call
            done.set_result(self._drive(run))
        except BaseException as exc:  # noqa: BLE001 - the Work carries it to wait()
            done.set_exception(exc)
        return Work(done)

    def _count(self, run: Callable[[], Any], p2p: str) -> Callable[[], Any]:
        """Count a collective (``p2p=""``), or remember an asynchronous send for
        :meth:`run_sends_behind` and return it wrapped to run once."""
        with self._counting:
            if not p2p:
                self.issued += 1
                return run
            while self._sends and self._sends[0][1].started:  # (done: no longer held)
                self._sends.popleft()
            send = _Send(run)
            self._sends.append((self.issued, send))
            return send

    def run_sends_behind(self, issued: int) -> None:
        """Run, on the communication thread, the asynchronous sends issued after a receive that
        is waiting for its message, with no other call between (``issued``: :attr:`issued` when
        the receive was issued). torch posts ``irecv`` and ``isend`` at once: two ranks that each
        ``irecv`` and then ``isend`` to the other must not each wait for the other's send behind
        their receive. A send never overtakes a collective: it would reach its peer inside it."""
        while self._sends and self._sends[0][1].started:
            self._sends.popleft()
        for before, send in list(self._sends):
            if before > issued:
                break
            if not send.started:
                send.run_ahead()

    def _drive(self, run: Callable[[], Any]) -> Any:
        with self._driving:
            self._local.driving = True
            try:
                return run()
            except Exception as exc:
                if self.closed:  # (the closed channels fail it at once, in whatever way they happen to)
                    raise self._closed_error(exc) from exc
                raise
            finally:
                self._local.driving = False

    def _closed_error(self, exc: Exception) -> LabError:
        """The error of a call that failed with ``exc`` because the mesh was closed while it ran."""
        return LabError(f"rank {self._rank}: the mesh was closed while this call ran "
                        f"(it failed with {type(exc).__name__}: {exc})")

    def check_owner(self) -> None:
        """Refuse a process forked inside ``fn``: its messages would interleave with the rank's."""
        if self.closed:
            raise LabError(
                f"rank {self._rank}: this mesh is closed (a collective, plan or send/recv after mesh.close())"
            )
        if _pid[0] != self._owner_pid:
            raise LabError(
                f"this mesh belongs to rank {self._rank}'s process (pid {self._owner_pid}); a process "
                f"forked from it (pid {os.getpid()}) cannot use it")

    def own_order(self) -> IssueQueue:
        """An issue order of its own over the same channels, for a torch group: its own
        communication thread, lock and pending calls (so its calls never wait for this order's,
        nor this order's for its), recording where this one records, closed with it.

            group_order = mesh.issue_queue.own_order()   # what lab.Mesh.sub_mesh(own_order=True) takes
        """
        order = _OwnOrder(self)
        self._orders.add(order)
        return order

    @property
    def alone(self) -> bool:
        """True while no open order of its own shares this one's channels (:meth:`own_order`): a
        call that holds up its caller until its peers join then waits on no other order's calls."""
        return not self._orders or not any(not order.closed for order in self._orders)

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous call has not completed."""
        return bool(self._pending) and any(not work.is_completed() for work in self._pending)

    def wait_all(self, recorded: bool = False) -> None:
        """Wait for every asynchronous call issued so far; raise the first failure the program
        has not had yet (from the Work's ``wait`` or ``result``, or an earlier ``wait_all``).
        ``recorded``: the program's own wait (``mesh.wait_all()``), noted where the rank records;
        not the wait a synchronous call makes first (its issue order says it)."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for work in pending:
            had = work.raised
            try:
                if recorded:
                    work.wait()
                else:
                    work.outcome(None)
            except BaseException as exc:
                if not work.is_completed():
                    raise  # our own wait interrupted (Ctrl-C), not the call's failure
                if first is None and not had:
                    first = exc
        if first is not None:
            raise first

    def _wait_all_before(self, refused: Callable[[], None] | None) -> None:
        """:meth:`wait_all` before a call runs. Where a failure is raised in its place, the call
        does not run, and ``refused`` numbers its collective all the same: its peers ran theirs,
        and this rank's next collective must not pair with the wrong one of theirs (it meets a
        mismatch instead: :meth:`lab.comm.exchange.Exchange.refused`)."""
        try:
            self.wait_all()
        except BaseException:
            if refused is not None:
                refused()
            raise

    def close(self) -> None:
        """Stop the communication thread, before the transport closes: queued calls are
        cancelled, and one still running fails on the closed channels with a LabError saying so.
        Not joined: the process ends soon anyway. The orders of its own (:meth:`own_order`) close too."""
        self._stop()
        for order in list(self._orders):
            order.close()
        if self.recorder is not None:
            self.recorder.close()  # (lines after the last step's end, kept in memory until now)

    def _stop(self) -> None:
        self.closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None


class _OwnOrder(IssueQueue):
    """An issue order of its own over the channels of ``root``'s (:meth:`IssueQueue.own_order`)."""
    def __init__(self, root: IssueQueue) -> None:
        super().__init__(root._rank)
        self._root = root
        self.closed = root.closed

    @property
    def recorder(self) -> Recording | None:
        """The root order's: a recording of the rank sees every order's calls."""
        return self._root.recorder

    @recorder.setter
    def recorder(self, value: Recording | None) -> None:
        self._root.recorder = value

    @property
    def alone(self) -> bool:
        return False  # (the root's order shares the channels)

    def own_order(self) -> IssueQueue:
        return self._root.own_order()

    def close(self) -> None:
        """Stop this order's thread (its root's recording goes on)."""
        self._stop()


class _ThreadState(threading.local):
    """Per thread: ``driving``, whether this thread is running a call now (a class default, so
    reading it in a thread that never set it costs no exception)."""

    driving = False


class _Send:
    """An asynchronous send that a waiting receive may run ahead of its turn: it runs once, and
    its turn returns (or raises) what it did."""
    def __init__(self, run: Callable[[], Any]) -> None:
        self._run, self.started = run, False
        self._result: Any = None
        self._error: BaseException | None = None

    def run_ahead(self) -> None:
        self.started = True
        try:
            self._result = self._run()
        except BaseException as exc:  # noqa: BLE001 - raised in its own turn, to its own Work
            self._error = exc

    def __call__(self) -> Any:
        if not self.started:
            self.run_ahead()
        if self._error is not None:
            raise self._error
        return self._result
