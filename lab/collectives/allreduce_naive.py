"""Naive allreduce: everyone sends to rank 0, rank 0 sends the result back (the O(N) baseline)."""

from __future__ import annotations

import numpy as np

from lab.mesh import Mesh
from lab.ops import Reduction


def allreduce_naive(mesh: Mesh, buf: np.ndarray, reduction: Reduction) -> None:
    """Reduce ``buf`` in place across all ranks through rank 0: the lesson's bad baseline.

    Cost: 2(N-1)·(α + T·β), all of it through one rank: rank 0 receives (N-1)·T bytes and sends
    (N-1)·T bytes, so its link is the bottleneck and the time grows linearly with N. Every other
    rank sends T and receives T.

    Per rank, N=4, sum, ``buf`` = arange(8) + rank::

        every rank -> buf == 4 * arange(8) + 6
    """
    n, rank = mesh.world_size, mesh.rank
    if rank == 0:
        # Fold in every other rank's whole tensor, one after the other.
        for src in range(1, n):
            mesh.recv_buffer(src, buf, reduction.combine)
        reduction.finalize(buf, n)
        # Send the result back to each of them, one after the other.
        for dst in range(1, n):
            mesh.send_buffer(dst, buf)
    else:
        mesh.send_buffer(0, buf)
        mesh.recv_buffer(0, buf)
