"""Tests for ``kernels.mailbox``: ranks as forked children over one anonymous shared mapping.

Every transfer goes through one compiled driver, ``transfer``, and the allreduce is one compiled
call; the module fixture compiles both for every signature the children use, once, in the parent,
so a child only runs machine code (each compiled entry point costs about a second: it
re-optimizes the mailbox code it calls). A child returns what it received through a pipe and leaves with
``os._exit``; every rank's output is checked against what its peers sent (inputs
``index * stride + rank``). Every child is killed if still running and reaped, whatever happens.

Timing is asserted generously, so it holds on a busy machine: a death must be reported as
PEER_LOST (from the liveness pipe, not from the 30 s deadline), a silence after its deadline and
within ten times it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import time
import traceback
from typing import Self

import numpy as np
import pytest
from numba import njit, typeof

from kernels import mailbox
from kernels.mailbox import LINE, MailboxPeers, region_bytes
from kernels.reduce import sum_into

SLOT = 256
DEPTH = 4
STRIDE = 3
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint16)
RESULT_TIMEOUT_S = 120  # only a hang reaches it
LONG_DEADLINE_NS = 30_000_000_000  # a death must be reported long before this


def fingerprint(seed: int) -> np.ndarray:
    return (np.arange(32) * 7 + seed).astype(np.uint8)


TAG = fingerprint(1)


def data(count: int, rank: int, dtype) -> np.ndarray:
    return (np.arange(count) * STRIDE + rank).astype(dtype)


def sizes(dtype) -> list[int]:
    """Element counts around one slot's worth, and many slots (more than the ring holds)."""
    per_slot = SLOT // np.dtype(dtype).itemsize
    return [0, 1, 7, per_slot - 1, per_slot, per_slot + 1, 10 * per_slot + 3]


SEND, RECV, SENDRECV = range(3)


@njit
def transfer(peers, how, dst, outgoing, src, incoming, combine):
    """One transfer of a test (``how``: SEND, RECV or SENDRECV) through the Peers methods, as one
    compiled call; ``combine`` is None or an @njit kernel. Returns the status."""
    if how == SEND:
        peers.send_buffer(dst, outgoing)
    elif combine is None:  # pruned at compile time: None is the default of recv and sendrecv
        if how == RECV:
            peers.recv_buffer(src, incoming)
        else:
            peers.sendrecv_buffer(dst, outgoing, src, incoming)
    elif how == RECV:
        peers.recv_buffer(src, incoming, combine)
    else:
        peers.sendrecv_buffer(dst, outgoing, src, incoming, combine)
    return peers.status


def send(peers, dst, outgoing):
    return transfer(peers, SEND, dst, outgoing, dst, outgoing, None)


def recv(peers, src, incoming, combine=None):
    return transfer(peers, RECV, src, incoming, src, incoming, combine)


def sendrecv(peers, dst, outgoing, src, incoming, combine=None):
    return transfer(peers, SENDRECV, dst, outgoing, src, incoming, combine)


@njit
def allreduce_recursive_doubling(peers, buf, incoming, tag, deadline_ns, combine):
    """Recursive doubling with the standard fold (lab.collectives.allreduce_recursive_doubling),
    as one compiled call over MailboxPeers; ``combine`` is a function value. Returns the status."""
    peers.begin(tag, deadline_ns)
    n, rank = peers.world_size, peers.rank
    p = 1
    while p * 2 <= n:
        p *= 2
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:  # sits out: hands its tensor over, gets the result back
        peers.send_buffer(rank + 1, buf)
        peers.recv_buffer(rank + 1, buf)
        return peers.status
    if rank < 2 * extra:
        peers.recv_buffer(rank - 1, buf, combine)
    vrank = rank // 2 if rank < 2 * extra else rank - extra
    mask = 1
    while mask < p:
        v = vrank ^ mask
        partner = 2 * v + 1 if v < extra else v + extra
        peers.sendrecv_buffer(partner, buf, partner, incoming)
        combine(buf, incoming)
        mask *= 2
    if rank < 2 * extra:
        peers.send_buffer(rank - 1, buf)
    return peers.status


@njit
def atomics_round_trip(words32, words64):
    """The primitives on both widths (and the clock), inside compiled code."""
    mailbox.store_release(words32, 1, 41)
    mailbox.store_release(words64, 2, 1 << 40)
    old = mailbox.atomic_add(words32, 1, 1)
    mailbox.fence_seq_cst()
    mailbox.cpu_relax()
    return old, mailbox.load_acquire(words32, 1), mailbox.load_acquire(words64, 2), mailbox.monotonic_ns()


# --- ranks as forked children -------------------------------------------------------------------


class Ranks:
    """``world_size`` forked children over one fresh shared region, each running ``body(peers)``
    and sending back its result (``None`` for a child that died). With ``liveness``, rank r holds
    the only write end of pipe r and every other rank polls its read end. On exit every child is
    killed if still running and reaped."""

    def __init__(self, world_size: int, body, *, slot_bytes: int = SLOT, depth: int = DEPTH,
                 liveness: bool = False) -> None:
        self.world_size, self.body, self.slot_bytes, self.depth = world_size, body, slot_bytes, depth
        self.liveness = liveness
        self.pids: list[int] = []
        self.result_fds: list[int] = []

    def __enter__(self) -> Self:
        region = np.frombuffer(mmap.mmap(-1, region_bytes(self.world_size, self.slot_bytes, self.depth)), np.uint8)
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
                peers = MailboxPeers(region, rank, self.world_size, self.slot_bytes, self.depth, fds)
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
        outcomes = [pickle.loads(received[rank]) if received[rank] else None for rank in range(self.world_size)]
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
    """Every signature the children use, compiled here (children inherit the machine code)."""
    region = np.frombuffer(mmap.mmap(-1, region_bytes(2, SLOT, DEPTH)), np.uint8)
    peers = MailboxPeers(region, 0, 2, SLOT, DEPTH, np.full(2, -1, np.int32))
    peers.begin(TAG, 0)
    me, how, kernel = typeof(peers), typeof(SEND), typeof(sum_into)
    for dtype in DTYPES:
        array = typeof(np.zeros(1, dtype))
        transfer.compile((me, how, how, array, how, array, typeof(None)))
    array = typeof(np.zeros(1, np.float32))
    transfer.compile((me, how, how, array, how, array, kernel))
    allreduce_recursive_doubling.compile((me, array, array, typeof(TAG), typeof(0), kernel))


# --- the primitives -----------------------------------------------------------------------------


def test_primitives():
    words64 = np.zeros(4, np.int64)
    words32 = words64.view(np.int32)
    old, word32, word64, now = atomics_round_trip(words32, words64)
    assert (old, word32, word64) == (41, 42, 1 << 40)
    assert abs(now - time.monotonic_ns()) < 10**9  # the same clock as Python's
    start = time.monotonic()
    mailbox.futex_wait(words32, 1, 42, 20_000_000)  # unchanged: sleeps until the timeout
    assert time.monotonic() - start >= 0.015
    mailbox.futex_wait(words32, 1, 7, 10**9)  # changed: returns at once
    assert mailbox.futex_wake(words32, 1, 1) == 0  # nobody asleep
    read, write = os.pipe()
    try:
        assert not mailbox.peer_gone(read)
        os.close(write)
        assert mailbox.peer_gone(read)
        assert not mailbox.peer_gone(-1)
    finally:
        os.close(read)


def test_region_and_arguments():
    assert region_bytes(2, SLOT, DEPTH) == 2 * 128 + 2 * (128 + DEPTH * (64 + SLOT))
    assert region_bytes(3, 100, 2) % 64 == 0 and region_bytes(1, SLOT, DEPTH) == 128
    size = region_bytes(2, SLOT, DEPTH)
    region = np.frombuffer(mmap.mmap(-1, size + LINE), np.uint8)
    fds = np.full(2, -1, np.int32)
    for rank, world_size, slot_bytes, depth, region_used in [(2, 2, SLOT, DEPTH, region),
                                                              (0, 2, 32, DEPTH, region),
                                                              (0, 2, SLOT, 0, region),
                                                              (0, 2, SLOT, DEPTH, region[:size - LINE]),
                                                              (0, 2, SLOT, DEPTH, region[8:8 + size])]:
        with pytest.raises(ValueError, match="MailboxPeers"):
            MailboxPeers(region_used, rank, world_size, slot_bytes, depth, fds)
    peers = MailboxPeers(region, 0, 2, SLOT, DEPTH, fds)
    assert (peers.rank, peers.world_size, peers.host_of(1), peers.status, peers.failed_peer) == (0, 2, 0, 0, -1)
    peers.begin(TAG, 0)
    send(peers, 0, data(3, 0, np.float32))  # to itself: a usage error, reported, not raised
    assert (peers.status, peers.failed_peer) == (mailbox.INVALID, 0)
    peers.begin(TAG, 0)
    recv(peers, 2, np.zeros(3, np.float32))
    assert (peers.status, peers.failed_peer) == (mailbox.INVALID, 2)
    assert peers.bytes_sent.tolist() == peers.bytes_received.tolist() == [0, 0]


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
                send(peers, partner, data(count, peers.rank, dtype))
                recv(peers, partner, out)
            else:
                recv(peers, partner, out)
                send(peers, partner, data(count, peers.rank, dtype))
            received.append(out)
        return peers.status, received, peers.bytes_sent.tolist(), peers.bytes_received.tolist()

    total = sum(sizes(dtype)) * np.dtype(dtype).itemsize
    for rank, (status, received, sent, got) in enumerate(run(2, body)):
        assert status == mailbox.OK
        for count, out in zip(sizes(dtype), received):
            np.testing.assert_array_equal(out, data(count, 1 - rank, dtype), err_msg=f"rank {rank}, {count} items")
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
            sendrecv(peers, partner, data(count, peers.rank, dtype), partner, out)
            received.append(out)
        return peers.status, received

    for rank, (status, received) in enumerate(run(2, body)):
        assert status == mailbox.OK
        for count, out in zip(sizes(dtype), received):
            np.testing.assert_array_equal(out, data(count, 1 - rank, dtype), err_msg=f"rank {rank}, {count} items")


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
            sendrecv(peers, (rank + 1) % n, holding, (rank - 1) % n, incoming)
            seen.append(incoming)
            holding = incoming
        return peers.status, seen

    for rank, (status, seen) in enumerate(run(world_size, body)):
        assert status == mailbox.OK
        for step, block in enumerate(seen, start=1):
            np.testing.assert_array_equal(block, data(count, (rank - step) % world_size, np.float64),
                                          err_msg=f"rank {rank}, step {step}")


def test_combine_with_a_sum_kernel():
    """``combine`` is an @njit kernel passed by value: recv_buffer and sendrecv_buffer fold each
    piece into ``out`` (a message of many slots, so the kernel runs per piece)."""
    count = 10 * SLOT // 4 + 3

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner = 1 - peers.rank
        received = data(count, peers.rank, np.float32)
        if peers.rank == 0:
            recv(peers, partner, received, sum_into)
        else:
            send(peers, partner, data(count, peers.rank, np.float32))
        exchanged = data(count, peers.rank, np.float32)
        sendrecv(peers, partner, data(count, peers.rank, np.float32), partner, exchanged, sum_into)
        return peers.status, received, exchanged

    both = data(count, 0, np.float32) + data(count, 1, np.float32)
    for rank, (status, received, exchanged) in enumerate(run(2, body)):
        assert status == mailbox.OK
        if rank == 0:
            np.testing.assert_array_equal(received, both)
        np.testing.assert_array_equal(exchanged, both, err_msg=f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 4, 3])
def test_allreduce_one_compiled_call(world_size):
    count = 1000  # float32: 16 slots, 4 rings

    def body(peers):
        buf = data(count, peers.rank, np.float32)
        status = allreduce_recursive_doubling(peers, buf, np.empty_like(buf), TAG, LONG_DEADLINE_NS, sum_into)
        return status, buf

    expected = (world_size * STRIDE * np.arange(count) + world_size * (world_size - 1) // 2).astype(np.float32)
    for rank, (status, buf) in enumerate(run(world_size, body)):
        assert status == mailbox.OK
        np.testing.assert_array_equal(buf, expected, err_msg=f"rank {rank}")


def test_ten_thousand_tiny_messages():
    """Back-to-back one-item messages both ways: each slot is reused 2,500 times."""
    messages = 10_000

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        partner, out, got = 1 - peers.rank, np.zeros(1, np.int64), np.empty(messages, np.int64)
        for i in range(messages):
            sendrecv(peers, partner, np.array([i * STRIDE + peers.rank]), partner, out)
            got[i] = out[0]
        return peers.status, got, int(peers.bytes_sent[partner]), int(peers.bytes_received[partner])

    for rank, (status, got, sent, received) in enumerate(run(2, body)):
        assert status == mailbox.OK
        np.testing.assert_array_equal(got, data(messages, 1 - rank, np.int64))
        assert sent == received == 8 * messages


@pytest.mark.parametrize("policy", ["spin", "yield", "block"])
def test_waiting_policies(policy):
    """Ping-pong of a three-slot message under each waiting policy (block: the futex at once)."""
    limits = {"spin": (10**12, 0), "yield": (0, 10**12), "block": (0, 0)}[policy]
    rounds, count = 50, 3 * SLOT // 4

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        peers.spin_limit, peers.yield_limit = limits
        partner, out = 1 - peers.rank, np.zeros(count, np.int32)
        for i in range(rounds):
            if peers.rank == 0:
                send(peers, partner, data(count, i, np.int32))
                recv(peers, partner, out)
            else:
                recv(peers, partner, out)
                send(peers, partner, out + 1)
        return peers.status, out

    results = run(2, body)
    assert [status for status, _ in results] == [mailbox.OK, mailbox.OK]
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
            send(peers, 0, data(10, peers.rank, np.float32))
            return None
        out = np.full(10, -1, np.float32)
        peers.begin(TAG, LONG_DEADLINE_NS)
        recv(peers, 1, out)
        other = (peers.status, peers.failed_peer, peers.peer_fingerprint.copy(), peers.peer_bytes)
        recv(peers, 2, out)  # returns at once: the collective has failed
        send(peers, 2, data(100 * SLOT, 0, np.float32))  # more than the ring holds: would block
        after = (peers.status, peers.failed_peer, int(peers.bytes_sent[2]), int(peers.bytes_received[2]), out)
        peers.begin(TAG, LONG_DEADLINE_NS)
        recv(peers, 2, np.zeros(12, np.float32))  # 10 items where 12 are expected
        size = (peers.status, peers.failed_peer, peers.peer_fingerprint.copy(), peers.peer_bytes)
        return other, after, size

    other, after, size = run(3, body)[0]
    assert other[:2] == (mailbox.MISMATCH, 1) and other[3] == 40
    np.testing.assert_array_equal(other[2], theirs)
    assert after[:4] == (mailbox.MISMATCH, 1, 0, 0)
    np.testing.assert_array_equal(after[4], np.full(10, -1, np.float32))
    assert size[:2] == (mailbox.MISMATCH, 2) and size[3] == 40
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
                recv(peers, 1, np.zeros(4, np.float32))
            elif transfer == "send":
                send(peers, 1, data(10 * SLOT, 0, np.float32))  # fills the ring, then waits
            else:
                sendrecv(peers, 1, data(4, 0, np.float32), 1, np.zeros(4, np.float32))
            outcomes.append((transfer, peers.status, peers.failed_peer, time.monotonic() - start))
        return outcomes

    for transfer, status, failed, elapsed in run(2, body)[0]:
        assert (status, failed) == (mailbox.SILENCE, 1), transfer
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
        recv(peers, 1, out)
        return peers.status, peers.failed_peer, out

    with Ranks(2, body, liveness=True) as ranks:
        time.sleep(0.5)  # rank 0 is asleep on its doorbell by now (the test holds either way)
        killed = time.monotonic()
        ranks.kill(1)
        (status, failed, out), dead = ranks.results()
        assert time.monotonic() - killed < 10
    assert dead is None
    assert (status, failed) == (mailbox.PEER_LOST, 1)
    np.testing.assert_array_equal(out, np.full(4, -1, np.float32))


def test_message_of_a_peer_that_exited_is_still_delivered():
    """Rank 1 sends and exits; rank 0 receives afterwards: the published message comes through
    (a last look before PEER_LOST), and only the next receive reports the loss."""

    def body(peers):
        peers.begin(TAG, LONG_DEADLINE_NS)
        if peers.rank == 1:
            send(peers, 0, data(5, 1, np.float32))
            return None
        time.sleep(0.3)  # rank 1 has exited (it only had to fill one slot)
        out = np.zeros(5, np.float32)
        recv(peers, 1, out)
        first = (peers.status, out.copy())
        recv(peers, 1, out)
        return first, (peers.status, peers.failed_peer)

    (first_status, first_out), second = run(2, body, liveness=True)[0]
    assert first_status == mailbox.OK
    np.testing.assert_array_equal(first_out, data(5, 1, np.float32))
    assert second == (mailbox.PEER_LOST, 1)
