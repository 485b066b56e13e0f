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
import resource
import secrets
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

from lab import checks
from lab.errors import DeadlineError, LabError, RankError
from lab.hosts import Hosts, check_link_gbit
from lab.flight import FlightRecord
from lab.mesh import Mesh
from lab.rendezvous import pool_store, serve_store
from lab.transport import queue as queue_transport
from lab.transport import shm as shm_transport
from lab.transport import mixed as mixed_transport
from lab.transport import tcp as tcp_transport

TRANSPORTS = ("shm", "queue", "tcp", "auto")

#: After one rank fails, how long the parent waits for the others to report before ending them.
FAILURE_GRACE_S = 1.0
#: How long the parent waits for a new pool's ranks to come up.
STARTUP_TIMEOUT_S = 120.0
_STOP = b""
_CONSEQUENCES = ("CollectiveMismatchError", "DeadlineError", "PeerLostError")
_PR_SET_PDEATHSIG = 1

#: How ranks may be started (``LAB_START_METHOD``). Not "fork": every rank would inherit every
#: other rank's channel ends, so a dead rank's pipes would never read end-of-file.
START_METHODS = ("forkserver", "spawn")

#: The largest pool per transport. A rank's channel descriptors travel to it in one
#: ``SCM_RIGHTS`` message, which Linux caps at 253 descriptors: shm passes 3N-2 of them (pipes and
#: segments), queue 5N-4 (queue pipes and "alive" pipes), plus multiprocessing's own few.
MAX_WORLD_SIZE = {"shm": 83, "queue": 50, "tcp": 1024, "auto": 1024}
#: "auto" runs a shm mesh per host: at most this many ranks per host.
MAX_RANKS_PER_HOST_AUTO = MAX_WORLD_SIZE["shm"]

#: The most shared memory a shm pool may map in all, as a fraction of the machine's memory.
MAX_SHM_FRACTION = 0.5


def _context() -> mp.context.BaseContext:
    method = os.environ.get("LAB_START_METHOD", "forkserver")
    if method not in START_METHODS:
        why = " (with 'fork' every rank inherits the others' channel ends, so a dead rank goes unnoticed)"
        raise ValueError(f"environment variable LAB_START_METHOD must be one of {', '.join(map(repr, START_METHODS))}; "
                         f"got {method!r}" + (why if method == "fork" else ""))
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["lab"])
        _check_forkserver()
    return context


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, Z zombie), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _forkserver_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _check_forkserver() -> None:
    """A stopped forkserver would block the start of every rank without limit: say so instead.
    (A dead one is restarted by multiprocessing.)"""
    pid = _forkserver_pid()
    if pid is not None and _process_state(pid) == "T":
        raise LabError(f"the forkserver that starts ranks (pid {pid}) is stopped (SIGSTOP or a debugger); "
                       f"resume it with `kill -CONT {pid}`, or kill it and the next pool starts a new one")


def _check_options(world_size: Any, transport: Any, recv_timeout_ms: Any, trace: Any, segment_bytes: Any,
                   slots: Any, eager_bytes: Any = shm_transport.DEFAULT_EAGER_BYTES) -> None:
    checks.positive_int(world_size, "world_size")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; got {transport!r}")
    if world_size > MAX_WORLD_SIZE[transport]:
        raise ValueError(f"world_size must be at most {MAX_WORLD_SIZE[transport]} with transport={transport!r} "
                         f"(see docs/failures.md, 'Limits'); got {world_size}")
    checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
    checks.trace_path(trace)
    checks.trace_path(os.environ.get("LAB_TRACE"), "LAB_TRACE")
    checks.env_flag("LAB_TRACE_STEPS")
    checks.positive_int(slots, "slots")
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 64 \
            or segment_bytes % 64:
        raise ValueError(f"segment_bytes must be a positive int multiple of 64; got {segment_bytes!r}")
    if isinstance(eager_bytes, bool) or not isinstance(eager_bytes, int) \
            or not 0 <= eager_bytes <= shm_transport.MAX_EAGER_BYTES:
        raise ValueError(f"eager_bytes must be an int in [0, {shm_transport.MAX_EAGER_BYTES}]; got {eager_bytes!r}")
    if transport == "shm":
        total = world_size * (world_size - 1) * slots * segment_bytes
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > MAX_SHM_FRACTION * memory:
            raise ValueError(f"slots x segment_bytes is too large: {world_size} ranks would map {total / 2**30:.1f} "
                             f"GiB of shared memory (N(N-1) x slots x segment_bytes), more than half of this "
                             f"machine's {memory / 2**30:.0f} GiB; got slots={slots}, segment_bytes={segment_bytes}")
    _ensure_descriptors(3 * world_size + (2 * world_size * (world_size - 1) if transport == "shm" else 0)
                        + (4 * world_size * (world_size - 1) if transport == "queue" else 0))


def _ensure_descriptors(needed: int) -> None:
    """Raise the soft limit on open files to the hard one if the pool needs it, or refuse."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    if in_use + needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or in_use + needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return
    raise ValueError(f"world_size is too large for this process's open-file limit: the pool needs {needed} "
                     f"descriptors, {in_use} are open, and the hard limit is {hard} (raise it with ulimit -n)")


def _mixed_endpoints(world_size: int, hosts: int, segment_bytes: int, slots: int,
                     eager_bytes: int) -> list[mixed_transport.MixedEndpoints]:
    """``transport="auto"``: one shm mesh per host (its ranks by local rank), one secret for TCP."""
    per_host, secret = world_size // hosts, secrets.token_bytes(32)
    endpoints: list[mixed_transport.MixedEndpoints] = []
    try:
        for host in range(hosts):
            local = shm_transport.create_endpoints(per_host, segment_bytes, slots, eager_bytes)
            endpoints += [mixed_transport.MixedEndpoints(host * per_host + ep.rank, world_size, secret, ep)
                          for ep in local]
    except BaseException:
        for ep in endpoints:
            ep.close_in_parent()
        raise
    return endpoints


def _check_hosts(world_size: int, transport: str, hosts: Any, link_gbit: Any) -> None:
    if hosts is None:
        if link_gbit is not None:
            raise ValueError(f"link_gbit caps the links of emulated hosts: give hosts= too; got link_gbit={link_gbit!r}")
        if transport == "auto" and world_size > MAX_RANKS_PER_HOST_AUTO:
            raise ValueError(f"world_size must be at most {MAX_RANKS_PER_HOST_AUTO} with transport='auto' on one "
                             f"host (a shm mesh per host); got {world_size}")
        return
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= world_size or world_size % hosts:
        raise ValueError(f"hosts must be an int that divides world_size ({world_size}); got {hosts!r}")
    check_link_gbit(link_gbit)  # the range tbf can cap at (lab.hosts.LINK_GBIT)
    if hosts > 1 and transport not in ("tcp", "auto"):
        raise ValueError(f"transport must be 'tcp' or 'auto' with hosts > 1 ({transport!r} would bypass the links)")
    if transport == "auto" and world_size // hosts > MAX_RANKS_PER_HOST_AUTO:
        raise ValueError(f"world_size must be at most {MAX_RANKS_PER_HOST_AUTO} per host with transport='auto' "
                         f"(a shm mesh per host); got {world_size // hosts} per host")


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
        eager_bytes: int = shm_transport.DEFAULT_EAGER_BYTES,
        hosts: int | None = None,
        link_gbit: float | None = None,
    ) -> None:
        _check_options(world_size, transport, recv_timeout_ms, trace, segment_bytes, slots, eager_bytes)
        _check_hosts(world_size, transport, hosts, link_gbit)
        context = _context()
        self.world_size = world_size
        self.transport = transport
        self._processes: list[mp.process.BaseProcess] = []
        self._controls: list[Any] = []
        self._closed = False
        self._closed_why = "close() was called"
        self._running = threading.Lock()  # one run at a time: replies carry no task id
        self._forkserver = _forkserver_pid()
        self.hosts: Hosts | None = None
        self._store = None
        endpoints: list[Any] = []
        try:
            # Emulated hosts (namespaces, switch, capped links) first: the ranks start inside them.
            self.hosts = Hosts(hosts, link_gbit) if hosts else None
            if transport == "shm":
                endpoints = shm_transport.create_endpoints(world_size, segment_bytes, slots, eager_bytes)
            elif transport == "queue":
                endpoints = queue_transport.create_endpoints(context, world_size)
            elif transport == "auto":  # a shm mesh per host, TCP between hosts
                endpoints = _mixed_endpoints(world_size, hosts or 1, segment_bytes, slots, eager_bytes)
            else:
                secret = secrets.token_bytes(32)  # handed to the ranks over their private pipes only
                endpoints = [tcp_transport.TcpEndpoints(rank, world_size, secret) for rank in range(world_size)]
            # Loopback only: ranks on emulated hosts connect before they enter their namespace.
            self._store = serve_store("127.0.0.1", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
            self._start(context, endpoints, world_size, transport, recv_timeout_ms, trace)
        except BaseException:
            for ep in endpoints:
                ep.close_in_parent()
            self.close(timeout_s=0.0)
            raise

    def _start(self, context, endpoints: list, world_size: int, transport: str, recv_timeout_ms, trace) -> None:
        options = {
            "environment": dict(os.environ),  # the forkserver's is older: ranks get the caller's now
            "transport": transport,
            "recv_timeout_ms": recv_timeout_ms,
            "trace": trace,
            "store": f"127.0.0.1:{self._store.port}",
            "hosts": self.hosts.hosts if self.hosts else None,
        }
        for rank in range(world_size):
            control, child_control = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(endpoints[rank], child_control, options),
                name=f"lab-rank{rank}",
                daemon=True,
            )
            self._controls.append(control)
            try:
                process.start()
            finally:
                child_control.close()
            self._processes.append(process)
        for ep in endpoints:  # the ranks hold their own copies now
            ep.close_in_parent()
        self._collect(b"ready", STARTUP_TIMEOUT_S)

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
            for control in self._controls:
                control.send_bytes(task)
            return self._collect(None, None)

    def _collect(self, expected: bytes | None, timeout_s: float | None) -> list[Any]:
        """Wait for one reply per rank. ``expected``: a fixed reply (start-up) instead of results."""
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
            handles = {self._controls[r]: r for r in waiting}
            handles.update({self._processes[r].sentinel: r for r in waiting})
            if self.hosts is not None:
                handles[self.hosts.sentinel] = -1  # readable if the hosts' keeper dies
            ready = wait(list(handles), remaining)
            if not ready:
                break
            for handle in ready:
                rank = handles[handle]
                if rank == -1:
                    self._check_keeper()
                    continue
                if rank not in waiting:
                    continue
                control = self._controls[rank]
                if handle is not control and control.poll(0):
                    continue  # the rank answered, then exited: read the answer next round
                waiting.discard(rank)
                try:
                    reply = control.recv_bytes()
                except (EOFError, OSError):
                    failures[rank] = _death(rank, self._processes[rank], self._forkserver)
                    continue
                if reply == expected and expected is not None:
                    continue
                status, payload = pickle.loads(reply)
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
        if failures or waiting:
            self._fail(failures, waiting)
        return results

    def _check_keeper(self) -> None:
        """If the emulated hosts' keeper died, their links went with it: no rank is to blame.
        Close the pool and raise a LabError saying what died (lab.hosts.Hosts.lost)."""
        lost = self.hosts.lost() if self.hosts is not None else None
        if lost:
            self._closed_why = lost
            self.close(timeout_s=0.0)
            raise LabError(lost + "; the pool was closed (start a new one)")

    def _fail(self, failures: dict[int, RankFailure], waiting: set[int]) -> None:
        """Raise RankError for the first failure; close the pool unless it is still consistent."""
        self._check_keeper()  # ranks that timed out because the links vanished are not the cause
        if not failures:  # start-up timed out
            self._closed_why = "its ranks did not start"
            self.close(timeout_s=0.0)
            raise RankError(min(waiting), "TimeoutError", f"ranks {sorted(waiting)} did not start in time")
        # The root cause: the most specific failure (a user exception or a dead process, then a
        # mismatch, then a deadline, and a lost peer last: those are usually consequences), earliest first.
        first = min(failures, key=lambda r: (_CONSEQUENCES.index(failures[r].exc_type) if failures[r].exc_type
                                             in _CONSEQUENCES else -1, failures[r].at_ns, r))
        cause = failures[first]
        if cause.exc_type in _CONSEQUENCES and waiting:
            # Only consequences, and ranks that never answered: the one they were all waiting for
            # (stopped, or stuck in fn) is the cause, not the first rank whose deadline expired.
            first = _awaited(failures, waiting)
            cause = _unresponsive(first, failures, self._processes[first].pid)
        lines = [f"rank {r}: {f.exc_type}: {f.message}" for r, f in sorted(failures.items()) if r != first]
        lines += [f"rank {r}: still running {FAILURE_GRACE_S} s after the first failure; ended"
                  for r in sorted(waiting) if r != first]
        records = {r: failures[r].records if r in failures else "still running, ended" for r in range(self.world_size)}
        records.update({r: "process died" for r, f in failures.items() if f.records is None})
        usable = not waiting and all(f.clean for f in failures.values())
        if not usable:
            unfinished = [r for r, f in failures.items() if f.in_flight]
            self._closed_why = (f"rank {first} failed with {cause.exc_type}"
                                + (f"; ranks {unfinished} had asynchronous collectives in flight" if unfinished else "")
                                + "; start a new pool")
            self.close(timeout_s=0.0)  # ranks still inside the failed collective are ended at once
        raise RankError(first, cause.exc_type, cause.message, cause.traceback, cause.exitcode,
                        "\n".join(lines), records)

    # -- teardown ------------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """End every rank process (politely, then after ``timeout_s`` by force). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._store = None
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
    waiting_for: tuple[int, ...] = ()  # a DeadlineError's silent peers
    in_flight: bool = False  # asynchronous collectives had not completed when it failed


def _death(rank: int, process: mp.process.BaseProcess, forkserver_pid: int | None) -> RankFailure:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        how = f"killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    if forkserver_pid is not None and _process_state(forkserver_pid) in (None, "Z"):
        how += (f": the forkserver that started it (pid {forkserver_pid}) is gone, and ranks die with it "
                "(the next pool starts a new one)")
    return RankFailure("ProcessDied", f"rank {rank}'s process {how}", "", time.monotonic_ns(), False, code)


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


def _unresponsive(rank: int, failures: dict[int, RankFailure], pid: int | None) -> RankFailure:
    state = _process_state(pid) if pid else None
    how = {"T": "stopped (SIGSTOP or a debugger)", "D": "blocked in the kernel"}.get(state, "still running")
    waiters = sorted(r for r, f in failures.items() if f.exc_type == "DeadlineError")
    named = f"rank {waiters[0]}" if len(waiters) == 1 else "ranks " + ", ".join(map(str, waiters))
    message = (f"rank {rank} stopped making progress: its process was {how}, and {named} timed out "
               f"waiting for it (directly or through other ranks); it was ended") if waiters else \
        f"rank {rank} did not answer after its peers failed: its process was {how}; it was ended"
    return RankFailure("Unresponsive", message, "", time.monotonic_ns(), False)


def launch(world_size: int, **options: Any) -> Cluster:
    """Start a persistent pool of rank processes; use it as a context manager.

    Same options as :func:`spawn` (``transport``, ``recv_timeout_ms``, ``trace``, ``segment_bytes``,
    ``slots``, ``eager_bytes``, ``hosts``, ``link_gbit``); ``segment_bytes`` and ``slots`` size the
    shm transport's per-peer buffers (``slots`` buffers of ``segment_bytes`` per directed edge);
    shm messages of at most ``eager_bytes`` (0 to 4,048; default 4,048) travel inline in the pipe.

    ``hosts=H`` places the ranks on H emulated hosts (:mod:`lab.hosts`: a network namespace each,
    one switch, each host's link capped at ``link_gbit`` Gbit/s each way, uncapped if None); host
    h holds ranks ``[h*L, (h+1)*L)``, ``L = world_size // H``. With ``H > 1`` the transport must be
    ``"tcp"`` or ``"auto"`` (shared memory inside a host, TCP between hosts). Raises
    :class:`lab.EmulationUnavailable` where namespaces cannot be made.

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
    eager_bytes: int = shm_transport.DEFAULT_EAGER_BYTES,
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
        segment_bytes=segment_bytes, slots=slots, eager_bytes=eager_bytes, hosts=hosts, link_gbit=link_gbit,
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
        elif options["transport"] == "auto":
            local = shm_transport.ShmTransport(endpoints.shm)
            remote = None
            if endpoints.shm.world_size < world_size:  # other hosts: TCP
                remote = tcp_transport.TcpTransport(rank, world_size, pool_store(), endpoints.secret, host=address)
            transport = mixed_transport.MixedTransport(rank, world_size, rank - endpoints.shm.rank, local, remote)
        else:
            transport = tcp_transport.TcpTransport(rank, world_size, pool_store(), endpoints.secret, host=address)
        mesh = Mesh(transport, transport_name=options["transport"],
                    recv_timeout_ms=options["recv_timeout_ms"], trace=options["trace"], placement=placement)
    except BaseException as exc:
        control.send_bytes(pickle.dumps(("error", _failure(exc, None))))
        return
    control.send_bytes(b"ready")
    rank_pid = os.getpid()
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
                _leave_if_forked(rank_pid, rank)
                mesh.wait_all()  # a task ends when every collective it issued has completed
                reply = ("ok", pickle.dumps(result))
            except BaseException as exc:
                _leave_if_forked(rank_pid, rank)
                in_flight = mesh.in_flight
                reply = ("error", _failure(exc, mesh, in_flight))
                if not mesh.clean or in_flight:
                    mesh.close()  # peers blocked on us see end-of-file now, not at their deadline
            control.send_bytes(pickle.dumps(reply))
    finally:
        mesh.close()


def _failure(exc: BaseException, mesh: Mesh | None, in_flight: bool = False) -> RankFailure:
    return RankFailure(
        type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic_ns(),
        clean=mesh is not None and mesh.clean and not in_flight, records=mesh.flight_records() if mesh else None,
        waiting_for=exc.peers if isinstance(exc, DeadlineError) else (), in_flight=in_flight,
    )


def _leave_if_forked(rank_pid: int, rank: int) -> None:
    """A process forked inside ``fn`` that returns here must not answer the parent in the rank's
    place (its reply would be taken for the next run's): it says so and exits."""
    if os.getpid() != rank_pid:
        os.write(2, f"lab: a process forked inside rank {rank}'s fn (pid {os.getpid()}) returned into the rank's "
                    "task loop; it exits now. End forked children with os._exit().\n".encode())
        os._exit(70)


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
