"""One-shot allreduce: every rank reads every rank's whole tensor and reduces it itself, in rank order."""

from __future__ import annotations

import numpy as np

from kernels.doorbell import INVALID, MISMATCH, OK
from kernels.mailbox_layout import FINGERPRINT_BYTES
from kernels.one_shot import one_shot
from kernels.two_shot import AREA_BYTES, HEADER, MESSAGE_WORD
from lab.algorithms.peers import Peers
from lab.compiled import compiled_as
from lab.ops import Reduction


def compiled_one_shot(peers, buf, reduction, source=None):
    """:func:`allreduce_one_shot` as the compiled plane runs it (:mod:`lab.compiled.plane`: one
    Numba call, ``peers`` the mailboxes, ``buf`` and ``source`` bytes, ``reduction`` coded): the
    same rounds, waits, headers and fold on the same shared scratch, read through the mailboxes'
    view of it (:mod:`kernels.one_shot`), waiting as the mailboxes do (``LAB_COMPILED_SPIN``,
    ``LAB_COMPILED_YIELD``); a failure goes into the mailboxes' status, as a transfer's does,
    and the counts are the message form's."""
    if peers.status != OK:  # (look_back found an earlier collective's message unread)
        return
    if peers.scratch_slot_bytes == 0:
        peers.status = INVALID
        return
    data = buf if source is None else source
    n, rank, scratch = peers.world_size, peers.rank, peers.scratch
    status, peer = one_shot(scratch, rank, n, peers.scratch_slot_bytes, buf, data, reduction,
                            peers.fingerprint, peers.deadline_ns, peers.liveness_fds, peers.hook,
                            peers.spin_limit, peers.yield_limit)
    if status != OK:
        peers.status, peers.failed_peer = status, peer
        if status == MISMATCH:  # what the peer's header says it is in
            header = peer * AREA_BYTES + HEADER
            peers.peer_fingerprint[:] = scratch[header:header + FINGERPRINT_BYTES]
            peers.peer_bytes = scratch.view(np.int64)[(header >> 3) + MESSAGE_WORD]
        return
    for other in range(n):
        if other != rank:
            peers.bytes_sent[other] += buf.size
            peers.bytes_received[other] += buf.size
            peers.messages_sent[other] += 1
            peers.messages_received[other] += 1


@compiled_as(compiled_one_shot)
def allreduce_one_shot(peers: Peers, buf: np.ndarray, reduction: Reduction,
                       source: np.ndarray | None = None) -> None:
    """Reduce every rank's ``source`` (default ``buf``, in place) into ``buf``: each rank folds the
    N whole inputs in rank order 0..N-1 itself, so every rank ends bit-identical, with the same
    bits at any N on any transport (and the bits of two-shot, which folds in the same order).

    On the shm transport's root mesh the ranks read each other's memory
    (``peers.shared_allreduce``, :mod:`lab.transport.peer_memory`): copy the input into our slot
    (not at all for a registered ``source`` out of place, :mod:`lab.symm_mem`), one flag wait
    until every rank's input is there, then reduce all N of them. In rounds of S bytes
    (``LAB_SHM_SCRATCH_BYTES``), one synchronisation each (two-shot: three). Up to
    ``LAB_COMPILED_MAX_BYTES`` the compiled plane runs the same rounds in one Numba call
    (:func:`compiled_one_shot`, this function's compiled face).
    Cost: ⌈T/S⌉·α + about (N+2)T/B, B the copy bandwidth of one core (T in, N·T read, T out),
    against two-shot's 3⌈T/S⌉·α + 4T/B: fewer waits, more reading, so it wins on small tensors.

    Elsewhere (another transport, a sub-mesh), the same fold over messages: N-1 steps in which
    rank r sends its whole input to rank r+s and takes rank r-s's, then the fold. Cost:
    (N-1)·α + (N-1)·T·β, with N·T of scratch. Either way each rank sends and receives (N-1)·T
    bytes (on shm ``mesh.stats()`` counts what the messages would carry, as ``lab.sim`` records).

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    source = buf if source is None else source
    shared = getattr(peers, "shared_allreduce", None)
    if shared is not None and shared(buf, reduction, one_shot=True, source=source):
        return
    n, rank = peers.world_size, peers.rank
    copies = np.empty_like(buf, shape=(n, buf.size))  # row p: rank p's input (virtual when recorded)
    copies[rank] = source
    # Step 1: our input to every other rank, every other rank's to us.
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        peers.sendrecv_buffer(dst, source, src, copies[src])
    # Step 2: fold the N inputs in rank order 0..N-1 (the order the shm path uses).
    buf[:] = copies[0]
    for src in range(1, n):
        reduction.combine(buf, copies[src])
    reduction.finalize(buf, n)


def shape(world_size: int) -> tuple[float, float]:
    """The message schedule's cost above as (latency steps on the critical path, bytes through the
    busiest rank per tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return n - 1, n - 1


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes (``python -m lab``'s check)."""
    return (world_size - 1) * total, "T(N-1)"
