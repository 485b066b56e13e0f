"""How a buffer is cut into per-rank chunks: ``numpy.array_split`` bounds, computed once."""

from __future__ import annotations

import numpy as np


def split_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``parts`` pieces of ``range(length)``, as ``numpy.array_split``.

    The first ``length % parts`` pieces get one extra element; pieces may be empty.

        >>> split_bounds(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    if length < 0:
        raise ValueError(f"length must be >= 0; got {length}")
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def row_bounds(rows: int, row_elements: int, parts: int) -> list[tuple[int, int]]:
    """Element bounds of ``parts`` blocks of whole rows (split along dim 0, as ``array_split``).

        >>> row_bounds(5, 2, 2)   # a (5, 2) tensor: rows 0-2 and 3-4
        [(0, 6), (6, 10)]
    """
    return [(a * row_elements, b * row_elements) for a, b in split_bounds(rows, parts)]


def ring_chunk(buf: np.ndarray, bounds: list[tuple[int, int]], index: int) -> np.ndarray:
    """Chunk ``index mod len(bounds)`` of ``buf`` (a view): ring algorithms count chunks modulo N.

        >>> ring_chunk(np.arange(10), split_bounds(10, 4), -1)
        array([8, 9])
    """
    start, stop = bounds[index % len(bounds)]
    return buf[start:stop]
