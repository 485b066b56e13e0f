"""NCCL's tree across hosts: a chain through the ranks of each host, a double binary tree across
the hosts, and both trees pipelined at once on the double tree's timetable
(:mod:`lab.algorithms.double_tree_schedule`, which takes any two trees)."""

from __future__ import annotations

import functools

import numpy as np

from lab.algorithms.allreduce_double_tree import run_steps
from lab.algorithms.double_tree_schedule import (
    NETWORK_LATENCY_BYTES,
    Move,
    Trees,
    depth_of,
    double_trees,
    greedy_phases,
    period_of,
    schedule_of,
    segment_count,
    timetable_of,
)
from lab.algorithms.peers import Peers, host_groups
from lab.chunking import split_bounds
from lab.ops import Reduction

#: The ranks of each host, in rank order, hosts in order of their first rank (a cache key).
Hosts = tuple[tuple[int, ...], ...]


def allreduce_chain_tree(peers: Peers, buf: np.ndarray, reduction: Reduction,
                         segment_bytes: int | None = None,
                         latency_bytes: int = NETWORK_LATENCY_BYTES) -> None:
    """Reduce ``buf`` in place across all ranks: half through each of two chain-and-tree trees, pipelined.

    Tree t (:func:`chain_trees`) runs a chain through the ranks of every host and joins the hosts
    by tree t of the double binary tree over hosts (:func:`double_trees` of H). Tree 0's chain
    starts at each host's first rank, tree 1's at its last: each host's head, the rank that talks
    to other hosts, is local rank 0 in tree 0 and local rank L-1 in tree 1, so with one NIC per
    rank (rails) the two trees leave and enter a host through different NICs. As in the double
    tree, tree t reduces half t to its root and broadcasts it back down in S segments
    (:func:`segment_count` for the trees' depth), everything at once, each step one
    ``peers.sendrecv_buffer``, on the timetable of :func:`chain_timetable`: period P (the most
    messages a rank handles per segment: 5 for the head of a host with a parent and two child
    hosts, H >= 4; 4 inside a chain, and with one rank per host), no rank sending two or receiving
    two in one slot. Deadlock-free however small the transport's buffers, by the double tree's
    argument (:func:`lab.algorithms.allreduce_double_tree.allreduce_double_tree`): both ends of
    a message compute its slot, and every rank runs its slots in increasing order.

    Cost, H hosts of L ranks, S segments of T/(2S) bytes, α', β' between hosts and α, β inside:
    about P·(S + ⌈log2 H⌉)·(α' + T/(2S)·β') + 2(L-1)·(α + T/(2S)·β). Each segment takes the
    period's P slots, each as long as a message between hosts (in every slot some rank of a
    chain talks across hosts, and the slots keep the chain in step; one more with one NIC per
    host, where both trees' heads queue), and the pipeline fills through ⌈log2 H⌉ levels of
    hosts and L-1 ranks of each chain. Between hosts an inner host's head sends and receives
    1.5T (its parent and two child hosts, T/2 each), in ⌈log2 H⌉ levels where a ring crosses
    hosts 2(H-1) or 2(N-1) times. Bit-identical on every rank: each segment is reduced once, in
    one order, at its tree's root, and copied down.

    Bytes, exactly (T_t = bytes of half t, ``split_bounds(count, 2)``; c_t = this rank's children
    in tree t; u_t = 1 unless it is tree t's root): sends and receives Σ_t (c_t + u_t)·T_t, as
    :func:`bytes_sent` counts. A rank inside a chain sends 2T (T/2 up and down in each tree); an
    inner host's head 5T/2, a leaf host's head 3T/2 (2T, T with one rank per host); the roots less.

    Per rank, 2 hosts x 2 ranks, sum, ``buf`` = arange(8) + rank::

        chain_trees(((0, 1), (2, 3)))   # tree 0: 0 -> 1 and 0 -> 2 -> 3; tree 1: 3 -> 2 and 3 -> 1 -> 0
        every rank -> buf == 4 * arange(8) + 6
    """
    n = peers.world_size
    hosts = tuple(tuple(group) for group in host_groups(peers))
    halves = [buf[a:b] for a, b in split_bounds(buf.size, 2)]
    depth = depth_of(chain_trees(hosts))
    segments = segment_count(buf.size, buf.itemsize, n, segment_bytes, latency_bytes, depth)
    pieces = [[half[a:b] for a, b in split_bounds(half.size, segments)] for half in halves]
    # One rank: its data is the reduction; finish it (avg divides by 1).
    if n == 1:
        reduction.finalize(buf, n)
        return
    # Every step: one message out, one in, or both at once; each tree's root finishes its segments.
    run_steps(peers, chain_schedule(hosts, peers.rank, segments), pieces, reduction)


@functools.lru_cache(maxsize=16)
def chain_trees(hosts: Hosts) -> Trees:
    """(parent, children) of every rank in each of the two trees (parent -1 at the root).

    Tree t: each host's ranks form a chain (in rank order in tree 0, reversed in tree 1) whose
    first rank, the host's head, is the child of the parent host's head in tree t of
    :func:`double_trees` over the hosts, and the parent of its child hosts' heads.

        chain_trees(((0, 1, 2), (3, 4, 5)))[0]   # rank 0: ((-1, (1, 3)), (1, ()))
    """
    world_size = sum(map(len, hosts))
    trees: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(world_size)]
    for tree in range(2):
        chains = [group if tree == 0 else group[::-1] for group in hosts]
        for host, chain in enumerate(chains):
            parent_host, child_hosts = double_trees(len(hosts), host)[tree]
            for place, rank in enumerate(chain):
                parent = chain[place - 1] if place else chains[parent_host][0] if parent_host >= 0 else -1
                children = chain[place + 1:place + 2] + (tuple(chains[c][0]
                                                               for c in child_hosts) if not place else ())
                trees[rank].append((parent, children))
    return tuple(tuple(mine) for mine in trees)


@functools.lru_cache(maxsize=16)
def chain_timetable(hosts: Hosts) -> tuple[int, dict[tuple[int, int, int], int]]:
    """(the period, the slot of segment 0 of every message class) of :func:`chain_trees`: the
    double tree's timetable (:func:`timetable_of`), each link preferring the phase it would take
    in its tree alone (:func:`greedy_phases`)."""
    trees = chain_trees(hosts)
    period = period_of(trees)
    return period, timetable_of(trees, period, greedy_phases(trees, period))


@functools.lru_cache(maxsize=256)
def chain_schedule(hosts: Hosts, rank: int, segments: int) -> tuple[tuple[Move | None, Move | None], ...]:
    """``rank``'s steps, in order: (send, receive) pairs, either of them None, one per slot."""
    period, slots = chain_timetable(hosts)
    return schedule_of(chain_trees(hosts)[rank], slots, period, rank, segments)


def host_layout(world_size: int, hosts: int) -> Hosts:
    """``hosts`` hosts of N/H consecutive ranks (as ``lab.launch(hosts=)`` places them).

        host_layout(6, 2)     # ((0, 1, 2), (3, 4, 5))
    """
    per_host = world_size // hosts
    return tuple(tuple(range(h * per_host, (h + 1) * per_host)) for h in range(hosts))


def shape(world_size: int) -> tuple[float, float]:
    """The cost above on one host (where fits are made: two chains of N ranks) as (latency steps
    on the critical path, bytes through the busiest rank per tensor byte), for ``auto``'s model
    (:mod:`lab.tuning`) and the reports; across hosts, see :func:`across_hosts_us`."""
    return 4 * max(world_size - 1, 1), 2.0


def bytes_sent(rank: int, world_size: int, total: int, hosts: int = 1) -> tuple[int, str]:
    """(bytes this rank sends, which equal the bytes it receives; the formula), from the docstring,
    for a tensor of ``total`` bytes whose element count p and 2N divide, on ``hosts`` hosts of
    N/H consecutive ranks (``python -m lab``'s check: one host)."""
    # each half, T/2, once per child and once to the parent, in each tree
    mine = chain_trees(host_layout(world_size, hosts))[rank]
    links = sum(len(children) + (parent >= 0) for parent, children in mine)
    return links * total // 2, f"{links}T/2"


def across_hosts_us(nbytes: int, world_size: int, hosts: int, inside: tuple[float, float],
                    across: tuple[float, float], nics_per_host: int = 1) -> float:
    """The time on ``hosts`` hosts of L = N/H ranks, for ``auto`` across hosts, in S segments of
    T/(2S) (the algorithm's count, for 4-byte elements): each segment takes its timetable's P
    slots (the period: 5 with L > 1 and H >= 4), each as long as a message between hosts,
    α' + T/(2S)·β' at ``across``'s terms, since in every slot some rank of the chain talks across
    hosts and the slots keep the chain in step; one more with one NIC per host, where both trees'
    heads queue on it; plus the pipeline's fill, P such slots per level of hosts and 2 inside per
    rank of a chain, α + T/(2S)·β at ``inside``'s. Against :mod:`lab.sim` on the same terms (4 and
    16 hosts of 8 ranks, rails or one NIC, α' 5 µs at 400 Gbit/s): within 25 % from 16 MiB up,
    up to 1.7x above it at 64 KiB-1 MiB."""
    (alpha, beta), (alpha_x, beta_x) = inside, across
    per_host, levels = world_size // hosts, (hosts - 1).bit_length()
    trees = chain_trees(host_layout(world_size, hosts))
    period, depth = period_of(trees), depth_of(trees)
    segments = segment_count(nbytes // 4, 4, world_size, depth=depth)
    piece = nbytes / (2 * segments)
    between, within = alpha_x + piece * beta_x, alpha + piece * beta
    slots = period + (nics_per_host == 1 and per_host > 1)
    return (segments * slots + period * levels) * between + 2 * (per_host - 1) * within
