"""The issue order (``async_op``) and point-to-point tensors of a :class:`lab.Mesh`: ``send``,
``recv`` (from one rank or any), ``probe``, matched per pair of ranks and tag.

A tensor travels as two messages, a header (kind, dtype, shape; :mod:`lab.comm.p2p`) and its payload,
each fingerprinted with the mesh's context, the tag and the pair's sequence number for that tag:
a message of another tag waits aside until its receive, as MPI matches by source and tag.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from lab import checks, fingerprint
from lab.buffers import as_buffer
from lab.comm import operations, p2p
from lab.comm.exchange import Exchange
from lab.comm.issue import IssueQueue
from lab.comm.membership import Membership
from lab.comm.operations import Operation
from lab.errors import DeadlineError
from lab.ops import DTYPES, DType, dtype_of
from lab.transport.base import Recv, Send, silence_error


class PointToPoint:
    """A mesh's issue order and point-to-point calls (see :class:`lab.Mesh`), over ``exchange``
    (the mesh's transfers, on ``membership``'s ranks) in the order ``issue_queue`` keeps."""
    def __init__(self, exchange: Exchange, membership: Membership, issue_queue: IssueQueue) -> None:
        self._exchange, self._membership, self._queue = exchange, membership, issue_queue
        self.rank, self.world_size = membership.rank, membership.world_size
        self._p2p_sent: Counter[tuple[int,
                                      int]] = Counter()  # point-to-point sequence numbers, per (peer, tag)
        self._p2p_received: Counter[tuple[int, int]] = Counter()
        self._next_any = 0  # recv(None) tries the ranks from this one on

    # -- issuing collectives, synchronously or not ----------------------------------------------

    def issue(self, run: Callable[[], Any], async_op: bool, p2p: str = "", numbered: bool = True,
              what: Operation | None = None) -> Any:
        """Run a collective's (or, ``p2p="send"``/``"recv"``, a send's or receive's)
        communication now, or on the communication thread (one issue order for a root mesh and
        its sub-meshes: :class:`lab.comm.issue.IssueQueue`). ``numbered`` False: ``run`` is no
        collective (a synchronous send, receive or probe), so a refusal numbers none. ``what``:
        the call as the program issued it, where the rank records (:meth:`describe`)."""
        refused = self._exchange.refused if numbered and not p2p else None
        return self._queue.issue(run, async_op, p2p, refused, what)

    @property
    def issue_queue(self) -> IssueQueue:
        """The issue order this mesh shares with its root and the root's sub-meshes."""
        return self._queue

    def issue_now(self, run: Callable[[], Any], what: Operation | None = None) -> Any:
        """``issue(run, async_op=True)``, run on this thread when nothing is in flight; the Work
        returned is then complete (:meth:`lab.comm.issue.IssueQueue.issue_now`)."""
        return self._queue.issue_now(run, self._exchange.refused, what)

    @property
    def in_flight(self) -> bool:
        """True while an asynchronous collective issued on this mesh (or its root, or any of the
        root's sub-meshes: they share one issue order) has not completed."""
        return self._queue.in_flight

    def wait_all(self) -> None:
        """Wait for every asynchronous collective issued so far; raise the first failure."""
        self._queue.wait_all(recorded=True)

    # -- what a recording notes (lab.comm.operations) ------------------------------------------------

    @property
    def recording(self) -> bool:
        """True while this rank records its calls (``lab.spawn(..., workload=)``, ``LAB_WORKLOAD``)."""
        return self._queue.recorder is not None

    def record_workload(self, path: str, store: Any = None, recorded: dict | None = None) -> None:
        """Record every collective and point-to-point call of this rank (on this mesh and its
        sub-meshes) into the workload file ``path`` (:mod:`lab.workload`), from now on.

        ``store``: the ranks meet there so that rank 0 writes the file's header before any rank
        records (under a launcher); without one, the header is written already (``lab.spawn``'s
        parent writes it). ``recorded``: what the header says of the run, besides this mesh's
        transport and hosts. A process already recording into ``path`` goes on with it.

            mesh.record_workload("step.jsonl", store)   # every rank, once
        """
        exchange, membership = self._exchange, self._membership  # (a sub-mesh records as its root: global ranks)
        about = {
            "transport": exchange.transport, "hosts": exchange.host_count,
            "ranks_per_host": exchange.local_world_size, **(recorded or {})}
        operations.attach(self._queue, path, membership.global_rank, len(membership.hosts), store, about)

    @functools.cached_property
    def global_ranks(self) -> tuple[int, ...]:
        """This mesh's ranks as global ranks, in its rank order."""
        members = self._membership.members
        return tuple(range(self.world_size)) if members is None else tuple(members)

    def describe(self, op: str, dtype: DType, count: int, out_count: int, *, root: int | None = None,
                 peer: int | None = None, dim: str | None = None, **rest: Any) -> Operation:
        """A call of ``op`` on this mesh as a recording notes it (``root``, ``peer``: this mesh's
        ranks; ``rest``: :class:`lab.comm.operations.Operation`'s other fields). Callers build it only
        where the rank records (:attr:`recording`).

            mesh.describe("broadcast", DTYPES["float32"], 256, 256, root=1)   # N=2: group (0, 1)
        """
        group = self.global_ranks
        return Operation(op, group, dtype.name, dtype.storage.itemsize, count, out_count, dim,
                         root=None if root is None else group[root],
                         peer=None if peer is None else group[peer], **rest)

    # -- public point-to-point -----------------------------------------------------------------

    def _check_peer(self, peer: int, name: str) -> None:
        if not checks.is_int(peer) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"{name} must be another rank in [0, {self.world_size}); got {peer!r} on rank {self.rank}")

    def _p2p_tag(self, tag: int, seq: int, dtype_code: int, count: int) -> bytes:
        return fingerprint.pack_p2p(self._membership.context, tag, seq, dtype_code, count)

    def send(self, dst: int, tensor: Any, tag: int = 0) -> None:
        """Send ``tensor`` (torch or numpy, any shape) to rank ``dst``; ordered per pair of ranks
        and ``tag`` (an int in [0, 2**31)): a receive of one tag never takes another's, so tagged
        messages may be received in another order than sent, as in MPI.

        Returns once the data is in the channel; a large tensor over ``"shm"`` waits until the
        receiver has taken all but the last few segments (buffers are bounded). Like a
        synchronous collective, it first waits for this mesh's asynchronous collectives: point-to-
        point and collectives share one issue order.

            mesh.send(1, torch.tensor([1.0]), tag=7)   # rank 0
            mesh.send(1, torch.tensor([2.0]), tag=8)   # rank 0
            mesh.recv(0, tag=8)                        # rank 1: tensor([2.])
            mesh.recv(0, tag=7)                        # rank 1: tensor([1.])
        """
        self._check_peer(dst, "dst")
        dst, tag = int(dst), checks.p2p_tag(tag)
        buffer = as_buffer(tensor, writable=False)
        header = p2p.encode_header(tensor, buffer.dtype)  # sent first, uncounted, then the payload

        def run() -> None:
            self._p2p_sent[dst, tag] += 1
            seq = self._p2p_sent[dst, tag]
            self._start_p2p("send", seq)
            transfer = self._exchange.transfer
            transfer([Send(dst, header)], [], counted=False, tag=self._p2p_tag(tag, seq, 0, p2p.HEADER_WORDS))
            # (the payload read now, after the async work before it)
            transfer([Send(dst, buffer.load())], [], tag=self._p2p_tag(tag, seq, buffer.dtype.code,
                                                                       buffer.numel))

        what = self.describe("send", buffer.dtype, buffer.numel, buffer.numel, peer=dst, tag=tag) \
            if self.recording else None
        self.issue(run, async_op=False, numbered=False, what=what)

    def recv(self, src: int | None, timeout_ms: float | None = None, tag: int = 0) -> Any:
        """Receive the next tensor rank ``src`` sent to this rank with ``tag``: same kind, dtype
        and shape.

        ``src=None``: from any source (``MPI_ANY_SOURCE``): the next tensor of whichever rank has
        one of ``tag`` waiting (one of them, if several have), returned as ``(src, tensor)``; each
        rank's tensors still arrive in the order it sent them.
        Waits at most ``timeout_ms`` of silence (from ``src``; with None, without a tensor from
        anyone; default: the mesh's ``recv_timeout_ms``; ``math.inf``: no limit), then raises
        :class:`lab.DeadlineError`. Waits first for this mesh's asynchronous collectives (one
        issue order).

            # N=3: ranks 1 and 2 each mesh.send(0, torch.tensor([mesh.rank]))
            src, x = mesh.recv(None)          # rank 0: (1, tensor([1])) or (2, tensor([2]))
            other, y = mesh.recv(None)        # rank 0: the other one
        """
        timeout_ms = checks.timeout_ms(timeout_ms, "timeout_ms")
        tag = checks.p2p_tag(tag)
        if src is not None:
            self._check_peer(src, "src")
            src = int(src)
        elif self.world_size == 1:
            raise ValueError("src=None receives from any other rank; this mesh has only one rank")

        def run() -> Any:
            if src is not None:
                return self._receive(src, tag, timeout_ms)
            chosen = self._ready_source(None, tag, timeout_ms)
            if chosen is None:
                others = [r for r in range(self.world_size) if r != self.rank]
                waited = self._exchange.recv_timeout_ms if timeout_ms is None else timeout_ms
                raise DeadlineError(
                    f"{silence_error(self.rank, others, self._exchange.position)} "
                    f"(timeout_ms={waited:g})", others)
            return chosen, self._receive(chosen, tag, timeout_ms)

        # (the tensor's dtype and size, and from any source its sender, come with it: learned)
        what = self.describe("recv", DTYPES["uint8"], 0, 0, peer=src, tag=tag, learn=self._learned) \
            if self.recording else None
        return self.issue(run, async_op=False, numbered=False, what=what)

    def _learned(self, received: Any) -> dict:
        """What a received tensor (from any source: ``(src, tensor)``) tells the receive's recorded line."""
        source, tensor = received if isinstance(received, tuple) else (None, received)
        dtype, numel = dtype_of(tensor), int(np.prod(tensor.shape))
        learned = {
            "dtype": dtype.name, "itemsize": dtype.storage.itemsize, "count": numel, "out_count": numel}
        if source is not None:
            learned["peer"] = self.global_ranks[source]
        return learned

    def probe(self, src: int | None, tag: int = 0, timeout_ms: float | None = None) -> int | None:
        """The rank whose next tensor of ``tag`` for this rank has arrived: ``src``, or with
        None any rank (trying them from the one after the rank last chosen, so that none is
        starved); None if none arrived within ``timeout_ms`` (``MPI_Probe``, ``MPI_Iprobe`` with a
        short timeout). It takes nothing: the next ``recv`` from that rank and tag gets the tensor.

            # N=2: rank 1 mesh.send(0, torch.ones(3), tag=4)
            src = mesh.probe(None, tag=4)        # rank 0: 1
            x = mesh.recv(src, tag=4)            # rank 0: tensor([1., 1., 1.])
        """
        timeout_ms, tag = checks.timeout_ms(timeout_ms, "timeout_ms"), checks.p2p_tag(tag)
        if src is not None:
            self._check_peer(src, "src")
            src = int(src)
        elif self.world_size == 1:
            raise ValueError("src=None probes any other rank; this mesh has only one rank")
        return self.issue(lambda: self._ready_source(src, tag, timeout_ms), async_op=False, numbered=False)

    def _ready_source(self, src: int | None, tag: int, timeout_ms: float | None) -> int | None:
        """``src`` (None: any rank) if its next tensor of ``tag`` has arrived within ``timeout_ms``, else None."""
        n = self.world_size
        if src is None:
            candidates = [(self._next_any + i) % n for i in range(n) if (self._next_any + i) % n != self.rank]
        else:
            candidates = [src]
        self._start_p2p("probe" if src is not None else "recv from any source", 0)
        # Each one's next header: what recv(src) would wait for (a peer's collectives later in its
        # issue order are not a tensor for us, and wait for their receive).
        expected = {
            r: self._p2p_tag(tag, self._p2p_received[r, tag] + 1, 0, p2p.HEADER_WORDS)
            for r in candidates}
        timeout_ms = self._exchange.recv_timeout_ms if timeout_ms is None else timeout_ms
        found = self._exchange.ready_source(expected, timeout_ms)
        if found is None:
            return None
        if src is None:
            self._next_any = (found + 1) % n
        return found

    def _receive(self, src: int, tag: int, timeout_ms: float | None) -> Any:
        """The next tensor of ``tag`` from ``src``: its header (kind, dtype, shape), then its payload."""
        self._p2p_received[src, tag] += 1
        seq = self._p2p_received[src, tag]
        self._start_p2p("recv", seq)
        header = np.empty(p2p.HEADER_WORDS, np.int64)
        transfer = self._exchange.transfer
        transfer([], [Recv(src, header)], timeout_ms, counted=False,
                 tag=self._p2p_tag(tag, seq, 0, p2p.HEADER_WORDS))
        incoming = p2p.decode_header(header)
        transfer([], [Recv(src, incoming.flat)], timeout_ms,
                 tag=self._p2p_tag(tag, seq, incoming.dtype.code, incoming.flat.size))
        return incoming.tensor()

    def _start_p2p(self, kind: str, seq: int) -> None:
        position = self._exchange.position
        position.collective, position.seq, position.algorithm, position.step = kind, seq, "", 0
