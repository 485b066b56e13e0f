"""The mailboxes' transfers, in nopython mode: a piece into a peer's ring, a piece out of ours, and
waiting when neither can move.

Memory ordering. ``s`` writes slot n (header and payload, plain stores), then publishes it with a
release store ``sent = n + 1``; ``d`` sees it with an acquire load of ``sent``, so every store
to the slot happens-before ``d``'s reads of it. ``d`` reads the slot (copy or combine), then
frees it with a release store ``taken = n + 1``; ``s`` reuses slot n only after an acquire load
shows ``taken > n``, so ``d``'s reads happen-before ``s``'s overwrite. Each counter has one writer,
so no read-modify-write is needed: release/acquire pairs are the whole protocol (on x86 they
compile to plain ``mov``; the atomics are there so LLVM neither hoists a flag load out of a wait
loop nor sinks a slot store past the publication). A waiter sleeps on its doorbell
(:mod:`kernels.doorbell`), and the side that makes progress rings it.

Waiting. A wait spins, yields, then sleeps (:mod:`kernels.doorbell`'s policy). While waiting it
reads the monotonic clock: past ``deadline_ns`` without progress the status becomes SILENCE;
every millisecond it polls the liveness pipe of each peer it waits for, and a pipe whose writer
died (POLLHUP/POLLERR) makes it PEER_LOST, unless a last look finds the peer's message published
after all; a mailbox with a hook calls it (:mod:`kernels.hook`). Failures never raise nor hang
inside compiled code: ``status`` is set, every later transfer of the collective returns at once.

Looking back. Before a collective's first transfer, :func:`look_back` makes it STRAY if a peer's
next message in our ring is of an earlier collective of ours (a call that left it unread: ranks
that disagreed on a root, each only sending), and calls the hook if the shm transport's pipe
counters say a pipe holds a message not received yet (the hook drains the pipes and raises for
one of an earlier collective): a couple of loads per peer, no system call.

The entry points (:func:`begin`, :func:`send`, :func:`recv`, :func:`recv_fold`, :func:`sendrecv`,
:func:`sendrecv_fold`) take a ``MailboxPeers`` (:mod:`kernels.mailbox`) and a buffer as an address
and byte count, or ``out`` and a reduction to fold into it::

    send(peers, 1, address_of(data), data.nbytes, data.itemsize)   # compiled, rank 0
    recv(peers, 0, address_of(out), out.nbytes, out.itemsize)      # compiled, rank 1

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.atomics import cpu_relax, load_acquire, store_release
from kernels.doorbell import (
    CLOCK_EVERY_SPINS,
    INVALID,
    LIVENESS_INTERVAL_NS,
    MISMATCH,
    OK,
    PEER_LOST,
    SILENCE,
    STRAY,
    nap,
    raise_flag,
    ring,
)
from kernels.hook import call_hook, hook_due
from kernels.libc import address_of, memcpy, monotonic_ns, peer_gone, sched_yield
from kernels.mailbox_layout import (
    DOORBELL,
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    HOOK_CALLED,
    IDLE_ROUNDS,
    IN_CHANNEL,
    LIVENESS_CHECKED,
    MESSAGE_WORD,
    OUT_CHANNEL,
    PIECE_WORD,
    PIPE_SENT,
    PIPE_TAKEN,
    RANK_AREA_BYTES,
    SENT,
    SENT_BY_ME,
    SENT_BY_PEER,
    SLEEPING,
    SLOTS,
    TAKEN,
    TAKEN_BY_ME,
    TAKEN_BY_PEER,
    WAIT_STARTED,
    slot_stride,
)

_NOBODY, _NOTHING, _ONE = np.int64(-1), np.int64(0), np.int64(1)  # not literals: one compilation serves all


@njit(cache=True, nogil=True)
def begin(peers, fingerprint, deadline_ns):
    peers.status, peers.failed_peer, peers.peer_bytes = OK, -1, -1
    peers.deadline_ns = deadline_ns
    if fingerprint.size != FINGERPRINT_BYTES:
        peers.status = INVALID
        return
    for i in range(FINGERPRINT_BYTES):
        peers.fingerprint[i] = fingerprint[i]


@njit(cache=True, nogil=True)
def look_back(peers):
    """Before the collective's first transfer (its fingerprint set by :func:`begin`): STRAY,
    naming the peer and its message, if a peer's next message in our ring is of an earlier
    collective of this context; else, with a hook, call it if a pipe holds a message not received."""
    fingerprint = peers.fingerprint_words
    peer = earlier_in_ring(peers.words, peers.rings[IN_CHANNEL], peers.depth, slot_stride(peers.slot_bytes),
                           fingerprint[0], fingerprint[1])
    if peer >= 0:
        channel, n = peers.rings[IN_CHANNEL, peer], peers.rings[TAKEN_BY_ME, peer]
        _mismatch(peers, peer, channel + SLOTS + (n % peers.depth) * slot_stride(peers.slot_bytes))
        peers.status = STRAY
    elif peers.hook != 0 and unread_on_pipes(peers.words, peers.rings[IN_CHANNEL]) >= 0:
        call_hook(peers.hook, peers.fingerprint)


@njit(cache=True, nogil=True)
def earlier_in_ring(words, in_channels, depth, stride, context_word, seq):
    """The first peer whose next unread message in our ring is in the context ``context_word``
    (a fingerprint's first word) with a number below ``seq``; -1 if none. ``in_channels[p]``:
    where the channel p -> us starts (-1: ourselves); ``stride``: :func:`slot_stride`'s."""
    for peer in range(in_channels.size):
        channel = in_channels[peer]
        if channel < 0:
            continue
        taken = words[(channel + TAKEN) >> 3]  # (ours to write)
        if load_acquire(words, (channel + SENT) >> 3) > taken:
            header = (channel + SLOTS + (taken % depth) * stride) >> 3
            if words[header] == context_word and words[header + 1] < seq:
                return peer
    return -1


@njit(cache=True, nogil=True)
def anything_unread(words, in_channels, depth, stride, context_word, seq):
    """Whether :func:`earlier_in_ring` or :func:`unread_on_pipes` finds a peer: one call from Python."""
    return earlier_in_ring(words, in_channels, depth, stride, context_word, seq) >= 0 \
        or unread_on_pipes(words, in_channels) >= 0


@njit(cache=True, nogil=True)
def unread_on_pipes(words, in_channels):
    """The first peer whose pipe to us holds a data frame we have not consumed, by the shm
    transport's counters (in the pipe, or read and held aside); -1 if none."""
    for peer in range(in_channels.size):
        channel = in_channels[peer]
        if channel < 0:
            continue
        if load_acquire(words, (channel + PIPE_SENT) >> 3) != words[(channel + PIPE_TAKEN) >> 3]:
            return peer
    return -1


@njit(cache=True, nogil=True)
def send(peers, dst, address, nbytes, itemsize):
    if _usable(peers, dst, itemsize, dst, itemsize):
        _exchange(peers, dst, address, nbytes, itemsize, _NOBODY, _NOTHING, _NOTHING, _ONE, peers.region,
                  None)


@njit(cache=True, nogil=True)
def recv(peers, src, address, nbytes, itemsize):
    if _usable(peers, src, itemsize, src, itemsize):
        _exchange(peers, _NOBODY, _NOTHING, _NOTHING, _ONE, src, address, nbytes, itemsize, peers.region,
                  None)


@njit(cache=True, nogil=True)
def recv_fold(peers, src, out, reduction):
    if _usable(peers, src, out.itemsize, src, out.itemsize):
        _exchange(peers, _NOBODY, _NOTHING, _NOTHING, _ONE, src, address_of(out), out.nbytes, out.itemsize,
                  out, reduction)


@njit(cache=True, nogil=True)
def sendrecv(peers, dst, send_address, send_bytes, send_itemsize, src, recv_address, recv_bytes,
             recv_itemsize):
    if _usable(peers, dst, send_itemsize, src, recv_itemsize):
        _exchange(peers, dst, send_address, send_bytes, send_itemsize, src, recv_address, recv_bytes,
                  recv_itemsize, peers.region, None)


@njit(cache=True, nogil=True)
def sendrecv_fold(peers, dst, send_address, send_bytes, send_itemsize, src, out, reduction):
    if _usable(peers, dst, send_itemsize, src, out.itemsize):
        _exchange(peers, dst, send_address, send_bytes, send_itemsize, src, address_of(out), out.nbytes,
                  out.itemsize, out, reduction)


@njit(cache=True, nogil=True)
def _exchange(peers, dst, send_address, send_bytes, send_itemsize, src, recv_address, recv_bytes,
              recv_itemsize, out, reduction):
    """Send ``send_bytes`` at ``send_address`` to ``dst`` (none if -1) and receive ``recv_bytes``
    to ``recv_address`` from ``src`` (none if -1; folded into ``out`` with ``reduction`` unless it
    is None), interleaving pieces, waiting only when neither can move. Pieces are whole items:
    ``slot_bytes`` rounded down to the itemsize. The peers were checked by ``_usable``. A message
    counts once all its pieces are through."""
    send_piece = peers.slot_bytes // send_itemsize * send_itemsize
    recv_piece = peers.slot_bytes // recv_itemsize * recv_itemsize
    # An empty message is one empty piece: its fingerprint is still checked.
    send_pieces = 0 if dst < 0 else 1 if send_bytes == 0 else (send_bytes + send_piece - 1) // send_piece
    recv_pieces = 0 if src < 0 else 1 if recv_bytes == 0 else (recv_bytes + recv_piece - 1) // recv_piece
    sent = got = 0
    waiting = peers.waiting
    waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
    while sent < send_pieces or got < recv_pieces:
        progressed = False
        if sent < send_pieces:
            offset = sent * send_piece
            piece = min(send_piece, send_bytes - offset)
            if _try_send(peers, dst, send_address + offset, piece, send_bytes):
                sent += 1
                progressed = True
                if sent == send_pieces:
                    peers.messages_sent[dst] += 1
        if got < recv_pieces:
            offset = got * recv_piece
            piece = min(recv_piece, recv_bytes - offset)
            if _try_recv(peers, src, recv_address + offset, piece, recv_bytes, out, offset // recv_itemsize,
                         reduction):
                if peers.status != OK:  # a mismatch: the slot stays where it is
                    return
                got += 1
                progressed = True
                if got == recv_pieces:
                    peers.messages_received[src] += 1
        if progressed:
            waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
        else:
            _idle(peers, dst if sent < send_pieces else -1, src if got < recv_pieces else -1)
            if peers.status != OK:
                return


@njit(cache=True)
def _usable(peers, dst, send_itemsize, src, recv_itemsize):
    """Whether a transfer may go ahead: the collective has not failed, and both peers are other
    ranks whose items fit a slot (if not, INVALID naming the bad one)."""
    if peers.status != OK:
        return False
    for peer, itemsize in ((dst, send_itemsize), (src, recv_itemsize)):
        if peer < 0 or peer >= peers.world_size or peer == peers.rank or itemsize > peers.slot_bytes:
            peers.status, peers.failed_peer = INVALID, peer
            return False
    return True


@njit(cache=True, nogil=True)
def _try_send(peers, dst, address, piece_bytes, message_bytes):
    """Put one piece into ``dst``'s ring if a slot is free; False if the ring is full."""
    rings, words, depth = peers.rings, peers.words, peers.depth
    channel, n = rings[OUT_CHANNEL, dst], rings[SENT_BY_ME, dst]
    if n - rings[TAKEN_BY_PEER, dst] >= depth:
        rings[TAKEN_BY_PEER, dst] = load_acquire(words, (channel + TAKEN) >> 3)
        if n - rings[TAKEN_BY_PEER, dst] >= depth:
            return False
    slot = channel + SLOTS + (n % depth) * slot_stride(peers.slot_bytes)
    header, fingerprint = slot >> 3, peers.fingerprint_words
    words[header], words[header + 1] = fingerprint[0], fingerprint[1]
    words[header + 2], words[header + 3] = fingerprint[2], fingerprint[3]
    words[header + PIECE_WORD], words[header + MESSAGE_WORD] = piece_bytes, message_bytes
    memcpy(address_of(words) + slot + HEADER_BYTES, address, piece_bytes)
    rings[SENT_BY_ME, dst] = n + 1
    store_release(words, (channel + SENT) >> 3, n + 1)  # publish: header and payload go first
    peers.bytes_sent[dst] += piece_bytes
    _wake(peers, dst)
    return True


@njit(cache=True, nogil=True)
def _try_recv(peers, src, address, piece_bytes, message_bytes, out, first, reduction):
    """Take one piece from ``src``'s ring if there is one (False if not): copy it to
    ``address``, or fold it into ``out[first:]`` with ``reduction.combine``. A fingerprint or byte
    count that differs from ours sets MISMATCH and leaves the slot (returns True: stop waiting)."""
    rings, words = peers.rings, peers.words
    channel, n = rings[IN_CHANNEL, src], rings[TAKEN_BY_ME, src]
    if n >= rings[SENT_BY_PEER, src]:
        rings[SENT_BY_PEER, src] = load_acquire(words, (channel + SENT) >> 3)
        if n >= rings[SENT_BY_PEER, src]:
            return False
    slot = channel + SLOTS + (n % peers.depth) * slot_stride(peers.slot_bytes)
    header, fingerprint = slot >> 3, peers.fingerprint_words
    if (words[header] != fingerprint[0] or words[header + 1] != fingerprint[1] or
            words[header + 2] != fingerprint[2] or words[header + 3] != fingerprint[3] or
            words[header + PIECE_WORD] != piece_bytes or words[header + MESSAGE_WORD] != message_bytes):
        _mismatch(peers, src, slot)
        return True
    payload = slot + HEADER_BYTES
    if reduction is None:  # pruned when Numba compiles: the None path has no fold at all
        memcpy(address, address_of(words) + payload, piece_bytes)
    elif piece_bytes > 0:
        count = piece_bytes // out.itemsize
        reduction.combine(out[first:first + count],
                          peers.region[payload:payload + piece_bytes].view(out.dtype))
    rings[TAKEN_BY_ME, src] = n + 1
    store_release(words, (channel + TAKEN) >> 3, n + 1)  # free the slot: our reads of it go first
    peers.bytes_received[src] += piece_bytes
    _wake(peers, src)
    return True


@njit(cache=True)
def _mismatch(peers, src, slot):
    """``src``'s message at ``slot`` is not the one we expect: say whose it is and what it is."""
    peers.status, peers.failed_peer = MISMATCH, src
    peers.peer_bytes = peers.words[(slot >> 3) + MESSAGE_WORD]
    for i in range(FINGERPRINT_BYTES):
        peers.peer_fingerprint[i] = peers.region[slot + i]


# --- waiting ---------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _ready(peers, dst, src):
    """A fresh look: can a piece go to ``dst`` or come from ``src`` now (-1: not waited for)?"""
    rings, words = peers.rings, peers.words
    if dst >= 0:
        rings[TAKEN_BY_PEER, dst] = load_acquire(words, (rings[OUT_CHANNEL, dst] + TAKEN) >> 3)
        if rings[SENT_BY_ME, dst] - rings[TAKEN_BY_PEER, dst] < peers.depth:
            return True
    if src >= 0:
        rings[SENT_BY_PEER, src] = load_acquire(words, (rings[IN_CHANNEL, src] + SENT) >> 3)
        if rings[SENT_BY_PEER, src] > rings[TAKEN_BY_ME, src]:
            return True
    return False


@njit(cache=True, nogil=True)
def _idle(peers, dst, src):
    """One round of waiting for ``dst`` (a free slot) or ``src`` (a message): spin, yield or
    sleep by how long it has lasted, then check the deadline and, every millisecond, liveness."""
    waiting = peers.waiting
    waiting[IDLE_ROUNDS] += 1
    rounds = waiting[IDLE_ROUNDS]
    if rounds <= peers.spin_limit:
        cpu_relax()
        if rounds != 1 and rounds % CLOCK_EVERY_SPINS != 0:
            return
    elif rounds <= peers.spin_limit + peers.yield_limit:
        sched_yield()
    else:
        _sleep(peers, dst, src)
    now = monotonic_ns()
    if waiting[WAIT_STARTED] == 0:
        waiting[WAIT_STARTED] = waiting[LIVENESS_CHECKED] = waiting[HOOK_CALLED] = now
        return
    if peers.deadline_ns > 0 and now - waiting[WAIT_STARTED] >= peers.deadline_ns:
        if not _ready(peers, dst, src):
            peers.status, peers.failed_peer = SILENCE, src if src >= 0 else dst
        return
    if now - waiting[LIVENESS_CHECKED] >= LIVENESS_INTERVAL_NS:
        waiting[LIVENESS_CHECKED] = now
        lost = -1
        if src >= 0 and peer_gone(peers.liveness_fds[src]):
            lost = src
        elif dst >= 0 and peer_gone(peers.liveness_fds[dst]):
            lost = dst
        # A last look: what the peer published before it died is still delivered.
        if lost >= 0 and not _ready(peers, dst if dst == lost else -1, src if src == lost else -1):
            peers.status, peers.failed_peer = PEER_LOST, lost
        elif hook_due(peers.hook, peers.liveness_fds, now, waiting[HOOK_CALLED]):
            waiting[HOOK_CALLED] = now
            call_hook(peers.hook, peers.fingerprint)


@njit(cache=True, nogil=True)
def _sleep(peers, dst, src):
    """Nap on our doorbell (at most FUTEX_TIMEOUT_NS) unless a fresh look finds progress."""
    area = peers.rank * RANK_AREA_BYTES
    bell, flag = (area + DOORBELL) >> 2, (area + SLEEPING) >> 3
    rung = raise_flag(peers.words, peers.doorbells, bell, flag)
    nap(peers.words, peers.doorbells, bell, flag, rung, _ready(peers, dst, src))


@njit(cache=True, nogil=True)
def _wake(peers, peer):
    """After publishing to ``peer`` (a piece, or a freed slot): ring its doorbell if it sleeps."""
    area = peer * RANK_AREA_BYTES
    ring(peers.words, peers.doorbells, (area + DOORBELL) >> 2, (area + SLEEPING) >> 3)
