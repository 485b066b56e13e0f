"""``lab.empty``: tensors that live in the mesh's shared memory (NCCL's buffer registration).

An allreduce with ``algorithm="two_shot"`` on the shm transport copies each rank's input into
shared memory once, then every rank reads it there. A tensor made by :func:`empty` already lies in
that memory (this rank's arena of the mesh's scratch, :mod:`lab.transport.peer_memory`), so its peers
read it in place and the copy in goes too. Any other tensor works as before (copied in).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lab import checks
from lab.errors import LabError
from lab.ops import dtype_of


def empty(mesh: Any, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in ``mesh``'s shared memory.

    Where the mesh has no shared scratch (the queue and tcp transports, ``transport="auto"``,
    a single rank), it is an ordinary ``torch.empty``: code that allocates through the lab runs on
    every transport. The memory is this rank's arena (``LAB_SHM_REGISTERED_BYTES`` per rank,
    default 256 MiB; a ``LabError`` when it is full) and returns to it when the tensor and every
    view of it are gone. Lifetime: registered until ``mesh.close()``; the tensor stays valid memory
    after that (never a crash), a collective on the closed mesh is a ``LabError``, and
    :func:`empty` on a closed mesh too.

    Per rank, N=2::

        x = lab.empty(mesh, (4,))                  # in this rank's arena
        x.copy_(torch.arange(4.0) + mesh.rank)     # rank 0: [0, 1, 2, 3]   rank 1: [1, 2, 3, 4]
        lab.allreduce(mesh, x, algorithm="two_shot")   # both: [1, 3, 5, 7], no copy in
    """
    if mesh.closed:
        raise LabError(f"rank {mesh.rank}: lab.empty on a closed mesh")
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    for size in shape:
        if not checks.is_int(size) or size < 0:
            raise ValueError(f"shape must be non-negative ints; got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype; got {dtype!r}")
    scratch = mesh.exchange.scratch
    if scratch is None:
        return torch.empty(shape, dtype=dtype)
    lab_dtype = dtype_of(torch.empty(0, dtype=dtype), "dtype")
    tensor = torch.from_numpy(scratch.allocate(math.prod(shape),
                                               lab_dtype.storage))  # holds the array: see allocate
    if lab_dtype.bits is not None:  # half and float8 types: numpy holds their bit patterns
        tensor = tensor.view(dtype)
    return tensor.view(shape)
