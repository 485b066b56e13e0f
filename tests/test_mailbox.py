"""Tests for ``kernels.mailbox``: ranks as forked children over one anonymous shared mapping.

A child opens its mailboxes with the compiled ``open_mailbox`` and moves messages through the
proxy's methods (``peers.send_buffer(...)`` from Python: a cached compiled call each); the
allreduce, which folds with a ``coded_reduction`` built inside it, opens the mailboxes inside one
compiled call. The module fixture compiles (or loads from Numba's cache) every signature the
children use, once, in the parent, so a child only runs machine code. This file's own compiled
functions are not cached on purpose: a cached caller holds a copy of the mailbox code, and
Numba's cache would not see an edit of ``kernels/mailbox.py``. A child returns what it
received through a pipe and leaves with ``os._exit``; every rank's output is checked against
what its peers sent (inputs ``index * stride + rank``). Every child is killed if still running
and reaped, whatever happens.

Timing is asserted generously, so it holds on a busy machine: a death must be reported as
PEER_LOST (from the liveness pipe, not from the 30 s deadline), a silence after its deadline and
within ten times it.
"""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Self

import numpy as np
import pytest
from helpers import child_env
from numba import njit, typeof

from kernels import atomics, doorbell, hook, libc, mailbox
from kernels.coded import FAMILY_CODES, OP_CODES, coded_reduction
from kernels.mailbox import MailboxPeers, open_mailbox
from kernels.mailbox_layout import LINE, pending_fingerprints, region_bytes

SLOT = 256
DEPTH = 4
STRIDE = 3
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint16)
RESULT_TIMEOUT_S = 120  # only a hang reaches it
LONG_DEADLINE_NS = 30_000_000_000  # a death must be reported long before this
SUM = OP_CODES["sum"]
# What the folding allreduce runs on: (dtype of the buffer, storage family), float16 as uint16 bits.
FOLDS = {
    "float32": (np.float32, FAMILY_CODES["native"]), "int64": (np.int64, FAMILY_CODES["native"]),
    "float16": (np.uint16, FAMILY_CODES["float16"])}


def fingerprint(seed: int) -> np.ndarray:
    return (np.arange(32) * 7 + seed).astype(np.uint8)


TAG = fingerprint(1)


def data(count: int, rank: int, dtype) -> np.ndarray:
    return (np.arange(count) * STRIDE + rank).astype(dtype)


def sizes(dtype) -> list[int]:
    """Element counts around one slot's worth, and many slots (more than the ring holds)."""
    per_slot = SLOT // np.dtype(dtype).itemsize
    return [0, 1, 7, per_slot - 1, per_slot, per_slot + 1, 10 * per_slot + 3]


def fresh_region(world_size: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, region_bytes(world_size, SLOT, DEPTH)), np.uint8)


@njit
def allreduce_recursive_doubling(region, rank, world_size, buf, tag, deadline_ns, family):
    """Recursive doubling with the standard fold (lab.algorithms.allreduce_recursive_doubling),
    a sum, as one compiled call that opens the mailboxes and builds the reduction itself; every
    fold goes through the mailbox (``recv_buffer``/``sendrecv_buffer`` with the reduction).
    Returns the status and the messages sent and received."""
    peers = open_mailbox(region, rank, world_size, SLOT, DEPTH, np.full(world_size, -1, np.int32))
    reduction = coded_reduction(SUM, family, -1, False)
    peers.begin(tag, deadline_ns)
    n = peers.world_size
    p = 1
    while p * 2 <= n:
        p *= 2
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:  # sits out: hands its tensor over, gets the result back
        peers.send_buffer(rank + 1, buf)
        peers.recv_buffer(rank + 1, buf)
    else:
        if rank < 2 * extra:
            peers.recv_buffer(rank - 1, buf, reduction)
        vrank = rank // 2 if rank < 2 * extra else rank - extra
        mask = 1
        while mask < p:
            v = vrank ^ mask
            partner = 2 * v + 1 if v < extra else v + extra
            peers.sendrecv_buffer(partner, buf.copy(), partner, buf, reduction)
            mask *= 2
        if rank < 2 * extra:
            peers.send_buffer(rank - 1, buf)
    return peers.status, peers.messages_sent.sum(), peers.messages_received.sum()


@njit
def atomics_round_trip(words32, words64):
    """The primitives on both widths (and the clock), inside compiled code."""
    atomics.store_release(words32, 1, 41)
    atomics.store_release(words64, 2, 1 << 40)
    old = atomics.atomic_add(words32, 1, 1)
    atomics.fence_seq_cst()
    atomics.cpu_relax()
    libc.sched_yield()
    return old, atomics.load_acquire(words32, 1), atomics.load_acquire(words64, 2), libc.monotonic_ns()


# --- ranks as forked children -------------------------------------------------------------------


class Ranks:
    """``world_size`` forked children over one fresh shared region, each running ``body(peers)``
    (``peers`` from ``open_mailbox``) and sending back its result (``None`` for a child that
    died). With ``liveness``, rank r holds the only write end of pipe r and every other rank polls
    its read end. On exit every child is killed if still running and reaped."""
    def __init__(self, world_size: int, body, *, slot_bytes: int = SLOT, depth: int = DEPTH,
                 liveness: bool = False) -> None:
        self.world_size, self.body, self.slot_bytes, self.depth = world_size, body, slot_bytes, depth
        self.liveness = liveness
        self.pids: list[int] = []
        self.result_fds: list[int] = []

    def __enter__(self) -> Self:
        region = np.frombuffer(mmap.mmap(-1, region_bytes(self.world_size, self.slot_bytes, self.depth)),
                               np.uint8)
        results = [os.pipe() for _ in range(self.world_size)]
        alive = [os.pipe() for _ in range(self.world_size)] if self.liveness else []
        try:
            for rank in range(self.world_size):
                pid = os.fork()
                if pid == 0:
                    self._child(rank, region, results, alive)
                self.pids.append(pid)
        except BaseException:
            self.__exit__()
            raise
        finally:
            for read, write in results:
                os.close(write)
                self.result_fds.append(read)
            for read, write in alive:
                os.close(read)
                os.close(write)
        return self

    def _child(self, rank: int, region: np.ndarray, results, alive) -> None:
        try:
            for r, (read, write) in enumerate(results):
                os.close(read)
                if r != rank:
                    os.close(write)
            fds = np.full(self.world_size, -1, np.int32)
            for r, (read, write) in enumerate(alive):
                if r == rank:
                    os.close(read)  # our own write end stays open until we die
                else:
                    os.close(write)
                    fds[r] = read
            try:
                peers = open_mailbox(region, rank, self.world_size, self.slot_bytes, self.depth, fds)
                outcome = ("ok", self.body(peers))
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
                outcome = ("error", traceback.format_exc())
            with os.fdopen(results[rank][1], "wb") as out:
                out.write(pickle.dumps(outcome))
        finally:
            os._exit(0)

    def kill(self, rank: int) -> None:
        os.kill(self.pids[rank], signal.SIGKILL)

    def results(self, timeout_s: float = RESULT_TIMEOUT_S) -> list:
        """Every rank's result, in rank order; fails the test if a rank raised or hangs."""
        pending = dict(zip(self.result_fds, range(self.world_size)))
        received: dict[int, bytearray] = {rank: bytearray() for rank in range(self.world_size)}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                pytest.fail(f"ranks {sorted(pending.values())} did not finish within {timeout_s} s")
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    received[pending[fd]] += chunk
                else:
                    del pending[fd]
        outcomes = [
            pickle.loads(received[rank]) if received[rank] else None for rank in range(self.world_size)]
        for rank, outcome in enumerate(outcomes):
            if outcome is not None and outcome[0] == "error":
                pytest.fail(f"rank {rank} raised:\n{outcome[1]}")
        return [None if outcome is None else outcome[1] for outcome in outcomes]

    def __exit__(self, *exc) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)  # not reaped yet, so the pid is still ours
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        for fd in self.result_fds:
            os.close(fd)


def run(world_size: int, body, **options) -> list:
    with Ranks(world_size, body, **options) as ranks:
        return ranks.results()


# --- compile once, before any fork --------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every signature the children use, compiled here or loaded from Numba's cache (children
    inherit the machine code): the proxy's fields and methods for every dtype, through a real
    exchange between two mailboxes of this process, and the allreduce for every fold."""
    region = fresh_region(2)
    fds = np.full(2, -1, np.int32)
    one, other = open_mailbox(region, 0, 2, SLOT, DEPTH, fds), open_mailbox(region, 1, 2, SLOT, DEPTH, fds)
    for peers in (one, other):
        peers.begin(TAG, LONG_DEADLINE_NS)
        peers.spin_limit, peers.yield_limit = peers.spin_limit, peers.yield_limit
    for dtype in DTYPES:
        outgoing, incoming = data(3, 0, dtype), np.zeros(3, dtype)
        other.send_buffer(0, outgoing)  # fits the ring: the sendrecv below finds it there
        one.sendrecv_buffer(1, outgoing, 1, incoming)
        other.recv_buffer(0, incoming)
    assert (one.status, other.status, one.peer_fingerprint.size) == (doorbell.OK, doorbell.OK, 32)
    integer = typeof(0)
    for dtype, _ in FOLDS.values():
        allreduce_recursive_doubling.compile(
            (typeof(one.region), integer, integer, typeof(np.zeros(1, dtype)), typeof(TAG), integer, integer))


# --- the primitives -----------------------------------------------------------------------------


@pytest.mark.slow
def test_primitives():
    words64 = np.zeros(4, np.int64)
    words32 = words64.view(np.int32)
    old, word32, word64, now = atomics_round_trip(words32, words64)
    assert (old, word32, word64) == (41, 42, 1 << 40)
    assert abs(now - time.monotonic_ns()) < 10**9  # the same clock as Python's
    start = time.monotonic()
    libc.futex_wait(words32, 1, 42, 20_000_000)  # unchanged: sleeps until the timeout
    assert time.monotonic() - start >= 0.015
    libc.futex_wait(words32, 1, 7, 10**9)  # changed: returns at once
    assert libc.futex_wake(words32, 1, 1) == 0  # nobody asleep
    read, write = os.pipe()
    try:
        assert not libc.peer_gone(read)
        os.close(write)
        assert libc.peer_gone(read)
        assert not libc.peer_gone(-1)
    finally:
        os.close(read)


def test_region_and_arguments():
    assert not hasattr(region_bytes,
                       "signatures")  # plain Python: the shm transport's parent compiles nothing
    assert region_bytes(2, SLOT, DEPTH) == 2 * 128 + 2 * (128 + DEPTH * (64 + SLOT))
    assert region_bytes(3, 100, 2) % 64 == 0 and region_bytes(1, SLOT, DEPTH) == 128
    size = region_bytes(2, SLOT, DEPTH)
    region = np.frombuffer(mmap.mmap(-1, size + LINE), np.uint8)
    fds = np.full(2, -1, np.int32)
    for rank, world_size, slot_bytes, depth, region_used, used_fds in [
        (2, 2, SLOT, DEPTH, region, fds), (0, 2, 32, DEPTH, region, fds), (0, 2, SLOT, 0, region, fds),
        (0, 2, SLOT, DEPTH, region[:size - LINE], fds), (0, 2, SLOT, DEPTH, region[8:8 + size], fds),
        (0, 2, SLOT, DEPTH, region, fds[:1])]:
        with pytest.raises(ValueError, match="MailboxPeers"):
            open_mailbox(region_used, rank, world_size, slot_bytes, depth, used_fds)
    peers = MailboxPeers(region, 0, 2, SLOT, DEPTH, fds)  # the same compiled constructor
    assert isinstance(peers, MailboxPeers) and typeof(peers) == mailbox.mailbox_peers_type
    assert (peers.rank, peers.world_size, peers.host_of(1), peers.status, peers.failed_peer) == (0, 2, 0, 0,
                                                                                                 -1)
    assert (peers.slot_bytes, peers.depth, peers.liveness_fds.tolist()) == (SLOT, DEPTH, [-1, -1])
    assert (peers.spin_limit, peers.yield_limit) == (doorbell.DEFAULT_SPIN_LIMIT,
                                                     doorbell.DEFAULT_YIELD_LIMIT)
    peers.begin(TAG, 0)
    peers.send_buffer(0, data(3, 0, np.float32))  # to itself: a usage error, reported, not raised
    assert (peers.status, peers.failed_peer) == (doorbell.INVALID, 0)
    peers.begin(TAG, 0)
    peers.recv_buffer(2, np.zeros(3, np.float32))
    assert (peers.status, peers.failed_peer) == (doorbell.INVALID, 2)
    with pytest.raises(TypeError, match="compiled"):
        peers.recv_buffer(1, np.zeros(3, np.float32), reduction=object())
    assert peers.bytes_sent.tolist() == peers.bytes_received.tolist() == [0, 0]
    assert peers.messages_sent.tolist() == peers.messages_received.tolist() == [0, 0]


def test_a_fresh_process_loads_the_mailbox_from_the_cache():
    """What the fixture compiled (cache=True everywhere, libc by symbol name, a structref) loads
    from Numba's cache in another process: nothing compiles there, and nothing warns."""
    probe = f"""
import mmap
import numpy as np
from numba.core.dispatcher import Dispatcher
from kernels import mailbox as mb
from kernels.mailbox_layout import region_bytes
region = np.frombuffer(mmap.mmap(-1, region_bytes(2, {SLOT}, {DEPTH})), np.uint8)
fds = np.full(2, -1, np.int32)
one, other = (mb.open_mailbox(region, rank, 2, {SLOT}, {DEPTH}, fds) for rank in range(2))
one.begin(np.zeros(32, np.uint8), 0)
other.begin(np.zeros(32, np.uint8), 0)
outgoing, incoming = np.arange(100, dtype=np.float32), np.zeros(100, np.float32)
one.send_buffer(1, outgoing)
other.recv_buffer(0, incoming)
assert (outgoing == incoming).all() and other.status == 0 and other.messages_received[0] == 1
stats = [value.stats for value in vars(mb).values() if isinstance(value, Dispatcher)]
print(sum(sum(s.cache_hits.values()) for s in stats), sum(sum(s.cache_misses.values()) for s in stats))
"""
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True,
                          timeout=RESULT_TIMEOUT_S, env=child_env(), cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert "NumbaWarning" not in done.stderr, done.stderr
    hits, misses = map(int, done.stdout.split())
    assert misses == 0 and hits >= 5, (hits, misses)


# --- transfers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_send_recv_every_size(dtype):
    """Rank 0 sends then receives, rank 1 the other way round (a message larger than the ring
    waits for the receiver to drain it); each checks what it got from the other."""
    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner = 1 - peers.rank
        received = []
        for count in sizes(dtype):
            out = np.full(count, 99, dtype)
            if peers.rank == 0:
                peers.send_buffer(partner, data(count, peers.rank, dtype))
                peers.recv_buffer(partner, out)
            else:
                peers.recv_buffer(partner, out)
                peers.send_buffer(partner, data(count, peers.rank, dtype))
            received.append(out)
        return peers.status, received, peers.bytes_sent.tolist(), peers.bytes_received.tolist()

    total = sum(sizes(dtype)) * np.dtype(dtype).itemsize
    for rank, (status, received, sent, got) in enumerate(run(2, body)):
        assert status == doorbell.OK
        for count, out in zip(sizes(dtype), received):
            np.testing.assert_array_equal(out, data(count, 1 - rank, dtype),
                                          err_msg=f"rank {rank}, {count} items")
        assert sent[1 - rank] == got[1 - rank] == total


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sendrecv_both_ways_every_size(dtype):
    """Both ranks sendrecv each other at once, messages up to 2.5 rings long: no deadlock."""
    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner = 1 - peers.rank
        received = []
        for count in sizes(dtype):
            out = np.full(count, 99, dtype)
            peers.sendrecv_buffer(partner, data(count, peers.rank, dtype), partner, out)
            received.append(out)
        return peers.status, received

    for rank, (status, received) in enumerate(run(2, body)):
        assert status == doorbell.OK
        for count, out in zip(sizes(dtype), received):
            np.testing.assert_array_equal(out, data(count, 1 - rank, dtype),
                                          err_msg=f"rank {rank}, {count} items")


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_ring_exchange(world_size):
    """N - 1 ring steps passing each block on: every rank ends up having seen every other's."""
    count = 10 * SLOT // 8 + 5  # float64: 11 pieces a step, more than a ring holds

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        n, rank = peers.world_size, peers.rank
        holding, seen = data(count, rank, np.float64), []
        for _ in range(n - 1):
            incoming = np.empty_like(holding)
            peers.sendrecv_buffer((rank + 1) % n, holding, (rank - 1) % n, incoming)
            seen.append(incoming)
            holding = incoming
        return peers.status, seen

    for rank, (status, seen) in enumerate(run(world_size, body)):
        assert status == doorbell.OK
        for step, block in enumerate(seen, start=1):
            np.testing.assert_array_equal(block, data(count, (rank - step) % world_size, np.float64),
                                          err_msg=f"rank {rank}, step {step}")


def test_message_counters():
    """A message counts once however many pieces it takes (an empty one too); bytes count the
    payload. Rank 0 sends three messages (0 items, 1, 10 slots and a bit), then both sendrecv."""
    counts = [0, 1, 10 * SLOT // 4 + 3]

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner = 1 - peers.rank
        for count in counts:
            if peers.rank == 0:
                peers.send_buffer(partner, data(count, 0, np.float32))
            else:
                peers.recv_buffer(partner, np.zeros(count, np.float32))
        peers.sendrecv_buffer(partner, data(5, peers.rank, np.float32), partner, np.zeros(5, np.float32))
        return (peers.status, peers.messages_sent.tolist(), peers.messages_received.tolist(),
                peers.bytes_sent.tolist(), peers.bytes_received.tolist())

    first, second = run(2, body)
    payload = 4 * (sum(counts) + 5)
    assert first == (doorbell.OK, [0, 4], [0, 1], [0, payload], [0, 20])
    assert second == (doorbell.OK, [1, 0], [4, 0], [20, 0], [payload, 0])


def test_pending_fingerprints_names_what_waits():
    """Published and not taken: the next piece's fingerprint per peer, read by plain numpy; once
    taken, nothing. Three mailboxes of one process, messages that fit a ring."""
    region = fresh_region(3)
    fds = np.full(3, -1, np.int32)
    ranks = [open_mailbox(region, rank, 3, SLOT, DEPTH, fds) for rank in range(3)]
    theirs = fingerprint(5)
    for rank, tag in enumerate([TAG, theirs, TAG]):
        ranks[rank].begin(tag, LONG_DEADLINE_NS)
    assert pending_fingerprints(region, 0, 3, SLOT, DEPTH) == {}
    ranks[1].send_buffer(0, data(3 * SLOT // 4, 1, np.float32))  # three pieces
    ranks[2].send_buffer(0, data(0, 2, np.float32))  # an empty message is one piece too
    assert pending_fingerprints(region, 0, 3, SLOT, DEPTH) == {1: theirs.tobytes(), 2: TAG.tobytes()}
    assert pending_fingerprints(memoryview(region), 1, 3, SLOT, DEPTH) == {}  # nothing for rank 1
    ranks[0].recv_buffer(1, np.zeros(3 * SLOT // 4, np.float32))  # another collective's: refused
    assert (ranks[0].status, ranks[0].failed_peer) == (doorbell.MISMATCH, 1)
    assert pending_fingerprints(region, 0, 3, SLOT, DEPTH) == {1: theirs.tobytes(), 2: TAG.tobytes()}
    ranks[0].begin(TAG, LONG_DEADLINE_NS)
    ranks[0].recv_buffer(2, np.zeros(0, np.float32))
    assert pending_fingerprints(region, 0, 3, SLOT, DEPTH) == {1: theirs.tobytes()}
    ranks[0].begin(theirs, LONG_DEADLINE_NS)
    out = np.zeros(3 * SLOT // 4, np.float32)
    ranks[0].recv_buffer(1, out)
    assert ranks[0].status == doorbell.OK and pending_fingerprints(region, 0, 3, SLOT, DEPTH) == {}
    np.testing.assert_array_equal(out, data(3 * SLOT // 4, 1, np.float32))


def expected_messages(rank: int, world_size: int) -> tuple[int, int]:
    """Messages a rank of the recursive-doubling allreduce sends and receives."""
    p = 1 << (world_size.bit_length() - 1)
    extra, steps = world_size - p, p.bit_length() - 1
    if rank < 2 * extra:
        return (1, 1) if rank % 2 == 0 else (steps + 1, steps + 1)
    return steps, steps


@pytest.mark.parametrize("world_size", [2, 4, 3])
def test_allreduce_one_compiled_call(world_size):
    """The mailboxes opened, the reduction built and the whole allreduce run in one compiled call."""
    count = 1000  # float32: 16 slots, 4 rings

    def body(peers):
        buf = data(count, peers.rank, np.float32)
        outcome = allreduce_recursive_doubling(peers.region, peers.rank, world_size, buf, TAG,
                                               LONG_DEADLINE_NS, FAMILY_CODES["native"])
        return outcome, buf

    expected = (world_size * STRIDE * np.arange(count) + world_size * (world_size - 1) // 2).astype(
        np.float32)
    for rank, (outcome, buf) in enumerate(run(world_size, body)):
        assert outcome == (doorbell.OK, *expected_messages(rank, world_size)), f"rank {rank}"
        np.testing.assert_array_equal(buf, expected, err_msg=f"rank {rank}")


@pytest.mark.parametrize("fold", FOLDS)
def test_fold_through_the_mailbox(fold):
    """``recv_buffer`` and ``sendrecv_buffer`` fold each piece with ``reduction.combine`` (a
    ``coded_reduction`` sum) for float32, int64 and float16 (uint16 bits): 3 ranks, so rank 1
    folds a receive and then a sendrecv, messages of many slots. Small integers: every sum is
    exact, whatever the order."""
    dtype, family = FOLDS[fold]
    count = 1000

    def buffer(exact: np.ndarray) -> np.ndarray:
        return exact.astype(np.float16).view(np.uint16) if fold == "float16" else exact.astype(dtype)

    def body(peers):
        buf = buffer(np.arange(count) % 200 + peers.rank)
        outcome = allreduce_recursive_doubling(peers.region, peers.rank, 3, buf, TAG, LONG_DEADLINE_NS,
                                               family)
        return outcome, buf

    expected = buffer(np.arange(count) % 200 * 3 + 3)  # ranks 0 + 1 + 2
    for rank, (outcome, buf) in enumerate(run(3, body)):
        assert outcome == (doorbell.OK, *expected_messages(rank, 3)), f"rank {rank}"
        np.testing.assert_array_equal(buf, expected, err_msg=f"rank {rank}")


def test_ten_thousand_tiny_messages():
    """Back-to-back one-item messages both ways: each slot is reused 2,500 times."""
    messages = 10_000

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner, out, got = 1 - peers.rank, np.zeros(1, np.int64), np.empty(messages, np.int64)
        for i in range(messages):
            peers.sendrecv_buffer(partner, np.array([i * STRIDE + peers.rank]), partner, out)
            got[i] = out[0]
        return (peers.status, got, int(peers.bytes_sent[partner]), int(peers.bytes_received[partner]),
                int(peers.messages_sent[partner]), int(peers.messages_received[partner]))

    for rank, (status, got, sent, received, messages_sent, messages_received) in enumerate(run(2, body)):
        assert status == doorbell.OK
        np.testing.assert_array_equal(got, data(messages, 1 - rank, np.int64))
        assert (sent, received, messages_sent, messages_received) == (8 * messages, 8 * messages, messages,
                                                                      messages)


@pytest.mark.parametrize("policy", ["spin", "yield", "block"])
def test_waiting_policies(policy):
    """Ping-pong of a three-slot message under each waiting policy (block: the futex at once)."""
    limits = {"spin": (10**12, 0), "yield": (0, 10**12), "block": (0, 0)}[policy]
    rounds, count = 50, 3 * SLOT // 4

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        peers.spin_limit, peers.yield_limit = limits
        assert (peers.spin_limit, peers.yield_limit) == limits
        partner, out = 1 - peers.rank, np.zeros(count, np.int32)
        for i in range(rounds):
            if peers.rank == 0:
                peers.send_buffer(partner, data(count, i, np.int32))
                peers.recv_buffer(partner, out)
            else:
                peers.recv_buffer(partner, out)
                peers.send_buffer(partner, out + 1)
        return peers.status, out

    results = run(2, body)
    assert [status for status, _ in results] == [doorbell.OK, doorbell.OK]
    np.testing.assert_array_equal(results[0][1], data(count, rounds - 1, np.int32) + 1)


# --- failures -----------------------------------------------------------------------------------


def test_mismatch_names_the_peer_and_what_it_sent():
    """Rank 1 sends a message of another collective, rank 2 one of another size: MISMATCH naming
    the peer, with the fingerprint and byte count it sent; later transfers of the failed
    collective return at once without touching memory."""
    theirs = fingerprint(2)

    def body(peers):
        if peers.rank > 0:
            peers.begin(theirs if peers.rank == 1 else TAG, LONG_DEADLINE_NS)
            peers.send_buffer(0, data(10, peers.rank, np.float32))
            return None
        out = np.full(10, -1, np.float32)
        peers.begin(TAG, LONG_DEADLINE_NS)
        peers.recv_buffer(1, out)
        other = (peers.status, peers.failed_peer, peers.peer_fingerprint.copy(), peers.peer_bytes)
        peers.recv_buffer(2, out)  # returns at once: the collective has failed
        peers.send_buffer(2, data(100 * SLOT, 0, np.float32))  # more than the ring holds: would block
        after = (peers.status, peers.failed_peer, int(peers.bytes_sent[2]), int(peers.bytes_received[2]), out)
        peers.begin(TAG, LONG_DEADLINE_NS)
        peers.recv_buffer(2, np.zeros(12, np.float32))  # 10 items where 12 are expected
        size = (peers.status, peers.failed_peer, peers.peer_fingerprint.copy(), peers.peer_bytes)
        return other, after, size

    other, after, size = run(3, body)[0]
    assert other[:2] == (doorbell.MISMATCH, 1) and other[3] == 40
    np.testing.assert_array_equal(other[2], theirs)
    assert after[:4] == (doorbell.MISMATCH, 1, 0, 0)
    np.testing.assert_array_equal(after[4], np.full(10, -1, np.float32))
    assert size[:2] == (doorbell.MISMATCH, 2) and size[3] == 40
    np.testing.assert_array_equal(size[2], TAG)


def test_silent_peer_is_reported_after_the_deadline():
    """Rank 1 never sends nor receives: a receive, a send into a full ring and a sendrecv each end
    in SILENCE naming it, after the deadline and well within ten times it."""
    deadline_s = 0.3

    def body(peers):
        if peers.rank == 1:
            return None
        outcomes = []
        for transfer in ("recv", "send", "sendrecv"):
            peers.begin(TAG, int(deadline_s * 1e9))
            start = time.monotonic()
            if transfer == "recv":
                peers.recv_buffer(1, np.zeros(4, np.float32))
            elif transfer == "send":
                peers.send_buffer(1, data(10 * SLOT, 0, np.float32))  # fills the ring, then waits
            else:
                peers.sendrecv_buffer(1, data(4, 0, np.float32), 1, np.zeros(4, np.float32))
            outcomes.append((transfer, peers.status, peers.failed_peer, time.monotonic() - start))
        return outcomes

    for transfer, status, failed, elapsed in run(2, body)[0]:
        assert (status, failed) == (doorbell.SILENCE, 1), transfer
        assert deadline_s <= elapsed < 10 * deadline_s, transfer


def test_killed_peer_is_reported_as_lost():
    """Rank 1 is SIGKILLed while rank 0 waits for it with a 30 s deadline: PEER_LOST (from its
    liveness pipe, not the deadline), soon after the kill."""
    def body(peers):
        if peers.rank == 1:
            time.sleep(RESULT_TIMEOUT_S)  # until killed
            return None
        peers.begin(TAG, LONG_DEADLINE_NS)
        out = np.full(4, -1, np.float32)
        peers.recv_buffer(1, out)
        return peers.status, peers.failed_peer, out

    with Ranks(2, body, liveness=True) as ranks:
        time.sleep(0.5)  # rank 0 is asleep on its doorbell by now (the test holds either way)
        killed = time.monotonic()
        ranks.kill(1)
        (status, failed, out), dead = ranks.results()
        assert time.monotonic() - killed < LONG_DEADLINE_NS / 1e9  # told of the death, not timed out
    assert dead is None
    assert (status, failed) == (doorbell.PEER_LOST, 1)
    np.testing.assert_array_equal(out, np.full(4, -1, np.float32))


def test_message_of_a_peer_that_exited_is_still_delivered():
    """Rank 1 sends and exits; rank 0 receives afterwards: the published message comes through
    (a last look before PEER_LOST), and only the next receive reports the loss."""
    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        if peers.rank == 1:
            peers.send_buffer(0, data(5, 1, np.float32))
            return None
        time.sleep(0.3)  # rank 1 has exited (it only had to fill one slot)
        out = np.zeros(5, np.float32)
        peers.recv_buffer(1, out)
        first = (peers.status, out.copy())
        peers.recv_buffer(1, out)
        return first, (peers.status, peers.failed_peer)

    (first_status, first_out), second = run(2, body, liveness=True)[0]
    assert first_status == doorbell.OK
    np.testing.assert_array_equal(first_out, data(5, 1, np.float32))
    assert second == (doorbell.PEER_LOST, 1)


# --- a long wait's hook ---------------------------------------------------------------------------


class Preempted(Exception):
    """What the test's signal handler raises."""


@njit(nogil=True)
def call_the_hook_for_ever(number, fingerprint, calls):
    """Call hook ``number`` ``calls`` times with a copy of ``fingerprint`` made here (an array
    without a Python object, as a mailbox's own)."""
    own = fingerprint.copy()
    for _ in range(calls):
        hook.call_hook(number, own)


def test_the_hook_gets_the_fingerprint_and_what_a_signal_handler_raises_propagates():
    """A hook is called with the waiting collective's fingerprint; a SIGALRM handler that raises
    while compiled code calls the hook over and over ends the call with the handler's own
    exception, whenever the alarm comes (300 alarms at 0.5-1.1 ms: it lands before, inside and
    between the hook's calls)."""
    received = []
    number = hook.register_hook(received.append)
    fingerprint = np.arange(32, dtype=np.uint8)
    call_the_hook_for_ever(number, fingerprint, 3)
    assert received == [fingerprint.tobytes()] * 3

    def on_alarm(signum, frame):
        raise Preempted("checkpoint now")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    raised = []
    # no collection meanwhile: a handler run inside a finalizer it calls has what it raises ignored
    # by Python ("Exception ignored in ..."), and the call would go on for minutes
    gc.collect()
    gc.disable()
    try:
        for trial in range(300):
            try:  # (a loaded machine may let the alarm land before the call starts: counted too)
                signal.setitimer(signal.ITIMER_REAL, 0.0005 + (trial % 7) * 0.0001)
                call_the_hook_for_ever(number, fingerprint, 10**9)  # minutes: only the alarm ends it
            except BaseException as exc:  # noqa: BLE001 (the alarm's exception, whatever its kind, is kept)
                raised.append(exc)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        gc.enable()
        signal.signal(signal.SIGALRM, previous)
        hook.unregister_hook(number)
    assert len(raised) == 300
    assert {(type(exc), str(exc)) for exc in raised} == {(Preempted, "checkpoint now")}
    call_the_hook_for_ever(number, fingerprint, 3)  # unregistered: called, it does nothing
    assert len(received) > 3 and set(received) == {fingerprint.tobytes()}
