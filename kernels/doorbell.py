"""How a compiled wait waits: its outcomes, its policy, and the doorbell it sleeps on.

A waiter spins ``spin_limit`` times on acquire loads, then yields ``yield_limit`` times, then
sleeps on its doorbell (an int32 futex word) for at most ``FUTEX_TIMEOUT_NS`` a nap; a peer
that publishes something rings the doorbell of a waiter whose sleeping flag (an int64) is up.
"I raise my flag, then look for progress" against "I publish, then look at the flag" is a
store-then-load on both sides (Dekker), which release/acquire does not order: a seq_cst fence
on each side does, so a waiter that missed the publication is always woken. The mailboxes
(:mod:`kernels.rings`) and the two-shot's flags (:mod:`kernels.two_shot`) both wait this way;
``bell`` and ``flag`` are indices into the region viewed as int32 and as int64.

    rung = raise_flag(words, doorbells, bell, flag)          # the waiter, out of spins and yields
    nap(words, doorbells, bell, flag, rung, progressed=look_again())
    ...
    store_release(words, counter, n + 1); ring(words, doorbells, bell, flag)   # the publisher

This module imports nothing from ``lab``.
"""

from __future__ import annotations

from numba import njit

from kernels.atomics import atomic_add, fence_seq_cst, load_acquire, store_release
from kernels.libc import futex_wait, futex_wake

# --- outcomes -------------------------------------------------------------------------------------

OK = 0
MISMATCH = 1  # a peer's fingerprint or byte count differs from ours (peer_fingerprint, peer_bytes)
SILENCE = 2  # no progress from failed_peer for deadline_ns
PEER_LOST = 3  # failed_peer's liveness pipe hung up before its message came
INVALID = 4  # a usage error: a peer rank out of range or our own, a bad fingerprint, items over a slot
STRAY = 5  # failed_peer's next message is of an earlier collective of ours, left unread (peer_fingerprint)
STATUS_NAMES = ("ok", "mismatch", "silence", "peer lost", "invalid", "stray")

# --- policy ---------------------------------------------------------------------------------------

# Spinning wins when every rank has a core (a wake through the futex costs microseconds), and
# loses badly when ranks outnumber cores (a spinner burns the time slice its peer needs), so by
# default a wait spins only briefly: a benchmark on dedicated cores sets spin_limit high. On an
# oversubscribed machine yielding beats both spinning and sleeping (it hands the core to the
# peer at once): the lab's compiled plane opens its mailboxes with 50 spins and 1,000 yields
# (lab/compiled/plane.py, measured there).
DEFAULT_SPIN_LIMIT = 500  # pause-spins before yielding (about 20 microseconds)
DEFAULT_YIELD_LIMIT = 8  # sched_yield calls before sleeping on the futex
FUTEX_TIMEOUT_NS = 1_000_000  # a sleep's longest nap: bounds a missed wake and the clock checks
LIVENESS_INTERVAL_NS = 1_000_000  # how often a wait polls its peers' liveness pipes
CLOCK_EVERY_SPINS = 256  # a spinning wait reads the clock only this often

# --- the doorbell ---------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def raise_flag(words, doorbells, bell, flag):
    """Raise our sleeping flag ``words[flag]``; returns the doorbell's value to nap on. The
    caller then looks for progress once more and calls :func:`nap` with what it found."""
    rung = load_acquire(doorbells, bell)
    store_release(words, flag, 1)
    fence_seq_cst()  # the flag's store before the caller's look (pairs with the fence in ring)
    return rung


@njit(cache=True, nogil=True)
def nap(words, doorbells, bell, flag, rung, progressed):
    """Sleep on ``doorbells[bell]`` while it still reads ``rung`` (at most FUTEX_TIMEOUT_NS),
    unless the look after :func:`raise_flag` ``progressed``; then lower the flag."""
    if not progressed:
        futex_wait(doorbells, bell, rung, FUTEX_TIMEOUT_NS)
    store_release(words, flag, 0)


@njit(cache=True, nogil=True)
def ring(words, doorbells, bell, flag):
    """After publishing: wake the owner of ``doorbells[bell]`` if its flag ``words[flag]`` is up."""
    fence_seq_cst()  # the publication before the flag's load (pairs with the fence in raise_flag)
    if load_acquire(words, flag) != 0:
        atomic_add(doorbells, bell, 1)
        futex_wake(doorbells, bell, 1)
