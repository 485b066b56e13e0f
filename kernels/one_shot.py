"""The one-shot allreduce over a shared scratch, in nopython mode: a whole call, every round, in one
compiled function.

The scratch is :mod:`lab.transport.peer_memory`'s (its control areas, :mod:`kernels.two_shot`'s
counters and headers, then one slot per rank, then one arena per rank); the Python path,
``SharedScratch.one_shot``, walks the same rounds with the same counters, so the two interleave
on a mesh, and with two-shot's rounds too. Rank r of N, per round of at most ``slot_bytes``
(a multiple of every item size) of the tensor:

1. wait until every rank is DONE with the last round (our slot is free);
2. copy the round into our slot (or, for a registered input, name where it lies in our arena),
   write our header (fingerprint, message bytes, source offset, round bytes), publish FILLED;
3. wait for every rank's FILLED and compare its header with ours (a difference: MISMATCH);
4. fold the round from the N inputs in rank order 0..N-1 into ``out``: input 0 copied, then
   ``reduction.combine`` with inputs 1..N-1, then ``reduction.finalize``; publish DONE.

A registered input is read in place by the peers, so at the end its rank waits until every peer
is DONE with the last round (the caller may write the input once the call returns).

The rounds completed are our own DONE counter (every rank's agree), so nothing of the Python
path's state crosses over. ``out`` and ``source`` are bytes; ``reduction`` is any value with
``combine`` and ``finalize`` on bytes (:func:`kernels.coded.coded_reduction`).

    status, peer = one_shot(scratch, rank, world_size, slot_bytes, out, source, reduction,
                            fingerprint, deadline_ns, liveness_fds, hook, spin_limit, yield_limit)
    # OK: out holds the reduction; SILENCE or PEER_LOST: ``peer`` fell silent or died;
    # MISMATCH: ``peer``'s header (kernels.two_shot.HEADER of its area) is another collective's

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.doorbell import MISMATCH, OK
from kernels.libc import address_of, memcpy
from kernels.two_shot import (
    AREA_BYTES,
    DONE,
    FILLED,
    HEADER,
    MESSAGE_WORD,
    ROUND_WORD,
    SOURCE_WORD,
    control_bytes,
    counter,
    publish,
    wait_all,
)


@njit(cache=True, nogil=True)
def registered_at(scratch, rank, world_size, slot_bytes, source):
    """Where ``source`` (bytes) starts in ``scratch`` if it lies whole in ``rank``'s arena, else -1
    (an empty one too: nothing to read in place)."""
    arenas = control_bytes(world_size) + world_size * slot_bytes
    arena_bytes = (scratch.size - arenas) // world_size
    mine = arenas + rank * arena_bytes
    start = address_of(source) - address_of(scratch)
    if source.size == 0 or start < mine or start + source.size > mine + arena_bytes:
        return -1
    return start


@njit(cache=True, nogil=True)
def _headers_match(words, world_size, fingerprint_words, message_bytes, round_bytes, sources):
    """Every rank's header against ours: -1 and ``sources`` filled in, or the first rank that differs."""
    for peer in range(world_size):
        header = (peer * AREA_BYTES + HEADER) >> 3
        for i in range(4):
            if words[header + i] != fingerprint_words[i]:
                return peer
        if words[header + MESSAGE_WORD] != message_bytes or words[header + ROUND_WORD] != round_bytes:
            return peer
        sources[peer] = words[header + SOURCE_WORD]
    return -1


@njit(cache=True, nogil=True)
def one_shot(scratch, rank, world_size, slot_bytes, out, source, reduction, fingerprint, deadline_ns,
             liveness_fds, hook, spin_limit, yield_limit):
    """``out`` = every rank's ``source`` reduced in rank order (see the module docstring); ``source``
    may be ``out`` (in place: always copied in). Returns ``(status, peer)``: ``(OK, -1)`` or the
    peer that fell silent (SILENCE), died (PEER_LOST) or is in another collective (MISMATCH).
    The waits spin ``spin_limit`` times, then yield ``yield_limit`` times, then nap."""
    n, nbytes = world_size, out.size
    words = scratch.view(np.int64)
    fingerprint_words = fingerprint.view(np.int64)
    registered = -1 if address_of(source) == address_of(out) else registered_at(
        scratch, rank, n, slot_bytes, source)
    own_header = (rank * AREA_BYTES + HEADER) >> 3
    slot = control_bytes(n) + rank * slot_bytes
    sources = np.empty(n, np.int64)
    rounds = counter(scratch, rank, DONE)
    lo = 0
    while True:  # an empty tensor: one empty round (the headers still meet)
        hi = min(nbytes, lo + slot_bytes)
        goal = rounds + 1
        # Step 1: our slot is free once every rank is done with the last round.
        status, peer = wait_all(scratch, rank, n, DONE, goal - 1, deadline_ns, liveness_fds, hook,
                                fingerprint, spin_limit, yield_limit)
        if status != OK:
            return status, peer
        # Step 2: our input where the peers read it, our header, FILLED.
        at = registered + lo
        if registered < 0:
            at = slot
            memcpy(address_of(scratch) + slot, address_of(source) + lo, hi - lo)
        words[own_header:own_header + 4] = fingerprint_words
        words[own_header + MESSAGE_WORD], words[own_header + SOURCE_WORD] = nbytes, at
        words[own_header + ROUND_WORD] = hi - lo
        publish(scratch, rank, n, FILLED, goal)
        # Step 3: the one synchronisation: every rank's input of this round, of this collective.
        status, peer = wait_all(scratch, rank, n, FILLED, goal, deadline_ns, liveness_fds, hook, fingerprint,
                                spin_limit, yield_limit)
        if status != OK:
            return status, peer
        peer = _headers_match(words, n, fingerprint_words, nbytes, hi - lo, sources)
        if peer >= 0:
            return MISMATCH, peer
        # Step 4: the fold in rank order 0..N-1, the Python path's, into out; DONE.
        memcpy(address_of(out) + lo, address_of(scratch) + sources[0], hi - lo)  # (libc's: no temporary)
        round_out = out[lo:hi]
        for peer in range(1, n):
            reduction.combine(round_out, scratch[sources[peer]:sources[peer] + hi - lo])
        reduction.finalize(round_out, n)
        publish(scratch, rank, n, DONE, goal)
        rounds, lo = goal, hi
        if lo >= nbytes:
            break
    if registered >= 0:  # the caller may write its input next: wait until no peer reads it
        return wait_all(scratch, rank, n, DONE, rounds, deadline_ns, liveness_fds, hook, fingerprint,
                        spin_limit, yield_limit)
    return OK, -1
