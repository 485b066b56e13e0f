"""Tests for the reduction kernels (``kernels.reduce``, ``kernels.python``) and the op/dtype table
(``lab.ops``).

References: numpy for the native dtypes (exact), ``float32`` arithmetic rounded by numpy for float16,
and torch's ``bfloat16`` for bfloat16. Half-precision results are compared bit for bit, with any
NaN equal to any NaN (payloads are not specified).
"""

from __future__ import annotations

import ast
import pathlib
import zlib

import numpy as np
import pytest
import torch

from kernels.python import NUMPY_KERNELS, PYTHON_KERNELS
from kernels.reduce import (
    DIVIDE,
    KERNELS,
    bfloat16_to_float32,
    float16_to_float32,
    float32_to_bfloat16,
    float32_to_float16,
)
from lab.ops import DTYPES, REDUCE_DTYPES, ReduceOp, Reduction, check_reduces, dtype_of, parse_op, reduction

pytestmark = pytest.mark.no_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ("sum", "prod", "min", "max")
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
NATIVE_DTYPES = (np.float32, np.float64, np.int32, np.int64)
FLOAT_DTYPES = (np.float32, np.float64)
LENGTHS = (0, 1, 7, 100_003)
NUMPY_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
TORCH_FN = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}

# --- helpers ------------------------------------------------------------------------------------


def _rng(*key) -> np.random.Generator:
    """A generator seeded from the test's parameters, so every case is reproducible."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _native_pair(dtype, n: int, op: str, rng: np.random.Generator):
    """Random dst/src of ``dtype``: mixed signs and magnitudes, some ties; integer ranges chosen so a
    single combine cannot overflow."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        scale = 10.0**rng.uniform(-3, 3, size=(2, n))
        a, b = (rng.standard_normal((2, n)) * scale).astype(dtype)
    else:
        bits = dtype.itemsize * 8
        limit = 2**(bits // 2 - 1) if op == "prod" else 2**(bits - 2)
        a, b = rng.integers(-limit, limit, size=(2, n), dtype=dtype)
    b[::5] = a[::5]  # ties for min/max
    return a.copy(), b.copy()


def _f16_nan(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7FFF) > 0x7C00


def _bf16_nan(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7FFF) > 0x7F80


def _assert_half_equal(got: np.ndarray, want: np.ndarray, is_nan) -> None:
    """Bitwise equality of uint16 half patterns, any NaN matching any NaN."""
    assert got.dtype == np.uint16 and want.dtype == np.uint16
    assert got.shape == want.shape
    got_nan, want_nan = is_nan(got), is_nan(want)
    bad = np.flatnonzero((got_nan != want_nan) | (~want_nan & (got != want)))
    assert bad.size == 0, (f"{bad.size} mismatches, first at {bad[:5].tolist()}: "
                           f"got {[hex(v) for v in got[bad[:5]]]}, want {[hex(v) for v in want[bad[:5]]]}")


def _assert_native_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Exact equality (bitwise for non-NaN floats, so -0.0 != +0.0), NaN matching NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":
        got_nan, want_nan = np.isnan(got), np.isnan(want)
        uint = np.dtype(f"u{got.dtype.itemsize}")
        bad = (got_nan != want_nan) | (~want_nan & (got.view(uint) != want.view(uint)))
    else:
        bad = got != want
    idx = np.flatnonzero(bad)
    assert idx.size == 0, (
        f"{idx.size} mismatches, first at {idx[:5].tolist()}: {got[idx[:5]]} vs {want[idx[:5]]}")


def _to_bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _f16_bits_from_f32(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def _half_pair(family: str, mode: str, n: int, rng: np.random.Generator):
    """dst/src uint16 patterns: ``values`` are ordinary signed numbers of many magnitudes;
    ``bits`` are uniformly random patterns (subnormals, infinities and NaNs included)."""
    if mode == "bits":
        a, b = rng.integers(0, 2**16, size=(2, n), dtype=np.uint16)
    else:
        x = (rng.standard_normal((2, n)) * 10.0**rng.uniform(-3, 2, size=(2, n))).astype(np.float32)
        if family == "float16":
            a, b = _f16_bits_from_f32(x)
        else:
            a, b = _bf16_bits(torch.from_numpy(x).to(torch.bfloat16))
    b[::5] = a[::5]
    return a.copy(), b.copy()


def _f16_reference(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a.astype(float32) op b.astype(float32)).astype(float16), as uint16 patterns."""
    fa, fb = a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        return _f16_bits_from_f32(NUMPY_UFUNC[op](fa, fb))


def _bf16_reference(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _bf16_bits(TORCH_FN[op](_to_bf16_tensor(a), _to_bf16_tensor(b)))


# --- the kernel table ---------------------------------------------------------------------------


def test_kernel_table_is_complete():
    """KERNELS has exactly one kernel per (op, family), the bitwise ops for the native integers
    only, and DIVIDE one per family."""
    assert set(KERNELS) == {(op, fam) for op in OPS for fam in ("native", "float16", "bfloat16")} | \
        {(op, "native") for op in BITWISE}
    assert set(DIVIDE) == {"native", "float16", "bfloat16"}
    assert len({id(k) for k in KERNELS.values()}) == len(KERNELS)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("op", list(BITWISE))
def test_bitwise_kernels_match_numpy(op, dtype):
    rng = np.random.default_rng(5)
    for size in (0, 1, 7, 4097):
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
        want = BITWISE[op](a, b)
        KERNELS[op, "native"](a, b)
        assert np.array_equal(a, want), (op, dtype, size)


def test_kernels_import_nothing_from_lab():
    """No module in kernels/ imports ``lab`` (checked on the source with ast)."""
    files = sorted((ROOT / "kernels").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "reduce.py", "python.py"}
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level >= 2:  # from .. import x: climbs out of kernels/
                    offenders.append(f"{path.name}:{node.lineno} relative import level {node.level}")
                names = [node.module or ""] if node.level == 0 else []
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", "")) in ("import_module", "__import__"):
                names = [
                    a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "lab"]
    assert not offenders, offenders


# --- native kernels vs numpy --------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_native_kernel_matches_numpy(op, dtype, n):
    """KERNELS[op, "native"] computes exactly numpy's elementwise op, in place, leaving src alone."""
    a, b = _native_pair(dtype, n, op, _rng("native", op, np.dtype(dtype).name, n))
    if n > 1:
        assert not np.array_equal(a, b) and np.unique(a).size > 1  # real data, not all ones
    want = NUMPY_UFUNC[op](a, b)
    src = b.copy()
    dst = a.copy()
    KERNELS[op, "native"](dst, src)
    _assert_native_equal(dst, want)
    _assert_native_equal(src, b)


@pytest.mark.parametrize("dtype", (np.int32, np.int64), ids=lambda d: np.dtype(d).name)
def test_integer_sum_wraps_like_numpy(dtype):
    """Integer sum wraps around on overflow (two's complement), exactly like numpy."""
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max // 2 + 1, 123, info.max], dtype=dtype)
    b = np.array([1, -1, info.max // 2 + 1, -5, info.max], dtype=dtype)
    with np.errstate(over="ignore"):
        want = a + b
    assert want[0] == info.min and want[1] == info.max  # numpy itself wraps
    dst = a.copy()
    KERNELS["sum", "native"](dst, b)
    _assert_native_equal(dst, want)
    np.testing.assert_array_equal(dst[:4], np.array([info.min, info.max, info.min, 118], dtype=dtype))


def test_int32_prod_wraps_like_numpy():
    """int32 prod wraps modulo 2**32 like numpy (no widening to int64 left in the buffer)."""
    a = np.array([65536, 46341, -65536, 3, 2**30], dtype=np.int32)
    b = np.array([65536, 46341, 32768, -7, 4], dtype=np.int32)
    with np.errstate(over="ignore"):
        want = a * b
    dst = a.copy()
    KERNELS["prod", "native"](dst, b)
    _assert_native_equal(dst, want)
    assert dst[0] == 0 and dst[1] == np.int32(np.int64(46341)**2 - 2**32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_native_float_specials_match_numpy(op, dtype):
    """Infinities, NaN, subnormals and overflow go through the native kernels as in numpy."""
    info = np.finfo(dtype)
    vals = np.array([np.inf, -np.inf, np.nan, info.max, -info.max, info.smallest_subnormal, 1.5, -2.0, 0.0],
                    dtype=dtype)
    a, b = (g.ravel() for g in np.meshgrid(vals, vals))
    a, b = a.copy(), b.copy()
    with np.errstate(all="ignore"):
        want = NUMPY_UFUNC[op](a, b)
    dst = a.copy()
    KERNELS[op, "native"](dst, b)
    # numpy's tie rule for min/max on +-0 is unspecified; vals holds one zero only, so no +-0 ties.
    _assert_native_equal(dst, want)


# --- half kernels --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ("values", "bits"))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", OPS)
def test_float16_kernel_matches_float32_reference(op, n, mode):
    """KERNELS[op, "float16"] == (a.astype(f32) op b.astype(f32)).astype(f16), bit for bit."""
    a, b = _half_pair("float16", mode, n, _rng("f16", op, n, mode))
    if n > 1:
        assert not np.array_equal(a, b)
    want = _f16_reference(op, a, b)
    dst, src = a.copy(), b.copy()
    KERNELS[op, "float16"](dst, src)
    _assert_half_equal(dst, want, _f16_nan)
    np.testing.assert_array_equal(src, b)


@pytest.mark.parametrize("mode", ("values", "bits"))
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", OPS)
def test_bfloat16_kernel_matches_torch(op, n, mode):
    """KERNELS[op, "bfloat16"] equals torch's bfloat16 op, bit for bit."""
    a, b = _half_pair("bfloat16", mode, n, _rng("bf16", op, n, mode))
    if n > 1:
        assert not np.array_equal(a, b)
    want = _bf16_reference(op, a, b)
    dst, src = a.copy(), b.copy()
    KERNELS[op, "bfloat16"](dst, src)
    _assert_half_equal(dst, want, _bf16_nan)
    np.testing.assert_array_equal(src, b)


def test_half_sum_rounds_once_per_step():
    """Each combine rounds the float32 result once to nearest even: 2048 + 1 is a tie -> 2048,
    2048 + 3 -> 2052, 65504 + 8 -> 65504, 65504 + 16 is a tie -> Inf, 1 + 2**-11 -> 1."""
    dst = _f16_bits_from_f32(np.array([2048.0, 2048.0, 65504.0, 65504.0, 1.0], np.float32))
    src = _f16_bits_from_f32(np.array([1.0, 3.0, 8.0, 16.0, 2.0**-11], np.float32))
    KERNELS["sum", "float16"](dst, src)
    np.testing.assert_array_equal(
        dst.view(np.float16).astype(np.float32), [2048.0, 2052.0, 65504.0, np.inf, 1.0])
    dst = _bf16_bits(torch.tensor([256.0, 256.0], dtype=torch.bfloat16))
    src = _bf16_bits(torch.tensor([1.0, 3.0], dtype=torch.bfloat16))
    KERNELS["sum", "bfloat16"](dst, src)
    assert _to_bf16_tensor(dst).float().tolist() == [256.0, 260.0]


# --- NaN propagation -----------------------------------------------------------------------------

_NAN_DST = [np.nan, 1.0, np.nan, 1.0, -np.inf, np.inf, 3.0]
_NAN_SRC = [1.0, np.nan, np.nan, 2.0, np.nan, np.nan, -np.inf]


def _encode(family: str, values) -> np.ndarray:
    x = np.array(values, np.float32)
    if family == "float16":
        return _f16_bits_from_f32(x).copy()
    if family == "bfloat16":
        return _bf16_bits(torch.from_numpy(x).to(torch.bfloat16))
    return x.astype(family)


def _decode(family: str, buf: np.ndarray) -> np.ndarray:
    if family == "float16":
        return buf.view(np.float16).astype(np.float64)
    if family == "bfloat16":
        return _to_bf16_tensor(buf).double().numpy()
    return buf.astype(np.float64)


@pytest.mark.parametrize("family", ("float32", "float64", "float16", "bfloat16"))
@pytest.mark.parametrize("op", ("min", "max"))
def test_min_max_propagate_nan(op, family):
    """min/max return NaN whenever either side is NaN (dst or src), like numpy.minimum/maximum."""
    kernel = KERNELS[op, family if family in ("float16", "bfloat16") else "native"]
    dst, src = _encode(family, _NAN_DST), _encode(family, _NAN_SRC)
    kernel(dst, src)
    got = _decode(family, dst)
    want = NUMPY_UFUNC[op](np.array(_NAN_DST), np.array(_NAN_SRC))
    np.testing.assert_array_equal(np.isnan(got), [True, True, True, False, True, True, False])
    np.testing.assert_array_equal(got, want)  # assert_array_equal treats NaN == NaN


# --- scalar conversions ----------------------------------------------------------------------------

ALL_HALF = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


def _widen(fn, bits: np.ndarray) -> np.ndarray:
    return np.array([fn(h) for h in bits], dtype=np.float32)


def _narrow(fn, x: np.ndarray) -> np.ndarray:
    return np.array([fn(v) for v in x], dtype=np.uint16)


def test_float16_to_float32_exhaustive():
    """All 65,536 float16 patterns widen exactly as numpy does (NaN stays NaN with its sign)."""
    got = _widen(float16_to_float32, ALL_HALF)
    want = ALL_HALF.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 * (2**10 - 1)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    np.testing.assert_array_equal(np.signbit(got[nan]), ALL_HALF[nan] >= 0x8000)


def test_float16_round_trip_exhaustive():
    """float32_to_float16(float16_to_float32(h)) == h for all 65,536 patterns (NaN -> NaN, same sign)."""
    back = _narrow(float32_to_float16, _widen(float16_to_float32, ALL_HALF))
    nan = _f16_nan(ALL_HALF)
    np.testing.assert_array_equal(back[~nan], ALL_HALF[~nan])
    assert _f16_nan(back[nan]).all()
    np.testing.assert_array_equal(back[nan] >> 15, ALL_HALF[nan] >> 15)


def test_bfloat16_to_float32_and_round_trip_exhaustive():
    """All 65,536 bfloat16 patterns widen as torch does and narrow back to themselves."""
    got = _widen(bfloat16_to_float32, ALL_HALF)
    want = _to_bf16_tensor(ALL_HALF).float().numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    back = _narrow(float32_to_bfloat16, got)
    np.testing.assert_array_equal(back[~nan], ALL_HALF[~nan])
    assert _bf16_nan(back[nan]).all()
    np.testing.assert_array_equal(back[nan] >> 15, ALL_HALF[nan] >> 15)


def _float32_sample() -> np.ndarray:
    """float32 values stressing half rounding: uniformly random bit patterns (subnormals, Inf, NaN),
    values around the float16 range, exact ties between float16 and bfloat16 neighbours and the
    floats next to them, and named specials."""
    rng = np.random.default_rng(20240517)
    uniform = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    # exponents 96..145 cover float16 subnormals, normals, and overflow
    exps = rng.integers(96, 146, 100_000, dtype=np.uint32)
    near_f16 = ((rng.integers(0, 2, 100_000, dtype=np.uint32) << 31)
                | (exps << 23)
                | rng.integers(0, 2**23, 100_000, dtype=np.uint32))
    f16 = ALL_HALF[:0x7C00].view(np.float16).astype(np.float64)  # 0 .. 65504
    mids = ((f16[:-1] + f16[1:]) / 2).astype(np.float32)  # exact float16 ties
    mids = np.concatenate([mids, [np.float32((65504.0 + 65536.0) / 2)]]).view(np.uint32)
    bf_ties = (rng.integers(0, 2**16, 50_000, dtype=np.uint32) << 16) | 0x8000
    specials = np.array([
        0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
        0x7F80FFFF, 0x7FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF, 0x00800000, 0x477FE000,
        0x477FEFFF, 0x477FF000, 0x47800000, 0x33000000, 0x33000001, 0x33800000, 0x387FC000, 0x38800000,
        0xB3000000, 0xB3000001], dtype=np.uint32)
    ties = np.concatenate([mids, bf_ties])
    parts = [uniform, near_f16, ties, ties - 1, ties + 1, ties | 0x80000000, specials]
    return np.concatenate(parts).astype(np.uint32).view(np.float32)


SAMPLE = _float32_sample()


def test_float32_to_float16_rounding_matches_numpy():
    """float32_to_float16 rounds to nearest even exactly like numpy's astype(float16): subnormals,
    overflow to Inf, ties, ±0 and NaN (any NaN payload, sign kept)."""
    got = _narrow(float32_to_float16, SAMPLE)
    want = _f16_bits_from_f32(SAMPLE)
    _assert_half_equal(got, want, _f16_nan)
    nan = np.isnan(SAMPLE)
    assert nan.sum() > 100 and (want == 0x7C00).sum() > 100 and (want < 0x400).sum() > 100
    np.testing.assert_array_equal(got[nan] >> 15, SAMPLE.view(np.uint32)[nan] >> 31)


def test_float32_to_bfloat16_rounding_matches_torch():
    """float32_to_bfloat16 rounds to nearest even exactly like torch's .to(torch.bfloat16)."""
    got = _narrow(float32_to_bfloat16, SAMPLE)
    want = _bf16_bits(torch.from_numpy(SAMPLE.copy()).to(torch.bfloat16))
    _assert_half_equal(got, want, _bf16_nan)
    nan = np.isnan(SAMPLE)
    np.testing.assert_array_equal(got[nan] >> 15, SAMPLE.view(np.uint32)[nan] >> 31)


@pytest.mark.parametrize(
    ("value", "f16", "bf16"),
    [
        (0.0, 0x0000, 0x0000),
        (-0.0, 0x8000, 0x8000),
        (1.0, 0x3C00, 0x3F80),
        (-2.5, 0xC100, 0xC020),
        (65504.0, 0x7BFF, 0x4780),
        (65520.0, 0x7C00, 0x4780),  # ties to even: overflows float16 to +Inf
        (2.0**-24, 0x0001, 0x3380),  # smallest float16 subnormal
        (2.0**-25, 0x0000, 0x3300),  # tie between 0 and 2**-24 -> even (0)
        (3 * 2.0**-25, 0x0002, 0x33C0),  # tie between 1 and 2 subnormal steps -> even (2)
        (float("inf"), 0x7C00, 0x7F80),
        (float("-inf"), 0xFC00, 0xFF80),
        (3.4028234663852886e38, 0x7C00, 0x7F80)  # float32 max: Inf in both
    ])
def test_narrowing_known_values(value, f16, bf16):
    """Hand-checked narrowing results for ±0, ties, subnormals and overflow."""
    assert int(float32_to_float16(value)) == f16
    assert int(float32_to_bfloat16(value)) == bf16


# --- DIVIDE ----------------------------------------------------------------------------------------

DIVISORS = (1, 2, 3, 7, 8, 1000)


@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_native_divide_matches_numpy(dtype, n, divisor):
    """DIVIDE["native"] divides in place exactly as numpy divides by the world size."""
    a, _ = _native_pair(dtype, n, "sum", _rng("div", np.dtype(dtype).name, n, divisor))
    if n >= 7:
        a[:4] = [np.nan, np.inf, -np.inf, 0.0]
    want = a / dtype(divisor)
    dst = a.copy()
    DIVIDE["native"](dst, float(divisor))
    _assert_native_equal(dst, want)


@pytest.mark.parametrize("mode", ("values", "bits"))
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("n", LENGTHS)
def test_float16_divide_matches_float32_reference(n, divisor, mode):
    """DIVIDE["float16"] == (a.astype(f32) / f32(d)).astype(f16), bit for bit."""
    a, _ = _half_pair("float16", mode, n, _rng("f16div", n, divisor, mode))
    with np.errstate(invalid="ignore"):
        want = _f16_bits_from_f32(a.view(np.float16).astype(np.float32) / np.float32(divisor))
    dst = a.copy()
    DIVIDE["float16"](dst, float(divisor))
    _assert_half_equal(dst, want, _f16_nan)


@pytest.mark.parametrize("mode", ("values", "bits"))
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("n", LENGTHS)
def test_bfloat16_divide_matches_torch(n, divisor, mode):
    """DIVIDE["bfloat16"] equals torch's bfloat16 tensor / divisor, bit for bit."""
    a, _ = _half_pair("bfloat16", mode, n, _rng("bf16div", n, divisor, mode))
    want = _bf16_bits(_to_bf16_tensor(a) / divisor)
    dst = a.copy()
    DIVIDE["bfloat16"](dst, float(divisor))
    _assert_half_equal(dst, want, _bf16_nan)


@pytest.mark.parametrize("dtype", (np.int32, np.int64), ids=lambda d: np.dtype(d).name)
def test_native_divide_rejects_integers(dtype):
    """DIVIDE is for floating buffers only: no integer signature is compiled."""
    with pytest.raises(TypeError):
        DIVIDE["native"](np.arange(4, dtype=dtype), 2.0)


# --- baselines ---------------------------------------------------------------------------------


def _baseline_inputs(dtype, n, op):
    a, b = _native_pair(dtype, n, op, _rng("baseline", op, np.dtype(dtype).name, n))
    if np.dtype(dtype).kind == "f" and n >= 7:
        a[1], b[2], a[3], b[3] = np.nan, np.nan, np.inf, -np.inf
    return a, b


@pytest.mark.parametrize("n", (0, 1, 7, 64))
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_python_baseline_matches_numba(op, dtype, n):
    """PYTHON_KERNELS[op] leaves the same bits in dst as the Numba kernel (NaN included)."""
    a, b = _baseline_inputs(dtype, n, op)
    numba_dst, python_dst = a.copy(), a.copy()
    KERNELS[op, "native"](numba_dst, b)
    with np.errstate(invalid="ignore"):
        PYTHON_KERNELS[op](python_dst, b)
    _assert_native_equal(python_dst, numba_dst)
    if n > 1:
        assert not np.array_equal(python_dst, a)  # the reduction really changed dst


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_numpy_baseline_matches_numba(op, dtype, n):
    """NUMPY_KERNELS[op] reduces in place (same buffer) to the Numba kernel's result."""
    a, b = _baseline_inputs(dtype, n, op)
    numba_dst, numpy_dst = a.copy(), a.copy()
    KERNELS[op, "native"](numba_dst, b)
    buffer_before = numpy_dst.ctypes.data
    with np.errstate(invalid="ignore"):
        assert NUMPY_KERNELS[op](numpy_dst, b) is None
    assert numpy_dst.ctypes.data == buffer_before
    _assert_native_equal(numpy_dst, numba_dst)


def test_baseline_tables_cover_all_ops():
    """Both baseline tables offer every op of the Numba table."""
    assert set(PYTHON_KERNELS) == set(OPS) == set(NUMPY_KERNELS)


# --- lab.ops -------------------------------------------------------------------------------------


def _torch_ops():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    return dist.ReduceOp


@pytest.mark.parametrize(("spelling", "expected"), [
    ("sum", ReduceOp.SUM),
    ("SUM", ReduceOp.SUM),
    ("Sum", ReduceOp.SUM),
    ("prod", ReduceOp.PROD),
    ("PROD", ReduceOp.PROD),
    ("PRODUCT", ReduceOp.PROD),
    ("product", ReduceOp.PROD),
    ("min", ReduceOp.MIN),
    ("MIN", ReduceOp.MIN),
    ("max", ReduceOp.MAX),
    ("MAX", ReduceOp.MAX),
    ("avg", ReduceOp.AVG),
    ("AVG", ReduceOp.AVG),
    ("ReduceOp.MAX", ReduceOp.MAX),
    (ReduceOp.SUM, ReduceOp.SUM),
    (ReduceOp.PROD, ReduceOp.PROD),
    (ReduceOp.MIN, ReduceOp.MIN),
    (ReduceOp.MAX, ReduceOp.MAX),
    (ReduceOp.AVG, ReduceOp.AVG),])
def test_parse_op_accepts_spellings(spelling, expected):
    """parse_op maps names in any case, "PRODUCT" and ReduceOp members to the ReduceOp member."""
    assert parse_op(spelling) is expected


@pytest.mark.parametrize(("name", "expected"), [("SUM", ReduceOp.SUM), ("PRODUCT", ReduceOp.PROD),
                                                ("MIN", ReduceOp.MIN), ("MAX", ReduceOp.MAX),
                                                ("AVG", ReduceOp.AVG)])
def test_parse_op_accepts_torch_distributed_ops(name, expected):
    """torch.distributed.ReduceOp.SUM etc. map to the lab's ReduceOp."""
    assert parse_op(getattr(_torch_ops(), name)) is expected


@pytest.mark.parametrize("bad", ["mean", "", "add", "sum_", "PREMUL_SUM", 3, None])
def test_parse_op_rejects_unknown(bad):
    """Unknown ops are a ValueError that names the parameter ``op`` and the offending value."""
    with pytest.raises(ValueError, match=r"\bop\b") as info:
        parse_op(bad)
    assert repr(bad) in str(info.value)
    assert "'sum'" in str(info.value)


def test_parse_op_maps_torch_bitwise_ops_and_rejects_premul_sum():
    """torch's BAND, BOR, BXOR are the lab's band, bor, bxor; a PREMUL_SUM (which carries a
    factor: the torch backend applies it) has no lab equivalent: ValueError naming ``op``."""
    import torch.distributed as dist

    assert [parse_op(getattr(_torch_ops(), name)).value
            for name in ("BAND", "BOR", "BXOR")] == ["band", "bor", "bxor"]
    with pytest.raises(ValueError, match=r"\bop\b"):
        parse_op(dist._make_nccl_premul_sum(2.0))


@pytest.mark.parametrize("name", list(DTYPES))
def test_dtype_of_accepts_supported_torch_dtypes(name):
    """Each supported torch dtype maps to its DType entry."""
    tensor = torch.zeros(3, dtype=DTYPES[name].torch_dtype)
    assert dtype_of(tensor) is DTYPES[name]


@pytest.mark.parametrize("name", ["float32", "float64", "int32", "int64"])
def test_dtype_of_accepts_native_numpy_arrays(name):
    """numpy arrays of the native dtypes map to their DType, whose storage is that dtype."""
    found = dtype_of(np.zeros(3, dtype=name))
    assert found is DTYPES[name]
    assert found.storage == np.dtype(name) and found.family == "native"


@pytest.mark.parametrize("tensor", [
    torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8),
    np.zeros(2, dtype=np.longdouble),
    np.zeros(2, dtype="datetime64[s]"),
    np.zeros(2, dtype="U3"),
    np.zeros(2, dtype=object)], ids=lambda t: f"{type(t).__module__.split('.')[0]}-{t.dtype}")
def test_dtype_of_rejects_unsupported_dtypes(tensor):
    """Unsupported dtypes are a TypeError naming the argument and listing every supported dtype."""
    with pytest.raises(TypeError) as info:
        dtype_of(tensor, "grad")
    message = str(info.value)
    assert "grad" in message
    for name in DTYPES:
        assert name in message


@pytest.mark.parametrize("tensor", [
    torch.zeros(2, dtype=torch.complex64),
    torch.zeros(2, dtype=torch.bool),
    torch.zeros(2, dtype=torch.float8_e5m2),
    np.zeros(2, dtype=np.uint8),
    np.zeros(2, dtype=bool),
    np.zeros(2, dtype=np.complex128)], ids=lambda t: f"{type(t).__module__.split('.')[0]}-{t.dtype}")
def test_moved_dtypes_are_supported_but_not_reduced(tensor):
    """The dtypes collectives only move map to their DType; a reduction of one is a TypeError naming
    the collective and listing the dtypes that reduce."""
    found = dtype_of(tensor)
    assert not found.reduces and found.name not in REDUCE_DTYPES
    with pytest.raises(TypeError, match="allreduce cannot reduce") as info:
        check_reduces(found, "allreduce")
    assert all(name in str(info.value) for name in REDUCE_DTYPES)
    with pytest.raises(TypeError, match=found.name):
        reduction(parse_op("sum"), found)


@pytest.mark.parametrize("thing", [[1.0, 2.0], 3.0, None, "float32"])
def test_dtype_of_rejects_non_tensors(thing):
    """Anything but a torch.Tensor or numpy.ndarray is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="grad"):
        dtype_of(thing, "grad")


def test_dtype_codes_are_unique():
    """Every DType has its own wire code (codes are part of message fingerprints)."""
    assert len({d.code for d in DTYPES.values()}) == len(DTYPES)


@pytest.mark.parametrize("name", ["int32", "int64"])
def test_avg_on_integers_is_a_type_error(name):
    """reduction(avg, integer dtype) raises TypeError mentioning 'avg' and the dtype."""
    with pytest.raises(TypeError, match="avg") as info:
        reduction(parse_op("avg"), DTYPES[name])
    assert name in str(info.value)


@pytest.mark.parametrize("name", list(REDUCE_DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_reduction_uses_kernel_table(op, name):
    """reduction(op, dtype).combine is KERNELS[op, dtype.family]; non-avg ops have no divide."""
    red = reduction(parse_op(op), DTYPES[name])
    assert isinstance(red, Reduction)
    assert red.combine is KERNELS[op, DTYPES[name].family]
    assert red.op is parse_op(op) and red.dtype is DTYPES[name]


def _encode_dtype(name: str, values) -> np.ndarray:
    x = np.array(values, np.float64)
    if name == "float16":
        return _f16_bits_from_f32(x.astype(np.float32)).copy()
    if name == "bfloat16":
        return _bf16_bits(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16))
    return x.astype(name)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("name", ["float32", "float64", "float16", "bfloat16"])
def test_avg_finalize_divides(name, world_size):
    """For avg, combine sums; float32/float64 divide the sum by the world size in finalize, the
    half types divide each contribution in prepare (matching DIVIDE) and finalize does nothing."""
    red = reduction(ReduceOp.AVG, DTYPES[name])
    assert red.combine is KERNELS["sum", DTYPES[name].family]
    assert red.prescales == (name in ("float16", "bfloat16"))
    rng = _rng("avg", name, world_size)
    ranks = [_encode_dtype(name, rng.integers(-50, 50, 33)) for _ in range(world_size)]
    prepared = [r.copy() for r in ranks]
    for r in prepared:
        red.prepare(r, world_size)
    buf, want = prepared[0].copy(), ranks[0].copy()
    if red.prescales:
        DIVIDE[DTYPES[name].family](want, float(world_size))
    np.testing.assert_array_equal(buf, want)  # prepare divides the half types' contributions only
    for other, original in zip(prepared[1:], ranks[1:]):
        red.combine(buf, other)
        if red.prescales:
            original = original.copy()
            DIVIDE[DTYPES[name].family](original, float(world_size))
        KERNELS["sum", DTYPES[name].family](want, original)
    if not red.prescales:
        DIVIDE[DTYPES[name].family](want, float(world_size))
    red.finalize(buf, world_size)
    np.testing.assert_array_equal(buf, want)
    # small integers: the sum is exact in every float type, so the mean is sum / n rounded once
    exact = sum(_decode_dtype(name, r) for r in ranks) / world_size
    # (the half types round each contribution once more: within N roundings of the mean)
    np.testing.assert_allclose(_decode_dtype(name, buf), exact, rtol=world_size * 2.0**-7,
                               atol=world_size * 2.0**-7)
    if world_size > 1:
        assert not np.array_equal(_decode_dtype(name, buf), sum(_decode_dtype(name, r) for r in ranks))


def _decode_dtype(name: str, buf: np.ndarray) -> np.ndarray:
    if name == "float16":
        return buf.view(np.float16).astype(np.float64)
    if name == "bfloat16":
        return _to_bf16_tensor(buf).double().numpy()
    return buf.astype(np.float64)


@pytest.mark.parametrize("name", list(REDUCE_DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_finalize_is_noop_without_avg(op, name):
    """For sum/prod/min/max, finalize leaves the buffer untouched for any world size."""
    red = reduction(parse_op(op), DTYPES[name])
    buf = _encode_dtype(name, [3.0, -6.0, 9.0, 12.0, 1.0])
    before = buf.copy()
    red.finalize(buf, 3)
    np.testing.assert_array_equal(buf, before)


def test_avg_finalize_on_empty_buffer():
    """finalize on an empty buffer is fine (nothing to divide)."""
    red = reduction(ReduceOp.AVG, DTYPES["float32"])
    buf = np.zeros(0, np.float32)
    red.finalize(buf, 4)
    assert buf.size == 0
