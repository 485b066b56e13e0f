"""The reduction kernels alone, in this process: pure Python vs numpy vs Numba, in GB/s.

GB/s counts the bytes of every input read (two buffers for ``dst += src``; four for the fused
``dst += a + b + c``, against three chained numpy adds).
"""

from __future__ import annotations

import pytest
from conftest import size_id

from lab.benchmark import time_kernel

KERNEL_SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20]


def bench_kernel(benchmark, impl: str, nbytes: int, inputs: int) -> None:
    benchmark.group = f"kernel {inputs} inputs {size_id(nbytes)}"
    result = time_kernel(impl, nbytes, inputs)
    benchmark.extra_info.update(impl=impl, bytes=nbytes, inputs=inputs, **result)
    benchmark.pedantic(time_kernel, args=(impl, nbytes, inputs, 1), rounds=3, iterations=1)


@pytest.mark.parametrize("nbytes", KERNEL_SIZES, ids=size_id)
@pytest.mark.parametrize("impl", ["python", "numpy", "numba"])
def test_two_input_sum(benchmark, impl, nbytes):
    if impl == "python" and nbytes > 1 << 20:
        pytest.skip("the pure-Python loop takes minutes at this size; its GB/s is flat from 64 KB up")
    bench_kernel(benchmark, impl, nbytes, 2)


@pytest.mark.parametrize("nbytes", KERNEL_SIZES, ids=size_id)
@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_fused_four_input_sum(benchmark, impl, nbytes):
    bench_kernel(benchmark, impl, nbytes, 4)
