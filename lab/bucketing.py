"""Gradient bucketing: many small tensors, few large allreduces (what DDP's 25 MB buckets do).

Every allreduce pays the latency floor (2(N-1) or 2⌈log2 N⌉ message steps) however small its
tensor; a model's thousands of gradient tensors paid one by one spend most of their time there.
Packing them into flat buckets pays the floor once per bucket instead.

Per rank, N=2::

    grads = [torch.ones(3) * (mesh.rank + 1), torch.arange(2.0)]
    lab.bucketing.allreduce_coalesced(mesh, grads, op="avg")   # [1.5, 1.5, 1.5], [0., 1.]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lab.buffers import check_tensor
from lab.collectives.calls import allreduce
from lab.collectives.choice import check_algorithm
from lab.comm.mesh import Mesh
from lab.ops import check_reduces, parse_op, reduction

#: DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def plan_buckets(tensors: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets: one dtype per bucket, in order, each up to
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own).

        >>> plan_buckets([torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.zeros(4)], 32)
        [[0, 2], [1]]
    """
    open_buckets: dict[Any, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for index, tensor in enumerate(tensors):
        key = (type(tensor), str(tensor.dtype))
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else tensor.nbytes
        members, size = open_buckets.get(key, ([], 0))
        if members and size + nbytes > bucket_bytes:
            done.append(members)
            members, size = [], 0
        members.append(index)
        open_buckets[key] = (members, size + nbytes)
    done += [members for members, _ in open_buckets.values()]
    return sorted(done, key=lambda bucket: bucket[0])


def allreduce_coalesced(mesh: Mesh, tensors: Sequence[Any], op: Any = "sum", algorithm: str = "auto",
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Sequence[Any]:
    """Allreduce every tensor in ``tensors`` in place, one allreduce per bucket; returns ``tensors``.

    Tensors may mix dtypes (each bucket holds one) and kinds (torch or numpy), any shapes.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes!r}")
    reduce_op = parse_op(op)
    check_algorithm(algorithm)
    checked: set = set()
    for i, tensor in enumerate(tensors):  # every error before any message; each kind checked once
        kind = (type(tensor), str(getattr(tensor, "dtype", None)), str(getattr(tensor, "device", "cpu")))
        if kind not in checked:
            dtype = check_tensor(tensor, f"tensors[{i}]")
            check_reduces(dtype, "allreduce", f"tensors[{i}]")
            reduction(reduce_op, dtype)
            checked.add(kind)
    # Pack only once the asynchronous collectives issued before this call are done: one may still
    # be writing these tensors (the same issue order every collective follows).
    mesh.wait_all()
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        if isinstance(members[0], torch.Tensor):
            # Pack and unpack in C++ (as DDP does): per-tensor Python here would cost more than the
            # latency that bucketing saves.
            members = [t.detach() for t in members]
            flat = _flatten_dense_tensors(members)
            allreduce(mesh, flat, op=reduce_op, algorithm=algorithm)
            torch._foreach_copy_(members, list(_unflatten_dense_tensors(flat, members)))
        else:
            flat = np.concatenate([t.reshape(-1) for t in members])
            allreduce(mesh, flat, op=reduce_op, algorithm=algorithm)
            offset = 0
            for tensor in members:
                tensor[...] = flat[offset:offset + tensor.size].reshape(tensor.shape)
                offset += tensor.size
    return tensors
