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

Every kernel is commutative *in bits*: ``a ⊕ b`` and ``b ⊕ a`` are the same bits for every
input, so algorithms in which two ranks combine the same operands in opposite orders (recursive
doubling) still leave every rank with identical bits. IEEE addition and multiplication are
commutative except for which NaN comes out, so a NaN result is always the canonical quiet NaN
(positive, empty payload); min and max propagate NaN the same way, and of -0.0 and +0.0 min
takes -0.0 and max +0.0, whichever comes first.

Per-rank example (rank 1 of a ring receiving rank 0's chunk)::

    >>> mine = np.array([1.0, 2.0], np.float32); theirs = np.array([10.0, 20.0], np.float32)
    >>> KERNELS["sum", "native"](mine, theirs); mine
    array([11., 22.], dtype=float32)

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

NATIVE_SIGNATURES = [
    "void(float32[::1], float32[::1])", "void(float64[::1], float64[::1])", "void(int32[::1], int32[::1])",
    "void(int64[::1], int64[::1])"]
INTEGER_SIGNATURES = NATIVE_SIGNATURES[2:]  # the bitwise ops: integers only
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


# --- canonical NaN and signed zero (the same bits whichever operand comes first) ---------------

#: The canonical quiet NaNs of the half types' bit patterns.
FLOAT16_NAN = np.uint16(0x7E00)
BFLOAT16_NAN = np.uint16(0x7FC0)


def canonical(value):
    """``value``, or the canonical quiet NaN of its type if it is a NaN (integers: unchanged)."""


@overload(canonical, inline="always")
def _canonical(value):
    if isinstance(value, types.Float):
        nan = np.float32(np.nan) if value == types.float32 else np.float64(np.nan)
        return lambda value: nan if value != value else value
    return lambda value: value


def is_negative(value):
    """Whether ``value``'s sign bit is set (-0.0 included)."""


@overload(is_negative, inline="always")
def _is_negative(value):
    if isinstance(value, types.Float):
        return lambda value: np.signbit(value)
    return lambda value: value < 0


@njit(inline="always")
def minimum(a, b):
    if a != a or b != b:  # NaN wins, as numpy.minimum; canonical, so the order does not show
        return canonical(a + b)
    if a == b:  # equal: the same bits, or -0.0 and +0.0, of which min is -0.0
        return b if is_negative(b) else a
    return min(b, a)


@njit(inline="always")
def maximum(a, b):
    if a != a or b != b:
        return canonical(a + b)
    if a == b:  # -0.0 and +0.0: max is +0.0
        return a if is_negative(b) else b
    return max(b, a)


# --- native kernels ---------------------------------------------------------------------------


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def sum_into(dst, src):
    for i in range(dst.size):
        dst[i] = canonical(dst[i] + src[i])


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def prod_into(dst, src):
    for i in range(dst.size):
        dst[i] = canonical(dst[i] * src[i])


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def min_into(dst, src):
    for i in range(dst.size):
        dst[i] = minimum(dst[i], src[i])


@njit(NATIVE_SIGNATURES, cache=True, nogil=True)
def max_into(dst, src):
    for i in range(dst.size):
        dst[i] = maximum(dst[i], src[i])


@njit(INTEGER_SIGNATURES, cache=True, nogil=True)
def band_into(dst, src):
    for i in range(dst.size):
        dst[i] &= src[i]


@njit(INTEGER_SIGNATURES, cache=True, nogil=True)
def bor_into(dst, src):
    for i in range(dst.size):
        dst[i] |= src[i]


@njit(INTEGER_SIGNATURES, cache=True, nogil=True)
def bxor_into(dst, src):
    for i in range(dst.size):
        dst[i] ^= src[i]


@njit(NATIVE_SCALE_SIGNATURES, cache=True, nogil=True)
def divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = dst[i] / divisor


@njit([
    "void(float32[::1], float32[::1], float32[::1], float32[::1])",
    "void(float64[::1], float64[::1], float64[::1], float64[::1])"], cache=True, nogil=True)
def sum3_into(dst, a, b, c):
    """``dst += a + b + c`` in one pass: reads four buffers and writes one, where three chained
    two-input adds read and write ``dst`` three times (the K=4 fused reduce of the benchmarks)."""
    for i in range(dst.size):
        dst[i] += a[i] + b[i] + c[i]


# --- min and max of half types: the bit patterns, decided on their float32 values ---------------


@njit(inline="always")
def half_minimum(a_bits, b_bits, a, b, nan):
    if a != a or b != b:
        return nan
    if a == b:  # the same bits, or -0.0 (0x8000) and +0.0 (0x0000): min is the larger pattern
        return max(a_bits, b_bits)
    return a_bits if a < b else b_bits


@njit(inline="always")
def half_maximum(a_bits, b_bits, a, b, nan):
    if a != a or b != b:
        return nan
    if a == b:  # max of -0.0 and +0.0 is +0.0, the smaller pattern
        return min(a_bits, b_bits)
    return a_bits if a > b else b_bits


# --- float16 kernels (uint16 bit patterns) ------------------------------------------------------


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_sum_into(dst, src):
    for i in range(dst.size):
        total = float16_to_float32(dst[i]) + float16_to_float32(src[i])
        dst[i] = FLOAT16_NAN if total != total else float32_to_float16(total)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_prod_into(dst, src):
    for i in range(dst.size):
        product = float16_to_float32(dst[i]) * float16_to_float32(src[i])
        dst[i] = FLOAT16_NAN if product != product else float32_to_float16(product)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_min_into(dst, src):
    for i in range(dst.size):
        dst[i] = half_minimum(dst[i], src[i], float16_to_float32(dst[i]), float16_to_float32(src[i]),
                              FLOAT16_NAN)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def float16_max_into(dst, src):
    for i in range(dst.size):
        dst[i] = half_maximum(dst[i], src[i], float16_to_float32(dst[i]), float16_to_float32(src[i]),
                              FLOAT16_NAN)


@njit(HALF_SCALE_SIGNATURE, cache=True, nogil=True)
def float16_divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = float32_to_float16(float16_to_float32(dst[i]) / np.float32(divisor))


# --- bfloat16 kernels (uint16 bit patterns) -----------------------------------------------------


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_sum_into(dst, src):
    for i in range(dst.size):
        total = bfloat16_to_float32(dst[i]) + bfloat16_to_float32(src[i])
        dst[i] = BFLOAT16_NAN if total != total else float32_to_bfloat16(total)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_prod_into(dst, src):
    for i in range(dst.size):
        product = bfloat16_to_float32(dst[i]) * bfloat16_to_float32(src[i])
        dst[i] = BFLOAT16_NAN if product != product else float32_to_bfloat16(product)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_min_into(dst, src):
    for i in range(dst.size):
        dst[i] = half_minimum(dst[i], src[i], bfloat16_to_float32(dst[i]), bfloat16_to_float32(src[i]),
                              BFLOAT16_NAN)


@njit(HALF_SIGNATURE, cache=True, nogil=True)
def bfloat16_max_into(dst, src):
    for i in range(dst.size):
        dst[i] = half_maximum(dst[i], src[i], bfloat16_to_float32(dst[i]), bfloat16_to_float32(src[i]),
                              BFLOAT16_NAN)


@njit(HALF_SCALE_SIGNATURE, cache=True, nogil=True)
def bfloat16_divide(dst, divisor):
    for i in range(dst.size):
        dst[i] = float32_to_bfloat16(bfloat16_to_float32(dst[i]) / np.float32(divisor))


#: ``KERNELS[op, family](dst, src)`` reduces ``src`` into ``dst`` in place.
KERNELS = {
    ("sum", "native"): sum_into,
    ("prod", "native"): prod_into,
    ("min", "native"): min_into,
    ("max", "native"): max_into,
    ("band", "native"): band_into,  # int32 and int64 (lab.ops.reduction checks)
    ("bor", "native"): bor_into,
    ("bxor", "native"): bxor_into,
    ("sum", "float16"): float16_sum_into,
    ("prod", "float16"): float16_prod_into,
    ("min", "float16"): float16_min_into,
    ("max", "float16"): float16_max_into,
    ("sum", "bfloat16"): bfloat16_sum_into,
    ("prod", "bfloat16"): bfloat16_prod_into,
    ("min", "bfloat16"): bfloat16_min_into,
    ("max", "bfloat16"): bfloat16_max_into}

#: ``DIVIDE[family](dst, divisor)`` divides in place (the second half of ``avg``; floats only).
DIVIDE = {"native": divide, "float16": float16_divide, "bfloat16": bfloat16_divide}
