"""Baselines for the Numba kernels: the same ``dst ⊕= src`` as a pure-Python loop and as numpy.

Same table shape as :mod:`kernels.reduce` (``PYTHON_KERNELS[op]``, ``NUMPY_KERNELS[op]``) for the
native dtypes, so a benchmark can swap implementations and compare bandwidth.

    >>> dst = np.array([1, 5], np.int64); NUMPY_KERNELS["min"](dst, np.array([3, 2], np.int64)); dst
    array([1, 2])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def python_sum_into(dst: np.ndarray, src: np.ndarray) -> None:
    for i in range(len(dst)):
        dst[i] += src[i]


def python_prod_into(dst: np.ndarray, src: np.ndarray) -> None:
    for i in range(len(dst)):
        dst[i] *= src[i]


def python_min_into(dst: np.ndarray, src: np.ndarray) -> None:
    for i in range(len(dst)):
        if src[i] < dst[i] or src[i] != src[i]:
            dst[i] = src[i]


def python_max_into(dst: np.ndarray, src: np.ndarray) -> None:
    for i in range(len(dst)):
        if src[i] > dst[i] or src[i] != src[i]:
            dst[i] = src[i]


PYTHON_KERNELS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "sum": python_sum_into, "prod": python_prod_into, "min": python_min_into, "max": python_max_into}


def _numpy_into(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], None]:
    def reduce_into(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    return reduce_into


NUMPY_KERNELS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "sum": _numpy_into(np.add), "prod": _numpy_into(np.multiply), "min": _numpy_into(np.minimum),
    "max": _numpy_into(np.maximum)}
