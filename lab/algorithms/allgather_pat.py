"""PAT allgather: NCCL's Parallel Aggregated Trees, ⌈log2 N⌉ messages at the ring's bytes."""

from __future__ import annotations

import numpy as np

from lab.algorithms.pat_schedule import allgather_messages, landing, message_count, packed, unpack
from lab.algorithms.peers import Peers
from lab.chunking import ring_chunk


def allgather_pat(peers: Peers, buf: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Given chunk ``peers.rank`` of ``buf`` on every rank, fill in every other chunk.

    Reduce-scatter PAT's trees run the other way: block r spreads down a binomial tree rooted at
    rank r. Rank r - s holds it at offset s; it receives it from rank r - s + 2^lowbit(s) (lowbit:
    the index of s's lowest set bit), over dimension lowbit(s), and passes it on over every lower
    dimension. The blocks that cross a dimension together travel as one message (NCCL's
    aggregation; which and in what order: :mod:`lab.algorithms.pat_schedule`): for N = 2^k,
    message d (d = k-1 down to 0) goes to rank r - 2^d and carries the N/2^(d+1) blocks at
    offsets that are multiples of 2^(d+1), all of which arrived over higher dimensions, which go
    first.

    As in NCCL, a message packs whole blocks, copied where they belong on arrival; NCCL cuts
    each block into step-buffer pieces and runs the schedule once per piece.

    Cost: ⌈log2 N⌉·α + (N-1)/N·T·β for a T-byte result (one more α when N = 2^k + 1 > 3): the
    ring's bytes in recursive doubling's steps, with no fold steps when N is not a power of two.

    Bytes, exactly (B_i = bytes of block i, lowbit(s) = the index of s's lowest set bit):
    rank r receives Σ_{s=1}^{N-1} B_{(r+s) mod N} = T - B_r and sends
    Σ_{s=1}^{N-1} B_{(r+s-2^lowbit(s)) mod N}; (N-1)/N·T each way when N divides the count.

    Per rank, N=3, ``buf`` = [0, 0, 0] with ``buf[r] = 10 + r`` on rank r::

        every rank -> buf == [10, 11, 12]
    """
    n, rank = peers.world_size, peers.rank
    for dim, offsets in allgather_messages(n):
        distance = 1 << dim
        # Rank r - 2^d lacks our blocks r + s - 2^d (its offsets s); rank r + 2^d has our blocks
        # r + s (its offsets s - 2^d), copied into place on arrival.
        outgoing = packed([ring_chunk(buf, bounds, rank + s - distance) for s in offsets])
        targets = [ring_chunk(buf, bounds, rank + s) for s in offsets]
        incoming = landing(targets)
        peers.sendrecv_buffer((rank - distance) % n, outgoing, (rank + distance) % n, incoming)
        unpack(incoming, targets)


def shape(world_size: int) -> tuple[float, float]:
    """The cost above as (latency steps on the critical path, bytes through the busiest rank per
    tensor byte), for ``auto``'s model (:mod:`lab.tuning`) and the reports."""
    n = world_size
    return message_count(n), (n - 1) / n
