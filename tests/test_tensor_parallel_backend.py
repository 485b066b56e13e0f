"""torch's tensor parallelism on the "lab" backend (issue 43, item 2): ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel`` over the "tp" dimension of
``init_device_mesh("cpu", (n / 2, 2))`` with FSDP2 (``fully_shard``) over its "dp" dimension,
unmodified, at 2 ranks (1 x 2) and 4 ranks (2 x 2): every rank's losses, gradients and parameters
bit-equal to the same mesh of gloo groups. One job per world size (a torchrun launch at 2 ranks;
at 4, ranks forked from the lab's forkserver with torchrun's environment, tests/torch_ranks.py)
runs tests/tensor_parallel_job.py, whose every rank compares its own shards and writes what it found.
"""

from __future__ import annotations

import json
import os

import pytest
import tensor_parallel_job
import torch_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
#: Child processes import the lab under test (this checkout), not another installed copy.
CHILD_ENV = {
    **os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                 os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
#: The world size launched by torchrun itself (the other's ranks: tests/torch_ranks.py).
TORCHRUN_SIZE = 2


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_and_fsdp2_on_a_2d_mesh_are_bit_equal_to_gloo(n, tmp_path):
    exits, logs = torch_ranks.launch(os.path.join(HERE, "tensor_parallel_job.py"), tensor_parallel_job.main,
                                     n, tmp_path, CHILD_ENV, torchrun=n == TORCHRUN_SIZE)
    failures = {}
    for rank in range(n):
        path = tmp_path / f"rank{rank}.json"
        outcome = (json.loads(path.read_text()).get("tensor_and_fsdp2_on_a_2d_mesh", "not run")
                   if path.exists() else f"wrote nothing (exit {exits[rank]}):\n{logs[rank]}")
        if outcome != "ok":
            failures[rank] = outcome
    assert not failures, "\n".join(f"rank {rank}: {outcome}" for rank, outcome in failures.items())
    assert exits == [0] * n, (exits, logs)
