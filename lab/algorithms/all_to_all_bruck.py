"""Bruck all-to-all: ⌈log2 N⌉ steps, each sending about half the blocks (latency-optimal)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers


def all_to_all_bruck(peers: Peers, send: np.ndarray, recv: np.ndarray, send_bounds: list[tuple[int, int]],
                     recv_bounds: list[tuple[int, int]]) -> None:
    """Rank r sends ``send[send_bounds[j]]`` to rank j and receives rank j's block into ``recv[recv_bounds[j]]``.

    Rotate: slot i holds our block for rank r + i. Then for k = 0, 1, ...: send every slot whose
    index has bit k set to rank r + 2^k, and take the same slots from rank r - 2^k: a block for
    distance i moves by the binary digits of i, so after ⌈log2 N⌉ steps slot i holds the block
    from rank r - i. Unrotate into ``recv``. The slots sent together are packed into one message.

    Cost: ⌈log2 N⌉·α + about ⌈log2 N⌉/2·T·β (every step sends about half the blocks): fewer
    steps than pairwise's N-1, more bytes; it wins for small blocks.

    Bytes, exactly: in step k a rank sends, for each slot i < N with bit k set, the block of the
    rank that slot is bound for, r + i - (i mod 2^k); with equal blocks of B bytes (N | rows)
    that is B·Σ_{i<N} popcount(i) in all (B·(N/2)·log2 N when N = 2^k), each way.

    Per rank, N=2, ``send`` = [10r, 10r + 1]::

        rank 0 -> recv == [0, 10];  rank 1 -> recv == [1, 11]
    """
    n, rank = peers.world_size, peers.rank
    size = [stop - start for start, stop in send_bounds]  # every rank's block for rank j has size[j]
    # Rotate: slot i holds our block for rank r + i.
    slots = [send[send_bounds[(rank + i) % n][0]:send_bounds[(rank + i) % n][1]].copy() for i in range(n)]
    distance = 1
    while distance < n:
        moving = [i for i in range(n) if i & distance]
        # Pack the slots with this bit set, swap them with the ranks `distance` away, unpack.
        outgoing = np.concatenate([slots[i] for i in moving]) if moving else send[:0]
        sizes = [size[(rank - distance + i - i % distance) % n] for i in moving]
        incoming = np.empty(sum(sizes), send.dtype)
        peers.sendrecv_buffer((rank + distance) % n, outgoing, (rank - distance) % n, incoming)
        offsets = np.cumsum([0, *sizes])
        for i, start, stop in zip(moving, offsets[:-1], offsets[1:]):
            slots[i] = incoming[start:stop]
        distance *= 2
    # Unrotate: slot i holds the block from rank r - i.
    for i in range(n):
        src = (rank - i) % n
        recv[recv_bounds[src][0]:recv_bounds[src][1]] = slots[i]


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    return d, d / 2
