"""Messages a call left unread, as errors. Ranks that disagree on a root may each only send, and
return: nothing they received tells them, but the message each left waits unread at a peer.

- Before a collective's first transfer (:func:`raise_if_stray`, from
  :meth:`lab.comm.exchange.Exchange.collective`): a message of an earlier collective of its mesh that
  arrived and was not received (:meth:`lab.transport.base.Transport.stray`; a glance where nothing
  waits: on shm the mailboxes' rings and the pipes' counters) is a ``CollectiveMismatchError``
  naming it. The compiled path looks too (``kernels.rings.look_back``: :func:`stray_error`).
- Where no peer may still send this rank something it will receive, at the end of a pool's run
  and at ``mesh.close()`` (:func:`raise_if_unread`): a message of a collective this rank made, or
  a point-to-point one, that arrived and was not received.

    unread.raise_if_stray(exchange, transport.stray(tag))
    unread.raise_if_unread(channels, membership.who, "closed the mesh")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from lab import fingerprint
from lab.compiled.plane import SEQ
from lab.errors import CollectiveMismatchError, LabError

if TYPE_CHECKING:
    from lab.comm.channels import Channels


class Mismatching(Protocol):
    """What a stray's error takes of its mesh (:class:`lab.comm.exchange.Exchange`)."""

    clean: bool

    def mismatch(self, src: int, got: bytes, expected: bytes | None = None) -> CollectiveMismatchError:
        ...


def stray_error(exchange: Mismatching, src: int, got: bytes,
                expected: bytes | None = None) -> CollectiveMismatchError:
    """Global rank ``src``'s message ``got``, of an earlier collective, waits unread where this rank
    is in ``expected`` (its own tag; default: its current one)."""
    return CollectiveMismatchError(f"{exchange.mismatch(src, got, expected)}, which this rank never received")


def raise_if_stray(exchange: Mismatching, found: tuple[int, bytes] | None) -> None:
    """Raise the error of the stray ``found`` (``(sender, its tag)``), if any: the channels are
    unclean from then on (the message stays where it is)."""
    if found is not None:
        exchange.clean = False
        raise stray_error(exchange, *found)


def raise_if_unread(channels: Channels, who: Callable[..., str], when: str) -> None:
    """Raise if a message has arrived on ``channels`` and was not received, of a collective this
    rank made (on any of its meshes) or point-to-point: ``CollectiveMismatchError`` naming the
    collective that sent it (``LabError`` for a point-to-point send), saying this rank (``who()``)
    did ``when`` (``"closed the mesh"``) with it unread.

    Looks without waiting: a message sent after it returns is not seen, but where ranks each left
    one for another, the last to look sees one. Nothing is looked at once a failure left the
    channels unclean (its messages may be anywhere; the program had its error), while a call is in
    flight, or while an issue order of its own is open (a torch group's: its calls run on threads
    of their own). A message of a collective this rank never made is its sender's to report: it
    waits for this rank there, and fails.
    """
    issue = channels.issue
    if channels.closed or not channels.clean or issue.in_flight or not issue.alone:
        return
    unread = []
    for src, tags in channels.transport.unconsumed_tags().items():
        for got in tags:
            context, _, seq, collective = fingerprint.FINGERPRINT.unpack_from(got)[:4]
            ledger = channels.ledgers.get(context)
            if not collective or ledger is None or seq <= ledger[SEQ]:
                unread.append((collective == 0, src, got))
    if not unread:
        return
    point_to_point, src, got = min(unread, key=lambda found: found[0])  # (a collective's first)
    channels.clean = False
    if point_to_point:
        _, tag, seq = fingerprint.FINGERPRINT.unpack_from(got)[:3]
        raise LabError(f"{who()} {when} with a message it never received: {who(src)} sent point-to-point "
                       f"message #{seq} of tag {tag}")
    raise CollectiveMismatchError(f"{who()} {when} with a message it never received: {who(src)} sent "
                                  f"{fingerprint.describe(got)}")
