"""2,004 transformer-shaped gradients: one allreduce each, or a few 25 MB buckets.

    python examples/bucketing.py
"""

import time

import lab
from lab.benchmark import transformer_gradients
from lab.bucketing import allreduce_coalesced


def step(mesh):
    grads = transformer_gradients()
    lab.allreduce(mesh, grads[0])  # warm up
    started = time.perf_counter()
    for grad in grads:
        lab.allreduce(mesh, grad, op="avg")
    one_by_one = time.perf_counter() - started
    started = time.perf_counter()
    allreduce_coalesced(mesh, grads, op="avg")
    bucketed = time.perf_counter() - started
    return len(grads), one_by_one * 1e3, bucketed * 1e3


if __name__ == "__main__":
    results = lab.spawn(step, 4)
    tensors = results[0][0]
    one_by_one = max(r[1] for r in results)
    bucketed = max(r[2] for r in results)
    print(f"{tensors} tensors: one by one {one_by_one:.0f} ms, bucketed {bucketed:.0f} ms "
          f"({one_by_one / bucketed:.1f}x): the per-call latency floor, paid {tensors} times, is what goes")
