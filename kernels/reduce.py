"""Numba in-place reduction kernels: ``dst ⊕= src`` over flat, contiguous buffers.

One kernel per op and storage family, compiled eagerly for its signatures (``cache=True``, so a
process loads machine code from the on-disk cache instead of compiling), releasing the GIL
(``nogil=True``) so a rank's Python computation can run while its communication thread reduces. The table ``KERNELS``
maps ``(op, family)`` to a kernel, as gloo's reduction functions are a table indexed by op.

Families:
- ``"native"``: float32, float64, int32, int64 arrays, reduced in their own type
  (integers wrap on overflow, as numpy and torch do);
- ``"float16"`` and ``"bfloat16"``: ``uint16`` arrays holding the bit patterns; every element is
  widened to float32, combined, and rounded back to nearest-even (gloo and NCCL accumulate
  half precision the same way, one rounding per step).

min and max propagate NaN like ``numpy.minimum``/``numpy.maximum``.

Per-rank example (rank 1 of a ring receiving rank 0's chunk)::

    >>> mine = np.array([1.0, 2.0], np.float32); theirs = np.array([10.0, 20.0], np.float32)
    >>> KERNELS["sum", "native"](mine, theirs); mine
    array([11., 22.], dtype=float32)

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

NATIVE_SIGNATURES = [
    "void(float32[::1], float32[::1])",
    "void(float64[::1], float64[::1])",
    "void(int32[::1], int32[::1])",
    "void(int64[::1], int64[::1])",
]
HALF_SIGNATURE = ["void(uint16[::1], uint16[::1])"]
NATIVE_SCALE_SIGNATURES = ["void(float32[::1], float64)", "void(float64[::1], float64)"]
HALF_SCALE_SIGNATURE = ["void(uint16[::1], float64)"]


# --- bit casts between float32 and uint32 (no memory round trip) -------------------------------


@intrinsic
def _float32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_float32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


# --- half-precision conversions (round to nearest even, NaN and Inf kept) ----------------------


@njit(inline="always")
def bfloat16_to_float32(h):
    return _float32_from_bits(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def float32_to_bfloat16(f):
    u = _bits_from_float32(np.float32(f))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it quiet, keep the sign
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16((u + rounding) >> np.uint32(16))


@njit(inline="always")
def float16_to_float32(h):
    # Move exponent and mantissa into float32 position, then fix up Inf/NaN and subnormals.
    bits = (np.uint32(h) & np.uint32(0x7FFF)) << np.uint32(13)
    exponent = bits & np.uint32(0x0F800000)
    bits += np.uint32(112 << 23)
    if exponent == np.uint32(0x0F800000):
        bits += np.uint32(112 << 23)
    elif exponent == 0:
        bits += np.uint32(1 << 23)
        bits = _bits_from_float32(_float32_from_bits(bits) - np.float32(6.103515625e-05))
    return _float32_from_bits(bits | ((np.uint32(h) & np.uint32(0x8000)) << np.uint32(16)))


@njit(inline="always")
def float32_to_float16(f):
    u = _bits_from_float32(np.float32(f))
    sign = u & np.uint32(0x80000000)
    u ^= sign
    if u >= np.uint32(0x47800000):  # overflow to Inf, or Inf/NaN already
        out = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif u < np.uint32(0x38800000):  # result is subnormal or zero: let float addition round it
        out = _bits_from_float32(_float32_from_bits(u) + np.float32(0.5)) - np.uint32(0x3F000000)
    else:
        odd_mantissa = (u >> np.uint32(13)) & np.uint32(1)
        u += np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF) + odd_mantissa
        out = u >> np.uint32(13)
    return np.uint16(out | (sign >> np.uint32(16)))


# --- native kernels ---------------------------------------------------------------------------


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def sum_into(dst, src):
    for i in range(dst.size):
        dst[i] += src[i]


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def prod_into(dst, src):
    for i in range(dst.size):
        dst[i] *= src[i]


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def min_into(dst, src):
    for i in range(dst.size):
        s = src[i]
        if s < dst[i] or s != s:
            dst[i] = s


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def max_into(dst, src):
    for i in range(dst.size):
        s = src[i]
        if s > dst[i] or s != s:
            dst[i] = s


@njit(NATIVE_SCALE_SIGNATURES, cache=True, nogil=True)
def divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = dst[i] / divisor


@njit(["void(float32[::1], float32[::1], float32[::1], float32[::1])",
       "void(float64[::1], float64[::1], float64[::1], float64[::1])"], cache=True, nogil=True)
def sum3_into(dst, a, b, c):
    """``dst += a + b + c`` in one pass: reads four buffers and writes one, where three chained
    two-input adds read and write ``dst`` three times (the K=4 fused reduce of the benchmarks)."""
    for i in range(dst.size):
        dst[i] += a[i] + b[i] + c[i]


# --- float16 kernels (uint16 bit patterns) ------------------------------------------------------


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_sum_into(dst, src):
    for i in range(dst.size):
        dst[i] = float32_to_float16(float16_to_float32(dst[i]) + float16_to_float32(src[i]))


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_prod_into(dst, src):
    for i in range(dst.size):
        dst[i] = float32_to_float16(float16_to_float32(dst[i]) * float16_to_float32(src[i]))


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_min_into(dst, src):
    for i in range(dst.size):
        s = float16_to_float32(src[i])
        if s < float16_to_float32(dst[i]) or s != s:
            dst[i] = src[i]


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_max_into(dst, src):
    for i in range(dst.size):
        s = float16_to_float32(src[i])
        if s > float16_to_float32(dst[i]) or s != s:
            dst[i] = src[i]


@njit(HALF_SCALE_SIGNATURE, cache=True, nogil=True)
def float16_divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = float32_to_float16(float16_to_float32(dst[i]) / np.float32(divisor))


# --- bfloat16 kernels (uint16 bit patterns) -----------------------------------------------------


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_sum_into(dst, src):
    for i in range(dst.size):
        dst[i] = float32_to_bfloat16(bfloat16_to_float32(dst[i]) + bfloat16_to_float32(src[i]))


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_prod_into(dst, src):
    for i in range(dst.size):
        dst[i] = float32_to_bfloat16(bfloat16_to_float32(dst[i]) * bfloat16_to_float32(src[i]))


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_min_into(dst, src):
    for i in range(dst.size):
        s = bfloat16_to_float32(src[i])
        if s < bfloat16_to_float32(dst[i]) or s != s:
            dst[i] = src[i]


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_max_into(dst, src):
    for i in range(dst.size):
        s = bfloat16_to_float32(src[i])
        if s > bfloat16_to_float32(dst[i]) or s != s:
            dst[i] = src[i]


@njit(HALF_SCALE_SIGNATURE, cache=True, nogil=True)
def bfloat16_divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = float32_to_bfloat16(bfloat16_to_float32(dst[i]) / np.float32(divisor))


FAMILIES = ("native", "float16", "bfloat16")
OPS = ("sum", "prod", "min", "max")

#: ``KERNELS[op, family](dst, src)`` reduces ``src`` into ``dst`` in place.
KERNELS = {
    ("sum", "native"): sum_into,
    ("prod", "native"): prod_into,
    ("min", "native"): min_into,
    ("max", "native"): max_into,
    ("sum", "float16"): float16_sum_into,
    ("prod", "float16"): float16_prod_into,
    ("min", "float16"): float16_min_into,
    ("max", "float16"): float16_max_into,
    ("sum", "bfloat16"): bfloat16_sum_into,
    ("prod", "bfloat16"): bfloat16_prod_into,
    ("min", "bfloat16"): bfloat16_min_into,
    ("max", "bfloat16"): bfloat16_max_into,
}

#: ``DIVIDE[family](dst, divisor)`` divides in place (the second half of ``avg``; floats only).
DIVIDE = {"native": divide, "float16": float16_divide, "bfloat16": bfloat16_divide}
