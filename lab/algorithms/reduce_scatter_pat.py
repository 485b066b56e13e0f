"""PAT reduce-scatter: NCCL's Parallel Aggregated Trees, ⌈log2 N⌉ messages at the ring's bytes."""

from __future__ import annotations

import numpy as np

from lab.algorithms.pat_schedule import message_count, packed, reduce_scatter_messages, unpack
from lab.algorithms.peers import Peers
from lab.chunking import ring_chunk
from lab.ops import Reduction


def reduce_scatter_pat(peers: Peers, buf: np.ndarray, reduction: Reduction, bounds: list[tuple[int,
                                                                                               int]]) -> None:
    """Leave the reduction over all ranks of chunk ``peers.rank`` (``buf[bounds[rank]]``) in place.

    Block r's contributions climb a binomial tree rooted at rank r: rank r - s holds it at offset
    s and, once its own partial of it is complete, sends it over dimension lowbit(s) (the index
    of s's lowest set bit) to rank r - s + 2^lowbit(s), which folds it into its partial. The partials that cross a dimension
    together travel as one message (NCCL's aggregation; which and in what order:
    :mod:`lab.algorithms.pat_schedule`): for N = 2^k, message d goes to rank r + 2^d and
    carries the N/2^(d+1) blocks at offsets with lowest bit d. Every partial is complete when it
    leaves, because it only waits on messages over lower dimensions, which go first. Other
    chunks of ``buf`` are left holding partial sums.

    As in NCCL, a message packs whole blocks and a received one is folded where its blocks
    belong; NCCL cuts each block into step-buffer pieces and runs the schedule once per piece,
    and folds some pieces later than they arrive (so a float sum may round differently).

    Cost: ⌈log2 N⌉·α + (N-1)/N·T·β for a T-byte buffer (one more α when N = 2^k + 1 > 3): the
    ring's bytes in recursive halving's steps, with no fold steps when N is not a power of two.

    Bytes, exactly (B_i = bytes of block i, lowbit(s) = the index of s's lowest set bit):
    rank r sends Σ_{s=1}^{N-1} B_{(r+s) mod N} = T - B_r and receives
    Σ_{s=1}^{N-1} B_{(r+s-2^lowbit(s)) mod N}; (N-1)/N·T each way when N divides the count.

    Per rank, N=3, sum, ``buf`` = [r, r, r] with one element per chunk::

        rank 0 -> buf[0] == 3;  rank 1 -> buf[1] == 3;  rank 2 -> buf[2] == 3
    """
    n, rank = peers.world_size, peers.rank
    for dim, offsets in reduce_scatter_messages(n):
        distance = 1 << dim
        # Our partials of blocks r + s go to rank r + 2^d, where they are offsets s - 2^d; rank
        # r - 2^d sends us its partials of our blocks r + s - 2^d, folded into ours on arrival.
        outgoing = packed([ring_chunk(buf, bounds, rank + s) for s in offsets])
        targets = [ring_chunk(buf, bounds, rank + s - distance) for s in offsets]
        folded = packed(targets)  # our partials, folded with the incoming ones in one pass
        peers.sendrecv_buffer((rank + distance) % n, outgoing, (rank - distance) % n, folded, reduction)
        unpack(folded, targets)
    # Block r now holds every contribution: finish it here, once (avg divides).
    reduction.finalize(ring_chunk(buf, bounds, rank), n)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return message_count(n), (n - 1) / n
