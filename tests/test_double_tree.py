"""The pipelined double tree allreduce: its schedule checked without processes (every message in
one slot at both ends, in the same order, after the data it forwards; no deadlock even when no
byte can be buffered), then real runs on the smallest shm buffers (64-byte segments, one slot,
nothing eager) at world sizes 2-7: exact results on every rank, bit-identical random floats,
and byte counters equal to the docstring's formula.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers import pool, run_without_buffers

import lab
from lab.algorithms.allreduce_double_tree import bytes_sent
from lab.algorithms.double_tree_schedule import (
    HOST_LATENCY_BYTES,
    double_trees,
    latency_bytes,
    schedule,
    segment_count,
)

SCHEDULE_WORLDS = [*range(1, 34), 64, 100, 127, 128]
STRIDE = 3


def all_steps(n: int, segments: int) -> list[tuple]:
    return [schedule(n, rank, segments) for rank in range(n)]


@pytest.mark.parametrize("n", SCHEDULE_WORLDS)
@pytest.mark.parametrize("segments", [1, 3])
def test_both_ends_of_every_message_agree_on_its_slot_and_order(n, segments):
    """Rank a's sends to b, in step order, are b's receives from a, in step order: same slot,
    tree and segment; each piece crosses each tree link once up and once down; slots increase."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, steps in enumerate(all_steps(n, segments)):
        slots = [(send or recv).slot for send, recv in steps]
        assert slots == sorted(set(slots)), f"rank {rank}: slots not increasing"
        for send, recv in steps:
            assert send is None or recv is None or send.slot == recv.slot
            if send is not None:
                sent[rank, send.peer].append((send.slot, send.tree, send.segment))
            if recv is not None:
                received[recv.peer, rank].append((recv.slot, recv.tree, recv.segment))
    assert sent == received
    links = sum(len(children) + (parent >= 0) for r in range(n)
                for parent, children in double_trees(n, r)) // 2
    assert sum(map(len, sent.values())) == 2 * links * segments  # up and down, per tree link and segment


@pytest.mark.parametrize("n", SCHEDULE_WORLDS)
def test_each_rank_forwards_a_segment_only_after_it_has_it(n):
    """Per tree and segment: every child's part is folded in before ours goes up, the root
    finishes once after its child, and nothing goes down before it came down (or was finished)."""
    segments = 2
    for rank, steps in enumerate(all_steps(n, segments)):
        for tree, (parent, children) in enumerate(double_trees(n, rank)):
            for segment in range(segments):
                order = []
                for send, recv in steps:  # within a step the receive and the send are of other pieces
                    mine = [
                        m for m in (recv, send) if m is not None and (m.tree, m.segment) == (tree, segment)]
                    assert len(mine) <= 1, f"rank {rank}: a step sends and receives the same piece"
                    order += mine
                folded = [m for m in order if not m.sends and m.reduces]
                assert sorted(m.peer for m in folded) == sorted(children)
                assert [m.finishes for m in folded] == [parent < 0] * len(folded)
                going_up = [m for m in order if m.sends and m.peer == parent and parent >= 0]
                coming_down = [m for m in order if not m.sends and not m.reduces]
                going_down = [m for m in order if m.sends and m.peer in children]
                expected = folded + going_up + coming_down + sorted(going_down, key=order.index)
                assert order == expected, f"rank {rank} tree {tree} segment {segment}: {order}"


@pytest.mark.parametrize("n", SCHEDULE_WORLDS)
def test_the_schedule_finishes_with_no_buffering_at_all(n):
    run_without_buffers(all_steps(n, segments=4))


def test_segment_count_grows_as_the_square_root_of_the_tensor():
    assert segment_count(256, 4, 1024) == 1  # 1 KB: a single segment, the fill is what costs
    assert segment_count(16 << 20 >> 2, 4, 4) == 16  # across a network (α/β = 64 KiB)
    assert segment_count(16 << 20 >> 2, 4, 4, latency_bytes=HOST_LATENCY_BYTES) == 1  # on one host
    assert latency_bytes("shm") == latency_bytes("auto", hosts=1) == HOST_LATENCY_BYTES
    assert latency_bytes("tcp") == latency_bytes("auto", hosts=2) == latency_bytes("sim") == 64 * 1024
    assert segment_count((64 << 20) >> 2, 4, 1024) == 72
    assert segment_count(0, 4, 8) == 1
    assert segment_count(1000, 4, 8, segment_bytes=64) == 32  # at most 16 elements each
    assert segment_count(5, 4, 8, segment_bytes=1) == 3  # never more segments than a half's elements


# -- real runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3, 4, 5, 6, 7], ids=lambda n: f"shm-N{n}")
def smallest_buffers(request):
    """One pool per world size on the smallest shm buffers: every message is a rendezvous."""
    with pool(request.param, "shm", segment_bytes=64, slots=1, eager_bytes=0) as cluster:
        yield cluster


def counts(n: int, forced: str) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by 2N, and enough for many segments: 201 8-byte
    elements make 13 of 64 bytes per half, the last one short (more segments only repeat the
    pipeline's middle step); a larger tensor only with the default sizing, one segment per half
    on shm: 2,001 elements cross the pool's 64-byte buffers 125 times a half (20,000 took 90 % of
    the module's time for the same steps, on 2 cores)."""
    return sorted({0, 1, n - 1, 2 * n + 3, 201} | ({2001} if not forced else set()))


def check_results(mesh: lab.Mesh) -> list[str]:
    """Exact sums, maxima and averages of ``index * 3 + rank`` on this rank; bit-identical
    random-float sums across ranks; byte counters against ``bytes_sent``. With the default
    segments (sized from the tensor) and with 64-byte segments (``LAB_SEGMENT_BYTES``)."""
    n, rank = mesh.world_size, mesh.rank
    failures = []
    for forced in ["", "64"]:
        os.environ["LAB_SEGMENT_BYTES"] = forced  # read by every call; "" is the default sizing
        for count in counts(n, forced):
            index = torch.arange(count, dtype=torch.float64)
            cases = [("sum", torch.int64, index * STRIDE * n + n * (n - 1) // 2),
                     ("max", torch.float32, index * STRIDE + n - 1),
                     ("avg", torch.float64, index * STRIDE + (n - 1) / 2)]
            for op, dtype, want in cases:
                x = (index * STRIDE + rank).to(dtype)
                lab.allreduce(mesh, x, op=op, algorithm="double_tree")
                wrong = int((x != want.to(dtype)).sum())
                if wrong:
                    failures.append(f"rank {rank} segments={forced or 'auto'} {op} {dtype} count {count}: "
                                    f"{wrong} wrong")
            noise = torch.rand(count, generator=torch.Generator().manual_seed(rank))
            lab.allreduce(mesh, noise, algorithm="double_tree")
            everyone = lab.allgather(mesh, noise.view(torch.int32)).view(n, count)
            if not bool((everyone == everyone[0]).all()):
                failures.append(
                    f"rank {rank} segments={forced or 'auto'} count {count}: random floats differ "
                    "between ranks")
        mesh.reset_stats()
        lab.allreduce(mesh, torch.arange(840.0), algorithm="double_tree")  # 2N divides 840 for N <= 7
        stats, (want, formula) = mesh.stats(), bytes_sent(rank, n, 840 * 4)
        if (stats["bytes_sent"], stats["bytes_received"]) != (want, want):
            failures.append(f"rank {rank} segments={forced or 'auto'}: sent/received {stats['bytes_sent']}/"
                            f"{stats['bytes_received']}, {formula} = {want}")
    del os.environ["LAB_SEGMENT_BYTES"]
    return failures


@pytest.mark.slow
def test_results_bits_and_bytes_on_the_smallest_buffers(smallest_buffers):
    failures = [f for per_rank in smallest_buffers.run(check_results) for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_one_rank_finishes_avg_alone():
    x = np.arange(5, dtype=np.float32)
    assert lab.spawn(_allreduce_avg, 1, args=(x,))[0].tolist() == x.tolist()


def _allreduce_avg(mesh: lab.Mesh, x: np.ndarray) -> np.ndarray:
    return lab.allreduce(mesh, x.copy(), op="avg", algorithm="double_tree")
