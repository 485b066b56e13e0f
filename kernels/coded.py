"""The reduction as compiled code sees it: ``reduction.combine(dst, src)`` and
``reduction.finalize(buf, n)`` on a value of three numbers.

An algorithm written once for Python and Numba (``lab.compiled``) calls ``reduction.combine``
and ``reduction.finalize``. In Python the reduction is ``lab.ops.Reduction``, whose ``combine``
is a kernel of :mod:`kernels.reduce`. Compiled, it is a :data:`coded_reduction_type` built from
two codes and a flag inside the compiled call (:func:`coded_reduction`): a call from Python that
passed kernels as function values would pay ~70 µs of typing, any Python object ~2 µs, three
integers nothing. ``combine`` picks the kernel by the array's type when Numba compiles and by
the codes when it runs.

Per rank (inside a compiled allreduce, float32 sum)::

    reduction = coded_reduction(SUM, NATIVE, FLOAT32, False)   # module constants: no dict in compiled code
    reduction.combine(mine, theirs)        # mine += theirs (kernels.reduce.sum_into)

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, make_attribute_wrapper, models, overload_method, register_model

from kernels import reduce as k

OP_CODES = {"sum": 0, "prod": 1, "min": 2, "max": 3}
FAMILY_CODES = {"native": 0, "float16": 1, "bfloat16": 2}
#: What the bytes of a byte buffer (uint8) hold: ``combine`` views them as this before reducing.
KIND_CODES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "uint16": 4}


class CodedReductionType(types.Type):
    def __init__(self) -> None:
        super().__init__(name="CodedReduction")


coded_reduction_type = CodedReductionType()


@register_model(CodedReductionType)
class _CodedReductionModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, [("op", types.int64), ("family", types.int64), ("kind", types.int64),
                                        ("divides", types.boolean)])


for _field in ("op", "family", "kind", "divides"):
    make_attribute_wrapper(CodedReductionType, _field, _field)


@intrinsic
def coded_reduction(typingctx, op, family, kind, divides):
    """The reduction of ``op`` (``OP_CODES``) on ``family`` (``FAMILY_CODES``), built in compiled
    code; ``kind`` (``KIND_CODES``): what byte buffers hold; ``divides``: ``finalize`` divides by N
    (avg of float32/float64)."""
    def codegen(context, builder, signature, args):
        reduction = cgutils.create_struct_proxy(coded_reduction_type)(context, builder)
        for field, value, typ in zip(("op", "family", "kind"), args[:3], signature.args[:3]):
            setattr(reduction, field, context.cast(builder, value, typ, types.int64))
        reduction.divides = context.cast(builder, args[3], signature.args[3], types.boolean)
        return reduction._getvalue()

    return coded_reduction_type(op, family, kind, divides), codegen


@njit(inline="always")
def _native(op, dst, src):
    if op == 0:
        k.sum_into(dst, src)
    elif op == 1:
        k.prod_into(dst, src)
    elif op == 2:
        k.min_into(dst, src)
    else:
        k.max_into(dst, src)


@njit(inline="always")
def _half(op, family, dst, src):
    if family == 1:
        if op == 0:
            k.float16_sum_into(dst, src)
        elif op == 1:
            k.float16_prod_into(dst, src)
        elif op == 2:
            k.float16_min_into(dst, src)
        else:
            k.float16_max_into(dst, src)
    elif op == 0:
        k.bfloat16_sum_into(dst, src)
    elif op == 1:
        k.bfloat16_prod_into(dst, src)
    elif op == 2:
        k.bfloat16_min_into(dst, src)
    else:
        k.bfloat16_max_into(dst, src)


@njit(inline="always")
def _bytes(op, family, kind, dst, src):
    if kind == 0:
        _native(op, dst.view(np.float32), src.view(np.float32))
    elif kind == 1:
        _native(op, dst.view(np.float64), src.view(np.float64))
    elif kind == 2:
        _native(op, dst.view(np.int32), src.view(np.int32))
    elif kind == 3:
        _native(op, dst.view(np.int64), src.view(np.int64))
    else:
        _half(op, family, dst.view(np.uint16), src.view(np.uint16))


@overload_method(CodedReductionType, "combine")
def _combine(reduction, dst, src):
    # Bytes: one compilation serves every dtype (the kind picks the view when it runs). Half
    # precision travels as uint16 bit patterns; every other dtype is reduced in its own type.
    if dst.dtype == types.uint8:
        return lambda reduction, dst, src: _bytes(reduction.op, reduction.family, reduction.kind, dst, src)
    if dst.dtype == types.uint16:
        return lambda reduction, dst, src: _half(reduction.op, reduction.family, dst, src)
    return lambda reduction, dst, src: _native(reduction.op, dst, src)


@overload_method(CodedReductionType, "finalize")
def _finalize(reduction, buf, world_size):
    # Only float32/float64 avg divides at the end (half precision divides each contribution first).
    if buf.dtype == types.uint8:

        def finalize_bytes(reduction, buf, world_size):
            if reduction.divides and buf.size:
                if reduction.kind == 0:
                    k.divide(buf.view(np.float32), np.float64(world_size))
                elif reduction.kind == 1:
                    k.divide(buf.view(np.float64), np.float64(world_size))

        return finalize_bytes
    if isinstance(buf.dtype, types.Float):

        def finalize(reduction, buf, world_size):
            if reduction.divides and buf.size:
                k.divide(buf, np.float64(world_size))

        return finalize
    return lambda reduction, buf, world_size: None
