"""One rank's transfers on one mesh: what :class:`lab.Mesh` adds to a transport on every wire.

:class:`Exchange` is the :class:`lab.algorithms.peers.Peers` that algorithms run on: it numbers each
collective, fingerprints its messages (so ranks in different collectives are caught at the first
message), translates a sub-mesh's ranks to the global ranks of the shared channels and turns a
transport's failure into the lab's error naming both sides; its :class:`lab.comm.books.Books`
(``exchange.books``) keep each collective's flight record, count payload bytes and write the
trace rows. A :class:`lab.Mesh` holds one (``mesh.exchange``). A root mesh and its sub-meshes share one
:class:`Channels`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels import doorbell as wait_status
from lab import fingerprint
from lab.buffers import new_flat
from lab.comm import unread
from lab.comm.books import Books
from lab.comm.channels import Channels
from lab.comm.membership import Membership
from lab.comm.planned_run import PlannedRun, raise_compiled_failure
from lab.compiled.plane import LEDGER_WORDS, SEQ, CompiledCall
from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError
from lab.flight import FlightRecord, Position
from lab.ops import DTYPES, DType, Reduction, reduction
from lab.transport.base import Recv, Send, TagMismatch

if TYPE_CHECKING:
    from lab.fingerprint import Signature

#: What a collective with no trace row passes as its counters before (see Exchange._begin).
_UNTRACED = (0, 0, 0)
#: A fingerprint as the int64 words ranks exchange to agree (Exchange.agree).
FINGERPRINT_WORDS = fingerprint.FINGERPRINT.size // 8
_INT64 = DTYPES["int64"]


class Exchange:
    """One rank's transfers on the mesh of ``membership`` over ``channels``; its byte counters
    are also counted in each mesh of ``parents`` (a sub-mesh's parent, its parent's, ...)."""
    def __init__(self, channels: Channels, membership: Membership, parents: list[Exchange]) -> None:
        self._channels, self._membership, self._transport = channels, membership, channels.transport
        self._rank, self._world_size = membership.rank, membership.world_size
        #: This mesh's exchange and its ancestors': a sub-mesh's parents (lab.Mesh.sub_mesh).
        self.lineage = [self, *parents]
        #: The compiled data plane of this mesh's small collectives (lab.compiled.plane), or None.
        self.plane = channels.plane if membership.members is None else None  # (mailboxes speak global ranks)
        self._trace = channels.trace
        self.tracing = channels.trace is not None  # (a planned run then takes the full path)
        self.transport, self.recv_timeout_ms = channels.transport_name, channels.recv_timeout_ms
        self.name = membership.name()
        # (host, local_rank, local_world_size): a sub-mesh counts its own ranks on this host
        self.host = channels.placement[0]
        self.local_rank, self.local_world_size = \
            channels.placement[1:] if membership.members is None else membership.local_placement(self.host)
        self.host_count = membership.host_count  # hosts this mesh's ranks are on
        self._nbytes = 0  # the current collective's tensor bytes
        self._compiled = True  # the current collective may take the compiled path
        # The collective number and the counts and flight records of compiled calls that keep
        # their own books (lab.compiled.plane: SEQ, BOOKED, RING): the plane's, where this mesh has one.
        self._ledger = self.plane.ledger if self.plane is not None else np.zeros(LEDGER_WORDS, np.int64)
        channels.ledgers[membership.context] = self._ledger
        self._tag = b""
        self.context = membership.context  # in every fingerprint
        self.position = Position(membership.describe())  # where this rank is: what errors name
        #: Flight records, counters (a transfer counts in each ancestor's too) and trace rows.
        self.books = Books(channels, membership, self._ledger, self.position,
                           [parent.books for parent in parents])
        self.recorder = self.books.recorder

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def closed(self) -> bool:
        """True once this mesh (or its root, for a sub-mesh) was closed."""
        return self._channels.closed

    @property
    def clean(self) -> bool:
        """False once a transfer failed half-way (on this mesh or one of its sub-meshes): peers
        may hold its messages, so the channels cannot be reused."""
        return self._channels.clean

    @clean.setter
    def clean(self, value: bool) -> None:
        self._channels.clean = value

    def host_of(self, rank: int) -> int:
        """The host of this mesh's rank ``rank`` (:class:`lab.algorithms.peers.Peers`)."""
        return self._membership.host_of(rank)

    # -- counters ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Payload bytes and messages since :meth:`reset_stats` (tensor data only, no headers).

        A message is one logical send (a chunk), however many segments the transport cut it into.
        ``bytes_sent_inter_host`` / ``bytes_received_inter_host``: the part to or from a rank on
        another host. A mesh's counters include its sub-meshes' traffic; a sub-mesh counts its own.
        """
        return self.books.stats()

    def reset_stats(self) -> None:
        self.books.reset_stats()

    # -- what the public collectives take from the mesh ----------------------------------------

    #: The kernels of ``(op, dtype)``, looked up once per process (an ``avg`` of integers still
    #: raises every time). The simulator's recorder hands out kernels that do nothing instead.
    kernels = staticmethod(functools.cache(reduction))

    #: A new flat output buffer (allgather's, all_to_all's); the recorder's are virtual.
    new_flat = staticmethod(new_flat)

    @property
    def compiled_max_bytes(self) -> int:
        """The largest tensor a collective on this mesh runs in one compiled call (0: none; lab.compiled.plane)."""
        return 0 if self.plane is None else self.plane.max_bytes

    def run(self, algorithm: Callable[..., None], *args: Any, **options: Any) -> None:
        """Run ``algorithm(self, *args, **options)``: one algorithm of the collective entered with
        :meth:`collective` (the public collectives call it). A small collective whose algorithm
        is compilable runs in one Numba call over the mailboxes where the transport has them."""
        plane = self.plane
        if plane is None or options or not self._compiled or not plane.takes(algorithm, self._nbytes, args):
            algorithm(self, *args, **options)
            return
        call = plane.call(algorithm, args)
        self.run_compiled(call, call.operands(args))

    def compiled_call(self, signature: Signature, algorithm: Any, args: tuple,
                      at: bool = False) -> PlannedRun | None:
        """The compiled call that the collective of ``signature`` running ``algorithm`` on
        arguments like ``args`` takes, made once now (for a plan, or a plain call's template), or
        None where it runs in Python. ``at``: it takes its first buffer as an address and a byte
        count (:meth:`lab.compiled.plane.CompiledPlane.call`)."""
        plane = self.plane
        nbytes = signature.count * signature.dtype.storage.itemsize
        if plane is None or not signature.compiled or not plane.takes(algorithm, nbytes, args):
            return None
        return PlannedRun(self, signature, plane.call(algorithm, args, at))

    def run_compiled(self, call: CompiledCall, operands: tuple) -> None:
        self.position.step += 1
        status = call(self._tag, self.recv_timeout_ms, operands)
        if status != wait_status.OK:
            raise_compiled_failure(self, call)
        bytes_sent, bytes_received, messages_sent, messages_received = call.counts()
        self.books.count(bytes_sent=bytes_sent, bytes_received=bytes_received, messages_sent=messages_sent,
                         messages_received=messages_received, collectives_compiled=1)

    # -- what algorithms use -------------------------------------------------------------------

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        """Send a flat buffer to ``dst`` (returns once the data is in the channel)."""
        self.transfer([Send(dst, data)], [])

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Reduction | None = None) -> None:
        """Receive from ``src`` into ``out``: copy, or ``reduction.combine(out, incoming)``."""
        self.transfer([], [Recv(src, out, None if reduction is None else reduction.combine)])

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray,
                        reduction: Reduction | None = None) -> None:
        """Send to ``dst`` and receive from ``src`` at once (one ring step)."""
        self.transfer([Send(dst, data)], [Recv(src, out, None if reduction is None else reduction.combine)])

    def transfer(self, sends: list[Send], recvs: list[Recv], timeout_ms: float | None = None,
                 counted: bool = True, tag: bytes | None = None) -> None:
        """One step: ``sends`` and ``recvs`` at once under the current fingerprint (``tag``: this from now on)."""
        if tag is not None:
            self._tag = tag
        self.position.step += 1
        timeout_ms = self.recv_timeout_ms if timeout_ms is None else timeout_ms
        trace_steps = self._trace is not None and self._trace.steps
        start_ns = time.time_ns() if trace_steps else 0
        members = self._membership.members
        if members is not None:  # a sub-mesh: its ranks are global ranks on the shared channels
            sends = [Send(members[s.dst], s.data) for s in sends]
            recvs = [Recv(members[r.src], r.out, r.combine) for r in recvs]
        with _failures(self, timeout_ms):
            self._transport.exchange(sends, recvs, self._tag, timeout_ms / 1000, self.position)
        if trace_steps:
            position = self.position
            sent, received = [[s.dst, s.data.nbytes] for s in sends], [[r.src, r.out.nbytes] for r in recvs]
            self.books.write_trace(kind="step", op=position.collective, algorithm=position.algorithm,
                                   seq=position.seq, step=position.step, sends=sent, recvs=received,
                                   start_ns=start_ns, duration_ns=time.time_ns() - start_ns)
        if counted:
            hosts, host = self._membership.hosts, self.host
            self.books.count(
                bytes_sent=sum(s.data.nbytes for s in sends), messages_sent=len(sends),
                bytes_sent_inter_host=sum(s.data.nbytes for s in sends if hosts[s.dst] != host),
                bytes_received=sum(r.out.nbytes for r in recvs), messages_received=len(recvs),
                bytes_received_inter_host=sum(r.out.nbytes for r in recvs if hosts[r.src] != host))

    @property
    def scratch(self) -> Any:
        """The shm transport's shared scratch (:mod:`lab.transport.peer_memory`: two-shot slots and
        ``lab.empty``'s arenas), or None (another transport, one rank, a closed mesh)."""
        return None if self.closed else getattr(self._transport, "scratch", None)

    def shared_allreduce(self, buf: np.ndarray, reduction: Reduction, one_shot: bool = False,
                         source: np.ndarray | None = None) -> bool:
        """Allreduce ``buf`` in place through the peers' memory (:mod:`lab.transport.peer_memory`'s two-shot, or
        its one-shot from ``source``); False, doing nothing, without scratch or on a sub-mesh (send messages)."""
        if self.closed:
            raise LabError(f"{self._membership.who()}: this mesh is closed (an allreduce after mesh.close())")
        if self.scratch is None or self._membership.members is not None:
            return False
        self.position.step += 1
        with _failures(self, self.recv_timeout_ms):
            moved = self.scratch.allreduce(buf, reduction, self._tag, self.recv_timeout_ms / 1e3,
                                           self.position, one_shot, source)
        self.books.count(bytes_sent=moved.bytes_sent, bytes_received=moved.bytes_received,
                         messages_sent=moved.messages, messages_received=moved.messages)
        return True

    def ready_source(self, expected: dict[int, bytes], timeout_ms: float) -> int | None:
        """:meth:`lab.transport.base.Transport.ready_source` in this mesh's ranks (a probe's wait)."""
        try:
            by_global = {self._membership.to_global(r): tag for r, tag in expected.items()}
            found = self._transport.ready_source(by_global, timeout_ms / 1000, self.position)
        except BaseException:
            self.clean = False  # (a lost peer, a forged frame: the channels cannot be trusted)
            raise
        return None if found is None else self._membership.from_global(found)

    def mismatch(self, src: int, got: bytes, expected: bytes | None = None) -> CollectiveMismatchError:
        """Global rank ``src`` sent ``got`` where this rank expected ``expected`` (its own tag)."""
        who = self._membership.who
        return CollectiveMismatchError(
            f"{who()} is in {fingerprint.describe(self._tag if expected is None else expected)}; "
            f"{who(src)} sent {fingerprint.describe(got)}")

    def raise_if_unread(self, when: str) -> None:
        """:func:`lab.comm.unread.raise_if_unread` on this rank's channels (at close, at a run's end)."""
        unread.raise_if_unread(self._channels, self._membership.who, when)

    def raise_if_mismatched(self, tag: bytes | None = None) -> None:
        """After a deadline or a lost peer: did a peer send this collective's number (``tag``'s;
        default: the current one's) with another fingerprint? (:func:`lab.fingerprint.disagreeing`)"""
        tag = self._tag if tag is None else tag
        found = fingerprint.disagreeing(tag, self._transport.unconsumed_tags())
        if found is not None:
            raise self.mismatch(*found, tag) from None

    # -- collectives: numbered, fingerprinted, recorded, traced ---------------------------------

    @contextlib.contextmanager
    def collective(self, name: str, algorithm: str, dtype: DType, count: int, op: str = "", root: int = -1,
                   compiled: bool = True) -> Iterator[None]:
        """Run one collective: number it, fingerprint its messages, trace it.

        Every rank enters the same collectives in the same order, so ``seq`` agrees across ranks
        and a message from a different collective is caught by its fingerprint. ``compiled``
        False keeps it off the compiled path whatever its size (every rank must pass the same:
        an all_to_all with split sizes, whose ranks agree on no size).
        """
        record, start_ns, before = self._begin(name, algorithm, dtype, count, op, root, compiled)
        try:
            unread.raise_if_stray(self, self._transport.stray(self._tag))  # (before its first transfer)
            yield
        except BaseException as exc:
            self.failed(record, exc)
            raise
        self.books.done(record, start_ns, before)

    def agree(self, signature: Signature) -> list[bytes]:
        """Every rank's fingerprint of ``signature`` (numbered 0), in rank order, from one
        internal collective numbered as a collective (a plan's ranks compare their plans with it
        at init, :mod:`lab.collectives.plans`)."""
        name, algorithm, dtype, count, op, root, _ = signature
        record = self.books.enter("agree", "", "int64", FINGERPRINT_WORDS, "", -1)
        mine = fingerprint.pack(self._membership.context, 0, name, algorithm, dtype.code, op, root, count)
        try:
            everyone = self._fingerprints(mine)
        except BaseException as exc:
            self.failed(record, exc)
            raise
        record.state, record.step = "done", self.position.step
        return everyone

    def _fingerprints(self, mine: bytes) -> list[bytes]:
        """Every rank's ``mine``, in rank order: this rank's sent to every other rank in one step,
        under the fingerprint of an "agree" collective (which no user call has) of the current
        number. Not counted: no payload of the program's."""
        everyone = np.zeros((self.world_size, FINGERPRINT_WORDS), np.int64)
        everyone[self.rank] = np.frombuffer(mine, np.int64)
        others = [r for r in range(self.world_size) if r != self.rank]
        self._tag = fingerprint.pack(self._membership.context, int(self._ledger[SEQ]), "agree", "",
                                     _INT64.code, "", -1, FINGERPRINT_WORDS)
        if others:
            self.transfer([Send(r, everyone[self.rank]) for r in others],
                          [Recv(r, everyone[r]) for r in others], counted=False)
        return [row.tobytes() for row in everyone]

    def _begin(self, name: str, algorithm: str, dtype: DType, count: int, op: str, root: int,
               compiled: bool) -> tuple[FlightRecord, int, tuple[int, int, int]]:
        """A collective's number, fingerprint, position and flight record; for its trace row,
        when it started, and the byte counters then and its tensor's bytes."""
        record = self.books.enter(name, algorithm, dtype.name, count, op, root)
        self._tag = fingerprint.pack(self._membership.context, record.seq, name, algorithm, dtype.code, op,
                                     root, count)
        self._nbytes = count * dtype.storage.itemsize
        self._compiled = compiled
        if self._trace is None:
            return record, 0, _UNTRACED
        counters = self.books.counters
        return record, time.time_ns(), (counters["bytes_sent"], counters["bytes_received"], self._nbytes)

    def refused(self) -> None:
        """Number a collective that was refused before it ran (an earlier asynchronous call's
        failure raised in its place: :meth:`lab.comm.issue.IssueQueue.wait_all`). Its peers ran theirs:
        this rank's next collective takes the number after it, and meets a mismatch there rather
        than pair with the wrong call of theirs."""
        self.books.refused()

    def note(self, seq: int, name: str, algorithm: str, dtype_name: str, count: int, op: str, root: int,
             step: int = 0) -> FlightRecord:
        """Say where this rank is (collective ``seq`` at ``step``) and note it in the flight recorder."""
        return self.books.note(seq, name, algorithm, dtype_name, count, op, root, step)

    def failed(self, record: FlightRecord, exc: BaseException) -> None:
        """Record the failure (:meth:`lab.comm.books.Books.failed`: a peer's root cause may be raised instead)."""
        self.books.failed(record, exc)

    def flight_records(self) -> list[FlightRecord]:
        """This rank's last collectives, oldest first; a running one shows the step it reached."""
        return self.books.flight_records()


@contextlib.contextmanager
def _failures(exchange: Exchange, timeout_ms: float) -> Iterator[None]:
    """A transport's failure as the lab's error naming both sides; any failure leaves the
    mesh unclean (messages may be in flight)."""
    try:
        yield
    except TagMismatch as mismatch:
        exchange.clean = False
        raise exchange.mismatch(mismatch.src, mismatch.got, mismatch.expected) from None
    except DeadlineError as late:
        exchange.clean = False
        exchange.raise_if_mismatched()
        raise DeadlineError(f"{late} (recv_timeout_ms={timeout_ms:g})", late.peers) from None
    except PeerLostError:
        exchange.clean = False
        exchange.raise_if_mismatched()  # the peer may have given up because we disagree
        raise
    except BaseException:
        exchange.clean = False
        raise
