"""Argument and environment checks shared by the public entry points.

Each raises ``ValueError``/``TypeError`` naming the parameter (or environment variable) before
anything is started or sent.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import numpy as np

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def is_int(value: Any) -> bool:
    """An integer, Python or numpy, and not a bool (``True`` is not rank 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A real number (int, float, numpy), not a bool; NaN and the infinities included."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def timeout_ms(value: Any, name: str) -> float | None:
    """A positive number of milliseconds, ``math.inf`` (wait forever) or None (the default)."""
    if value is None:
        return None
    if not is_real(value) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of milliseconds, math.inf (no limit) or None; "
                         f"got {value!r}")
    return float(value)


def p2p_tag(value: Any, name: str = "tag") -> int:
    """A point-to-point tag: an int in [0, 2**31) (MPI's tags; torch.distributed's ``tag``)."""
    if not is_int(value) or not 0 <= value < 2**31:
        raise ValueError(f"{name} must be an int in [0, 2**31); got {value!r}")
    return int(value)


def flag(value: Any, name: str) -> bool:
    """A real bool (``async_op="no"`` must not mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def positive_int(value: Any, name: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return value


def env_flag(variable: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off/unset."""
    text = os.environ.get(variable, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"environment variable {variable} must be one of 1, true, yes, on, 0, false, no, off; "
                     f"got {os.environ[variable]!r}")


def env_int(variable: str, default: int, low: int = 0, high: int = 2**31 - 1, multiple: int = 1) -> int:
    """An integer environment variable in ``[low, high]`` (a multiple of ``multiple``), or
    ``default`` where it is unset or empty. Only ASCII digits count (``'²'.isdigit()`` is True,
    ``int(' 7')`` takes spaces): anything else is a ``ValueError`` naming the variable and its range."""
    text = os.environ.get(variable, "")
    if not text:
        return default
    value = int(text) if text.isascii() and text.isdigit() else None
    if value is None or not low <= value <= high or value % multiple:
        what = f"a multiple of {multiple:,} " if multiple > 1 else "an integer "
        raise ValueError(
            f"environment variable {variable} must be {what}in [{low:,}, {high:,}]; got {text!r}")
    return value


def trace_path(value: Any, name: str = "trace") -> str | None:
    """A JSONL file to append to: its directory must exist and it must not be a directory."""
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path (str or os.PathLike) or None; got {value!r}")
    path = os.fspath(value)
    if os.path.isdir(path):
        raise ValueError(f"{name} must be a file to append JSON lines to; {path!r} is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"{name}: the directory of {path!r} does not exist")
    return path


def workload_path(value: Any) -> str | None:
    """Where a rank records its workload: ``value`` (a ``workload=`` argument), else
    ``LAB_WORKLOAD``; None: nowhere. Checked as :func:`trace_path` checks a trace's."""
    return trace_path(value, "workload") or trace_path(os.environ.get("LAB_WORKLOAD"), "LAB_WORKLOAD")
