"""Reduction ops and supported dtypes: the table that maps ``(op, dtype)`` to a Numba kernel."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.coded import FAMILY_CODES, KIND_CODES, OP_CODES
from kernels.reduce import DIVIDE, KERNELS


class ReduceOp(str, enum.Enum):
    """Elementwise reductions. ``"avg"`` is a sum divided by the world size (floating dtypes);
    ``"band"``, ``"bor"``, ``"bxor"`` are bitwise and, or, xor (int32 and int64, as gloo)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_TORCH_OP_NAMES = {
    "SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg", "BAND": "band", "BOR": "bor",
    "BXOR": "bxor"}
_BITWISE = frozenset({"band", "bor", "bxor"})


def _torch_op_name(op: Any) -> str | None:
    """The name of a ``torch.distributed.ReduceOp`` (or its ``RedOpType``), else None."""
    import torch.distributed as dist

    if isinstance(op, dist.ReduceOp):
        for name in _TORCH_OP_NAMES:
            if op == getattr(dist.ReduceOp, name):
                return name
        return repr(op)  # a premul-sum or other op the lab does not have
    if isinstance(op, dist.ReduceOp.RedOpType):
        return op.name
    return None


def parse_op(op: Any) -> ReduceOp:
    """``"sum"`` (any case; also ``"ReduceOp.SUM"``, and torch's ``"PRODUCT"``), ``lab.ReduceOp.SUM``
    or ``torch.distributed.ReduceOp.SUM`` (or ``ReduceOp(ReduceOp.SUM)``) -> ``ReduceOp.SUM``;
    anything else (``"garbage.sum"``) is a ``ValueError``."""
    if isinstance(op, ReduceOp):
        return op
    torch_name = _torch_op_name(op)
    if torch_name is not None:
        name = _TORCH_OP_NAMES.get(torch_name, "")
    elif isinstance(op, str):  # "sum" in any case, torch's "PRODUCT", and "ReduceOp.SUM" as torch prints it
        bare = op.removeprefix("ReduceOp.").removeprefix("RedOpType.")
        name = _TORCH_OP_NAMES.get(bare.upper(), bare.lower())
    else:
        name = ""
    try:
        return ReduceOp(name)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in ReduceOp)
        raise ValueError(f"op must be one of {choices} (or lab.ReduceOp / torch.distributed.ReduceOp); "
                         f"got {op!r}") from None


@dataclass(frozen=True)
class DType:
    """A supported element type: how it is stored in buffers and which kernel family reduces it.

    ``family`` "" is a dtype that collectives only move (broadcast, allgather, gather, scatter,
    all_to_all, send/recv): no reduction kernel takes it. ``bits``: the unsigned torch dtype of
    ``storage``, through which a tensor is viewed on its way to and from numpy where the flat
    buffer holds bit patterns (float16, bfloat16, the float8 types, complex32); None where numpy
    holds the dtype itself."""

    name: str
    torch_dtype: torch.dtype
    storage: np.dtype  # numpy dtype of the flat buffers (uint16 bit patterns for half types)
    family: str  # kernel family in kernels.reduce; "": moved, never reduced
    code: int  # wire identifier, part of every message's fingerprint
    bits: torch.dtype | None = None  # torch's name for storage, where storage holds bit patterns

    @property
    def is_floating(self) -> bool:
        return self.torch_dtype.is_floating_point

    @property
    def reduces(self) -> bool:
        """Whether allreduce, reduce and reduce_scatter take this dtype."""
        return bool(self.family)


def _moved(name: str, code: int, storage: Any, bits: torch.dtype | None = None) -> DType:
    """A dtype the collectives move but never reduce."""
    return DType(name, getattr(torch, name), np.dtype(storage), "", code, bits)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (DType("float32", torch.float32, np.dtype(np.float32), "native", 1),
              DType("float64", torch.float64, np.dtype(np.float64), "native", 2),
              DType("int32", torch.int32, np.dtype(np.int32), "native", 3),
              DType("int64", torch.int64, np.dtype(np.int64), "native", 4),
              DType("float16", torch.float16, np.dtype(np.uint16), "float16", 5, torch.uint16),
              DType("bfloat16", torch.bfloat16, np.dtype(np.uint16), "bfloat16", 6, torch.uint16),
              _moved("uint8", 7, np.uint8), _moved("int8", 8, np.int8), _moved("int16", 9, np.int16),
              _moved("bool", 10, np.bool_), _moved("complex64", 11, np.complex64),
              _moved("complex128", 12, np.complex128), _moved("uint16", 13, np.uint16),
              _moved("uint32", 14, np.uint32), _moved("uint64", 15, np.uint64),
              _moved("complex32", 16, np.uint32, torch.uint32),
              _moved("float8_e4m3fn", 17, np.uint8, torch.uint8),
              _moved("float8_e5m2", 18, np.uint8, torch.uint8),
              _moved("float8_e4m3fnuz", 19, np.uint8, torch.uint8),
              _moved("float8_e5m2fnuz", 20, np.uint8, torch.uint8),
              _moved("float8_e8m0fnu", 21, np.uint8, torch.uint8),
              _moved("float4_e2m1fn_x2", 22, np.uint8, torch.uint8))}
DTYPES_BY_CODE = {d.code: d for d in DTYPES.values()}
#: The dtypes allreduce, reduce and reduce_scatter take (the others are only moved).
REDUCE_DTYPES: dict[str, DType] = {name: d for name, d in DTYPES.items() if d.reduces}
_BY_TORCH = {d.torch_dtype: d for d in DTYPES.values()}


def dtype_of(tensor: Any, name: str = "tensor") -> DType:
    """The :class:`DType` of a torch tensor or numpy array; ``TypeError`` listing the supported ones."""
    if isinstance(tensor, torch.Tensor):
        found = _BY_TORCH.get(tensor.dtype)
        if found is not None:
            return found
        shown = str(tensor.dtype).removeprefix("torch.")
    elif isinstance(tensor, np.ndarray):
        if not tensor.dtype.isnative:
            raise TypeError(
                f"{name} has non-native byte order ({tensor.dtype.str}); convert it with .astype(dtype.newbyteorder('='))"
            )
        found = DTYPES.get(tensor.dtype.name)
        if found is not None and found.storage.itemsize != tensor.dtype.itemsize:
            found = None  # a numpy dtype that only shares a name (complex32 does not exist in numpy)
        shown = tensor.dtype.name
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray; got {type(tensor).__name__}")
    if found is None:
        raise TypeError(f"{name} has dtype {shown}, which is not supported; supported: {', '.join(DTYPES)}")
    return found


def check_reduces(dtype: DType, collective: str, name: str = "tensor") -> None:
    """``TypeError`` naming ``name`` unless ``collective`` (a reduction) can reduce ``dtype``;
    it lists the dtypes it takes. Raised before any communication."""
    if not dtype.reduces:
        raise TypeError(
            f"{name} has dtype {dtype.name}, which {collective} cannot reduce (it only moves bytes: "
            f"broadcast, allgather, gather, scatter, all_to_all and send/recv take it); {collective} "
            f"supports: {', '.join(REDUCE_DTYPES)}")


@dataclass(frozen=True)
class Reduction:
    """``combine(dst, src)`` does ``dst ⊕= src`` in place; ``prepare(buf, n)`` readies a rank's own
    contribution before any combine, and ``finalize(buf, n)`` completes the op once ``buf`` holds
    the reduction of all ``n`` ranks. Only ``avg`` does anything in either: float32/float64
    divide the sum at the end (``finalize``); float16/bfloat16 divide each contribution first
    (``prepare``, ``prescales``), as NCCL does, so a representable average never overflows."""

    op: ReduceOp
    dtype: DType
    combine: Callable[[np.ndarray, np.ndarray], None]
    _divide: Callable[[np.ndarray, float], None] | None
    prescales: bool = False  # _divide runs in prepare (before the sum), not in finalize

    def prepare(self, buf: np.ndarray, world_size: int) -> None:
        if self.prescales and buf.size:
            self._divide(buf, float(world_size))

    def finalize(self, buf: np.ndarray, world_size: int) -> None:
        if self._divide is not None and not self.prescales and buf.size:
            self._divide(buf, float(world_size))

    @functools.cached_property
    def codes(self) -> tuple[int, int, int, bool] | None:
        """``(op, family, kind, finalize divides)`` as compiled code takes them (:mod:`kernels.coded`);
        None for the bitwise ops, which only the Python path runs."""
        if self.op.value in _BITWISE:
            return None
        op = "sum" if self.op is ReduceOp.AVG else self.op.value
        return (OP_CODES[op], FAMILY_CODES[self.dtype.family], KIND_CODES[self.dtype.storage.name],
                self._divide is not None and not self.prescales)

    def partial(self) -> Reduction:
        """The same combine with nothing to prepare or finish: for the phases of an algorithm whose
        result a later phase completes once (hierarchical allreduce sums inside and across hosts,
        then divides once)."""
        return dataclasses.replace(self, _divide=None, prescales=False)


def reduction(op: ReduceOp, dtype: DType) -> Reduction:
    """The kernels for ``op`` on ``dtype``. ``avg`` needs a floating dtype (as in gloo); a dtype
    that is only moved (``DType.reduces`` false) is a ``TypeError`` listing those that reduce.

    ``avg`` on float16/bfloat16 divides each rank's contribution by N before summing: a sum of
    N half-precision values overflows long before their average does (three float16 30,000s sum
    to inf). It costs one extra rounding per contribution (docs/using.md).
    """
    check_reduces(dtype, f"op {op.value!r}")
    if op is ReduceOp.AVG and not dtype.is_floating:
        raise TypeError(f"op 'avg' needs a floating dtype; tensor has dtype {dtype.name} (use 'sum')")
    if op.value in _BITWISE and dtype.name not in ("int32", "int64"):
        raise TypeError(
            f"op {op.value!r} needs an integer dtype (int32, int64); tensor has dtype {dtype.name}")
    kernel_op = "sum" if op is ReduceOp.AVG else op.value
    divide = DIVIDE[dtype.family] if op is ReduceOp.AVG else None
    prescales = divide is not None and dtype.family in ("float16", "bfloat16")
    return Reduction(op, dtype, KERNELS[kernel_op, dtype.family], divide, prescales)
