"""What a root mesh and all its sub-meshes share (:class:`Channels`): the transport, one issue
order, the compiled plane with the hook its long waits call, the trace file, the deadline, and
whether the channels are still usable.

    channels = Channels(transport, "shm", recv_timeout_ms=60_000, trace=None, placement=(0, 0, 2))
    Exchange(channels, membership, parents=[])      # one per mesh and sub-mesh (lab.comm.exchange)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from kernels import hook as compiled_hooks
from lab.comm.issue import IssueQueue
from lab.compiled.plane import CompiledPlane
from lab.errors import LabError
from lab.flight import TraceFile
from lab.transport.base import Transport


class Channels:
    """What a root mesh and all its sub-meshes share: the transport, one issue order, the
    compiled plane, the trace file, the deadline, whether the channels are still usable, and
    where this rank is: ``placement``, its (host, local rank, local world size) on the root mesh."""
    def __init__(self, transport: Transport, transport_name: str, recv_timeout_ms: float,
                 trace: TraceFile | None, placement: tuple[int, int, int]) -> None:
        self.transport, self.transport_name, self.recv_timeout_ms, self.trace = \
            transport, transport_name, recv_timeout_ms, trace
        self.placement = placement
        self.issue = IssueQueue(transport.rank)  # shared by every sub-mesh but a torch group's (own_order)
        # What a long wait in the shared memory (the mailboxes, the two-shot) calls: it drains the
        # pipes meanwhile (kernels.hook.call_hook). Held weakly: the hook must not keep us alive.
        park_pending = getattr(transport, "park_pending", None)
        parking = None if park_pending is None else \
            _parking(weakref.WeakMethod(park_pending), _closed_flag(weakref.ref(self)))
        self.hook = 0 if parking is None else compiled_hooks.register_hook(parking)
        weakref.finalize(self, compiled_hooks.unregister_hook, self.hook)
        # Small collectives in one Numba call, where the transport has mailboxes (shm): lab.compiled.plane
        mailbox = getattr(transport, "mailbox", None)
        self.plane = CompiledPlane(mailbox, self.hook) if mailbox is not None else None
        if getattr(transport, "scratch", None) is not None:
            transport.scratch.hook = self.hook
        self.clean = True  # False once a transfer failed half-way: peers may hold its messages
        #: The books (lab.compiled.plane's ledger: its SEQ word, the last collective's number) of each live
        #: mesh by context id: a message of a number past its mesh's was sent by a call this rank
        #: never made (lab.comm.unread.raise_if_unread).
        self.ledgers: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.closed = False
        self.next_context = 1  # past every sub-mesh context id this rank has used (Mesh.split)


def _closed_flag(channels: weakref.ref) -> Callable[[], bool]:
    """Whether the (weakly held) channels are closed, or gone."""
    return lambda: channels() is None or channels().closed


def _parking(park_pending: weakref.WeakMethod, closed: Callable[[], bool]) -> Callable[[bytes], None]:
    """The hook of a transport's ``park_pending`` (while it lives), for the collective whose
    fingerprint a compiled wait hands it; once the mesh is ``closed()``, the wait ends."""
    def hook(tag: bytes) -> None:
        if closed():  # (its descriptors are gone, and may be another file's by now)
            raise LabError("the mesh was closed while this call waited in the shared memory")
        park = park_pending()
        if park is not None:
            park(tag, "a wait in the shared memory")

    return hook
