"""What an ``"shm"`` rank holds that it has not received, and the glance that says whether it
holds any: :class:`PipeUnread` is a part of :class:`lab.transport.shm.ShmTransport`, whose pipes,
queues, parking and mappings it reads.

    transport.holds_unread(tag)      # a few loads a peer: the mailboxes' rings, the pipes' counters
    transport.unconsumed_tags()      # drains the pipes: each peer's messages not received, by tag
    transport.queued_bytes(peer)     # what the flood test bounds
"""

from __future__ import annotations

import contextlib
import fcntl
import struct
import termios
from collections import deque
from collections.abc import Callable

from lab.errors import PeerLostError
from lab.transport.base import locked
from lab.transport.parking import Parking
from lab.transport.shm_endpoints import DESCRIPTOR, ShmMappings


class PipeUnread:
    """The messages an shm transport's rank holds unread."""

    parking: Parking
    _shared: ShmMappings
    _read_fd: dict[int, int]
    _partial: dict[int, bytes]
    _arrived: dict[int, deque]  # per peer: (kind, slot, nbytes, tag, payload) read and not consumed
    _drain: Callable[[int, object], None]

    def holds_unread(self, tag: bytes) -> bool:
        """A peer's next message in a mailbox is of a collective before ``tag``'s, or a pipe
        holds a data frame not consumed (:meth:`lab.transport.shm_endpoints.ShmMappings.unread`)."""
        return self._shared.unread(tag)

    @locked
    def unconsumed_tags(self) -> dict[int, list[bytes]]:
        """What was read off the pipes and not received (parked for another mesh, or queued), what
        is still in them, and the next message in each mailbox ring (a peer that took the compiled
        path where this rank took the pipes: a size on either side of the compiled path's threshold)."""
        for peer in self._arrived:
            with contextlib.suppress(PeerLostError):
                self._drain(peer, "diagnosis")
        tags = self.parking.tags()
        for peer, arrived in self._arrived.items():
            if arrived:
                tags.setdefault(peer, []).extend(entry[3] for entry in arrived)
        for peer, pending in self._shared.pending_fingerprints().items():
            tags.setdefault(peer, []).extend(pending)
        return tags

    def queued_bytes(self, peer: int) -> int:
        """Bytes ``peer`` has sent that this rank holds but has not consumed (eager payloads and
        descriptors in its queue, plus what is still in the pipe): what the flood test bounds."""
        in_pipe = struct.unpack("i", fcntl.ioctl(self._read_fd[peer], termios.FIONREAD, b"\0\0\0\0"))[0]
        held = len(self._partial[peer]) + in_pipe
        for _, _, nbytes, _, payload in self._arrived[peer]:
            held += DESCRIPTOR.size + (len(payload) if payload is not None else 0)
        return held
