"""A rank that only reads its tensor takes it read-only: ``reduce``'s ranks other than ``dst``
send their input and keep it as it was, so a read-only input is accepted there (as allgather's
and send's are), through ``lab.reduce`` and torch's ``dist.reduce`` on the "lab" backend; ``dst``,
which writes the result into its tensor, still refuses one, before anything is sent.

Read-only, three ways: a tensor over a read-only ``np.memmap`` (memory a write would fault on), a
numpy array whose ``writeable`` flag is off, and an ``expand()`` view (elements sharing memory).
Every rank's input is ``index * STRIDE + rank``; each rank checks its own tensor afterwards.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

import lab
import lab.backend

STRIDE, COUNT = 3, 1000


def pattern(rank: int) -> np.ndarray:
    return np.arange(COUNT, dtype=np.float32) * STRIDE + rank


def over_read_only_memory(values: np.ndarray, directory: str, name: str) -> torch.Tensor:
    path = os.path.join(directory, f"{name}.f32")
    values.tofile(path)
    with warnings.catch_warnings():  # torch warns that the array is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r"))


def frozen_array(values: np.ndarray, directory: str, name: str) -> np.ndarray:
    frozen = values.copy()
    frozen.flags.writeable = False
    return frozen


def expanded_view(values: np.ndarray, directory: str, name: str) -> torch.Tensor:
    return torch.from_numpy(values.copy()).reshape(-1, 1).expand(-1, 2)  # each element twice, one memory


#: Each kind of read-only input, made of a rank's values, and the words of dst's refusal.
READ_ONLY: dict[str, tuple[Callable[[np.ndarray, str, str], object], str]] = {
    "memmap": (over_read_only_memory, "over read-only memory"),
    "frozen numpy": (frozen_array, "read-only numpy array"), "expand view": (expanded_view, "share memory")}
OPS = {"sum": np.sum, "max": np.max, "avg": np.mean}


def as_array(tensor: object) -> np.ndarray:
    return tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


def readers_take_read_only_inputs(mesh: lab.Mesh) -> list[str]:
    """Per dst, kind and op: lab.reduce with a read-only input on every rank but dst (whose input
    is writable); then each rank its own dst with a read-only input, refused on every rank.
    Returns what went wrong on this rank."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    with tempfile.TemporaryDirectory() as directory:
        for kind, (make, refusal) in READ_ONLY.items():
            for dst in range(n):
                for op, combine in OPS.items():
                    values = pattern(rank)
                    read_only = make(values, directory, f"{kind}-{dst}-{op}")
                    shape = as_array(read_only).shape
                    mine = read_only if rank != dst else torch.from_numpy(as_array(read_only).copy())
                    try:
                        result = lab.reduce(mesh, mine, dst=dst, op=op)
                    except (ValueError, TypeError) as exc:
                        wrong.append(f"rank {rank}, {kind}, dst {dst}, {op}: refused: {exc}")
                        continue
                    everyone = np.stack([pattern(r) for r in range(n)])
                    want = combine(everyone, axis=0) if rank == dst else values
                    want = np.broadcast_to(want.reshape(-1, 1), shape) if len(shape) == 2 else want
                    if result is not mine or not np.allclose(as_array(result), want, rtol=1e-6, atol=0):
                        wrong.append(f"rank {rank}, {kind}, dst {dst}, {op}: {as_array(result).ravel()[:4]} "
                                     f"instead of {want.ravel()[:4]}")
            refused = make(pattern(rank), directory, f"{kind}-refused")
            try:  # every rank the dst of its own call: each refuses before sending anything
                lab.reduce(mesh, refused, dst=rank)
                wrong.append(f"rank {rank}, {kind}: a read-only tensor on dst was not refused")
            except ValueError as exc:
                if refusal not in str(exc):
                    wrong.append(f"rank {rank}, {kind} on dst: {exc}")
            if not np.array_equal(np.asarray(as_array(refused)).reshape(COUNT, -1)[:, 0], pattern(rank)):
                wrong.append(f"rank {rank}, {kind}: the refused tensor changed")
        total = torch.from_numpy(pattern(rank))
        lab.allreduce(mesh, total)  # in step: the refused calls sent nothing
        if not np.array_equal(total.numpy(), sum(pattern(r) for r in range(n))):
            wrong.append(f"rank {rank}: the allreduce after the refusals is wrong")
    return wrong


def torch_reduce_takes_read_only_inputs(mesh: lab.Mesh) -> list[str]:
    """dist.reduce on the "lab" backend: a tensor over read-only memory on every rank but dst."""
    n, rank, wrong = mesh.world_size, mesh.rank, []
    lab.backend.init_process_group(mesh)
    try:
        with tempfile.TemporaryDirectory() as directory:
            for dst in range(n):
                values = pattern(rank)
                tensor = (over_read_only_memory(values, directory, f"torch-{dst}")
                          if rank != dst else torch.from_numpy(values.copy()))
                try:
                    dist.reduce(tensor, dst=dst)
                except (ValueError, RuntimeError) as exc:
                    wrong.append(f"rank {rank}, dist.reduce to {dst}: refused: {exc}")
                    continue
                want = sum(pattern(r) for r in range(n)) if rank == dst else values
                if not np.array_equal(tensor.numpy(), want):
                    wrong.append(f"rank {rank}, dist.reduce to {dst}: {tensor[:4].tolist()} instead of "
                                 f"{want[:4].tolist()}")
            refused = over_read_only_memory(pattern(rank), directory, "torch-refused")
            try:
                dist.reduce(refused, dst=rank)
                wrong.append(f"rank {rank}: dist.reduce into read-only memory was not refused")
            except (ValueError, RuntimeError) as exc:
                if "over read-only memory" not in str(exc):
                    wrong.append(f"rank {rank}, dist.reduce on dst: {exc}")
    finally:
        dist.destroy_process_group()  # (the mesh stays open: the pool's)
    return wrong


@pytest.mark.parametrize("transport", ["shm", "tcp", "queue"])
@pytest.mark.parametrize("n", [2, 3])
def test_reduce_takes_a_read_only_input_on_every_rank_but_dst(n, transport):
    with lab.launch(n, transport=transport, recv_timeout_ms=20_000) as cluster:  # a refusal: a deadline
        assert cluster.run(readers_take_read_only_inputs) == [[]] * n
        assert cluster.run(torch_reduce_takes_read_only_inputs) == [[]] * n
