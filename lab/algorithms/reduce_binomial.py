"""Binomial-tree reduce to one rank (the first half of tree allreduce, to any root)."""

from __future__ import annotations

import numpy as np

from lab.algorithms.fold import power_terms
from lab.algorithms.peers import Peers
from lab.compiled import compilable
from lab.ops import Reduction


@compilable
def reduce_binomial(peers: Peers, buf: np.ndarray, reduction: Reduction, dst: int) -> None:
    """Leave the reduction over all ranks in ``buf`` on rank ``dst``; other ranks' ``buf`` unchanged.

    Ranks are numbered relative to the root (v = (rank - dst) mod N). At distance 1, 2, 4, ...
    a rank folds in the partial result of the child at that distance, until it is itself the
    child at that distance and hands its partial result to its parent. An inner rank other than
    the root accumulates into a scratch copy, so its caller's tensor stays as it was.

    Cost: ⌈log2 N⌉·(α + T·β) on the critical path; the root receives T per child
    (⌈log2 N⌉·T when N = 2^k) and sends nothing.

    Bytes, exactly (T = bytes of ``buf``; children of v: v + 2^j for each 2^j below v's lowest
    set bit, with v + 2^j < N): rank v receives (children)·T and sends T unless it is the root.

    Per rank, N=3, dst=1, sum, ``buf`` = [rank]::

        rank 1 -> buf == [3];  ranks 0 and 2 -> buf unchanged ([0] and [2])
    """
    n, rank = peers.world_size, peers.rank
    relative = (rank - dst) % n
    # The root reduces in place; a rank with children (its first is v + 1) reduces into a copy.
    has_children = relative % 2 == 0 and relative + 1 < n
    work = buf.copy() if has_children and relative else buf
    mask = 1
    while mask < n:
        if relative & mask:
            # Our subtree is complete: hand its partial result to the parent.
            peers.send_buffer((rank - mask) % n, work)
            return
        if relative + mask < n:
            # Fold in the child's subtree at this distance.
            peers.recv_buffer((rank + mask) % n, work, reduction)
        mask <<= 1
    # Only the root gets here: it holds every contribution; finish it once (avg divides).
    reduction.finalize(work, n)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    d = power_terms(world_size).d
    return d, d
