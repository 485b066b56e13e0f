"""Tests for ``lab.chunking``: ``split_bounds`` reproduces ``numpy.array_split`` and ``row_bounds``
splits a 2-D buffer along whole rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lab.chunking import row_bounds, split_bounds

pytestmark = pytest.mark.no_ranks


def _array_split_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Bounds of numpy.array_split's pieces, read off the pieces of an arange."""
    pieces = np.array_split(np.arange(length), parts)
    bounds, start = [], 0
    for piece in pieces:
        if piece.size:
            assert piece[0] == start  # array_split pieces are contiguous slices
        bounds.append((start, start + piece.size))
        start += piece.size
    return bounds


def _check_invariants(bounds: list[tuple[int, int]], length: int, parts: int) -> None:
    assert len(bounds) == parts
    assert bounds[0][0] == 0
    assert bounds[-1][1] == length
    for (_, stop), (start, _) in itertools.pairwise(bounds):
        assert stop == start, "pieces must be contiguous (no gap, no overlap)"
    sizes = [stop - start for start, stop in bounds]
    assert all(size >= 0 for size in sizes)
    assert sum(sizes) == length
    assert max(sizes) - min(sizes) <= 1
    # array_split puts the larger pieces first
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("parts", range(1, 10))
@pytest.mark.parametrize("length", range(41))
def test_split_bounds_matches_array_split_small(length, parts):
    """For every length 0..40 and parts 1..9 the bounds are exactly numpy.array_split's pieces."""
    bounds = split_bounds(length, parts)
    assert bounds == _array_split_bounds(length, parts)
    assert all(isinstance(a, int) and isinstance(b, int) for a, b in bounds)


@pytest.mark.parametrize(("length", "parts"), [(1_000_003, 7), (1_000_000, 8), (999_999, 1000), (65_537, 3),
                                               (3, 64), (0, 16)])
def test_split_bounds_matches_array_split_large(length, parts):
    """Larger lengths (and more parts than elements) still match numpy.array_split."""
    assert split_bounds(length, parts) == _array_split_bounds(length, parts)


@pytest.mark.parametrize("parts", range(1, 10))
@pytest.mark.parametrize("length", [*range(41), 1_000_003, 2**31 + 5, 10**12 + 7])
def test_split_bounds_invariants(length, parts):
    """Pieces are contiguous, cover range(length) exactly once, and differ in size by at most one."""
    bounds = split_bounds(length, parts)
    _check_invariants(bounds, length, parts)
    if length <= 40:  # small enough to count every element's owners directly
        covered = np.zeros(length, dtype=np.int64)
        for start, stop in bounds:
            covered[start:stop] += 1
        assert (covered == 1).all()


def test_split_bounds_docstring_example():
    """The documented example: 10 elements in 4 parts -> sizes 3, 3, 2, 2."""
    assert split_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("parts", [0, -1, -7])
def test_split_bounds_rejects_nonpositive_parts(parts):
    """parts < 1 is a ValueError naming ``parts``."""
    with pytest.raises(ValueError, match="parts"):
        split_bounds(10, parts)


@pytest.mark.parametrize("length", [-1, -100])
def test_split_bounds_rejects_negative_length(length):
    """A negative length is a ValueError naming ``length``."""
    with pytest.raises(ValueError, match="length"):
        split_bounds(length, 3)


def _array_split_row_bounds(rows: int, row_elements: int, parts: int) -> list[tuple[int, int]]:
    """Flat element bounds of numpy.array_split(x, parts, axis=0) for x of shape (rows, row_elements)."""
    flat = np.arange(rows * row_elements)
    x = flat.reshape(rows, row_elements)
    bounds, start = [], 0
    for block in np.array_split(x, parts, axis=0):
        bounds.append((start, start + block.size))
        if block.size:
            assert block.ravel()[0] == start
        start += block.size
    return bounds


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("row_elements", [1, 2, 5, 128])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 13])
def test_row_bounds_splits_whole_rows(rows, row_elements, parts):
    """row_bounds equals array_split along dim 0; every bound is a multiple of the row size."""
    bounds = row_bounds(rows, row_elements, parts)
    assert bounds == _array_split_row_bounds(rows, row_elements, parts)
    assert all(a % row_elements == 0 and b % row_elements == 0 for a, b in bounds)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == rows * row_elements
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(bounds))
    row_counts = [(b - a) // row_elements for a, b in bounds]
    assert row_counts == [b - a for a, b in split_bounds(rows, parts)]
    assert max(row_counts) - min(row_counts) <= 1


def test_row_bounds_docstring_example():
    """The documented example: a (5, 2) tensor in 2 parts -> rows 0-2 and 3-4."""
    assert row_bounds(5, 2, 2) == [(0, 6), (6, 10)]


def test_row_bounds_differs_from_flat_split():
    """Splitting rows is not the same as splitting the flat buffer: (5, 2) in 3 parts keeps rows whole."""
    assert row_bounds(5, 2, 3) == [(0, 4), (4, 8), (8, 10)]
    assert split_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]


@pytest.mark.parametrize(("rows", "parts"), [(5, 0), (-1, 2)])
def test_row_bounds_rejects_invalid(rows, parts):
    """Invalid rows/parts propagate split_bounds' ValueError."""
    with pytest.raises(ValueError):
        row_bounds(rows, 4, parts)
