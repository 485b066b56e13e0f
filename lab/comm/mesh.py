"""``lab.Mesh``: one rank's handle on the mesh, what algorithms and users send and receive through.

A mesh holds two parts and delegates to them: an :class:`lab.comm.exchange.Exchange`
(``mesh.exchange``: the transfers algorithms run on, with their numbering, fingerprints,
deadlines, counters, flight recorder and trace) and a :class:`lab.comm.point_to_point.PointToPoint`
(``mesh.point_to_point``: the issue order, ``async_op``, and point-to-point tensors). It adds the
launchers' constructors (:mod:`lab.comm.bootstrap`), ``close`` and sub-meshes. What the public
calls and the torch backend use of it is declared in :mod:`lab.comm.protocols`, what algorithms
use in :class:`lab.algorithms.peers.Peers`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from lab import checks
from lab.comm.channels import Channels
from lab.comm.exchange import Exchange
from lab.comm.membership import Membership, agree_split
from lab.comm.point_to_point import PointToPoint
from lab.flight import FlightRecord, TraceFile
from lab.ops import DTYPES, DType, Reduction
from lab.transport.base import Recv, Send, Transport

if TYPE_CHECKING:
    from lab.comm.operations import Operation
    from lab.comm.planned_run import PlannedRun
    from lab.fingerprint import Signature

#: A receive that waits longer than this raises DeadlineError (override with recv_timeout_ms).
DEFAULT_RECV_TIMEOUT_MS = 300_000


def _of(path: str, doc: str | None = None) -> property:
    """A mesh's read-only attribute that is its part's (``"exchange.rank"``): read through the mesh."""
    return property(attrgetter(path), doc=doc)


class Mesh:
    """One rank's handle: ``rank``, ``world_size``, point-to-point ``send``/``recv``, ``stats``.

    Created for you in every rank by :func:`lab.spawn` / :func:`lab.launch`. ``host``,
    ``local_rank`` and ``local_world_size`` say where the rank is (``hosts=``; without: host 0).

        def step(mesh):                       # runs in every rank's process
            if mesh.rank == 0:
                mesh.send(1, torch.arange(4.0))
            elif mesh.rank == 1:
                x = mesh.recv(0)              # tensor([0., 1., 2., 3.])
    """

    #: The plain calls' checks and choices, by their arguments (:mod:`lab.collectives.prepared`).
    templates: dict

    def __init__(self, transport: Transport, *, transport_name: str, recv_timeout_ms: float | None = None,
                 trace: str | None = None, placement: tuple[int, int, int] | None = None,
                 hosts: list[int] | None = None) -> None:
        # (host, local_rank, local_world_size): one host holding every rank unless told otherwise
        placement = placement or (0, transport.rank, transport.world_size)
        # Host of every global rank: as agreed under a launcher (``hosts``), else ranks
        # [h*L, (h+1)*L) on host h (lab.launch(hosts=))
        hosts = hosts or [r // placement[2] for r in range(transport.world_size)]
        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        trace_path = checks.trace_path(trace) or checks.trace_path(os.environ.get("LAB_TRACE"), "LAB_TRACE")
        trace_file = TraceFile(trace_path, checks.env_flag("LAB_TRACE_STEPS")) if trace_path else None
        timeout_ms = DEFAULT_RECV_TIMEOUT_MS if recv_timeout_ms is None else recv_timeout_ms
        channels = Channels(transport, transport_name, timeout_ms, trace_file, placement)
        self._compose(channels, Membership(transport.rank, hosts), [])

    def _compose(self, channels: Channels | _OwnOrderChannels, membership: Membership,
                 parents: list[Exchange]) -> None:
        """This mesh's parts over ``channels`` for ``membership``'s ranks, counted in ``parents`` too."""
        self._channels, self._membership, self._transport = channels, membership, channels.transport
        #: The transfers algorithms run on (lab.algorithms.peers.Peers), numbered, fingerprinted and counted.
        self.exchange = Exchange(channels, membership, parents)
        #: The issue order (async_op) and point-to-point tensors.
        self.point_to_point = PointToPoint(self.exchange, membership, channels.issue)
        self.templates = {}

    def _sub(self, membership: Membership, channels: _OwnOrderChannels | None = None) -> Mesh:
        """The sub-mesh of ``membership``: this mesh's channels (``channels``: with an issue
        order of its own), its own parts; its bytes counted in this mesh's too."""
        sub = object.__new__(type(self))  # not type(self)(...): that would open new channels
        sub._compose(channels or self._channels, membership, self.exchange.lineage)
        return sub

    @classmethod
    def from_env(cls, *, recv_timeout_ms: float | None = None, trace: str | None = None,
                 transport: str = "tcp", workload: str | None = None) -> Mesh:
        """This process's handle on a TCP mesh, from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT`` (as ``torchrun`` sets them), on one host or several; under ``mpiexec``
        (MPICH, Open MPI) or Slurm's ``srun``, from their variables (:mod:`lab.hosts.launchers`).

        ``transport="auto"``: shared memory between the ranks of one host (``GROUP_RANK``; each
        node's ranks consecutive, as torchrun numbers them), TCP between hosts. Local rank 0 builds
        its host's shm mesh and hands each local rank its descriptors over a Unix socket, after the
        rank proves it holds the job's secret. Every rank reports its (``GROUP_RANK``,
        ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) through the store first, so all agree on the host of
        each rank (nodes may hold different numbers of ranks) or fail at once naming who disagrees.

            # torchrun --nproc-per-node 4 train.py
            mesh = lab.Mesh.from_env()
            lab.allreduce(mesh, grads, op="avg")

        Ranks meet through the launcher's TCPStore. Each listens on ``LAB_TCP_HOST`` (default
        loopback: set it to this host's address when ranks span hosts) and proves it belongs to
        the job with the secret ``LAB_TCP_SECRET``, which ranks on several hosts must set; on one
        host, without it, rank 0 draws a secret into a file only this user can read. The
        variables are checked first (``ValueError`` naming the variable).

        ``workload`` (or ``LAB_WORKLOAD``): record this rank's calls into that file
        (:meth:`record_workload`; rank 0 writes its header first).
        """
        from lab.comm.bootstrap import connect_from_env
        from lab.hosts.rendezvous import env_store

        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        trace, workload = checks.trace_path(trace), checks.workload_path(workload)
        wire, placement, hosts = connect_from_env(transport)
        mesh = cls(wire, transport_name=transport, recv_timeout_ms=recv_timeout_ms, trace=trace,
                   placement=placement, hosts=hosts)
        if workload:
            mesh.record_workload(workload, env_store())
        return mesh

    @classmethod
    def from_store(cls, store: Any, rank: int, world_size: int, *, transport: str = "auto",
                   recv_timeout_ms: float | None = None, trace: str | None = None,
                   workload: str | None = None) -> Mesh:
        """This process's handle on a mesh whose ranks meet through ``store`` (a
        ``torch.distributed.Store`` every rank reaches, e.g. the one ``init_process_group`` made),
        as rank ``rank`` of ``world_size``: what the ``"lab"`` torch.distributed backend builds.

        ``transport="auto"``: shared memory between ranks on one host, TCP between hosts. Where
        torchrun's variables describe this world they say which host each rank is on; otherwise
        ranks whose host name, boot and network namespace agree share a host. The job's secret
        comes as for :meth:`from_env`.

            store = torch.distributed.TCPStore("127.0.0.1", 29500, 2, is_master=rank == 0)
            mesh = lab.Mesh.from_store(store, rank, 2)

        ``workload`` (or ``LAB_WORKLOAD``): as for :meth:`from_env`, through ``store``.
        """
        from lab.comm.bootstrap import connect_with_store

        if not checks.is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be a positive int; got {world_size!r}")
        if not checks.is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        trace, workload = checks.trace_path(trace), checks.workload_path(workload)
        wire, placement, hosts = connect_with_store(store, int(rank), int(world_size), transport)
        mesh = cls(wire, transport_name=transport, recv_timeout_ms=recv_timeout_ms, trace=trace,
                   placement=placement, hosts=hosts)
        if workload:
            mesh.record_workload(workload, store)
        return mesh

    def record_workload(self, path: str, store: Any = None, recorded: dict | None = None) -> None:
        """Record every collective and point-to-point call of this rank (on this mesh and its
        sub-meshes) into the workload file ``path`` from now on
        (:meth:`lab.comm.point_to_point.PointToPoint.record_workload`).

            mesh.record_workload("step.jsonl", store)   # every rank, once
        """
        self.point_to_point.record_workload(path, store, recorded)

    def close(self) -> None:
        """Stop the communication thread, then release the transport: queued collectives are
        cancelled, and one still running fails at once on the closed channels, with a
        :class:`lab.LabError` saying the mesh was closed. A sub-mesh owns nothing: closing it does
        nothing (its root's close ends it).

        A message that arrived and was never received (ranks that disagreed on a root, each only
        sending, in the program's last call) is then raised, once everything is released:
        ``CollectiveMismatchError`` naming the call that sent it (:meth:`raise_if_unread`; not
        after a failure, nor with a call in flight)."""
        if self._membership.members is not None:
            return
        try:
            self.exchange.raise_if_unread("closed the mesh")
        finally:
            self._channels.closed = True
            self._channels.issue.close()  # (first: what fails on the closed channels is told apart)
            self._transport.close()

    # -- sub-meshes ----------------------------------------------------------------------------

    def split(self, color: int | None, key: int | None = None) -> Mesh | None:
        """The sub-mesh of the ranks that pass the same ``color``, ordered by ``(key, rank)``
        (``MPI_Comm_split``); ``color=None`` opts this rank out and returns None.

        Every rank of this mesh must call it (it is a collective: every rank sends its
        ``(color, key)`` to every other, in one step). The sub-mesh runs every collective, ``send``/``recv``, counter and
        trace of a mesh, over this mesh's channels (no new process or socket), with its own
        sequence numbers and a context id agreed in that allgather, distinct from that of every
        other live mesh sharing a rank with it, so its messages never pass for another's:
        collectives on the two interleave freely, even entered in different orders by different
        ranks (a message of another context waits aside).
        It shares this mesh's issue order (an asynchronous collective on either completes before a
        later synchronous one on either) and counts its bytes in this mesh's ``stats()`` too.

            rows = mesh.split(color=mesh.rank // 2)             # N=4: ranks {0,1} and {2,3}
            lab.allreduce(rows, x)                              # sums within each pair
            cols = mesh.split(color=mesh.rank % 2, key=-mesh.rank)  # {2,0} and {3,1}: reversed order
        """
        if color is not None and (not checks.is_int(color) or not 0 <= color < 2**63):
            raise ValueError(f"color must be an int in [0, 2**63), or None to opt out; got {color!r}")
        if key is not None and (not checks.is_int(key) or not -2**63 <= key < 2**63):
            raise ValueError(f"key must be an int (int64) or None; got {key!r}")
        channels, mine = self._channels, (-1 if color is None else int(color), 0 if key is None else int(key))
        everyone = self.point_to_point.issue(lambda: _split_round(self.exchange, mine, channels.next_context),
                                             async_op=False)
        # Members and context id, agreed from what every rank sent (lab.comm.membership.agree_split)
        members, context, channels.next_context = agree_split(everyone, color)
        return None if members is None else self._sub(self._membership.sub(members, context))

    def sub_mesh(self, members: list[int], context: int, own_order: bool = False) -> Mesh:
        """The sub-mesh of ``members`` (this mesh's ranks, in the sub-mesh's rank order; this rank
        among them) under the context id ``context``, without any communication: what
        :meth:`split` returns once the ranks agreed, and what the torch backend's ``new_group``
        makes from a context id agreed through its store.

        Every member must make it with the same ``members`` and ``context``, and ``context`` must
        differ from that of every other live mesh sharing a rank with it (0 is the root's): its
        messages are told from theirs by it alone. The sub-mesh shares this mesh's channels,
        issue order and deadlines, and counts its bytes in this mesh's ``stats()`` too.

        ``own_order=True`` (a torch group's): an issue order of its own instead
        (:meth:`lab.comm.issue.IssueQueue.own_order`: its own communication thread and lock), so that
        its calls progress whatever the other meshes' do, issued in any order by each rank and
        from any thread; closed with this mesh's, or by ``sub.issue_queue.close()``.

            pair = mesh.sub_mesh([2, 0], context=9)   # ranks 0 and 2 of N=4, each calling it
            pair.rank                                 # rank 2: 0, rank 0: 1
        """
        membership = self._membership.sub(members, context)
        return self._sub(membership, _OwnOrderChannels(self._channels) if own_order else None)

    # -- who this rank is, and its counters: the exchange's ------------------------------------

    rank = _of("exchange.rank")
    world_size = _of("exchange.world_size")
    host = _of("exchange.host", "The host this rank is on (0 without ``hosts=``).")
    local_rank = _of("exchange.local_rank", "This rank's index among its host's ranks of this mesh.")
    local_world_size = _of("exchange.local_world_size", "This mesh's ranks on this rank's host.")
    host_count = _of("exchange.host_count", "The hosts this mesh's ranks are on.")
    transport = _of("exchange.transport", 'The transport\'s name: "shm", "queue", "tcp" or "auto".')
    recv_timeout_ms = _of("exchange.recv_timeout_ms", "A receive's longest silence before a DeadlineError.")
    name = _of("exchange.name", '"" for the root mesh, "sub-mesh 1a2b3c4d" for a sub-mesh.')
    closed = _of("exchange.closed", "True once this mesh (or its root, for a sub-mesh) was closed.")

    def stats(self) -> dict[str, int]:
        """:meth:`lab.comm.exchange.Exchange.stats`: payload bytes and messages since :meth:`reset_stats`."""
        return self.exchange.stats()

    def reset_stats(self) -> None:
        self.exchange.reset_stats()

    def flight_records(self) -> list[FlightRecord]:
        """This rank's last collectives, oldest first (:meth:`lab.comm.exchange.Exchange.flight_records`)."""
        return self.exchange.flight_records()

    # -- what algorithms use (lab.algorithms.peers.Peers): the exchange's -----------------------

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        self.exchange.send_buffer(dst, data)

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Reduction | None = None) -> None:
        self.exchange.recv_buffer(src, out, reduction)

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray,
                        reduction: Reduction | None = None) -> None:
        self.exchange.sendrecv_buffer(dst, data, src, out, reduction)

    def host_of(self, rank: int) -> int:
        return self.exchange.host_of(rank)

    shared_allreduce = _of("exchange.shared_allreduce", "Two-shot's and one-shot's shared memory.")

    # -- what the public collectives use (lab.comm.protocols.CallMesh) --------------------------

    kernels = staticmethod(Exchange.kernels)
    new_flat = staticmethod(Exchange.new_flat)

    compiled_max_bytes = _of("exchange.compiled_max_bytes", "The most bytes one compiled call runs.")

    def collective(self, name: str, algorithm: str, dtype: DType, count: int, op: str = "", root: int = -1,
                   compiled: bool = True) -> AbstractContextManager[None]:
        return self.exchange.collective(name, algorithm, dtype, count, op, root, compiled)

    def run(self, algorithm: Callable[..., None], *args: Any, **options: Any) -> None:
        self.exchange.run(algorithm, *args, **options)

    def compiled_call(self, signature: Signature, algorithm: Any, args: tuple,
                      at: bool = False) -> PlannedRun | None:
        return self.exchange.compiled_call(signature, algorithm, args, at)

    def agree(self, signature: Signature) -> list[bytes]:
        return self.exchange.agree(signature)

    def refused(self) -> None:
        self.exchange.refused()

    # -- the issue order and point-to-point: the point_to_point part's --------------------------

    issue_queue = _of("point_to_point.issue_queue", "The issue order shared with its root and theirs.")

    def issue(self, run: Callable[[], Any], async_op: bool, p2p: str = "", numbered: bool = True,
              what: Operation | None = None) -> Any:
        return self.point_to_point.issue(run, async_op, p2p, numbered, what)

    def issue_now(self, run: Callable[[], Any], what: Operation | None = None) -> Any:
        return self.point_to_point.issue_now(run, what)

    in_flight = _of("point_to_point.in_flight", "True while an asynchronous call of this order runs.")

    def wait_all(self) -> None:
        """Wait for every asynchronous collective issued so far; raise the first failure."""
        self.point_to_point.wait_all()

    recording = _of("point_to_point.recording", "True while this rank records its calls into a workload.")
    global_ranks = _of("point_to_point.global_ranks", "This mesh's ranks as global ranks, in its rank order.")

    def describe(self, op: str, dtype: DType, count: int, out_count: int, **rest: Any) -> Operation:
        return self.point_to_point.describe(op, dtype, count, out_count, **rest)

    def send(self, dst: int, tensor: Any, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst`` (:meth:`lab.comm.point_to_point.PointToPoint.send`)."""
        self.point_to_point.send(dst, tensor, tag)

    def recv(self, src: int | None, timeout_ms: float | None = None, tag: int = 0) -> Any:
        """The next tensor from ``src`` (None: any rank; :meth:`lab.comm.point_to_point.PointToPoint.recv`)."""
        return self.point_to_point.recv(src, timeout_ms, tag)

    def probe(self, src: int | None, tag: int = 0, timeout_ms: float | None = None) -> int | None:
        """The rank whose next tensor has arrived (:meth:`lab.comm.point_to_point.PointToPoint.probe`)."""
        return self.point_to_point.probe(src, tag, timeout_ms)


def _split_round(exchange: Exchange, color_key: tuple[int, int], next_context: int) -> list[list[int]]:
    """:meth:`Mesh.split`'s collective: every rank's (color, key, next context id), in rank order,
    this rank's sent to every other rank in one step."""
    rank, world_size = exchange.rank, exchange.world_size
    everyone = np.empty((world_size, 3), np.int64)
    everyone[rank] = *color_key, next_context
    others = [r for r in range(world_size) if r != rank]
    with exchange.collective("split", "", DTYPES["int64"], 3):
        if others:
            exchange.transfer([Send(r, everyone[rank]) for r in others],
                              [Recv(r, everyone[r]) for r in others])
    return everyone.tolist()


class _OwnOrderChannels:
    """``channels`` as a sub-mesh with an issue order of its own sees them (:meth:`Mesh.sub_mesh`):
    every attribute the shared one's (read and written there: its closing, cleanness and context
    count are every mesh's), but ``issue``."""
    def __init__(self, channels: Channels) -> None:
        object.__setattr__(self, "_shared", channels)
        object.__setattr__(self, "issue", channels.issue.own_order())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._shared, name, value)
