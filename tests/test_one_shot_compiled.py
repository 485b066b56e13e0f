"""The compiled one-shot allreduce (kernels.one_shot, run by the compiled plane as
allreduce_one_shot's compiled face): a plain call, its lane, a plan and
``lab.symm_mem.one_shot_all_reduce_out`` of at most ``LAB_COMPILED_MAX_BYTES`` run it in one
Numba call on the shm root mesh.

Every rank checks its own output against a fold of ``index * stride + rank`` in rank order and
against two-shot's bits (the Python path, the same fold order), at world sizes 1-8, every
reducing dtype (from N = 5 float32, int64 and bfloat16: helpers.matrix_dtypes) and op, counts 0, 1, fewer than the ranks, not divisible and 16,384 elements (up to
16 rounds of the pools' 4 KiB slot), and counts from ``mesh.stats()`` that each call took the compiled path
where it should (every op but the bitwise ones, which have no compiled kernels and stay in
Python). Random floats give the same bits on every rank as two-shot
and the Python one-shot; compiled and Python rounds interleave on one mesh. The faults (another
size, op or algorithm; a stopped or killed rank) are tests/test_one_shot.py's, run on both paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import matrix_dtypes, pool, slow_from_five
from test_two_shot import OPS, SLOT_BYTES, expected, pattern, same_bits, takes

import lab
from lab.ops import REDUCE_DTYPES

LARGEST = 64 * 1024  # lab's LAB_COMPILED_MAX_BYTES: the largest tensor a compiled call takes


@pytest.fixture(scope="module", params=slow_from_five(range(1, 9)), ids=lambda n: f"N{n}")
def cluster(request):
    with pool(request.param, "shm", env={"LAB_SHM_SCRATCH_BYTES": str(SLOT_BYTES)}) as running:
        yield running


def compiles(mesh: lab.Mesh, op: str) -> bool:
    """Whether a one-shot of ``op`` of at most 64 KiB should take the compiled path (an ``avg`` of a
    half type too: its inputs are divided first, in Python, then the sum runs compiled)."""
    return mesh.world_size > 1 and op not in ("band", "bor", "bxor")


def compiled_count(mesh: lab.Mesh) -> int:
    return mesh.stats()["collectives_compiled"]


def four_ways(mesh: lab.Mesh, x: torch.Tensor, op: str) -> tuple[list[torch.Tensor], int]:
    """``x`` reduced by a plain call, the same tensor's second call (its lane), a plan (twice) and
    ``one_shot_all_reduce_out`` from a symmetric buffer; and how many of the five ran compiled."""
    before = compiled_count(mesh)
    plain = lab.allreduce(mesh, x.clone(), op=op, algorithm="one_shot")
    again = x.clone()
    lab.allreduce(mesh, again, op=op, algorithm="one_shot")
    again.copy_(x)
    lab.allreduce(mesh, again, op=op, algorithm="one_shot")  # the lane its first call made
    planned = x.clone()
    plan = lab.allreduce_init(mesh, planned, op=op, algorithm="one_shot")
    plan()
    planned.copy_(x)
    plan()
    source = lab.symm_mem.empty(mesh, x.shape, x.dtype)
    source.copy_(x)
    out = lab.symm_mem.one_shot_all_reduce_out(source, op, mesh, torch.empty_like(x))
    untouched = same_bits(source, x)
    ran = compiled_count(mesh) - before
    return [plain, again, planned, out if untouched else out.new_full(out.shape, -7)], ran


def exact_and_compiled(mesh: lab.Mesh) -> list[str]:
    n, wrong = mesh.world_size, []
    for name, dtype in matrix_dtypes(n, REDUCE_DTYPES).items():
        itemsize = torch.empty(0, dtype=dtype.torch_dtype).element_size()
        # The last: 64 KiB, or 32 KiB of a half type (where the pattern's avg stays finite).
        for count in sorted({0, 1, max(n - 1, 1), 2 * n + 1, min(LARGEST // itemsize, 16_384)}):
            for op in OPS:
                if not takes(op, dtype):
                    continue
                x = pattern(count, mesh.rank, dtype.torch_dtype)
                results, ran = four_ways(mesh, x, op)
                two = lab.allreduce(mesh, x.clone(), op=op, algorithm="two_shot")
                want = expected(op, count, n, dtype.torch_dtype)
                exact = same_bits(two, want) if op != "avg" else torch.allclose(
                    two.double(), want, rtol=(n + 1) * torch.finfo(dtype.torch_dtype).eps, atol=0)
                same = [same_bits(got, two) for got in results]
                should = 6 if compiles(mesh, op) else 0  # 3 plain calls, 2 plan runs, symm_mem
                if not (exact and all(same) and ran == should):
                    wrong.append(
                        f"rank {mesh.rank} {name}[{count}] {op}: two-shot {'ok' if exact else 'WRONG'}, "
                        f"plain/lane/plan/symm_mem same as two-shot {same}, compiled {ran} of {should}")
    return wrong


def test_every_form_is_exact_compiled_and_gives_two_shots_bits(cluster):
    assert cluster.run(exact_and_compiled) == [[]] * cluster.world_size


def random_floats(mesh: lab.Mesh, count: int) -> list[bytes]:
    """Random float32 and bfloat16 (rounding on every step: the fold's order shows), through the
    compiled one-shot, two-shot, and the Python one-shot (over 64 KiB: the first ``count`` of a
    larger tensor that starts with the same values)."""
    rng = np.random.default_rng([7, mesh.rank])
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.normal(size=count).astype(np.float32)).to(dtype)
        before = compiled_count(mesh)
        compiled = lab.allreduce(mesh, x.clone(), algorithm="one_shot")
        assert compiled_count(mesh) - before == (mesh.world_size > 1)
        big = torch.cat([x, torch.zeros(LARGEST, dtype=dtype)])
        python = lab.allreduce(mesh, big, algorithm="one_shot")[:count]
        assert compiled_count(mesh) - before == (mesh.world_size > 1)  # (that one ran in Python)
        two = lab.allreduce(mesh, x.clone(), algorithm="two_shot")
        outputs.append(b"".join(
            t.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes()
            for t in (compiled, python, two)))
    return outputs


def test_random_floats_give_the_same_bits_on_every_rank_and_path(cluster):
    """Each rank's compiled, Python and two-shot results, side by side, are the same on every rank;
    and the three agree with each other."""
    count = 3 * SLOT_BYTES // 4 + 5  # three rounds of float32
    outputs = cluster.run(random_floats, count)
    assert all(output == outputs[0] for output in outputs)
    for joined, itemsize in zip(outputs[0], (4, 2)):
        third = count * itemsize
        assert joined[:third] == joined[third:2 * third] == joined[2 * third:]


def interleaved(mesh: lab.Mesh) -> list[str]:
    """Compiled one-shots between Python one-shots, two-shots and the ring on one mesh: the rounds
    they share stay in step, every result exact."""
    wrong, n = [], mesh.world_size
    for step, (count, algorithm) in enumerate([(300, "one_shot"), (40_000, "one_shot"), (300, "two_shot"),
                                               (5000, "one_shot"), (7, "ring"), (1, "one_shot"),
                                               (40_000, "two_shot"), (16_384, "one_shot")]):
        x = pattern(count, mesh.rank, torch.float64)
        lab.allreduce(mesh, x, algorithm=algorithm)
        if not torch.equal(x, expected("sum", count, n, torch.float64)):
            wrong.append(f"rank {mesh.rank}: step {step} ({algorithm}, {count}) wrong")
    return wrong


def test_compiled_and_python_rounds_interleave(cluster):
    assert cluster.run(interleaved) == [[]] * cluster.world_size
