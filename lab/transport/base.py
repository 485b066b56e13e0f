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
  of another mesh (or tag) over the same channel, entered in another order by its sender. The receiver parks it (MPI's unexpected-message queue, one per
  source) and a later receive of that context takes it first, in arrival order.

A wait raises :class:`lab.DeadlineError` after ``timeout_s`` seconds in which no awaited peer
made progress (:class:`Silence`): the deadline measures silence, so a peer streaming a large
tensor is never timed out, however long the transfer takes (``timeout_s`` may be ``math.inf``).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import reduction

import numpy as np

from lab.errors import DeadlineError

Combine = Callable[[np.ndarray, np.ndarray], None]

#: The longest tag a message can carry (the mesh's fingerprint fills it).
TAG_BYTES = 32
#: The first bytes of a tag: the context (mesh or sub-mesh, and point-to-point tag) the message
#: belongs to.
CONTEXT_BYTES = 8


def same_context(tag: bytes, other: bytes) -> bool:
    """True if two tags belong to the same mesh (otherwise a receive parks the message)."""
    return tag[:CONTEXT_BYTES] == other[:CONTEXT_BYTES]


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
    def exchange(
        self, sends: Sequence[Send], recvs: Sequence[Recv], tag: bytes, timeout_s: float, where: object
    ) -> None:
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
        """Tags of messages that arrived but were not received yet, per sender (for diagnosis
        after a deadline: a message from the same collective with another fingerprint means the
        ranks disagree). Transports that cannot look without consuming return ``{}``."""
        return {}

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
