"""The double binary tree's schedule: NCCL's two complementary trees, the segment count, and a
timetable that gives every message of every segment a slot (no rank sends or receives two in one
slot, and every message comes after what it forwards), so that all links of both trees carry
data at once without a deadlock (the argument: :mod:`lab.algorithms.allreduce_double_tree`).
The timetable and the schedule take any two trees over the ranks (:func:`timetable_of`,
:func:`schedule_of`): the chain-and-tree allreduce across hosts runs on them too.

Per rank, N = 6, rank 2, 3 segments::

    double_trees(6, 2)        # [(4, [1, 3]), (parent, children) in the mirrored tree]
    schedule(6, 2, 3)         # ((send Move or None, receive Move or None), ...) in slot order

The segment size comes from α/β, which depends on where the ranks are (:func:`call_options`
reads it off the mesh: the one place that names a transport).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lab import checks

#: α/β, the bytes a link moves in the time one message's latency takes; segments are sized from it
#: so that per-segment latency and pipeline fill balance. Across a network (tcp; the simulator's
#: 5 µs at 100 Gbit/s is 62.5 KB): 64 KiB.
NETWORK_LATENCY_BYTES = 64 * 1024
#: On one host (shm, queue) a step costs a Python call and a wake-up on each side, tens of µs to ms
#: on shared cores, against GB/s of memory copies: megabytes. Measured on 4 shm ranks, 16 MB: 2.5x
#: the ring's time in 16 segments, 1.25x in 4, 0.9x in 1 (bench/double_tree.py, 2 busy cores).
HOST_LATENCY_BYTES = 8 << 20


def latency_bytes(transport: str, hosts: int = 1) -> int:
    """α/β for ``transport`` (``"auto"``: shared memory on one host, tcp across hosts)."""
    one_host = transport in ("shm", "queue") or (transport == "auto" and hosts == 1)
    return HOST_LATENCY_BYTES if one_host else NETWORK_LATENCY_BYTES


def forced_segment_bytes() -> int | None:
    """Double tree's largest pipeline segment: ``LAB_SEGMENT_BYTES``, or None: sized from the
    tensor and N (tests force many segments)."""
    return checks.env_int("LAB_SEGMENT_BYTES", 0, low=1, high=2**62) or None


def call_options(mesh: Any) -> dict[str, Any]:
    """The keyword arguments a call on ``mesh`` passes (the registry's ``options``): the segment
    cap, and α/β for its transport."""
    return {
        "segment_bytes": forced_segment_bytes(),
        "latency_bytes": latency_bytes(mesh.transport, getattr(mesh, "host_count", 1))}


def binary_tree(world_size: int, rank: int) -> tuple[int, list[int]]:
    """(parent, children) of ``rank`` in NCCL's in-order binary tree (parent -1 at the root).

    A rank's level is its lowest set bit b: odd ranks are leaves, rank r has children r - b/2 and
    r + b/2 (the right one moved down while it is past the end), and rank 0 is the root with one
    child, the largest power of two below N. Depth: ⌈log2 N⌉.

        N = 6:  0
                └─ 4
                   ├─ 2 ─┬─ 1
                   │     └─ 3
                   └─ 5
    """
    if rank == 0:
        top = 1 << (world_size - 1).bit_length() if world_size > 1 else 1
        return -1, [top >> 1] if world_size > 1 else []
    bit = rank & -rank
    parent = (rank ^ bit) | (bit << 1)
    if parent >= world_size:
        parent = rank ^ bit
    children, low = [], bit >> 1
    if low:
        children.append(rank - low)
        while low and rank + low >= world_size:
            low >>= 1
        if low:
            children.append(rank + low)
    return parent, children


def tree_rank(world_size: int, tree: int, rank: int) -> int:
    """``rank``'s number in tree ``tree`` (the rank :func:`binary_tree` places): itself in the
    first tree; in the second, mirrored (r -> N-1-r) when N is even, shifted (r -> r-1 mod N)
    when N is odd."""
    if tree == 0:
        return rank
    return world_size - 1 - rank if world_size % 2 == 0 else (rank - 1) % world_size


def double_trees(world_size: int, rank: int) -> list[tuple[int, list[int]]]:
    """(parent, children) of ``rank`` in each of the two trees.

    The second tree is the first mirrored (r -> N-1-r) when N is even, shifted by one
    (r -> r-1 mod N) when N is odd: the first tree's leaves (odd ranks) are the second's inner
    nodes, so every rank forwards data in one tree and only sends and receives once in the other.
    """
    def back(node: int) -> int:  # tree_rank(world_size, 1, ·) undone
        return world_size - 1 - node if world_size % 2 == 0 else (node + 1) % world_size

    parent, children = binary_tree(world_size, tree_rank(world_size, 1, rank))
    second = (back(parent) if parent >= 0 else -1, [back(c) for c in children])
    return [binary_tree(world_size, rank), second]


def segment_count(count: int, itemsize: int, world_size: int, segment_bytes: int | None = None,
                  latency_bytes: int = NETWORK_LATENCY_BYTES, depth: int | None = None) -> int:
    """How many segments each half of a ``count``-element tensor travels in (every rank agrees).

    ``segment_bytes`` caps a segment's size (tests force many segments with tiny tensors). By
    default the count minimises the cost (:func:`allreduce_double_tree`):
    S = √(⌈log2 N⌉·T / (2·α/β)), α/β = ``latency_bytes``; across a network, one segment for 1 KB
    (the fill is what costs) and 72 for 64 MB on 1,024 ranks; never more than a half's elements.
    ``depth``: the trees' depth, where it is not the binary tree's ⌈log2 N⌉.
    """
    half = (count + 1) // 2
    if segment_bytes is not None:
        return max(1, -(-half // max(1, segment_bytes // itemsize)))
    depth = (world_size - 1).bit_length() if depth is None else depth
    return max(1, min(half, round(math.sqrt(depth * count * itemsize / (2 * latency_bytes)))))


class Move(NamedTuple):
    """One message of a rank's schedule, from this rank's end."""

    slot: int  # the same at both ends; a rank sends at most one message and receives at most one per slot
    peer: int
    sends: bool  # else receives
    tree: int
    segment: int
    reduces: bool  # a receive from a child: fold it into ours
    finishes: bool  # the root's receive from its last child: the segment is complete, finish it


#: Each rank of the double tree handles 4 messages each way per segment (see :func:`allreduce_double_tree`).
PERIOD = 4

#: Two trees over the same ranks: ``trees[rank][t]`` is (parent, children) of ``rank`` in tree t,
#: parent -1 at the root (what :func:`double_trees` returns, for every rank).
Trees = Sequence[Sequence[tuple[int, Sequence[int]]]]


def period_of(trees: Trees) -> int:
    """The most messages any rank sends per segment, which equals what it receives: Σ over both
    trees of its children and its parent. The timetable's period: König's theorem gives every
    message class one of that many phases with no rank sending, or receiving, two of one phase."""
    return max(1, max(sum(len(children) + (parent >= 0) for parent, children in mine) for mine in trees))


def depth_of(trees: Trees) -> int:
    """The deepest of the two trees: the most links from its root down to a leaf."""
    deepest = 0
    for tree in range(2):
        depth = {}
        for rank in _top_down(trees, tree):
            parent = trees[rank][tree][0]
            depth[rank] = depth[parent] + 1 if parent >= 0 else 0
        deepest = max(deepest, *depth.values())
    return deepest


def _preferred_phase(world_size: int, tree: int, child: int) -> int:
    """The phase the link from ``child`` to its parent in ``tree`` would take in one binary tree
    alone: 2·level + side, so that a parent hears its left child, then its right one, then
    speaks (level: the child's height, leaves 0; side: 1 for a right child)."""
    node = tree_rank(world_size, tree, child)
    parent, _ = binary_tree(world_size, node)
    level = (node & -node).bit_length() - 1
    return (2 * level + int(node > parent) + 2 * tree) % PERIOD


def _top_down(trees: Trees, tree: int) -> list[int]:
    """Tree ``tree``'s ranks, every parent before its children (breadth first from the root)."""
    order = [next(rank for rank, mine in enumerate(trees) if mine[tree][0] < 0)]
    for rank in order:
        order.extend(trees[rank][tree][1])
    return order


def greedy_phases(trees: Trees, period: int) -> Callable[[int, int], int]:
    """A preferred phase for each link ``(tree, child)`` of any two trees: its slot were its tree
    alone, every parent hearing its children one per slot in the order they are ready, then
    speaking (the generalisation of the binary tree's 2·level + side); mod ``period``."""
    phases = {}
    for tree in range(2):
        ready = {}
        for rank in reversed(_top_down(trees, tree)):
            slot = -1
            for child in sorted(trees[rank][tree][1], key=ready.__getitem__):
                slot = max(ready[child], slot + 1)
                phases[tree, child] = slot % period
            ready[rank] = slot + 1
    return lambda tree, child: phases[tree, child]


def _color(arcs: list[tuple[int, int, int]], world_size: int, period: int) -> list[int]:
    """A phase 0..period-1 for each message class ``(sender, receiver, preferred phase)`` such that no
    rank sends two, or receives two, of the same phase: König's edge colouring of the bipartite
    graph of senders and receivers (each rank sends and receives at most ``period`` classes),
    keeping the preferred phase where it is free at both ends."""
    sent: list[dict[int, int]] = [{} for _ in range(world_size)]  # phase -> arc, per sender
    received: list[dict[int, int]] = [{} for _ in range(world_size)]  # phase -> arc, per receiver
    phases = [-1] * len(arcs)
    for arc, (sender, receiver, preferred) in enumerate(arcs):
        order = [(preferred + k) % period for k in range(period)]
        free = next(p for p in order if p not in sent[sender])
        if free in received[receiver]:
            other = next(p for p in order if p not in received[receiver])
            if other not in sent[sender]:
                free = other
            else:
                # Swap free/other along the path from the receiver that alternates between them (it
                # cannot reach the sender, which lacks `free`); then `free` is free at both ends.
                path, node, phase, at_receiver = [], receiver, free, True
                while (hop := (received if at_receiver else sent)[node].get(phase)) is not None:
                    path.append(hop)
                    node = arcs[hop][0] if at_receiver else arcs[hop][1]
                    at_receiver, phase = not at_receiver, other if phase == free else free
                for hop in path:
                    del sent[arcs[hop][0]][phases[hop]], received[arcs[hop][1]][phases[hop]]
                for hop in path:
                    phases[hop] = other if phases[hop] == free else free
                    sent[arcs[hop][0]][phases[hop]] = received[arcs[hop][1]][phases[hop]] = hop
        phases[arc] = free
        sent[sender][free] = received[receiver][free] = arc
    return phases


@functools.lru_cache(maxsize=16)
def timetable(world_size: int) -> dict[tuple[int, int, int], int]:
    """The double tree's :func:`timetable_of`, its links preferring the binary tree's phases."""
    trees = [double_trees(world_size, rank) for rank in range(world_size)]
    return timetable_of(trees, PERIOD, functools.partial(_preferred_phase, world_size))


def timetable_of(trees: Trees, period: int, preferred: Callable[[int, int],
                                                                int]) -> dict[tuple[int, int, int], int]:
    """The slot of segment 0 of every message class of ``trees``, by ``(tree, child, direction)``
    (the link from ``child`` to its parent; 0 up, 1 down); segment s goes ``period·s`` slots later.

    Each class gets a phase (its slot mod ``period``, :func:`_color`, preferring
    ``preferred(tree, child)``); then, tree by tree, the earliest slot of that phase after what
    it waits for: going up, after its children's; going down, after its parent's (the root's
    children: after the root heard them).
    """
    world_size = len(trees)
    links = [(tree, child, trees[child][tree][0]) for tree in range(2) for child in range(world_size)]
    links = [link for link in links if link[2] >= 0]
    arcs = []
    for tree, child, parent in links:
        arcs += [(child, parent, preferred(tree, child)), (parent, child, preferred(tree, child))]
    phases = _color(arcs, world_size, period)
    phase = {(tree, child, direction): phases[2 * i + direction]
             for i, (tree, child, _) in enumerate(links)
             for direction in range(2)}

    def at_or_after(slot: int, phase: int) -> int:
        return slot + (phase - slot) % period

    slots = {}
    for tree in range(2):
        order = _top_down(trees, tree)
        heard = 0
        for rank in reversed(order):  # children before parents, the root last; then back down
            parent, children = trees[rank][tree]
            ready = max((slots[tree, c, 0] + 1 for c in children), default=0)
            if parent < 0:
                heard = ready
            else:
                slots[tree, rank, 0] = at_or_after(ready, phase[tree, rank, 0])
        for rank in order:
            parent, children = trees[rank][tree]
            ready = heard if parent < 0 else slots[tree, rank, 1] + 1
            for c in children:
                slots[tree, c, 1] = at_or_after(ready, phase[tree, c, 1])
    return slots


@functools.lru_cache(maxsize=256)
def schedule(world_size: int, rank: int, segments: int) -> tuple[tuple[Move | None, Move | None], ...]:
    """``rank``'s steps in the double tree, in order: (send, receive) pairs, either of them None,
    one per slot (:func:`schedule_of`)."""
    return schedule_of(double_trees(world_size, rank), timetable(world_size), PERIOD, rank, segments)


def schedule_of(mine: Sequence[tuple[int, Sequence[int]]], slots: dict[tuple[int, int, int], int],
                period: int, rank: int, segments: int) -> tuple[tuple[Move | None, Move | None], ...]:
    """``rank``'s steps, in order: (send, receive) pairs, either of them None, one per slot, given
    its (parent, children) in each tree (``mine``) and the :func:`timetable_of` of the trees."""
    moves = []
    for tree, (parent, children) in enumerate(mine):
        last = max(children, key=lambda c: slots[tree, c, 0], default=-1)  # the root finishes after it
        for segment in range(segments):
            later = period * segment
            # Up: each child's part of the segment comes in and is folded into ours; then ours goes up.
            # Down: the finished segment comes from the parent (the root made it), then goes to each child.
            for child in children:
                moves.append(
                    Move(slots[tree, child, 0] + later, child, False, tree, segment, True, parent < 0 and
                         child == last))
                moves.append(Move(slots[tree, child, 1] + later, child, True, tree, segment, False, False))
            if parent >= 0:
                moves.append(Move(slots[tree, rank, 0] + later, parent, True, tree, segment, False, False))
                moves.append(Move(slots[tree, rank, 1] + later, parent, False, tree, segment, False, False))
    by_slot: dict[int, list[Move | None]] = {}
    for move in moves:
        step = by_slot.setdefault(move.slot, [None, None])
        if step[1 - move.sends] is not None:
            raise RuntimeError(f"tree schedule: rank {rank} has two "
                               f"{'sends' if move.sends else 'receives'} in slot {move.slot}")
        step[1 - move.sends] = move
    return tuple(tuple(by_slot[slot]) for slot in sorted(by_slot))
