"""Start an allreduce, keep computing, wait for it when the result is needed.

    python examples/async_overlap.py
"""

import time

import torch

import lab


def step(mesh):
    grads = torch.randn(4 << 20) + mesh.rank  # 16 MB of "gradients"
    started = time.perf_counter()
    work = lab.allreduce(mesh, grads, op="avg", async_op=True)  # returns at once
    issued = time.perf_counter() - started
    torch.randn(512, 512) @ torch.randn(512, 512)  # compute meanwhile
    work.wait()  # now grads hold the average
    return issued * 1e6, (time.perf_counter() - started) * 1e3, float(grads.mean())


if __name__ == "__main__":
    for rank, (issued_us, total_ms, mean) in enumerate(lab.spawn(step, 4)):
        print(
            f"rank {rank}: allreduce issued in {issued_us:.0f} µs, done after {total_ms:.1f} ms, mean {mean:.3f}"
        )
