"""The pool: :class:`Cluster` starts one process per rank, runs tasks in all of them, collects
their replies and ends them.

The parent builds the whole mesh (its transport's endpoints), starts each rank
(:func:`lab.launch.rank.rank_main`) and talks to it over a private control pipe (the protocol is in
:mod:`lab.launch.rank`). Whatever happens, :meth:`Cluster.close` ends every process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Self

from lab.comm import operations as recording
from lab.errors import LabError
from lab.hosts.emulated import Hosts
from lab.hosts.rendezvous import serve_store
from lab.launch.diagnosis import FAILURE_GRACE_S, RankFailure, death, diagnose
from lab.launch.forkserver import forkserver_pid, start_context
from lab.launch.options import PoolOptions, environment, takes_pool_options
from lab.launch.rank import READY, STOP, RankOptions, rank_main

#: How long the parent waits for a new pool's ranks to come up.
STARTUP_TIMEOUT_S = 120.0
#: Held while a pool starts (its ``env`` is set in this process's environment meanwhile).
_STARTING = threading.Lock()
#: The handle that stands for the emulated hosts' keeper among the ranks' in :meth:`Cluster._collect`.
_KEEPER = -1


class Cluster:
    """A pool of ``world_size`` rank processes with their mesh, created once, reused by ``run``.

        with lab.launch(4) as cluster:
            outs = cluster.run(step, 2.0)      # step(mesh, 2.0) in every rank; results in rank order

    Use :func:`lab.launch` to create one.
    """
    @takes_pool_options
    def __init__(self, world_size: int, **options: Any) -> None:
        pool = PoolOptions(**options).checked(world_size)
        context = start_context()
        self.world_size = world_size
        self.transport = pool.transport
        self._processes: list[mp.process.BaseProcess] = []
        self._controls: list[Any] = []
        self._closed = False
        self._closed_why = "close() was called"
        self._running = threading.Lock()  # one run at a time: replies carry no task id
        self._forkserver = forkserver_pid()
        self.hosts: Hosts | None = None
        self._store = None
        endpoints: list[Any] = []
        try:
            # ``env`` holds while the pool is built (the shm endpoints read some variables here) and
            # in every rank (they take this environment). The process's environment is one for all
            # threads: pools start one at a time, so none sees another's variables.
            with _STARTING, environment(**(pool.env or {})):
                # Emulated hosts (namespaces, switch, capped links) first: the ranks start inside them.
                self.hosts = Hosts(pool.hosts, pool.link_gbit) if pool.hosts else None
                endpoints = pool.wire.endpoints(context, world_size, pool)
                # Loopback only: ranks on emulated hosts connect before they enter their namespace.
                self._store = serve_store("127.0.0.1", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
                if pool.workload:  # the header, once, before any rank records
                    recording.write_header(pool.workload, world_size, _recorded(pool, world_size))
                self._start(context, endpoints, pool)
        except BaseException:
            for ep in endpoints:
                ep.close_in_parent()
            self.close(timeout_s=0.0)
            raise

    def _start(self, context: mp.context.BaseContext, endpoints: list[Any], pool: PoolOptions) -> None:
        """Start one process per rank with its endpoints and control pipe; wait until all joined the mesh."""
        options = RankOptions(environment=dict(os.environ), transport=pool.transport,
                              recv_timeout_ms=pool.recv_timeout_ms, trace=pool.trace,
                              store=f"127.0.0.1:{self._store.port}",
                              hosts=self.hosts.hosts if self.hosts else None, workload=pool.workload)
        for rank, ends in enumerate(endpoints):
            control, child_control = context.Pipe()
            process = context.Process(target=rank_main, args=(ends, child_control, options),
                                      name=f"lab-rank{rank}", daemon=True)
            self._controls.append(control)
            try:
                process.start()
            finally:
                child_control.close()
            self._processes.append(process)
        for ep in endpoints:  # the ranks hold their own copies now
            ep.close_in_parent()
        self._collect(READY, STARTUP_TIMEOUT_S)

    # -- running -------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, in rank order."""
        return [process.pid for process in self._processes]

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``fn(mesh, *args)`` in every rank; return the results in rank order.

        ``fn`` must be picklable (a module-level function). If a rank raises or dies, raises
        :class:`lab.RankError` naming it; the pool stays usable only if every rank failed before
        sending anything (for example the same bad argument everywhere), and is closed otherwise.
        """
        try:
            task = pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(f"fn and args must be picklable (fn a module-level function): {exc}") from exc
        with self._running:  # a second thread waits its turn: replies carry no task id
            if self._closed:
                raise LabError(f"this cluster is closed ({self._closed_why})")
            self._check_keeper()  # hosts lost since the last run: send nothing over links that are gone
            for control in self._controls:
                control.send_bytes(task)
            return self._collect(None, None)

    def _collect(self, expected: bytes | None, timeout_s: float | None) -> list[Any]:
        """Wait for one reply per rank. ``expected``: a fixed reply (start-up) instead of results.
        Once one rank failed, the others get FAILURE_GRACE_S to answer."""
        results: list[Any] = [None] * self.world_size
        failures: dict[int, RankFailure] = {}
        waiting = set(range(self.world_size))
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        grace_started = False
        while waiting:
            if failures and not grace_started:  # during start-up too: a failed rank cuts the wait short
                grace_started = True
                grace_end = time.monotonic() + FAILURE_GRACE_S
                give_up = grace_end if give_up is None else min(give_up, grace_end)
            remaining = None if give_up is None else max(0.0, give_up - time.monotonic())
            handles = self._handles(waiting)
            ready = wait(list(handles), remaining)
            if not ready:
                break
            for handle in ready:
                rank = handles[handle]
                if rank == _KEEPER:
                    self._check_keeper()
                elif rank in waiting and self._answered(rank, handle):
                    waiting.discard(rank)
                    self._read_reply(rank, expected, results, failures)
        if failures or waiting:
            self._fail(failures, waiting)
        return results

    def _handles(self, waiting: set[int]) -> dict[Any, int]:
        """What to wait on: each waited-for rank's control pipe and process sentinel, and the
        emulated hosts' keeper (readable if it dies)."""
        handles = {self._controls[r]: r for r in waiting}
        handles.update({self._processes[r].sentinel: r for r in waiting})
        if self.hosts is not None:
            handles[self.hosts.sentinel] = _KEEPER
        return handles

    def _answered(self, rank: int, handle: Any) -> bool:
        """The rank replied or is gone; not when its process exited with a reply still unread
        (read the reply next round, from its pipe)."""
        control = self._controls[rank]
        return handle is control or not control.poll(0)

    def _read_reply(self, rank: int, expected: bytes | None, results: list[Any],
                    failures: dict[int, RankFailure]) -> None:
        """Read ``rank``'s reply into ``results`` or ``failures`` (a closed pipe: it died)."""
        try:
            reply = self._controls[rank].recv_bytes()
        except (EOFError, OSError):
            failures[rank] = death(rank, self._processes[rank], self._forkserver)
            return
        if reply == expected and expected is not None:
            return
        status, payload = pickle.loads(reply)
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload

    def _check_keeper(self) -> None:
        """If the emulated hosts' keeper died, their links went with it: no rank is to blame.
        Close the pool and raise a LabError saying what died (lab.hosts.emulated.Hosts.lost)."""
        lost = self.hosts.lost() if self.hosts is not None else None
        if lost:
            self._closed_why = lost
            self.close(timeout_s=0.0)
            raise LabError(lost + "; the pool was closed (start a new one)")

    def _fail(self, failures: dict[int, RankFailure], waiting: set[int]) -> None:
        """Raise RankError for the root cause; close the pool unless it is still consistent."""
        self._check_keeper()  # ranks that timed out because the links vanished are not the cause
        error, closed_why = diagnose(failures, waiting, self.pids)
        if closed_why is not None:
            self._closed_why = closed_why
            self.close(timeout_s=0.0)  # ranks still inside the failed collective are ended at once
        raise error

    # -- teardown ------------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """End every rank process (politely, then after ``timeout_s`` by force). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._store = None
        for control in self._controls:
            try:
                control.send_bytes(STOP)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for control in self._controls:
            control.close()
        for process in self._processes:
            process.close()
        if self.hosts is not None:
            self.hosts.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        # Leaving on an exception (Ctrl-C included), ranks may be busy: end them at once.
        self.close(timeout_s=0.0 if exc_type else 5.0)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _recorded(pool: PoolOptions, world_size: int) -> dict:
    """What a workload's header says of the pool that recorded it (the network a replay calibrates)."""
    hosts = pool.hosts or 1
    return {
        "launcher": "lab.launch", "transport": pool.transport, "hosts": hosts,
        "ranks_per_host": world_size // hosts, "link_gbit": pool.link_gbit}
