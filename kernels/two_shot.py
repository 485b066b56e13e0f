"""The flags of a shared-buffer two-shot allreduce, in nopython mode: publish a counter, wait for one.

A two-shot allreduce over memory every rank maps (``lab.transport.peer_memory``) needs no messages,
only three counters per rank that say how far it got, and a header that says what it is doing.
Each sits on its own 64-byte line of the shared region, written by its rank alone::

    per rank r (AREA_BYTES = 6 lines)   FILLED   (int64: rounds whose input r has published)
                                        REDUCED  (int64: rounds whose slice r has reduced and published)
                                        DONE     (int64: rounds r has copied every slice out of)
                                        HEADER   (fingerprint[32], message bytes, source offset,
                                                  round bytes: int64 words; valid once FILLED moves)
                                        DOORBELL (int32: the futex word r sleeps on)
                                        SLEEPING (int64: 1 while r may be asleep on its doorbell)

Counters start at 0 and only grow. A rank writes its header and data with plain stores, then
:func:`publish` stores the counter with release semantics; a peer that sees it with
:func:`wait_all`'s acquire load sees everything written before it. :func:`publish` then rings the
doorbell of every peer whose SLEEPING flag is up (:mod:`kernels.doorbell`: the sleep and the wake
the mailboxes use).

Waiting spins (``pause``), then yields, then sleeps on the doorbell (at most 1 ms a nap); it
reads the clock to give up after ``deadline_ns`` (0: never) and polls each awaited peer's liveness
pipe every millisecond (a pipe whose writer died: the peer is lost, unless its counter moved after
all). :func:`wait_all` returns a status and the peer it concerns; a wait given a hook calls it
as the mailboxes' waits do (:func:`kernels.hook.call_hook`: signal handlers run, the pipes are
drained), and what the hook raises is all that propagates.

Per rank, after copying its input into its slot and writing its header::

    publish(region, rank, world_size, FILLED, round + 1)
    status, peer = wait_all(region, rank, world_size, FILLED, round + 1, deadline_ns, liveness_fds, 0, fingerprint,
                            DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT)
    # status OK: every rank's input of this round is readable; SILENCE or PEER_LOST: ``peer``'s is not

:func:`wait_word` and :func:`store_word` wait for and store any int64 word of the region the
same way (``lab.symm_mem``'s signal pads, which lie in the arenas).

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.atomics import cpu_relax, load_acquire, store_release
from kernels.doorbell import (
    CLOCK_EVERY_SPINS,
    DEFAULT_SPIN_LIMIT,
    DEFAULT_YIELD_LIMIT,
    LIVENESS_INTERVAL_NS,
    OK,
    PEER_LOST,
    SILENCE,
    nap,
    raise_flag,
    ring,
)
from kernels.hook import call_hook, hook_due
from kernels.libc import monotonic_ns, peer_gone, sched_yield

LINE = 64
FILLED, REDUCED, DONE, HEADER, DOORBELL, SLEEPING = (i * LINE for i in range(6))
AREA_BYTES = 6 * LINE
# The header's int64 words after the 4 of the fingerprint.
MESSAGE_WORD, SOURCE_WORD, ROUND_WORD = 4, 5, 6


@njit(cache=True, nogil=True)
def control_bytes(world_size):
    """Bytes of the control areas of ``world_size`` ranks, rounded up to a 4 KiB page (what follows
    starts page-aligned)."""
    return -(-world_size * AREA_BYTES // 4096) * 4096


@njit(cache=True, nogil=True)
def counter(region, rank, field):
    """``rank``'s counter ``field`` (FILLED, REDUCED, DONE), as an acquire load."""
    return load_acquire(region.view(np.int64), (rank * AREA_BYTES + field) >> 3)


@njit(cache=True, nogil=True)
def publish(region, rank, world_size, field, value):
    """Store our counter ``field`` = ``value`` (release: our earlier writes go first), then wake the
    peers that sleep."""
    words, doorbells = region.view(np.int64), region.view(np.int32)
    store_release(words, (rank * AREA_BYTES + field) >> 3, value)
    for peer in range(world_size):
        if peer != rank:
            area = peer * AREA_BYTES
            ring(words, doorbells, (area + DOORBELL) >> 2, (area + SLEEPING) >> 3)


@njit(cache=True, nogil=True)
def _sleep(words, doorbells, rank, index, target):
    """Nap on our doorbell (at most 1 ms) unless the counter at ``index`` got there."""
    area = rank * AREA_BYTES
    bell, flag = (area + DOORBELL) >> 2, (area + SLEEPING) >> 3
    rung = raise_flag(words, doorbells, bell, flag)
    nap(words, doorbells, bell, flag, rung, load_acquire(words, index) >= target)


@njit(cache=True, nogil=True)
def _wait(words, doorbells, rank, peer, field, target, deadline_ns, liveness_fds, hook, fingerprint,
          spin_limit=DEFAULT_SPIN_LIMIT, yield_limit=DEFAULT_YIELD_LIMIT):
    """Wait until ``peer``'s counter ``field`` is at least ``target``: OK, SILENCE or PEER_LOST."""
    return _wait_at(words, doorbells, rank, peer, (peer * AREA_BYTES + field) >> 3, target, deadline_ns,
                    liveness_fds, hook, fingerprint, spin_limit, yield_limit)


@njit(cache=True, nogil=True)
def _wait_at(words, doorbells, rank, peer, index, target, deadline_ns, liveness_fds, hook, fingerprint,
             spin_limit=DEFAULT_SPIN_LIMIT, yield_limit=DEFAULT_YIELD_LIMIT):
    """Wait until int64 word ``index`` of the region, which ``peer`` writes, is at least ``target``:
    OK, SILENCE or PEER_LOST. Every millisecond it polls ``peer``'s liveness pipe and, where due,
    calls ``hook`` with ``fingerprint`` (:func:`kernels.hook.call_hook`: it drains
    ``liveness_fds``, the pipes). It spins ``spin_limit`` times, then yields ``yield_limit``
    times, then naps (the compiled one-shot passes the compiled plane's policy)."""
    rounds = 0
    started = checked = hooked = monotonic_ns()
    while load_acquire(words, index) < target:
        rounds += 1
        if rounds <= spin_limit:
            cpu_relax()
            if rounds % CLOCK_EVERY_SPINS != 0:
                continue
        elif rounds <= spin_limit + yield_limit:
            sched_yield()
        else:
            _sleep(words, doorbells, rank, index, target)
        now = monotonic_ns()
        if deadline_ns > 0 and now - started >= deadline_ns:
            return SILENCE if load_acquire(words, index) < target else OK
        if now - checked >= LIVENESS_INTERVAL_NS:
            checked = now
            if peer_gone(liveness_fds[peer]):  # a last look: what it published before it died still counts
                return PEER_LOST if load_acquire(words, index) < target else OK
            if hook_due(hook, liveness_fds, now, hooked):
                hooked = now
                call_hook(hook, fingerprint)
    return OK


@njit(cache=True, nogil=True)
def wait_all(region, rank, world_size, field, target, deadline_ns, liveness_fds, hook, fingerprint,
             spin_limit, yield_limit):
    """Wait until every other rank's counter ``field`` is at least ``target`` (``deadline_ns``
    without progress per peer, 0: never; ``liveness_fds[r]``: rank r's pipe; ``hook``, the
    limits: see :func:`_wait_at`). Returns ``(status, peer)``: ``(OK, -1)``, or the first peer
    that fell silent (SILENCE) or died (PEER_LOST). Every argument is required: a call from Python
    that left one to its default would go through Numba's slow dispatch every time (about 100 µs,
    against 2 µs)."""
    words, doorbells = region.view(np.int64), region.view(np.int32)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        status = _wait(words, doorbells, rank, peer, field, target, deadline_ns, liveness_fds, hook,
                       fingerprint, spin_limit, yield_limit)
        if status != OK:
            return status, peer
    return OK, -1


@njit(cache=True, nogil=True)
def wait_one(region, rank, peer, field, target, deadline_ns, liveness_fds, hook, fingerprint):
    """Wait until ``peer``'s counter ``field`` is at least ``target``: OK, SILENCE or PEER_LOST."""
    return _wait(region.view(np.int64), region.view(np.int32), rank, peer, field, target, deadline_ns,
                 liveness_fds, hook, fingerprint)


@njit(cache=True, nogil=True)
def wait_word(region, rank, peer, offset, target, deadline_ns, liveness_fds, hook, fingerprint):
    """Wait until the int64 at byte ``offset`` of the region, which ``peer`` writes, is at least
    ``target`` (a signal pad's counter, :mod:`lab.symm_mem`): OK, SILENCE or PEER_LOST."""
    return _wait_at(region.view(np.int64), region.view(np.int32), rank, peer, offset >> 3, target,
                    deadline_ns, liveness_fds, hook, fingerprint)


@njit(cache=True, nogil=True)
def store_word(region, peer, offset, value):
    """Store the int64 at byte ``offset`` = ``value`` (release: our earlier writes go first), then
    wake ``peer`` if it sleeps (it may wait on that word)."""
    words, doorbells = region.view(np.int64), region.view(np.int32)
    store_release(words, offset >> 3, value)
    area = peer * AREA_BYTES
    ring(words, doorbells, (area + DOORBELL) >> 2, (area + SLEEPING) >> 3)
