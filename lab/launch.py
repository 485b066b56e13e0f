"""Rank processes: ``lab.spawn`` for one call, ``lab.launch`` for a persistent pool.

The parent builds the whole mesh (pipes or queues, shared-memory segments), starts one process
per rank and talks to each over a private control pipe: it sends ``(fn, args)`` pickled, the rank
answers with its result or its exception. Processes start from a forkserver that has already
imported torch, numba and the compiled kernels, so a pool starts in well under a second and no
rank compiles anything. Whatever happens, :meth:`Cluster.close` ends every process.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing import forkserver
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

from lab.errors import LabError, RankError
from lab.hosts import Hosts
from lab.mesh import FlightRecord, Mesh
from lab.rendezvous import pool_store
from lab.transport import queue as queue_transport
from lab.transport import shm as shm_transport
from lab.transport import tcp as tcp_transport

TRANSPORTS = ("shm", "queue", "tcp")

#: After one rank fails, how long the parent waits for the others to report before ending them.
FAILURE_GRACE_S = 1.0
#: How long the parent waits for a new pool's ranks to come up.
STARTUP_TIMEOUT_S = 120.0
_STOP = b""
_CONSEQUENCES = ("CollectiveMismatchError", "DeadlineError", "PeerLostError")
_PR_SET_PDEATHSIG = 1


def _context() -> mp.context.BaseContext:
    method = os.environ.get("LAB_START_METHOD", "forkserver")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["lab"])
    return context


def _check_options(world_size: Any, transport: Any, recv_timeout_ms: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; got {transport!r}")
    if recv_timeout_ms is not None and not (isinstance(recv_timeout_ms, (int, float)) and recv_timeout_ms > 0):
        raise ValueError(f"recv_timeout_ms must be a positive number of milliseconds or None; got {recv_timeout_ms!r}")


def _check_hosts(world_size: int, transport: str, hosts: Any, link_gbit: Any) -> None:
    if hosts is None:
        if link_gbit is not None:
            raise ValueError(f"link_gbit caps the links of emulated hosts: give hosts= too; got link_gbit={link_gbit!r}")
        return
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= world_size or world_size % hosts:
        raise ValueError(f"hosts must be an int that divides world_size ({world_size}); got {hosts!r}")
    if link_gbit is not None and (isinstance(link_gbit, bool) or not isinstance(link_gbit, (int, float))
                                  or not link_gbit > 0):
        raise ValueError(f"link_gbit must be a positive number of Gbit/s or None (uncapped); got {link_gbit!r}")
    if hosts > 1 and transport != "tcp":
        raise ValueError(f"transport must be 'tcp' with hosts > 1 ({transport!r} would bypass the links)")


class Cluster:
    """A pool of ``world_size`` rank processes with their mesh, created once, reused by ``run``.

        with lab.launch(4) as cluster:
            outs = cluster.run(step, 2.0)      # step(mesh, 2.0) in every rank; results in rank order

    Use :func:`launch` to create one.
    """

    def __init__(
        self,
        world_size: int,
        *,
        transport: str = "shm",
        recv_timeout_ms: float | None = None,
        trace: str | None = None,
        segment_bytes: int = shm_transport.DEFAULT_SEGMENT_BYTES,
        slots: int = shm_transport.DEFAULT_SLOTS,
        hosts: int | None = None,
        link_gbit: float | None = None,
    ) -> None:
        _check_options(world_size, transport, recv_timeout_ms)
        _check_hosts(world_size, transport, hosts, link_gbit)
        import torch.distributed as dist  # the rendezvous store for gloo (and tcp) lives here

        self.world_size = world_size
        self.transport = transport
        self._processes: list[mp.process.BaseProcess] = []
        self._controls: list[Any] = []
        self._closed = False
        self.hosts: Hosts | None = None
        # Emulated hosts (namespaces, switch, capped links) first: the ranks start inside them.
        self.hosts = Hosts(hosts, link_gbit) if hosts else None
        context = _context()
        if transport == "shm":
            endpoints = shm_transport.create_endpoints(world_size, segment_bytes, slots)
        elif transport == "queue":
            endpoints = queue_transport.create_endpoints(context, world_size)
        else:
            endpoints = [tcp_transport.TcpEndpoints(rank, world_size) for rank in range(world_size)]
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
        )
        options = {
            "environment": dict(os.environ),  # the forkserver's is older: ranks get the caller's now
            "transport": transport,
            "recv_timeout_ms": recv_timeout_ms,
            "trace": trace,
            "store": f"127.0.0.1:{self._store.port}",
            "hosts": self.hosts.hosts if self.hosts else None,
        }
        try:
            for rank in range(world_size):
                control, child_control = context.Pipe()
                process = context.Process(
                    target=_rank_main,
                    args=(endpoints[rank], child_control, options),
                    name=f"lab-rank{rank}",
                    daemon=True,
                )
                process.start()
                child_control.close()
                self._processes.append(process)
                self._controls.append(control)
            for ep in endpoints:  # the ranks hold their own copies now
                ep.close_in_parent()
            self._collect(b"ready", STARTUP_TIMEOUT_S)
        except BaseException:
            for ep in endpoints:
                ep.close_in_parent()
            self.close()
            raise

    # -- running -------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Call ``fn(mesh, *args)`` in every rank; return the results in rank order.

        ``fn`` must be picklable (a module-level function). If a rank raises or dies, raises
        :class:`lab.RankError` naming it; the pool stays usable only if every rank failed before
        sending anything (for example the same bad argument everywhere), and is closed otherwise.
        """
        if self._closed:
            raise LabError("this cluster is closed (a rank failed, or close() was called)")
        try:
            task = pickle.dumps((fn, args))
        except Exception as exc:
            raise TypeError(f"fn and args must be picklable (fn a module-level function): {exc}") from exc
        for control in self._controls:
            control.send_bytes(task)
        return self._collect(None, None)

    def _collect(self, expected: bytes | None, timeout_s: float | None) -> list[Any]:
        """Wait for one reply per rank. ``expected``: a fixed reply (start-up) instead of results."""
        results: list[Any] = [None] * self.world_size
        failures: dict[int, RankFailure] = {}
        waiting = set(range(self.world_size))
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            if failures and give_up is None:
                give_up = time.monotonic() + FAILURE_GRACE_S
            remaining = None if give_up is None else max(0.0, give_up - time.monotonic())
            handles = {self._controls[r]: r for r in waiting}
            handles.update({self._processes[r].sentinel: r for r in waiting})
            ready = wait(list(handles), remaining)
            if not ready:
                break
            for handle in ready:
                rank = handles[handle]
                if rank not in waiting:
                    continue
                control = self._controls[rank]
                if handle is not control and control.poll(0):
                    continue  # the rank answered, then exited: read the answer next round
                waiting.discard(rank)
                try:
                    reply = control.recv_bytes()
                except (EOFError, OSError):
                    failures[rank] = _death(rank, self._processes[rank])
                    continue
                if reply == expected:
                    continue
                status, payload = pickle.loads(reply)
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
        if failures or waiting:
            self._fail(failures, waiting)
        return results

    def _fail(self, failures: dict[int, RankFailure], waiting: set[int]) -> None:
        """Raise RankError for the first failure; close the pool unless it is still consistent."""
        if not failures:  # start-up timed out
            raise RankError(min(waiting), "TimeoutError", f"ranks {sorted(waiting)} did not start in time")
        # The root cause: the most specific failure (a user exception or a dead process, then a
        # mismatch, then a deadline, and a lost peer last: those are usually consequences), earliest first.
        first = min(failures, key=lambda r: (_CONSEQUENCES.index(failures[r].exc_type) if failures[r].exc_type
                                             in _CONSEQUENCES else -1, failures[r].at_ns, r))
        cause = failures[first]
        lines = [f"rank {r}: {f.exc_type}: {f.message}" for r, f in sorted(failures.items()) if r != first]
        lines += [f"rank {r}: still running {FAILURE_GRACE_S} s after rank {first} failed; ended" for r in sorted(waiting)]
        records = {r: failures[r].records if r in failures else "still running, ended" for r in range(self.world_size)}
        records.update({r: "process died" for r, f in failures.items() if f.records is None})
        usable = not waiting and all(f.clean for f in failures.values())
        if not usable:
            self.close(timeout_s=0.0)  # ranks still inside the failed collective are ended at once
        raise RankError(first, cause.exc_type, cause.message, cause.traceback, cause.exitcode,
                        "\n".join(lines), records)

    # -- teardown ------------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """End every rank process (politely, then after ``timeout_s`` by force). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for control in self._controls:
            try:
                control.send_bytes(_STOP)
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
        self._store = None
        if self.hosts is not None:
            self.hosts.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        # Leaving on an exception (Ctrl-C included), ranks may be busy: end them at once.
        self.close(timeout_s=0.0 if exc_type else 5.0)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


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


def _death(rank: int, process: mp.process.BaseProcess) -> RankFailure:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        how = f"killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return RankFailure("ProcessDied", f"rank {rank}'s process {how}", "", time.monotonic_ns(), False, code)


def launch(world_size: int, **options: Any) -> Cluster:
    """Start a persistent pool of rank processes; use it as a context manager.

    Same options as :func:`spawn` (``transport``, ``recv_timeout_ms``, ``trace``, ``segment_bytes``,
    ``slots``, ``hosts``, ``link_gbit``); ``segment_bytes`` and ``slots`` size the shm transport's
    per-peer buffers (``slots`` buffers of ``segment_bytes`` per directed edge).

    ``hosts=H`` places the ranks on H emulated hosts (:mod:`lab.hosts`: a network namespace each,
    one switch, each host's link capped at ``link_gbit`` Gbit/s each way, uncapped if None); host
    h holds ranks ``[h*L, (h+1)*L)``, ``L = world_size // H``. With ``H > 1`` the transport must be
    ``"tcp"``. Raises :class:`lab.EmulationUnavailable` where namespaces cannot be made.

        with lab.launch(4, transport="queue") as cluster:
            first = cluster.run(step, 1.0)
            second = cluster.run(step, 2.0)   # same processes, same mesh
    """
    return Cluster(world_size, **options)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    transport: str = "shm",
    recv_timeout_ms: float | None = None,
    trace: str | None = None,
    segment_bytes: int = shm_transport.DEFAULT_SEGMENT_BYTES,
    slots: int = shm_transport.DEFAULT_SLOTS,
    hosts: int | None = None,
    link_gbit: float | None = None,
) -> list[Any]:
    """Run ``fn(mesh, *args)`` in ``world_size`` new processes; return their results in rank order.

        def step(mesh, scale):
            x = torch.arange(4.0) * scale + mesh.rank
            return lab.allreduce(mesh, x)

        lab.spawn(step, 2, args=(10.0,))      # [tensor([1., 21., 41., 61.])] * 2

    Everything (processes, pipes, queues, shared memory) is torn down before it returns or raises.
    """
    with Cluster(
        world_size, transport=transport, recv_timeout_ms=recv_timeout_ms, trace=trace,
        segment_bytes=segment_bytes, slots=slots, hosts=hosts, link_gbit=link_gbit,
    ) as cluster:
        return cluster.run(fn, *args)


# -- inside a rank's process ---------------------------------------------------------------------


def _rank_main(endpoints: Any, control: Any, options: dict[str, Any]) -> None:
    """A rank's life: join the mesh, then run tasks from the parent until told to stop."""
    import torch

    torch.set_num_threads(1)  # ranks share the cores; intra-op threads would oversubscribe them
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends us
    _die_with_parent()
    rank, world_size = endpoints.rank, endpoints.world_size
    os.environ.clear()
    os.environ.update(options["environment"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), LAB_STORE=options["store"])
    host, address, placement = None, "127.0.0.1", None
    try:
        if options["hosts"]:
            # On an emulated host: the store stays on the root namespace's loopback, so connect
            # to it first, then move into the host's network namespace, before any other socket.
            per_host = world_size // len(options["hosts"])
            host = options["hosts"][rank // per_host]
            placement = (host.index, rank % per_host, per_host)
            host.enter(before_network=pool_store)
            address = host.address
            os.environ.update(LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host),
                              GROUP_RANK=str(host.index), GLOO_SOCKET_IFNAME=host.interface)
        if options["transport"] == "shm":
            transport = shm_transport.ShmTransport(endpoints)
        elif options["transport"] == "queue":
            transport = queue_transport.QueueTransport(endpoints)
        else:
            transport = tcp_transport.TcpTransport(rank, world_size, pool_store(), host=address)
        mesh = Mesh(transport, transport_name=options["transport"],
                    recv_timeout_ms=options["recv_timeout_ms"], trace=options["trace"], placement=placement)
    except BaseException as exc:
        control.send_bytes(pickle.dumps(("error", _failure(exc, None))))
        return
    control.send_bytes(b"ready")
    try:
        while True:
            try:
                task = control.recv_bytes()
            except (EOFError, OSError):  # the parent is gone
                break
            if task == _STOP:
                break
            try:
                fn, args = pickle.loads(task)
                result = fn(mesh, *args)
                mesh.wait_all()  # a task ends when every collective it issued has completed
                reply = ("ok", pickle.dumps(result))
            except BaseException as exc:
                reply = ("error", _failure(exc, mesh))
                if not mesh.clean:
                    mesh.close()  # peers blocked on us see end-of-file now, not at their deadline
            control.send_bytes(pickle.dumps(reply))
    finally:
        mesh.close()


def _failure(exc: BaseException, mesh: Mesh | None) -> RankFailure:
    return RankFailure(
        type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic_ns(),
        clean=mesh is not None and mesh.clean, records=mesh.flight_records() if mesh else None,
    )


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent dies (even by SIGKILL), so no rank outlives
    its job. The parent is the forkserver, which exits once every holder of its "alive" pipe is
    gone: the user's process, and every process it forked, which inherit the pipe. A rank drops
    its copy, so the forkserver (and then the rank) ends when the user's process does."""
    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)
