"""``lab.Mesh``: one rank's handle on the mesh, what algorithms and users send and receive through.

The mesh adds to a transport what is the same on every wire: payload byte counters, deadlines,
the fingerprint that every message carries (so ranks in different collectives are caught at
the first message), and the per-collective trace row.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lab.buffers import as_buffer, new_flat, to_caller_type
from lab import checks
from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError
from lab.flight import FLIGHT_RECORDER_SIZE, FlightRecord, Position, TraceFile
from lab.issue import IssueQueue
from lab import fingerprint
from lab.fingerprint import describe as describe_fingerprint
from lab.ops import DTYPES, DTYPES_BY_CODE, DType, Reduction, reduction
from kernels import mailbox as mailbox_status
from lab.plane import CompiledPlane, Report
from lab.transport.base import Recv, Send, TagMismatch, Transport, silence_error

#: A receive that waits longer than this raises DeadlineError (override with recv_timeout_ms).
DEFAULT_RECV_TIMEOUT_MS = 300_000

_MAX_P2P_DIMS = 16
_P2P_HEADER_WORDS = 3 + _MAX_P2P_DIMS  # is_torch, dtype code, ndim, shape


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

    def __init__(
        self,
        transport: Transport,
        *,
        transport_name: str,
        recv_timeout_ms: float | None = None,
        trace: str | None = None,
        placement: tuple[int, int, int] | None = None,
        hosts: list[int] | None = None,
    ) -> None:
        self._transport = transport
        # (host, local_rank, local_world_size): one host holding every rank unless told otherwise
        self.host, self.local_rank, self.local_world_size = placement or (0, transport.rank, transport.world_size)
        self._rank, self._world_size = transport.rank, transport.world_size
        # Sub-meshes (split) share all of this with their root: transport, issue order, host map.
        self._root = self
        self._lineage = [self]  # this mesh and its ancestors: a transfer counts in each one's stats
        self._members: list[int] | None = None  # a sub-mesh's ranks as global ranks, in its rank order
        self._context = 0  # 0: the root mesh; a sub-mesh's id, agreed when it is made (see split)
        self._next_context = 1  # (the root's) past every context id this rank has used
        self.name = ""
        # Host of every global rank: as agreed under a launcher (``hosts``), else ranks
        # [h*L, (h+1)*L) on host h (lab.launch(hosts=))
        self._global_hosts = hosts or [r // self.local_world_size for r in range(transport.world_size)]
        self.host_count = len(set(self._global_hosts))  # hosts this mesh's ranks are on
        self.transport = transport_name
        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        self.recv_timeout_ms = DEFAULT_RECV_TIMEOUT_MS if recv_timeout_ms is None else recv_timeout_ms
        trace_path = checks.trace_path(trace) or checks.trace_path(os.environ.get("LAB_TRACE"), "LAB_TRACE")
        self._trace = TraceFile(trace_path, checks.env_flag("LAB_TRACE_STEPS")) if trace_path else None
        self._issue = IssueQueue(transport.rank)  # shared by every sub-mesh: one issue order
        # Small collectives in one Numba call, where the transport has mailboxes (shm): lab.plane
        mailbox = getattr(transport, "mailbox", None)
        self._plane = CompiledPlane(mailbox) if mailbox is not None else None
        self._nbytes = 0  # the current collective's tensor bytes
        self._compiled = True  # the current collective may take the compiled path
        self._seq = 0
        self._p2p_sent = [0] * transport.world_size
        self._p2p_received = [0] * transport.world_size
        self._next_any = 0  # recv(None) tries the ranks from this one on
        self._tag = b""
        self._position = Position()
        self._clean = True  # False once a transfer failed half-way: peers may hold its messages
        self._closed = False
        self._records: deque[FlightRecord] = deque(maxlen=FLIGHT_RECORDER_SIZE)
        self.reset_stats()

    @classmethod
    def from_env(cls, *, recv_timeout_ms: float | None = None, trace: str | None = None,
                 transport: str = "tcp") -> Mesh:
        """This process's handle on a TCP mesh, from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT`` (as ``torchrun`` sets them), on one host or several; under ``mpiexec``
        (MPICH, Open MPI) or Slurm's ``srun``, from their variables (:mod:`lab.launchers`).

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
        """
        from lab.bootstrap import connect_from_env

        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        trace = checks.trace_path(trace)
        wire, placement, hosts = connect_from_env(transport)
        return cls(wire, transport_name=transport, recv_timeout_ms=recv_timeout_ms, trace=trace,
                   placement=placement, hosts=hosts)

    @classmethod
    def from_store(cls, store: Any, rank: int, world_size: int, *, transport: str = "auto",
                   recv_timeout_ms: float | None = None, trace: str | None = None) -> Mesh:
        """This process's handle on a mesh whose ranks meet through ``store`` (a
        ``torch.distributed.Store`` every rank reaches, e.g. the one ``init_process_group`` made),
        as rank ``rank`` of ``world_size``: what the ``"lab"`` torch.distributed backend builds.

        ``transport="auto"``: shared memory between ranks on one host, TCP between hosts. Where
        torchrun's variables describe this world they say which host each rank is on; otherwise
        ranks whose host name, boot and network namespace agree share a host. The job's secret
        comes as for :meth:`from_env`.

            store = torch.distributed.TCPStore("127.0.0.1", 29500, 2, is_master=rank == 0)
            mesh = lab.Mesh.from_store(store, rank, 2)
        """
        from lab.bootstrap import connect_with_store

        if not checks.is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be a positive int; got {world_size!r}")
        if not checks.is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        recv_timeout_ms = checks.timeout_ms(recv_timeout_ms, "recv_timeout_ms")
        trace = checks.trace_path(trace)
        wire, placement, hosts = connect_with_store(store, int(rank), int(world_size), transport)
        return cls(wire, transport_name=transport, recv_timeout_ms=recv_timeout_ms, trace=trace,
                   placement=placement, hosts=hosts)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def closed(self) -> bool:
        """True once this mesh (or its root, for a sub-mesh) was closed."""
        return self._root._closed

    @property
    def clean(self) -> bool:
        """False once a transfer failed half-way (on this mesh or one of its sub-meshes): peers
        may hold its messages, so the channels cannot be reused."""
        return self._root._clean

    @clean.setter
    def clean(self, value: bool) -> None:
        self._root._clean = value

    # -- counters ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Payload bytes and messages since :meth:`reset_stats` (tensor data only, no headers).

        A message is one logical send (a chunk), however many segments the transport cut it into.
        ``bytes_sent_inter_host`` / ``bytes_received_inter_host``: the part to or from a rank on
        another host. A mesh's counters include its sub-meshes' traffic; a sub-mesh counts its own.
        """
        return dict(self._stats)

    def reset_stats(self) -> None:
        self._stats = dict.fromkeys(
            ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "collectives",
             "collectives_compiled", "bytes_sent_inter_host", "bytes_received_inter_host"), 0
        )

    # -- issuing collectives, synchronously or not ----------------------------------------------

    def issue(self, run: Callable[[], Any], async_op: bool) -> Any:
        """Run a collective's communication now, or on the communication thread (one issue order
        for a root mesh and its sub-meshes: :class:`lab.issue.IssueQueue`)."""
        return self._issue.issue(run, async_op)

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous collective issued on this mesh (or its root, or any of the
        root's sub-meshes: they share one issue order) has not completed."""
        return self._issue.in_flight

    def wait_all(self) -> None:
        """Wait for every asynchronous collective issued so far; raise the first failure."""
        self._issue.wait_all()

    def close(self) -> None:
        """Release the transport, then stop the communication thread (a collective it is still
        running fails at once on the closed channels; queued ones are cancelled). A sub-mesh owns
        nothing: closing it does nothing (its root's close ends it)."""
        if self._root is not self:
            return
        self._closed = True
        self._transport.close()
        self._issue.close()

    # -- what the public collectives take from the mesh ----------------------------------------

    #: The kernels of ``(op, dtype)``, looked up once per process (an ``avg`` of integers still
    #: raises every time). The simulator's recorder hands out kernels that do nothing instead.
    kernels = staticmethod(functools.cache(reduction))

    #: A new flat output buffer (allgather's, all_to_all's); the recorder's are virtual.
    new_flat = staticmethod(new_flat)

    @property
    def compiled_max_bytes(self) -> int:
        """The largest tensor a collective on this mesh runs in one compiled call (0: none; lab.plane)."""
        return 0 if self._plane is None else self._plane.max_bytes

    def run(self, algorithm: Callable[..., None], *args: Any, **options: Any) -> None:
        """Run ``algorithm(self, *args, **options)``: one algorithm of the collective entered with
        :meth:`collective` (the public collectives call it). A small collective whose algorithm
        is compilable runs in one Numba call over the mailboxes where the transport has them."""
        plane = self._plane
        if plane is None or options or not self._compiled or not plane.takes(algorithm, self._nbytes, args):
            algorithm(self, *args, **options)
            return
        self._position.step += 1
        report = plane.run(algorithm, self._tag, self.recv_timeout_ms, args)
        if report.status != mailbox_status.OK:
            self.clean = False
            self._raise_compiled_failure(report)
        for mesh in self._lineage:
            stats = mesh._stats
            stats["bytes_sent"] += report.bytes_sent
            stats["bytes_received"] += report.bytes_received
            stats["messages_sent"] += report.messages_sent
            stats["messages_received"] += report.messages_received
            stats["collectives_compiled"] += 1

    def _raise_compiled_failure(self, report: Report) -> None:
        peer = report.failed_peer
        if report.status == mailbox_status.MISMATCH:
            raise CollectiveMismatchError(f"{self._who()} is in {describe_fingerprint(self._tag)}; "
                                          f"{self._who(peer)} sent {describe_fingerprint(report.peer_tag)}")
        self._raise_if_mismatched()  # the peer may be elsewhere because we disagree
        if report.status == mailbox_status.SILENCE:
            raise DeadlineError(f"{silence_error(self.rank, [peer], self._position)} "
                                f"(recv_timeout_ms={self.recv_timeout_ms:g})", [peer])
        if report.status == mailbox_status.PEER_LOST:
            raise PeerLostError(f"rank {self.rank}: rank {peer} is gone (waiting in {self._position})")
        raise LabError(f"rank {self.rank}: the compiled path refused a transfer with rank {peer} "
                       f"(status {report.status}) in {self._position}")

    # -- what algorithms use -------------------------------------------------------------------

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        """Send a flat buffer to ``dst`` (returns once the data is in the channel)."""
        self._exchange([Send(dst, data)], [])

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Reduction | None = None) -> None:
        """Receive from ``src`` into ``out``: copy, or ``reduction.combine(out, incoming)``."""
        self._exchange([], [Recv(src, out, None if reduction is None else reduction.combine)])

    def sendrecv_buffer(
        self, dst: int, data: np.ndarray, src: int, out: np.ndarray, reduction: Reduction | None = None
    ) -> None:
        """Send to ``dst`` and receive from ``src`` at once (one ring step)."""
        self._exchange([Send(dst, data)], [Recv(src, out, None if reduction is None else reduction.combine)])

    @property
    def scratch(self) -> Any:
        """The shm transport's shared scratch (:mod:`lab.transport.scratch`: two-shot slots and
        ``lab.empty``'s arenas), or None (another transport, one rank, a closed mesh)."""
        return None if self.closed else getattr(self._transport, "scratch", None)

    def shared_allreduce(self, buf: np.ndarray, reduction: Reduction) -> bool:
        """Allreduce ``buf`` in place by reading the peers' memory in place (the two-shot of
        :mod:`lab.transport.scratch`); False, having done nothing, where there is no scratch or
        this is a sub-mesh (whose ranks are not the scratch's): the caller then sends messages."""
        if self.closed:
            raise LabError(f"{self._who()}: this mesh is closed (an allreduce after mesh.close())")
        if self.scratch is None or self._members is not None:
            return False
        self._position.step += 1
        try:
            moved = self.scratch.allreduce(buf, reduction, self._tag, self.recv_timeout_ms / 1000, self._position)
        except TagMismatch as mismatch:
            self.clean = False
            raise CollectiveMismatchError(f"{self._who()} is in {describe_fingerprint(mismatch.expected)}; "
                                          f"{self._who(mismatch.src)} sent {describe_fingerprint(mismatch.got)}"
                                          ) from None
        except (DeadlineError, PeerLostError) as failure:
            self.clean = False
            self._raise_if_mismatched()  # the peer may be elsewhere because we disagree
            if isinstance(failure, DeadlineError):
                raise DeadlineError(f"{failure} (recv_timeout_ms={self.recv_timeout_ms:g})", failure.peers) from None
            raise
        except BaseException:
            self.clean = False
            raise
        for mesh in self._lineage:
            for key, value in (("bytes_sent", moved.bytes_sent), ("bytes_received", moved.bytes_received),
                               ("messages_sent", moved.messages), ("messages_received", moved.messages)):
                mesh._stats[key] += value
        return True

    def _exchange(self, sends: list[Send], recvs: list[Recv], timeout_ms: float | None = None, counted=True):
        self._position.step += 1
        timeout_ms = self.recv_timeout_ms if timeout_ms is None else timeout_ms
        trace_steps = self._trace is not None and self._trace.steps
        start_ns = time.time_ns() if trace_steps else 0
        members = self._members
        if members is not None:  # a sub-mesh: its ranks are global ranks on the shared channels
            sends = [Send(members[s.dst], s.data) for s in sends]
            recvs = [Recv(members[r.src], r.out, r.combine) for r in recvs]
        try:
            self._transport.exchange(sends, recvs, self._tag, timeout_ms / 1000, self._position)
        except TagMismatch as mismatch:
            self.clean = False
            raise CollectiveMismatchError(
                f"{self._who()} is in {describe_fingerprint(mismatch.expected)}; "
                f"{self._who(mismatch.src)} sent {describe_fingerprint(mismatch.got)}"
            ) from None
        except DeadlineError as late:
            self.clean = False
            self._raise_if_mismatched()
            raise DeadlineError(f"{late} (recv_timeout_ms={timeout_ms:g})", late.peers) from None
        except PeerLostError:
            self.clean = False
            self._raise_if_mismatched()  # the peer may have given up because we disagree
            raise
        except BaseException:
            self.clean = False
            raise
        if trace_steps:
            position = self._position
            self._write_trace(
                kind="step", op=position.collective, algorithm=position.algorithm, seq=position.seq,
                step=position.step, sends=[[s.dst, s.data.nbytes] for s in sends],
                recvs=[[r.src, r.out.nbytes] for r in recvs], start_ns=start_ns,
                duration_ns=time.time_ns() - start_ns,
            )
        if counted:
            hosts, host = self._global_hosts, self.host
            for mesh in self._lineage:
                stats = mesh._stats
                for send in sends:
                    stats["bytes_sent"] += send.data.nbytes
                    stats["messages_sent"] += 1
                    if hosts[send.dst] != host:
                        stats["bytes_sent_inter_host"] += send.data.nbytes
                for recv in recvs:
                    stats["bytes_received"] += recv.out.nbytes
                    stats["messages_received"] += 1
                    if hosts[recv.src] != host:
                        stats["bytes_received_inter_host"] += recv.out.nbytes

    def _who(self, global_rank: int | None = None) -> str:
        """``rank 3`` on the root mesh; ``rank 1 of sub-mesh 1a2b3c4d (global rank 3)`` on a sub-mesh."""
        if global_rank is None:
            global_rank = self._root.rank
        if self._members is None:
            return f"rank {global_rank}"
        if global_rank in self._members:
            return f"rank {self._members.index(global_rank)} of sub-mesh {self._context:08x} (global rank {global_rank})"
        return f"global rank {global_rank}"

    def _raise_if_mismatched(self) -> None:
        """After a deadline or a lost peer: did a peer send this collective's number with another
        fingerprint?

        Ranks that disagree on, say, the root of a broadcast may never receive from each other;
        the message one of them sent is still waiting, unconsumed, and tells what happened.
        """
        context, seq = fingerprint.FINGERPRINT.unpack_from(self._tag)[:2]
        for src, tags in self._transport.unconsumed_tags().items():
            for tag in tags:
                got_context, got_seq, coll = fingerprint.FINGERPRINT.unpack_from(tag)[:3]
                if got_context == context and got_seq == seq and coll and tag[: len(self._tag)] != self._tag:
                    raise CollectiveMismatchError(
                        f"{self._who()} is in {describe_fingerprint(self._tag)}; "
                        f"{self._who(src)} sent {describe_fingerprint(tag)}"
                    ) from None

    @contextlib.contextmanager
    def collective(
        self, name: str, algorithm: str, dtype: DType, count: int, op: str = "", root: int = -1,
        compiled: bool = True,
    ) -> Iterator[None]:
        """Run one collective: number it, fingerprint its messages, trace it.

        Every rank enters the same collectives in the same order, so ``seq`` agrees across ranks
        and a message from a different collective is caught by its fingerprint. ``compiled``
        False keeps it off the compiled path whatever its size (every rank must pass the same:
        an all_to_all with split sizes, whose ranks agree on no size).
        """
        self._seq += 1
        self._tag = fingerprint.pack(self._context, self._seq, name, algorithm, dtype.code, op, root, count)
        self._position.collective, self._position.seq = name, self._seq
        self._position.algorithm, self._position.step = algorithm, 0
        self._nbytes = count * dtype.storage.itemsize
        self._compiled = compiled
        record = FlightRecord(self._seq, name, algorithm, dtype.name, count, op, root)
        self._records.append(record)
        before = (self._stats["bytes_sent"], self._stats["bytes_received"])
        start_ns = time.time_ns()
        try:
            yield
        except BaseException as exc:
            record.state, record.step = f"failed ({type(exc).__name__})", self._position.step
            if self._position.step:  # messages may be in flight: this mesh can't be reused
                self.clean = False
            raise
        duration_ns = time.time_ns() - start_ns
        record.state, record.step = "done", self._position.step
        self._stats["collectives"] += 1
        if self._trace is not None:
            self._write_trace(
                kind="collective", op=name, algorithm=algorithm, dtype=dtype.name, count=count,
                nbytes=count * dtype.storage.itemsize, reduce_op=op or None, root=None if root < 0 else root,
                bytes_sent=self._stats["bytes_sent"] - before[0],
                bytes_received=self._stats["bytes_received"] - before[1],
                start_ns=start_ns, duration_ns=duration_ns, seq=self._seq,
            )

    def flight_records(self) -> list[FlightRecord]:
        """This rank's last collectives, oldest first; a running one shows the step it reached."""
        if self._records and self._records[-1].state == "running":
            self._records[-1].step = self._position.step
        return list(self._records)

    def _write_trace(self, **row: Any) -> None:
        if self._members is not None:  # a sub-mesh's row says which one, and the global rank
            row = {"sub_mesh": f"{self._context:08x}", "global_rank": self._root.rank, **row}
        self._trace.write(rank=self.rank, world_size=self.world_size, transport=self.transport, **row)

    # -- public point-to-point -----------------------------------------------------------------

    def _check_peer(self, peer: int, name: str) -> None:
        if not checks.is_int(peer) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"{name} must be another rank in [0, {self.world_size}); got {peer!r} on rank {self.rank}"
            )

    def _p2p_tag(self, seq: int, dtype_code: int, count: int) -> bytes:
        return fingerprint.pack_p2p(self._context, seq, dtype_code, count)

    def send(self, dst: int, tensor: Any) -> None:
        """Send ``tensor`` (torch or numpy, any shape) to rank ``dst``; ordered per pair of ranks.

        Returns once the data is in the channel; a large tensor over ``"shm"`` waits until the
        receiver has taken all but the last few segments (buffers are bounded). Like a
        synchronous collective, it first waits for this mesh's asynchronous collectives: point-to-
        point and collectives share one issue order.
        """
        self._check_peer(dst, "dst")
        dst = int(dst)
        buffer = as_buffer(tensor, writable=False)
        shape = tuple(np.shape(tensor))
        if len(shape) > _MAX_P2P_DIMS:
            raise ValueError(f"tensor has {len(shape)} dimensions; send supports up to {_MAX_P2P_DIMS}")
        # A fixed-size header (kind, dtype, shape) first, uncounted, then the payload.
        header = np.zeros(_P2P_HEADER_WORDS, np.int64)
        header[:3] = isinstance(tensor, torch.Tensor), buffer.dtype.code, len(shape)
        header[3 : 3 + len(shape)] = shape

        def run() -> None:
            self._p2p_sent[dst] += 1
            seq = self._p2p_sent[dst]
            self._start_p2p("send", seq)
            self._tag = self._p2p_tag(seq, 0, _P2P_HEADER_WORDS)
            self._exchange([Send(dst, header)], [], counted=False)
            self._tag = self._p2p_tag(seq, buffer.dtype.code, buffer.numel)
            self._exchange([Send(dst, buffer.load())], [])  # read now, after the async work before it

        self.issue(run, async_op=False)

    def recv(self, src: int | None, timeout_ms: float | None = None) -> Any:
        """Receive the next tensor rank ``src`` sent to this rank: same kind, dtype and shape.

        ``src=None``: from any source (``MPI_ANY_SOURCE``): the next tensor of whichever rank has
        one waiting (one of them, if several have), returned as ``(src, tensor)``; each rank's
        tensors still arrive in the order it sent them.
        Waits at most ``timeout_ms`` of silence (from ``src``; with None, without a tensor from
        anyone; default: the mesh's ``recv_timeout_ms``; ``math.inf``: no limit), then raises
        :class:`lab.DeadlineError`. Waits first for this mesh's asynchronous collectives (one
        issue order).

            # N=3: ranks 1 and 2 each mesh.send(0, torch.tensor([mesh.rank]))
            src, x = mesh.recv(None)          # rank 0: (1, tensor([1])) or (2, tensor([2]))
            other, y = mesh.recv(None)        # rank 0: the other one
        """
        timeout_ms = checks.timeout_ms(timeout_ms, "timeout_ms")
        if src is not None:
            self._check_peer(src, "src")
            src = int(src)
        elif self.world_size == 1:
            raise ValueError("src=None receives from any other rank; this mesh has only one rank")

        def run() -> Any:
            if src is not None:
                return self._receive(src, timeout_ms)
            chosen = self._ready_source(timeout_ms)
            return chosen, self._receive(chosen, timeout_ms)

        return self.issue(run, async_op=False)

    def _ready_source(self, timeout_ms: float | None) -> int:
        """The rank whose next tensor for this rank is waiting (``recv(None)``), trying them from
        the one after the rank last chosen so that none is starved; DeadlineError after
        ``timeout_ms`` with none."""
        n = self.world_size
        others = [(self._next_any + i) % n for i in range(n) if (self._next_any + i) % n != self.rank]
        self._start_p2p("recv from any source", 0)
        # Each one's next header: what recv(src) would wait for (a peer's collectives later in its
        # issue order are not a tensor for us, and wait for their receive).
        expected = {self._global(r): self._p2p_tag(self._p2p_received[r] + 1, 0, _P2P_HEADER_WORDS) for r in others}
        timeout_ms = self.recv_timeout_ms if timeout_ms is None else timeout_ms
        try:
            found = self._transport.ready_source(expected, timeout_ms / 1000, self._position)
        except BaseException:
            self.clean = False  # (a lost peer, a forged frame: the channels cannot be trusted)
            raise
        if found is None:
            raise DeadlineError(f"{silence_error(self.rank, others, self._position)} "
                                f"(timeout_ms={timeout_ms:g})", others)
        src = found if self._members is None else self._members.index(found)
        self._next_any = (src + 1) % n
        return src

    def _receive(self, src: int, timeout_ms: float | None) -> Any:
        """The next tensor from ``src``: its header (kind, dtype, shape), then its payload."""
        self._p2p_received[src] += 1
        seq = self._p2p_received[src]
        self._start_p2p("recv", seq)
        header = np.empty(_P2P_HEADER_WORDS, np.int64)
        self._tag = self._p2p_tag(seq, 0, _P2P_HEADER_WORDS)
        self._exchange([], [Recv(src, header)], timeout_ms, counted=False)
        is_torch, code, ndim = (int(v) for v in header[:3])
        shape = tuple(int(v) for v in header[3 : 3 + ndim])
        dtype = DTYPES_BY_CODE[code]
        flat = np.empty(int(np.prod(shape)), dtype.storage)
        self._tag = self._p2p_tag(seq, code, flat.size)
        self._exchange([], [Recv(src, flat)], timeout_ms)
        like = torch.empty(0, dtype=dtype.torch_dtype) if is_torch else np.empty(0, dtype.name)
        return to_caller_type(flat, dtype, shape, like)

    def _start_p2p(self, kind: str, seq: int) -> None:
        position = self._position
        position.collective, position.seq, position.algorithm, position.step = kind, seq, "", 0

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
        root = self._root

        def run() -> list[list[int]]:
            # Every rank's (color, key, next context id) to every other rank, in one step.
            everyone = np.empty((self.world_size, 3), np.int64)
            everyone[self.rank] = -1 if color is None else int(color), 0 if key is None else int(key), \
                root._next_context
            others = [r for r in range(self.world_size) if r != self.rank]
            with self.collective("split", "", DTYPES["int64"], 3):
                if others:
                    self._exchange([Send(r, everyone[self.rank]) for r in others],
                                   [Recv(r, everyone[r]) for r in others])
            return everyone.tolist()

        everyone = self.issue(run, async_op=False)
        # Context ids, agreed here: colour i (in sorted order) gets base + i, where base is past
        # every id any participant has used. Two sub-meshes that share a rank were both made by
        # splits that rank took part in, one after the other, so the later one's base is past the
        # earlier one's ids: live sub-meshes on common channels never share an id.
        colors = sorted({c for c, _, _ in everyone if c >= 0})
        base = max(used for _, _, used in everyone)
        if base + len(colors) > fingerprint.MAX_CONTEXT:
            raise LabError(f"this job has made {base - 1:,} sub-meshes; context ids (4 bytes) are spent")
        root._next_context = base + len(colors)
        if color is None:
            return None
        members = [r for _, r in sorted((k, r) for r, (c, k, _) in enumerate(everyone) if c == color)]
        return self._sub_mesh(members, base + colors.index(color))

    def _sub_mesh(self, members: list[int], context: int) -> Mesh:
        """A mesh over ``members`` (this mesh's ranks, in the sub-mesh's rank order) with ``context``."""
        sub = copy.copy(self)  # shares the transport, the trace file, the deadlines
        sub._lineage = [sub, *self._lineage]
        sub._members = [self._global(r) for r in members]
        sub._context = context
        sub._rank, sub._world_size = members.index(self.rank), len(members)
        sub._seq, sub._tag = 0, b""
        sub._plane = None  # the mailboxes speak global ranks; a sub-mesh takes the Python path
        sub._p2p_sent, sub._p2p_received = [0] * len(members), [0] * len(members)
        sub._next_any = 0
        shown = ", ".join(map(str, sub._members[:8])) + (", ..." if len(members) > 8 else "")
        sub.name = f"sub-mesh {context:08x}"
        sub._position = Position(f"{sub.name} (global ranks {shown}; this is its rank {sub._rank})")
        sub._records = deque(maxlen=FLIGHT_RECORDER_SIZE)
        same_host = [g for g in sub._members if self._global_hosts[g] == self.host]
        sub.local_rank, sub.local_world_size = same_host.index(self._root.rank), len(same_host)
        sub.host_count = len({self._global_hosts[g] for g in sub._members})
        sub.reset_stats()
        return sub

    def _global(self, rank: int) -> int:
        return rank if self._members is None else self._members[rank]

    def host_of(self, rank: int) -> int:
        """The host of this mesh's rank ``rank`` (:class:`lab.peers.Peers`)."""
        return self._global_hosts[self._global(rank)]
