"""``lab.perf``'s timing of one size in a rank: out of place and in place, warmed up, timed, checked."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import numpy as np
import torch

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.collectives import calls as collectives
from lab.comm.mesh import Mesh
from lab.perf.data import as_tensor, count_wrong, exact_limit, expected, layout, pattern
from lab.perf.spec import TYPES, Spec


def _operation(mesh: Mesh, spec: Spec) -> Callable[[torch.Tensor], torch.Tensor]:
    """The collective as one call on a tensor, returning the tensor that holds the result."""
    name, record = spec.collective, CATALOG[spec.collective]
    options = {"algorithm": spec.algorithm} if registry.choosable(name) else {}  # reduce: one, no argument
    if record.reduces:
        options["op"] = spec.op
    if record.rooted:
        options[record.root] = spec.root
    call = getattr(collectives, name)
    return lambda tensor: call(mesh, tensor, **options)


def placements(mesh: Mesh, spec: Spec, count: int) -> dict[str, tuple[Callable[[], torch.Tensor], Callable]]:
    """``{"oop": (call, fill), "ip": (call, fill)}``: ``call()`` runs the collective once, out of
    place or in place (``lab.perf``'s docstring says what each is in the lab), and returns the
    tensor to check; ``fill()`` writes this rank's inputs where the next call reads them."""
    n, rank, op = mesh.world_size, mesh.rank, _operation(mesh, spec)
    record, itemsize = CATALOG[spec.collective], TYPES[spec.dtype].itemsize
    size = count * itemsize * (n if record.splits else 1)  # nccl-tests' size, as layout() has it
    inputs = record.input_bytes(size, n, itemsize) // itemsize
    send = as_tensor(pattern(np.arange(inputs), rank, n, spec.op, exact_limit(spec.dtype)), spec.dtype)
    if not record.returns:
        recv = torch.empty_like(send)

        def out_of_place() -> torch.Tensor:
            return op(recv.copy_(send))

        return {"oop": (out_of_place, lambda: None), "ip": (lambda: op(recv), lambda: recv.copy_(send))}
    recv = torch.empty(n * count, dtype=send.dtype)
    mine = recv[rank * count:(rank + 1) * count]  # this rank's block of the receive buffer
    source = mine if spec.collective == "allgather" else recv  # nccl-tests' in-place offsets
    target = mine if spec.collective == "reduce_scatter" else recv

    def in_place() -> torch.Tensor:
        return target.copy_(op(source))

    return {"oop": (lambda: op(send), lambda: None), "ip": (in_place, lambda: source.copy_(send))}


def bench_size(mesh: Mesh, spec: Spec, nbytes: int) -> dict[str, tuple[float, int]]:
    """In one rank: ``{"oop": (µs per call, wrong elements), "ip": (...)}`` at ``nbytes``
    (wrong -1 without checks). Every rank makes the same calls: the checks never stop early."""
    _, count = layout(spec.collective, nbytes, mesh.world_size, TYPES[spec.dtype].itemsize)
    want = expected(spec, count, mesh.rank, mesh.world_size) if spec.check else None
    out = {}
    for name, (call, fill) in placements(mesh, spec, count).items():
        fill()
        for _ in range(spec.warmup):
            call()
        collectives.barrier(mesh)  # start together: the loop's time is then the collectives'
        start = time.perf_counter_ns()
        for _ in range(spec.iters):
            call()
        elapsed_us = (time.perf_counter_ns() - start) / 1e3 / spec.iters
        wrong = -1
        for _ in range(spec.check):
            fill()
            wrong = max(wrong, count_wrong(call(), want))
        out[name] = (elapsed_us, wrong)
    return out


def describe_rank(mesh: Mesh) -> tuple[int, int, str, int]:
    """``(rank, pid, host, device)`` for the "Using devices" lines: an emulated host's name is the
    machine's with ``-h<host>`` (so a reader counts the hosts), the device the local rank."""
    host = socket.gethostname() + (f"-h{mesh.host}" if mesh.host_count > 1 else "")
    return mesh.rank, os.getpid(), host, mesh.local_rank
