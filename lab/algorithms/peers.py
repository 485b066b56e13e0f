"""What an algorithm sees of whatever runs it: ``Peers``, and views of some of them.

An algorithm is a plain function of a ``Peers``, its buffer and its options. It sends and
receives whole buffers (slices of its own) and asks which host a rank is on; nothing else. So the
same source runs on a mesh over any transport (:class:`lab.Mesh`), inside one phase of another
algorithm (:class:`GroupView`), and on the simulator's recorder, which implements the same five
members and records the calls instead of moving bytes.

    def allreduce_naive(peers: Peers, buf, reduction):
        if peers.rank == 0:
            for src in range(1, peers.world_size):
                peers.recv_buffer(src, buf, reduction)
        ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lab.ops import Reduction  # reduction.combine(out, incoming): fold a received piece into out


class Peers(Protocol):
    """This rank among ``world_size`` ranks, and the pairwise transfers between them."""
    @property
    def rank(self) -> int:
        ...

    @property
    def world_size(self) -> int:
        ...

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        """Send ``data`` to rank ``dst`` (returns once it is in the channel)."""

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Reduction | None = None) -> None:
        """Receive from ``src`` into ``out``: copy, or ``reduction.combine(out, incoming)``."""

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray,
                        reduction: Reduction | None = None) -> None:
        """Send to ``dst`` and receive from ``src`` at once (one ring step)."""

    def host_of(self, rank: int) -> int:
        """The host rank ``rank`` is on (0 for every rank on one machine)."""


class GroupView:
    """Some of ``peers``' ranks renumbered ``0..k-1``, for one phase of an algorithm (hierarchical
    allreduce runs ring phases inside a host and across hosts on them). Its transfers are the
    underlying peers' own: same fingerprint, counters and deadlines."""
    def __init__(self, peers: Peers, ranks: list[int]) -> None:
        self._peers, self._ranks = peers, ranks
        self.rank, self.world_size = ranks.index(peers.rank), len(ranks)

    def send_buffer(self, dst: int, data: np.ndarray) -> None:
        self._peers.send_buffer(self._ranks[dst], data)

    def recv_buffer(self, src: int, out: np.ndarray, reduction: Reduction | None = None) -> None:
        self._peers.recv_buffer(self._ranks[src], out, reduction)

    def sendrecv_buffer(self, dst: int, data: np.ndarray, src: int, out: np.ndarray,
                        reduction: Reduction | None = None) -> None:
        self._peers.sendrecv_buffer(self._ranks[dst], data, self._ranks[src], out, reduction)

    def host_of(self, rank: int) -> int:
        return self._peers.host_of(self._ranks[rank])


@dataclass
class Hierarchy:
    """Where a rank is among hosts, as :class:`GroupView` s: ``host`` (the ranks on its host, in
    rank order), ``shards`` (the fewest ranks any host has), ``leaders`` (its host's first
    ``shards`` ranks) and ``cross`` (the ranks with its local index on every host); ``leaders`` and
    ``cross`` are None for a rank whose local index is ``shards`` or more (a host with more ranks
    than the smallest)."""

    host: GroupView
    shards: int
    leaders: GroupView | None
    cross: GroupView | None


def host_groups(peers: Peers) -> list[list[int]]:
    """The ranks of each host, in rank order, hosts in order of their first rank (from
    :meth:`Peers.host_of`).

        host_groups(peers)        # 5 ranks, hosts [0, 0, 1, 1, 1]: [[0, 1], [2, 3, 4]]
    """
    groups: dict[int, list[int]] = {}
    for rank in range(peers.world_size):
        groups.setdefault(peers.host_of(rank), []).append(rank)
    return list(groups.values())


def hierarchy(peers: Peers) -> Hierarchy:
    """``peers``' rank among hosts, from :meth:`Peers.host_of` (hosts in order of first rank)."""
    groups = host_groups(peers)
    shards = min(len(g) for g in groups)
    mine = next(g for g in groups if peers.rank in g)
    local = mine.index(peers.rank)
    if local >= shards:
        return Hierarchy(GroupView(peers, mine), shards, None, None)
    return Hierarchy(GroupView(peers, mine), shards, GroupView(peers, mine[:shards]),
                     GroupView(peers, [g[local] for g in groups]))
