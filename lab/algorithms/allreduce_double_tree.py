"""Double binary tree allreduce (NCCL's): two complementary binary trees, each reducing and
broadcasting half of the tensor, pipelined in segments so that every link of both trees, up and
down, carries data at once. The trees, the segments and the timetable that keeps every link busy
without a deadlock are :mod:`lab.algorithms.double_tree_schedule`'s; this file runs them."""

from __future__ import annotations

import numpy as np

from lab.algorithms.double_tree_schedule import (
    NETWORK_LATENCY_BYTES,
    Move,
    double_trees,
    schedule,
    segment_count,
)
from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.chunking import split_bounds
from lab.ops import Reduction


def allreduce_double_tree(peers: Peers, buf: np.ndarray, reduction: Reduction,
                          segment_bytes: int | None = None,
                          latency_bytes: int = NETWORK_LATENCY_BYTES) -> None:
    """Reduce ``buf`` in place across all ranks: half through each of two binary trees, pipelined.

    Tree t reduces half t of the tensor to its root and broadcasts it back down in S segments
    (:func:`segment_count`; ``segment_bytes`` caps them, ``latency_bytes`` is the transport's
    α/β). Everything runs at once, as in NCCL: a rank sends segment s up while it receives a later
    one from a child, forwards early segments down while later ones still come up, and works in
    both trees, each step one ``peers.sendrecv_buffer`` (one message out, one in). An inner node
    of one tree that is a leaf of the other handles 4 messages each way per segment, so
    :func:`timetable` gives every message a *slot*, segment s 4·s after segment 0, such that no
    rank sends two or receives two in one slot, and every message comes after what it forwards.

    Deadlock freedom, however small the transport's buffers: both ends of a message compute the
    same slot, and every rank runs its slots in increasing order, one step per slot (its send and
    its receive of that slot at once). Were the ranks stuck, take an unfinished message of the
    least slot: its sender and its receiver have finished every earlier slot (an unfinished one
    would hold a message of a smaller slot), so both are in the step that holds it, and
    ``sendrecv_buffer`` moves a step's send and receive concurrently: it finishes, a
    contradiction. Each pair's messages are in slot order at both ends, so a receive always
    matches the message it expects.

    Cost: with S segments of T/(2S) bytes, about (4S + 4·⌈log2 N⌉)·(α + T/(2S)·β): 2T·β of
    bandwidth (an inner node of one tree, a leaf in the other, sends and receives 2T), 4S·α, and
    a pipeline fill of 4·⌈log2 N⌉ segment-messages (2 per level up, 2 down: a parent takes its
    two children one after the other); S = √(⌈log2 N⌉·T·β/(2α)) balances the last two. Unlike
    the ring's 2(N-1)·α, the latency grows as log N; at small T it is about twice the binomial
    tree's 2⌈log2 N⌉·α. Bit-identical on every rank: each segment is reduced once, in one order,
    at its tree's root, and copied down.

    Bytes, exactly (T_t = bytes of half t, ``split_bounds(count, 2)``; c_t = this rank's
    children in tree t; u_t = 1 unless it is tree t's root): sends and receives
    Σ_t (c_t + u_t)·T_t. With N even, a rank sends 2T as an inner node of one tree and a leaf of
    the other (3·T/2 + T/2); the roots less.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n = peers.world_size
    halves = [buf[a:b] for a, b in split_bounds(buf.size, 2)]
    segments = segment_count(buf.size, buf.itemsize, n, segment_bytes, latency_bytes)
    pieces = [[half[a:b] for a, b in split_bounds(half.size, segments)] for half in halves]
    # One rank: its data is the reduction; finish it (avg divides by 1).
    if n == 1:
        reduction.finalize(buf, n)
        return
    # Every step: one message out, one in, or both at once.
    run_steps(peers, schedule(n, peers.rank, segments), pieces, reduction)


def run_steps(peers: Peers, steps: tuple[tuple[Move | None, Move | None], ...],
              pieces: list[list[np.ndarray]], reduction: Reduction) -> None:
    """Run a rank's ``steps`` (:func:`lab.algorithms.double_tree_schedule.schedule_of`) on the
    ``pieces`` of its buffer (``pieces[tree][segment]``): each step one message out, one in, or
    both at once; a child's piece is folded in, a parent's copied, and the root finishes each
    segment once it holds every contribution."""
    for send, recv in steps:
        if recv is None:
            peers.send_buffer(send.peer, pieces[send.tree][send.segment])
            continue
        out, combine = pieces[recv.tree][recv.segment], reduction if recv.reduces else None
        if send is None:
            peers.recv_buffer(recv.peer, out, combine)
        else:
            peers.sendrecv_buffer(send.peer, pieces[send.tree][send.segment], recv.peer, out, combine)
        if recv.finishes:  # the root holds every contribution to this segment: finish it once
            reduction.finalize(out, peers.world_size)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    # the fill (2 messages per level, up and down); the bandwidth of an inner node that is also a leaf
    return 4 * d, 2.0


def fewest_steps(world_size: int, count: int, itemsize: int, segment_bytes: int | None = None,
                 latency_bytes: int = NETWORK_LATENCY_BYTES) -> int:
    """The fewest steps all ranks together take (a step sends one message at most): each of the
    N-1 links of each tree carries every segment up and down, 4·(N-1)·S messages. The simulator
    refuses a case past its limit with this, before the timetable is built (38 s at a million ranks)."""
    return 4 * (world_size - 1) * segment_count(count, itemsize, world_size, segment_bytes, latency_bytes)


def bytes_sent(rank: int, world_size: int, total: int) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide (``python -m lab``'s check)."""
    # each half, T/2, once per child and once to the parent, in each tree
    links = sum(len(children) + (parent >= 0) for parent, children in double_trees(world_size, rank))
    return links * total // 2, f"{links}T/2"
