"""What ``python -m lab``'s commands share to refuse a bad input as argparse does: one line naming
the option (or the file), exit status 2, before anything runs; and JSON that is always valid.

An argparse type here converts and checks an option's text, raising ``ArgumentTypeError`` so that
argparse itself names the option: ``error: argument --ranks: must be a whole number from 1 to 82``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

Value = TypeVar("Value")


def whole(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in ASCII digits from ``low`` up (to ``high``).
    (``'²'.isdigit()`` is True and ``int(' 7')`` takes spaces: neither is a count typed here.)"""
    def whole_number(text: str) -> int:
        value = int(text) if text.isascii() and text.isdigit() else None
        if value is None or value < low or (high is not None and value > high):
            span = f"from {low:,} up" if high is None else f"from {low:,} to {high:,}"
            raise argparse.ArgumentTypeError(f"must be a whole number {span}; got {text!r}")
        return value

    return whole_number


def number(text: str) -> float:
    """A number as ``float`` reads it (NaN and the infinities too: the check that follows refuses them)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number; got {text!r}") from None


def checked(convert: Callable[[str], Value],
            check: Callable[[Value], Any] | None = None) -> Callable[[str], Value]:
    """An argparse type: ``convert`` the text, then ``check`` the value (a library's own check,
    raising ``ValueError``/``TypeError`` that names its parameter): its message names the option's
    trouble, argparse the option (argparse alone would say ``invalid convert value``)."""
    def value(text: str) -> Value:
        try:
            converted = convert(text)
            if check is not None:
                check(converted)
        except (ValueError, TypeError, OverflowError) as problem:
            raise argparse.ArgumentTypeError(str(problem)) from None
        return converted

    return value


def refused(problem: BaseException) -> str:
    """An error's one line: an ``OSError`` names its file (``/x/y.log: No such file or directory``)."""
    if isinstance(problem, OSError) and problem.filename is not None:
        return f"{problem.filename}: {problem.strerror or problem}"
    return str(problem)


def output_file(path: str, option: str) -> None:
    """Refuse (``ValueError`` naming ``option``) an output that cannot be a file: a directory, or a
    file in a folder that does not exist; checked before the work that ends in writing it."""
    if os.path.isdir(path):
        raise ValueError(f"argument {option}: {path} is a directory; give a file to write")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"argument {option}: the folder of {path} does not exist")


def finite_json(value: Any) -> Any:
    """``value`` with every float that is no finite number as None, so ``json.dumps(...,
    allow_nan=False)`` writes valid JSON (``null``, never ``NaN`` or ``Infinity``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    if isinstance(value, np.generic):  # numpy's scalars as Python's own
        return finite_json(value.item())
    return value
