"""PAT allgather and reduce_scatter: NCCL's schedule, byte counts to the block, the simulator, ``auto``.

Results at every world size 1-8, dtype, op and count run with the other algorithms in
tests/test_collectives.py (and against gloo in tests/test_gloo.py; the simulator's counters
against real runs in tests/test_sim.py). Here: the schedule's messages against the ones NCCL's
``PatRSAlgorithm``/``PatAGAlgorithm::getNextOp`` emit at its largest aggregation, which blocks
travel when, every rank's bytes when blocks are uneven (the docstrings' exact formulas), 1,024
ranks in the simulator, and ``auto`` weighing PAT by its cost shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import pool

import lab
from lab import sim, tuning
from lab.algorithms import allgather_pat, reduce_scatter_pat, registry
from lab.algorithms.pat_schedule import aggregation, allgather_messages, lowest_bit, reduce_scatter_messages

#: (dimension, offsets) of each message, as NCCL's getNextOp emits them at rank 0 (the sent blocks'
#: offsets for reduce-scatter, the received ones for allgather) when every block fits one step
#: buffer: its largest aggFactor. Traced on 2026-12-06 from src/include/collectives.h of NCCL's
#: master of June 2026 (2.29.7 and the 2.30 development squash), by a line-by-line Python copy of
#: both getNextOp kept out of the repository; it agreed with the schedule at every N from 2 to 129.
NCCL_REDUCE_SCATTER = {
    2: [(0, [1])], 3: [(1, [2]), (0, [1])], 5: [(0, [3]), (1, [2]), (0, [1]), (2, [4])],
    6: [(0, [1, 3, 5]), (1, [2]), (2, [4])], 8: [(0, [1, 3, 5, 7]), (1, [2, 6]), (2, [4])], 9: [(0, [3, 7]),
                                                                                                (1, [2, 6]),
                                                                                                (0, [1, 5]),
                                                                                                (2, [4]),
                                                                                                (3, [8])]}
NCCL_ALLGATHER = {
    2: [(0, [1])], 3: [(1, [2]), (0, [1])], 5: [(2, [4]), (1, [2]), (0, [3]), (0, [1])],
    6: [(2, [4]), (1, [2]), (0, [1, 3, 5])], 8: [(2, [4]), (1, [2, 6]), (0, [1, 3, 5, 7])], 9: [(3, [8]),
                                                                                                (2, [4]),
                                                                                                (1, [2, 6]),
                                                                                                (0, [3, 7]),
                                                                                                (0, [1, 5])]}
NET = sim.Network(alpha_us=5.0, gbit=100.0)


@pytest.mark.parametrize("n", sorted(NCCL_REDUCE_SCATTER))
def test_the_messages_are_nccls(n):
    assert [(d, list(s)) for d, s in reduce_scatter_messages(n)] == NCCL_REDUCE_SCATTER[n]
    assert [(d, list(s)) for d, s in allgather_messages(n)] == NCCL_ALLGATHER[n]


def test_aggregation_is_nccls_largest():
    # aggFactor doubles while below nranks/2; aggDelta = nrPow2 / aggFactor
    assert [aggregation(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 1024, 1025)] == [
        (1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 2), (4, 2), (4, 4), (512, 2), (512, 4)]


@pytest.mark.parametrize("n", [*range(1, 70), 1000, 1024, 1025])
def test_every_block_travels_once_after_what_it_waits_on(n):
    """Reduce-scatter: every offset 1..N-1 leaves once, over its lowest bit, after every partial
    folded into it arrived. Allgather: every offset arrives once, over its lowest bit, from an
    offset already held. Both: ⌈log2 N⌉ messages, one more when N = 2^k + 1 > 3."""
    done = {0}
    for dim, offsets in reduce_scatter_messages(n):
        for s in offsets:
            assert lowest_bit(s) == dim and s not in done
            assert all(s + (1 << j) in done for j in range(dim) if s + (1 << j) < n)
        done.update(offsets)
    assert done == set(range(n))
    held = {0}
    for dim, offsets in allgather_messages(n):
        for s in offsets:
            assert lowest_bit(s) == dim and s not in held and s - (1 << dim) in held
        held.update(offsets)
    assert held == set(range(n))
    steps = (n - 1).bit_length() + (n > 3 and (n - 1) & (n - 2) == 0)
    assert len(reduce_scatter_messages(n)) == len(allgather_messages(n)) == steps
    assert reduce_scatter_pat.shape(n) == allgather_pat.shape(n) == (steps, (n - 1) / n)


def docstring_bytes(rank: int, n: int, blocks: list[int]) -> tuple[int, int]:
    """(Σ_{s=1}^{N-1} B_{r+s}, Σ_{s=1}^{N-1} B_{r+s-lowbit(s)}): the docstrings' two sums."""
    own = sum(blocks[(rank + s) % n] for s in range(1, n))
    tree = sum(blocks[(rank + s - (s & -s)) % n] for s in range(1, n))
    return own, tree


def uneven_bytes(mesh: lab.Mesh) -> list[str]:
    """Every world size 1-8 (sub-meshes), counts that leave blocks uneven: each rank's counters
    against the docstrings' sums, and the results."""
    wrong = []
    for world in range(1, mesh.world_size + 1):
        sub = mesh.split(color=0 if mesh.rank < world else None)
        if sub is None:
            continue
        n, rank = world, sub.rank
        for count in (0, 1, n - 1, 2 * n + 1, 1001):
            blocks = [len(b) * 8 for b in np.array_split(np.arange(count), n)]
            own, tree = docstring_bytes(rank, n, blocks)
            x = torch.arange(count, dtype=torch.float64) * 3 + rank
            sub.reset_stats()
            got = lab.reduce_scatter(sub, x, algorithm="pat")
            stats = sub.stats()
            want = torch.tensor_split(sum(torch.arange(count, dtype=torch.float64) * 3 + r for r in range(n)),
                                      n)[rank]
            if (stats["bytes_sent"], stats["bytes_received"]) != (own, tree) or not torch.equal(got, want):
                wrong.append(f"N={n} rank {rank} reduce_scatter [{count}]: {stats['bytes_sent']}/"
                             f"{stats['bytes_received']} bytes, docstring {own}/{tree}")
            rows = np.array_split(np.arange(count), n)[0].size  # allgather: every rank's block of equal rows
            part = torch.arange(rows, dtype=torch.float64) * 3 + rank
            sub.reset_stats()
            got = lab.allgather(sub, part, algorithm="pat")
            stats = sub.stats()
            own, tree = docstring_bytes(rank, n, [rows * 8] * n)
            want = torch.cat([torch.arange(rows, dtype=torch.float64) * 3 + r for r in range(n)])
            if (stats["bytes_received"], stats["bytes_sent"]) != (own, tree) or not torch.equal(got, want):
                wrong.append(f"N={n} rank {rank} allgather [{rows}]: sent {stats['bytes_sent']}, received "
                             f"{stats['bytes_received']}, docstring {tree}/{own}")
            if rows and stats["messages_sent"] != len(allgather_messages(n)):
                wrong.append(f"N={n} rank {rank} allgather: {stats['messages_sent']} messages")
    return wrong


def test_byte_counters_equal_the_docstrings_with_uneven_blocks():
    with pool(8, "shm") as cluster:
        failures = [f for per_rank in cluster.run(uneven_bytes) for f in per_rank]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow  # 20-50 s: the recorder runs every rank's Python, N-1 blocks each
def test_the_simulator_runs_pat_at_1024_ranks():
    """log2 N = 10 messages per rank carrying (N-1)/N·T each way (the ring: N-1 = 1,023)."""
    n, nbytes = 1024, 1024 * 256
    for collective in ("reduce_scatter", "allgather"):
        r = sim.simulate(collective, "pat", n, nbytes, NET)
        total = nbytes if collective == "reduce_scatter" else nbytes * n  # allgather's T: the result
        assert r.messages == n * 10 and (r.bytes_sent == total * (n - 1) // n).all()
        assert len(r.critical_path) == 10


def test_the_simulator_weighs_pat_against_the_ring():
    """At 64 ranks, 1 KB per rank, PAT's 6 α beat the ring's 63, in the same bytes."""
    for collective in ("reduce_scatter", "allgather"):
        times = {a: sim.simulate(collective, a, 64, 1024, NET) for a in ("ring", "pat")}
        assert (times["pat"].bytes_sent == times["ring"].bytes_sent).all()
        assert len(times["pat"].critical_path) == 6 and times["pat"].time_us < times["ring"].time_us / 5
        assert sim.best_algorithm(collective, 64, 1024, NET, candidates=["ring", "pat"]) == "pat"


def test_auto_weighs_pat_by_its_shape(monkeypatch):
    """With a fitted line per algorithm (as ``python -m lab results`` writes), ``auto`` predicts PAT
    from its shape, ⌈log2 N⌉ steps of (N-1)/N·T, and picks it where it is the fastest."""
    assert "pat" in registry.auto_candidates("allgather") and "pat" in registry.auto_candidates(
        "reduce_scatter")
    fit = {"alpha_step_us": 50.0, "beta_byte_us": 0.001}
    models = {"tcp": {c: {"ring": dict(fit), "pat": dict(fit)} for c in ("allgather", "reduce_scatter")}}
    monkeypatch.delenv("LAB_ALGO", raising=False)
    for collective in ("allgather", "reduce_scatter"):
        choice = tuning.decide(1 << 20, 16, "tcp", collective, models=models, networks={})
        assert choice.algorithm == "pat" and choice.predictions["pat"].steps == 4
        assert choice.predictions["ring"].latency_us == pytest.approx(15 * 50.0)
        assert choice.predictions["pat"].latency_us == pytest.approx(4 * 50.0)
