"""What runs in each rank process: join the mesh, then run the parent's tasks until told to stop.

The control protocol, over the rank's private pipe: the rank first answers :data:`READY`, or a
pickled ``("error", RankFailure)`` if it could not join the mesh. Then, for each task the parent
sends (a pickled ``(fn, args)``), it answers a pickled ``("ok", pickled result)`` or
``("error", RankFailure)``. :data:`STOP`, or end-of-file (the parent is gone), ends the rank.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from lab.comm.mesh import Mesh
from lab.errors import DeadlineError
from lab.hosts.emulated import Host
from lab.hosts.rendezvous import pool_store
from lab.launch.diagnosis import RankFailure
from lab.launch.forkserver import die_with_parent
from lab.launch.transports import POOL_TRANSPORTS

#: The parent's "stop" (an empty task) and the rank's "joined the mesh".
STOP = b""
READY = b"ready"


@dataclass(frozen=True)
class RankOptions:
    """What the parent hands every rank at start, with its endpoints."""

    environment: dict[str, str]  # the caller's as it is now (the forkserver's is older)
    transport: str
    recv_timeout_ms: float | None
    trace: str | None
    store: str  # the pool's rendezvous store, host:port on loopback
    hosts: list[Host] | None  # the emulated hosts, if any
    workload: str | None = None  # where every rank records its calls (the parent wrote the header)


def rank_main(endpoints: Any, control: Any, options: RankOptions) -> None:
    """A rank's life: join the mesh, then run tasks from the parent until told to stop."""
    import torch

    torch.set_num_threads(1)  # ranks share the cores; intra-op threads would oversubscribe them
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends us
    die_with_parent()
    _take_environment(endpoints, options)
    try:
        mesh = _join(endpoints, options)
    except BaseException as exc:  # noqa: BLE001 (whatever stops the join, the parent hears of it)
        control.send_bytes(pickle.dumps(("error", _failure(exc, None))))
        return
    control.send_bytes(READY)
    try:
        _serve(mesh, control, endpoints.rank)
    finally:
        mesh.close()


def _take_environment(endpoints: Any, options: RankOptions) -> None:
    """The caller's environment, and the variables a launcher would set for this rank."""
    rank, world_size = endpoints.rank, endpoints.world_size
    os.environ.clear()
    os.environ.update(options.environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), LAB_STORE=options.store)
    if options.workload:  # a torch group made in the rank (Mesh.from_store) goes on with the pool's recording
        os.environ["LAB_WORKLOAD"] = options.workload


def _join(endpoints: Any, options: RankOptions) -> Mesh:
    """Move onto this rank's emulated host, if any, then build its transport and mesh."""
    rank, world_size = endpoints.rank, endpoints.world_size
    address, placement = "127.0.0.1", None
    if options.hosts:
        # On an emulated host: the store stays on the root namespace's loopback, so connect
        # to it first, then move into the host's network namespace, before any other socket.
        per_host = world_size // len(options.hosts)
        host = options.hosts[rank // per_host]
        placement = (host.index, rank % per_host, per_host)
        host.enter(before_network=pool_store)
        address = host.address
        os.environ.update(LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host),
                          GROUP_RANK=str(host.index), GLOO_SOCKET_IFNAME=host.interface)
    transport = POOL_TRANSPORTS[options.transport].connect(endpoints, address)
    mesh = Mesh(transport, transport_name=options.transport, recv_timeout_ms=options.recv_timeout_ms,
                trace=options.trace, placement=placement)
    if options.workload:
        mesh.record_workload(options.workload)
    return mesh


def _serve(mesh: Mesh, control: Any, rank: int) -> None:
    """Run each task the parent sends and answer it, until STOP or the parent is gone."""
    rank_pid = os.getpid()
    while True:
        try:
            task = control.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if task == STOP:
            break
        control.send_bytes(pickle.dumps(_run(mesh, task, rank_pid, rank)))


def _run(mesh: Mesh, task: bytes, rank_pid: int, rank: int) -> tuple[str, Any]:
    """One task's reply: ``("ok", pickled result)`` once every collective it issued has
    completed, or ``("error", RankFailure)``."""
    recorder = mesh.issue_queue.recorder
    try:
        fn, args = pickle.loads(task)
        if recorder is not None:
            recorder.returned()  # the program starts now: the time since the last task is no compute
        result = fn(mesh, *args)
        _leave_if_forked(rank_pid, rank)
        mesh.issue_queue.wait_all()  # a task ends when every collective it issued has completed
        mesh.exchange.raise_if_unread("ended its run")  # (a message a disagreement left: not a silent end)
        if recorder is not None:
            recorder.close()  # its lines written: the parent may read the file once the run returns
        return "ok", pickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 (whatever a task raises goes back to the parent)
        _leave_if_forked(rank_pid, rank)
        in_flight = mesh.in_flight
        reply = ("error", _failure(exc, mesh, in_flight))
        if not mesh.exchange.clean or in_flight:
            mesh.close()  # peers blocked on us see end-of-file now, not at their deadline
        return reply


def _failure(exc: BaseException, mesh: Mesh | None, in_flight: bool = False) -> RankFailure:
    """What the parent is told of ``exc`` (call it while handling ``exc``: it takes the traceback)."""
    return RankFailure(
        type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic_ns(), clean=mesh is not None and
        mesh.exchange.clean and not in_flight, records=mesh.flight_records() if mesh else None,
        waiting_for=exc.peers if isinstance(exc, DeadlineError) else (), in_flight=in_flight,
        told=getattr(exc, "notice", None) is not None)


def _leave_if_forked(rank_pid: int, rank: int) -> None:
    """A process forked inside ``fn`` that returns here must not answer the parent in the rank's
    place (its reply would be taken for the next run's): it says so and exits."""
    if os.getpid() != rank_pid:
        os.write(
            2, f"lab: a process forked inside rank {rank}'s fn (pid {os.getpid()}) returned into the "
            "rank's task loop; it exits now. End forked children with os._exit().\n".encode())
        os._exit(70)
