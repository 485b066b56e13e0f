"""Dissemination barrier: ⌈log2 N⌉ rounds of empty messages (Hensgen, Finkel and Manber)."""

from __future__ import annotations

import numpy as np

from lab.mesh import Mesh


def barrier_dissemination(mesh: Mesh) -> None:
    """Return once every rank has entered.

    Round k: signal rank r + 2^k and wait for rank r - 2^k. After round k a rank has heard,
    directly or through others, from the 2^(k+1) - 1 ranks before it, so after ⌈log2 N⌉ rounds
    from all of them. Works for any N (no fold needed).

    Cost: ⌈log2 N⌉·α. Bytes: none; ⌈log2 N⌉ messages sent and received per rank.

    Per rank, N=3: every rank returns only after all three have called it.
    """
    n, rank = mesh.world_size, mesh.rank
    empty = np.empty(0, np.uint8)
    distance = 1
    while distance < n:
        # Signal the rank `distance` ahead; wait for the one `distance` behind.
        mesh.sendrecv_buffer((rank + distance) % n, empty, (rank - distance) % n, empty)
        distance *= 2
