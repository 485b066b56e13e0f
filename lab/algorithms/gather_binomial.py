"""Binomial-tree gather to any root (MPICH's): ⌈log2 N⌉ rounds, each rank sending its subtree once."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable


@compilable
def gather_binomial(peers: Peers, send: np.ndarray, recv: np.ndarray, bounds: list[tuple[int, int]],
                    dst: int) -> None:
    """Leave every rank's ``send`` in ``recv[bounds[j]]`` (rank j's block, equal blocks) on rank ``dst``.

    Ranks are numbered relative to the root (v = (rank - dst) mod N). Rank v collects the blocks
    of its subtree, relative ranks v .. v + 2^k - 1 (2^k: v's lowest set bit), in relative order
    at the front of ``recv`` (a non-root rank's ``recv`` is scratch: untouched pages cost nothing),
    taking each child's subtree in one message, then hands the whole run to its parent in one.
    The root's run holds every block, in relative order; it rotates them into rank order.

    Cost: ⌈log2 N⌉·α + (N-1)·B·β for blocks of B bytes (the root receives every other block once,
    through its link); with T = N·B (the result, as nccl-tests counts a gather): (N-1)/N·T·β.

    Bytes, exactly: rank v sends its subtree, min(2^k, N - v)·B (k: v's lowest set bit; the root
    sends nothing) and receives its children's subtrees, min(2^k, N - v)·B - B; the root receives
    (N-1)·B.

    Per rank, N=3, dst=1, ``send`` = [10 + rank]::

        rank 1 -> recv == [10, 11, 12];  ranks 0 and 2: recv is scratch
    """
    n, rank = peers.world_size, peers.rank
    relative = (rank - dst) % n
    block = bounds[0][1] - bounds[0][0]
    # The root collects in a scratch buffer unless relative order is rank order (dst 0).
    work = np.empty_like(recv) if relative == 0 and dst != 0 else recv
    # Our own block opens our run.
    work[:block] = send
    mask = 1
    while mask < n:
        if relative & mask:
            # Our subtree is complete: hand the run to the parent, in one message.
            peers.send_buffer((rank - mask) % n, work[:(min(relative + mask, n) - relative) * block])
            return
        if relative + mask < n:
            # Take the child's subtree at this distance: relative ranks v + mask .. v + 2·mask - 1.
            peers.recv_buffer((rank + mask) % n,
                              work[mask * block:(min(relative + 2 * mask, n) - relative) * block])
        mask <<= 1
    # Only the root gets here: relative slot i holds rank i + dst; rotate into rank order.
    if dst != 0:
        recv[dst * block:] = work[:(n - dst) * block]
        recv[:dst * block] = work[(n - dst) * block:]


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    result byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return power_terms(n).d, (n - 1) / n
