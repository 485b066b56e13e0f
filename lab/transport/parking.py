"""Messages of another context, held until their receive comes (MPI's unexpected-message queue),
and the check of what arrives: one mechanism, every transport.

Parent and sub-mesh traffic (and point-to-point tags) share each pair's channel, and a rank may
enter them in another order than its peer: a receive that meets a message of another context
holds it aside (:meth:`Parking.park`), and the first receive of that context takes it
(:meth:`Parking.take`) before it reads the channel again. What is held is bounded, per peer
(``MAX_PARKED_BYTES_PER_PEER``) and in all (``MAX_PARKED_BYTES``): a message that would pass a
bound is a :class:`lab.LabError` naming it, not back-pressure (a held message is only taken by a
later receive, and what this one waits for is behind it on the same channel, so not reading it
would only turn the overflow into a silent wait until the deadline). A message of the receive's
own context must carry its exact tag and byte count (:func:`check_arrival`). A message held of a
collective numbered before the one a receive of its context is in will never be taken: a call
left it unread (:func:`lab.fingerprint.earlier`, which a collective looks for before its first
transfer).

Per rank, inside a transport's receive from ``peer`` for ``tag``::

    held = parking.take(peer, tag)                 # (tag, what the transport kept) or None
    if held is None:
        got_tag, payload = read_the_channel()
        if not same_context(got_tag, tag):
            parking.park(peer, got_tag, payload.nbytes, payload, where)   # may raise LabError
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lab import fingerprint
from lab.errors import CollectiveMismatchError, LabError
from lab.transport.base import CONTEXT_BYTES, TagMismatch, same_context

#: The most payload bytes held from one peer, and from all peers together (module globals: a
#: program that enters its meshes far apart on purpose may raise them, in every rank).
MAX_PARKED_BYTES_PER_PEER = 1 << 30
MAX_PARKED_BYTES = 4 << 30


def size_text(nbytes: int) -> str:
    """``nbytes`` as people read it (1.5 MiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def check_arrival(rank: int, peer: int, tag: bytes, got_tag: bytes, expected_bytes: int, nbytes: int,
                  where: object, what: str = "") -> None:
    """A message of the receive's context from ``peer`` must carry its tag (else
    :class:`TagMismatch`, which the mesh describes) and its byte count (else a
    CollectiveMismatchError); ``what`` names it where the count alone does not (a segment)."""
    if got_tag != tag:
        raise TagMismatch(peer, tag, got_tag)
    if nbytes != expected_bytes:
        raise CollectiveMismatchError(
            f"rank {rank} expected {expected_bytes} bytes from rank {peer} in {where}, "
            f"got {what or nbytes}")


class Parking:
    """What rank ``rank`` holds of other contexts, per peer, in arrival order (see the module's
    docstring). ``entry`` is whatever the transport keeps of a message (a copy of its payload,
    with the transport's own fields); the parking counts only its ``nbytes``."""
    def __init__(self, rank: int, peers: Iterable[int]) -> None:
        self.rank = rank
        self._held: dict[int, list[tuple[bytes, int, Any]]] = {p: [] for p in peers}
        self._bytes = dict.fromkeys(self._held, 0)
        self.messages = 0  # held now, from every peer (0: nothing to look at)

    def bound_passed(self, peer: int, nbytes: int) -> str | None:
        """The bound that holding ``nbytes`` more from ``peer`` would pass, as the error names it,
        or None while there is room."""
        held, total = self._bytes[peer], sum(self._bytes.values())
        if held + nbytes > MAX_PARKED_BYTES_PER_PEER:
            return (f"MAX_PARKED_BYTES_PER_PEER ({size_text(MAX_PARKED_BYTES_PER_PEER)}; "
                    f"{size_text(held)} held from it already)")
        if total + nbytes > MAX_PARKED_BYTES:
            return f"MAX_PARKED_BYTES ({size_text(MAX_PARKED_BYTES)} from all peers; {size_text(total)} held already)"
        return None

    def room_for(self, peer: int, got_tag: bytes, nbytes: int, where: object) -> None:
        """Raise LabError if ``peer``'s message of ``nbytes`` (tag ``got_tag``) cannot be held: a
        transport asks before it reads a large payload off its channel."""
        bound = self.bound_passed(peer, nbytes)
        if bound is None:
            return
        context = int.from_bytes(got_tag[:CONTEXT_BYTES], "little")  # (the mesh's id and the tag)
        raise LabError(
            f"rank {self.rank}: rank {peer} sent a {size_text(nbytes)} message of another mesh or tag (context "
            f"{context:016x}) while this rank waited in {where}; holding it until its receive would exceed "
            f"lab.transport.parking.{bound}. The ranks enter the collectives of their meshes and sub-meshes in "
            "orders too far apart: enter them in the same order, or raise the bound in every rank")

    def park(self, peer: int, got_tag: bytes, nbytes: int, entry: Any, where: object) -> None:
        """Hold ``entry`` (``nbytes`` of payload, tag ``got_tag``) from ``peer`` until a receive of
        its context; LabError if a bound would be passed (:meth:`room_for`)."""
        self.room_for(peer, got_tag, nbytes, where)
        self._held[peer].append((got_tag, nbytes, entry))
        self._bytes[peer] += nbytes
        self.messages += 1

    def take(self, peer: int, tag: bytes) -> tuple[bytes, Any] | None:
        """The first message held from ``peer`` in ``tag``'s context, as ``(its tag, entry)``, no
        longer held; None if there is none."""
        held = self._held[peer]
        index = next((i for i, (got, _, _) in enumerate(held) if same_context(got, tag)), None)
        if index is None:
            return None
        got_tag, nbytes, entry = held.pop(index)
        self._bytes[peer] -= nbytes
        self.messages -= 1
        return got_tag, entry

    def first(self, peer: int, tag: bytes) -> bytes | None:
        """The tag of the first message held from ``peer`` in ``tag``'s context (None: none)."""
        return next((got for got, _, _ in self._held[peer] if same_context(got, tag)), None)

    def held_bytes(self, peer: int) -> int:
        """Payload bytes held from ``peer``."""
        return self._bytes[peer]

    def tags(self) -> dict[int, list[bytes]]:
        """The tags of the messages held, per peer that has any, in arrival order."""
        return {peer: [got for got, _, _ in held] for peer, held in self._held.items() if held}


def raise_if_behind(rank: int, pending: Mapping[int, list[bytes]], tag: bytes, queue: str,
                    where: object) -> None:
    """Raise CollectiveMismatchError if ``pending`` (tags of messages waiting, by sender) holds one
    of this mesh's collectives not later than ``tag``'s on ``queue``, the other queue than the one
    rank ``rank`` waits on (a message that will never be received where it is)."""
    context, _, seq = fingerprint.FINGERPRINT.unpack_from(tag)[:3]
    for peer, tags in pending.items():
        for got in tags:
            got_context, p2p_tag, got_seq, collective = fingerprint.FINGERPRINT.unpack_from(got)[:4]
            if got_context == context and collective and not p2p_tag and got_seq <= seq:
                why = (": the ranks disagree on which path it takes (LAB_COMPILED_MAX_BYTES?)"
                       if got[:fingerprint.FINGERPRINT.size] == tag[:fingerprint.FINGERPRINT.size] else
                       ", which this rank never received" if got_seq < seq else "")
                raise CollectiveMismatchError(
                    f"rank {rank} is in {fingerprint.describe(tag)} ({where}); rank {peer} sent "
                    f"{fingerprint.describe(got)} through {queue}{why}")
