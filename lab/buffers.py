"""Caller tensors <-> the flat, contiguous numpy buffers the algorithms and kernels work on.

A torch tensor and its buffer share memory whenever the tensor is contiguous; otherwise the
buffer is a contiguous copy, taken by :meth:`Buffer.load` when the collective runs (not when it
is called: an asynchronous collective issued earlier may still be writing the tensor), and
:meth:`Buffer.write_back` copies the result into the caller's tensor. bfloat16 and float16 are
handled as ``uint16`` bit patterns, and every dtype numpy lacks (the float8 types, complex32) as
the unsigned integers of its width (:attr:`lab.ops.DType.bits`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lab.ops import DType, dtype_of


def _flat_storage(tensor: Any, dtype: DType) -> np.ndarray:
    """A 1-D numpy view of a contiguous tensor's elements, typed as ``dtype.storage``."""
    if isinstance(tensor, torch.Tensor):
        if tensor.requires_grad:
            tensor = tensor.detach()
        if dtype.bits is not None:
            return tensor.reshape(-1).view(dtype.bits).numpy()
        array = tensor.numpy()  # contiguous: a view either way, numpy's is cheaper than torch's
        return array if array.ndim == 1 else array.reshape(-1)
    return tensor.reshape(-1).view(dtype.storage)


@dataclass(slots=True)
class Buffer:
    """The caller's ``tensor``, its :class:`DType`, and ``flat``: the 1-D buffer collectives use.

    ``flat`` aliases the caller's memory when ``shared``; otherwise it is None until
    :meth:`load` copies the tensor's current contents.
    """

    tensor: Any
    dtype: DType
    flat: np.ndarray | None
    shared: bool  # flat aliases the caller's memory, so no load or write-back copy is needed
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.storage.itemsize

    def load(self) -> np.ndarray:
        """``flat`` with the tensor's contents as they are now: call it where the collective runs,
        after the collectives issued before it (the issue order), never at call time."""
        if not self.shared:
            tensor = self.tensor
            copy = tensor.contiguous() if isinstance(tensor, torch.Tensor) else np.ascontiguousarray(tensor)
            self.flat = _flat_storage(copy, self.dtype)
        return self.flat

    def write_back(self) -> None:
        """Copy ``flat`` into the caller's tensor when they do not share memory."""
        if self.shared:
            return
        if isinstance(self.tensor, torch.Tensor):
            self.tensor.copy_(to_caller_type(self.flat, self.dtype, self.tensor.shape, like=self.tensor))
        else:
            self.tensor[...] = self.flat.view(self.tensor.dtype).reshape(self.tensor.shape)


def check_tensor(tensor: Any, name: str = "tensor") -> DType:
    """Validate a collective's tensor argument (type, dtype, device); return its :class:`DType`."""
    if isinstance(tensor, torch.Tensor):
        if tensor.is_nested:
            raise TypeError(
                f"{name} is a nested tensor; collectives take dense tensors (use .to_padded_tensor())")
        if tensor.layout != torch.strided:
            raise TypeError(f"{name} has layout {tensor.layout}; collectives take dense (strided) tensors "
                            "(use .to_dense())")
    dtype = dtype_of(tensor, name)
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_cpu:
            raise ValueError(f"{name} must be a CPU tensor; got device {tensor.device}")
        if tensor.is_conj() or tensor.is_neg():  # its memory is not its values
            raise ValueError(f"{name} is a lazy {'conjugate' if tensor.is_conj() else 'negative'} view; pass "
                             f"{name}.resolve_conj().resolve_neg() (or a clone)")
    return dtype


def _overlaps(tensor: Any) -> bool:
    """Whether elements share memory (a stride-0 dimension, as ``expand()`` or ``broadcast_to`` make)."""
    strides = tensor.stride() if isinstance(tensor, torch.Tensor) else tensor.strides
    return any(stride == 0 and size > 1 for stride, size in zip(strides, tensor.shape))


#: ``madvise(2)``'s "fault these pages in as a write would" (Linux 5.14): it fails (EFAULT, or
#: EINVAL on a mapping without write permission) where a write would fault, and writes nothing.
_MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, or None where ``MADV_POPULATE_WRITE`` is unknown (asked once, of our page)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = ctypes.create_string_buffer(2 * mmap.PAGESIZE)
    page = (ctypes.addressof(probe) + mmap.PAGESIZE - 1) & -mmap.PAGESIZE
    return madvise if madvise(page, mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0 else None


def check_writable(tensor: torch.Tensor, name: str) -> None:
    """Refuse a tensor over memory a write would fault on (``np.memmap(mode="r")``: the rank would
    die of SIGSEGV at the collective's first write), with a ``ValueError`` naming ``name``.

    Only memory torch did not allocate can be read-only (``from_numpy``, ``frombuffer``: a storage
    that cannot resize); of that, the pages of its first and last element are asked. A read-only
    Python object on writable memory (``torch.frombuffer(bytes)``, which torch warns of) cannot be
    told from a writable one. A tensor found writable is remembered while it lives and its memory is
    the same (``set_`` can move it): asking costs two madvise calls, several µs a collective, and
    a storage numpy has viewed (a collective's tensor, after its first call) no longer resizes."""
    madvise = _madvise()
    if madvise is None or tensor.numel() == 0 or _remembered(tensor):
        return
    if not tensor.untyped_storage().resizable():
        shape, strides = tensor.shape, tensor.stride()
        last_element = sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
        last = tensor.data_ptr() + last_element * tensor.element_size()
        for address in {tensor.data_ptr(), last}:
            if madvise(address & -mmap.PAGESIZE, mmap.PAGESIZE, _MADV_POPULATE_WRITE) != 0 \
                    and ctypes.get_errno() in (errno.EFAULT, errno.EINVAL):
                raise ValueError(f"{name} is over read-only memory (a read-only np.memmap or mmap?); "
                                 "collectives write their result into it: pass a writable copy (.clone())")
    key = id(tensor)  # (torch's own memory too: once numpy viewed it, its storage no longer resizes)
    _known_writable[key] = (weakref.ref(tensor,
                                        lambda _, key=key: _known_writable.pop(key, None)), tensor.data_ptr())


#: Tensors :func:`check_writable` found writable, by ``id``, while they live: (the tensor, its address).
_known_writable: dict[int, tuple[weakref.ref, int]] = {}


def known_writable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is known to be over writable memory without asking the kernel: torch
    allocated it (its storage can resize), or :func:`check_writable` found it so and it still lives
    over the same memory."""
    return tensor.untyped_storage().resizable() or _remembered(tensor)  # (the common case first)


def writable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory takes writes: :func:`known_writable`, or else asked once by
    :func:`check_writable` and remembered (a tensor numpy viewed, read by an earlier collective,
    is no longer known by its storage)."""
    if known_writable(tensor):
        return True
    try:
        check_writable(tensor, "tensor")
    except ValueError:
        return False
    return True


def _remembered(tensor: torch.Tensor) -> bool:
    known = _known_writable.get(id(tensor))
    return known is not None and known[0]() is tensor and known[1] == tensor.data_ptr()


def as_buffer(tensor: Any, name: str = "tensor", writable: bool = True) -> Buffer:
    """Wrap a caller's tensor; ``ValueError``/``TypeError`` naming ``name`` if it is unusable.

    ``writable``: the collective writes its result into the tensor (allreduce, broadcast).
    Nothing of the tensor's contents is read here: :meth:`Buffer.load` reads them.
    """
    dtype = check_tensor(tensor, name)
    if isinstance(tensor, torch.Tensor):
        contiguous, numel = tensor.is_contiguous(), tensor.numel()
        if writable:
            check_writable(tensor, name)
    else:
        if writable and not tensor.flags.writeable:
            raise ValueError(f"{name} is a read-only numpy array; collectives write their result into it")
        contiguous, numel = tensor.flags.c_contiguous, tensor.size
    if writable and not contiguous and _overlaps(tensor):  # a contiguous tensor has no repeated elements
        raise ValueError(
            f"{name} has elements that share memory (an expand() or broadcast view), so an in-place "
            "result cannot be written into it; pass a copy (.clone() / .copy())")
    if contiguous:
        return Buffer(tensor, dtype, _flat_storage(tensor, dtype), True, numel)
    return Buffer(tensor, dtype, None, False, numel)  # copied by load(), when the collective runs


def new_flat(numel: int, dtype: DType) -> np.ndarray:
    """An uninitialised flat buffer for a collective's new output."""
    return np.empty(numel, dtype=dtype.storage)


def to_caller_type(flat: np.ndarray, dtype: DType, shape: tuple[int, ...], like: Any) -> Any:
    """Wrap a flat buffer (no copy) as a tensor of ``like``'s kind (torch or numpy) and ``shape``."""
    if isinstance(like, torch.Tensor):
        return torch.from_numpy(flat).view(dtype.torch_dtype).reshape(
            shape)  # (bit patterns: viewed as the dtype)
    return flat.view(like.dtype).reshape(shape)
