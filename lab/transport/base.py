"""The interface between algorithms (through :class:`lab.Mesh`) and the wires that move bytes.

A transport moves flat numpy buffers between ranks. Its single primitive is
:meth:`Transport.exchange`: post some sends and some receives and return once all are complete,
progressing them together so that a ring step (every rank sends and receives at once) cannot
deadlock even when buffers are bounded. A receive either copies into its output or reduces into
it with a kernel (``combine(out, incoming)``), straight from where the bytes landed.

What a transport knows of collectives is two things about the opaque ``tag`` each message
carries (the mesh's fingerprint of the current collective), and nothing else (no algorithm,
step or op):

- it compares the whole tag with the one the receive expects: a different one raises
  :class:`TagMismatch`, which the mesh turns into a :class:`lab.CollectiveMismatchError`; a
  message of the right tag whose size differs from the receive's buffer raises that error
  directly;
- its first ``CONTEXT_BYTES`` name the mesh or sub-mesh (``mesh.split``) that sent it and, for
  point-to-point, the message's tag: a message of another context is not a mismatch but traffic
  of another mesh (or tag) over the same channel, entered in another order by its sender. The
  receiver parks it (:mod:`lab.transport.parking`: MPI's unexpected-message queue, one per
  source, bounded) and a later receive of that context takes it first, in arrival order.

A wait raises :class:`lab.DeadlineError` after ``timeout_s`` seconds in which no awaited peer
made progress (:class:`Silence`): the deadline measures silence, so a peer streaming a large
tensor is never timed out, however long the transfer takes (``timeout_s`` may be ``math.inf``).

Abort notices. A rank whose collective fails tells its peers what it found before it raises
(:meth:`Transport.share_failure`): an :class:`AbortNotice` on every link, out of band (a frame
kind of its own, authenticated as any frame on tcp). A peer that reads one, in a wait or when its
own wait fails, raises the root cause it names (a mismatch, the silent rank at the end of a chain
of waits) instead of what it saw itself ("rank 0 is gone", a deadline on an innocent rank that was
waiting too). Under a launcher, where no parent collects the ranks' reports, this is how every
rank learns why the job failed. The ``"queue"`` transport (``lab.spawn``'s only, whose parent
diagnoses) carries none.

Threads. Several threads may drive one transport at once, each in its own context (a torch
group's issue order: :mod:`lab.comm.issue`): each entry point holds the transport's ``_lock``
(:func:`locked`), which a wait lets go of, so that one thread's wait never holds up another's
messages; what one thread reads of another context is parked for it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import reduction

import numpy as np

from lab import fingerprint
from lab.errors import CollectiveMismatchError, DeadlineError, LabError, PeerLostError

Combine = Callable[[np.ndarray, np.ndarray], None]

#: The longest tag a message can carry (the mesh's fingerprint fills it).
TAG_BYTES = 32
#: The first bytes of a tag: the context (mesh or sub-mesh, and point-to-point tag) the message
#: belongs to.
CONTEXT_BYTES = 8


def same_context(tag: bytes, other: bytes) -> bool:
    """True if two tags belong to the same mesh (otherwise a receive parks the message)."""
    return tag[:CONTEXT_BYTES] == other[:CONTEXT_BYTES]


def locked(method: Callable) -> Callable:
    """``method`` of a transport, run holding the transport's ``_lock`` (a ``threading.RLock``,
    which its waits release while they block: see Threads above)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


#: The longest single wait handed to poll/select (they cannot take an unbounded timeout): a longer
#: (or infinite) deadline is waited out in slices of this.
MAX_WAIT_SLICE_S = 3600.0


class Silence:
    """The deadline of one wait, measured as silence: it expires ``timeout_s`` after the awaited
    peers last made progress, so a peer that keeps moving bytes is never timed out.

    A transport calls :meth:`progress` whenever an awaited peer moved something, waits at most
    :meth:`wait_s` at a time (a slice: poll and select cannot wait forever, and ``timeout_s`` may
    be ``math.inf``), and raises :func:`silence_error` once :meth:`expired`.
    """

    __slots__ = ("_deadline", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.progress()

    def progress(self) -> None:
        """An awaited peer moved: the silence starts over."""
        self._deadline = time.monotonic() + self.timeout_s

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def wait_s(self) -> float:
        """How long the next wait may block: what is left, at most ``MAX_WAIT_SLICE_S``, 0 once expired."""
        return min(max(self._deadline - time.monotonic(), 0.0), MAX_WAIT_SLICE_S)


def silence_error(rank: int, peers: Iterable[int], where: object) -> DeadlineError:
    """The error of an expired :class:`Silence`: this rank, the peers it waited for (also in
    ``.peers``, which the launcher's diagnosis reads) and the caller's position ``where``."""
    peers = sorted(peers)
    names = ", ".join(str(p) for p in peers)
    return DeadlineError(f"rank {rank} timed out waiting for rank {names} in {where}", peers=peers)


#: The longest message an abort notice carries, in characters (a notice fits one pipe write).
NOTICE_TEXT_CHARS = 900
#: The most bytes an encoded notice takes (4 per character at most, and its other fields).
MAX_NOTICE_BYTES = 4 * NOTICE_TEXT_CHARS + 128
#: After its own deadline, how long a rank waits at most for the peers it waited on to say what
#: they found (they wait too, and their deadlines expire about when this rank's does), as a part of
#: the deadline and in seconds.
NOTICE_GRACE_PART, NOTICE_GRACE_S = 0.25, 0.5
#: How a rank that did not find a failure itself names what a notice told it, by its kind.
_TOLD = {
    "CollectiveMismatchError": (CollectiveMismatchError, "rank {origin} found a mismatch: {message}"),
    "DeadlineError": (DeadlineError, "{silent} silent: {message}"),
    "PeerLostError": (PeerLostError, "rank {origin} lost a peer: {message}")}


@dataclass(frozen=True)
class AbortNotice:
    """What rank ``origin`` found when a collective failed there: its error's class name
    (``kind``) and message and, for a deadline, the ``silent`` ranks it waited for. ``via``: the
    peer this rank read it from (``origin``, or a rank that was told and passed it on; -1: this
    rank's own); not sent."""

    origin: int
    kind: str
    message: str
    silent: tuple[int, ...] = ()
    via: int = field(default=-1, compare=False)

    @classmethod
    def of(cls, error: BaseException, rank: int) -> AbortNotice:
        """The notice of ``error``: what this rank found, or what a peer's notice told it."""
        told = told_by(error)
        if told is not None:
            return told
        message = str(error)
        if len(message) > NOTICE_TEXT_CHARS:
            message = message[:NOTICE_TEXT_CHARS - 3] + "..."
        silent = error.peers if isinstance(error, DeadlineError) else ()
        return cls(rank, type(error).__name__, message, silent)

    def encode(self) -> bytes:
        fields = [self.origin, self.kind, self.message, list(self.silent)]
        return json.dumps(fields, ensure_ascii=False).encode()

    @classmethod
    def decode(cls, data: bytes, sender: int) -> AbortNotice:
        """The notice ``sender`` sent as ``data``; one that cannot be read says so, as ``sender``'s."""
        try:
            origin, kind, message, silent = json.loads(data)
            return cls(int(origin), str(kind), str(message), tuple(int(peer) for peer in silent), sender)
        except (ValueError, TypeError):
            unread = f"rank {sender} failed, and its abort notice could not be read"
            return cls(sender, "LabError", unread, (), sender)

    def error(self, rank: int, where: object) -> LabError:
        """What rank ``rank``, told this in ``where``, raises: the root cause, of its kind (a
        :class:`lab.LabError` for a kind not of the wires), with this notice as ``.notice``."""
        kind, text = _TOLD.get(self.kind, (LabError, "rank {origin} failed with {kind}: {message}"))
        silent = f"rank {self.silent[0]} is" if len(self.silent) == 1 else \
            f"ranks {', '.join(map(str, self.silent))} are"
        text = text.format(origin=self.origin, kind=self.kind, message=self.message, silent=silent)
        text += f" (rank {rank} was told in {where})"
        error = kind(text, self.silent) if kind is DeadlineError else kind(text)
        error.notice = self
        return error


def told_by(error: BaseException) -> AbortNotice | None:
    """The notice that told this rank ``error``, or None where it found it itself; also for the
    same error raised again in its place (as the mesh raises a deadline again, with its timeout)."""
    again = error.__context__
    raised_again = getattr(again, "notice", None) if type(again) is type(error) else None
    return getattr(error, "notice", None) or raised_again


def root_cause(heard: Sequence[AbortNotice], rank: int, mine: AbortNotice | None = None,
               deadlines: bool = True) -> AbortNotice | None:
    """Of the notices rank ``rank`` ``heard`` (in arrival order) and its own finding ``mine``, the
    one that names the root cause, as :mod:`lab.launch.diagnosis` ranks reports: a failure not of
    the wires first, then a mismatch, then a deadline on silent ranks, then a lost peer. Of one
    standing, this rank's own deadline comes before one heard, and a lost peer heard before its
    own (the peer may have gone because of it); what this rank found, passed back to it, is left
    out. A deadline on ranks that are all alive (this one, and every rank that sent or passed on
    a notice) is a consequence, last: it waited on ranks that were waiting too. ``deadlines``
    False leaves deadlines out, as a wait that reads a notice does: whether one is a consequence
    shows only once the ranks it names have told theirs, and this rank's own deadline will weigh
    it against what this rank waited for."""
    alive = {rank} | {notice.origin for notice in heard} | {notice.via for notice in heard}
    heard = [notice for notice in heard if notice.origin != rank]

    def standing(notice: AbortNotice) -> int:
        if notice.kind == "DeadlineError":
            return _CONSEQUENCE if set(notice.silent) <= alive else 2
        return {"CollectiveMismatchError": 1, "PeerLostError": 3}.get(notice.kind, 0)

    ordered = heard if mine is None else [mine, *heard] if mine.kind == "DeadlineError" else [*heard, mine]
    candidates = [notice for notice in ordered if deadlines or notice.kind != "DeadlineError"]
    return min(candidates, key=standing, default=None)  # (the first of a standing)


_CONSEQUENCE = 4  # (root_cause's standing of a deadline on live ranks)


@dataclass
class Send:
    dst: int
    data: np.ndarray  # flat, contiguous; read-only to the transport


@dataclass
class Recv:
    src: int
    out: np.ndarray  # flat, contiguous, exactly the size the sender sends
    combine: Combine | None = None  # None: copy; otherwise out ⊕= incoming


class TagMismatch(Exception):
    """A message from ``src`` carried ``got`` where the receiver expected ``expected``."""
    def __init__(self, src: int, expected: bytes, got: bytes) -> None:
        super().__init__(src, expected, got)
        self.src, self.expected, self.got = src, expected, got


class Transport(ABC):
    """One rank's end of the mesh."""

    rank: int
    world_size: int

    @abstractmethod
    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float,
                 where: object) -> None:
        """Complete every send and receive, or raise.

        ``timeout_s``: the longest silence (no progress from any awaited peer) before a wait
        raises :class:`lab.DeadlineError` naming the peers in ``.peers``; ``where`` describes
        the caller's position (its ``str`` is used only in error messages). A peer that is gone
        raises :class:`lab.PeerLostError`.
        """

    @abstractmethod
    def ready_source(self, expected: Mapping[int, bytes], timeout_s: float, where: object) -> int | None:
        """A peer among ``expected`` (tried in its order) whose next message of ``expected[peer]``'s
        context has a tag that starts with ``expected[peer]``; None once ``timeout_s`` passed with
        none. It consumes nothing (messages of other contexts met on the way are parked, as a
        receive parks them): the next :meth:`exchange` receiving from that peer takes the message,
        so each peer's messages are still taken in the order it sent them. What
        ``mesh.recv(None)`` (any source) waits with.
        """

    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """Tags of messages that arrived but were not received yet, per sender, held aside
        (:mod:`lab.transport.parking`) or still on the channel, looked at without waiting: for
        diagnosis after a deadline (a message from the same collective with another fingerprint
        means the ranks disagree), and where every message should have been received (a mesh's
        close: :func:`lab.comm.unread.raise_if_unread`). Transports that cannot look
        return ``{}``."""
        return {}

    def stray(self, tag: bytes) -> tuple[int, bytes] | None:
        """Before the first transfer of the collective of ``tag``: a message of an earlier
        collective of its context that arrived and was not received (which it never will be:
        :func:`lab.fingerprint.earlier`), as ``(sender, its tag)``; None if none. Looked for in
        :meth:`unconsumed_tags` only where :meth:`holds_unread` says one may wait."""
        return fingerprint.earlier(tag, self.unconsumed_tags()) if self.holds_unread(tag) else None

    def holds_unread(self, tag: bytes) -> bool:
        """Whether a message not received may wait that :meth:`stray` should look at: a glance,
        with no system call (every collective asks). False where nothing is held."""
        return False

    def send_notice(self, notice: AbortNotice) -> None:
        """Tell every peer ``notice``, where a link can carry it: best effort, never blocking for
        long, never raising. Transports without notices send nothing."""

    def notices(self, awaited: Iterable[int], grace_s: float) -> list[AbortNotice]:
        """The notices peers sent this rank, in arrival order: what has come from any peer, and
        for up to ``grace_s`` more while none has come from ``awaited``. Never raises."""
        return []

    def share_failure(self, error: LabError, where: object, timeout_s: float) -> LabError:
        """What this rank raises for ``error``, the failure of its collective in ``where``, after
        telling its peers (:class:`AbortNotice`). A deadline or a lost peer may be the consequence
        of what a peer found: after a deadline, the peers waited for get a grace (a part of
        ``timeout_s``) to say so; the root cause among the notices heard and ``error``
        (:func:`root_cause`) is returned. A mismatch found here, or a failure not of the wires,
        is a root cause itself; a notice already raised is passed on."""
        mine = AbortNotice.of(error, self.rank)
        if told_by(error) is None and isinstance(error, (DeadlineError, PeerLostError)):
            awaited = error.peers if isinstance(error, DeadlineError) else ()
            if awaited:  # first, for the ranks waiting on this one: their graces run too
                self.send_notice(mine)
            grace_s = min(timeout_s * NOTICE_GRACE_PART, NOTICE_GRACE_S) if awaited else 0.0
            found = root_cause(self.notices(awaited, grace_s), self.rank, mine)
            if found is mine and awaited:
                return error
            if found is not mine:
                error, mine = found.error(self.rank, where), found
        self.send_notice(mine)
        return error

    @abstractmethod
    def close(self) -> None:
        """Release this rank's resources. Idempotent."""


class SharedFd:
    """A file descriptor that travels to a child process when the process starts."""
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _rebuild_shared_fd, (reduction.DupFd(self.fd),)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rebuild_shared_fd(dup: reduction.DupFd) -> SharedFd:
    return SharedFd(dup.detach())


def recv_available(sock, limit: int) -> bytes | None:
    """Up to ``limit`` bytes a non-blocking socket holds: None if nothing has arrived yet, b""
    if the peer closed or the connection failed (the listeners of both handshakes drop it then)."""
    try:
        return sock.recv(limit)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
