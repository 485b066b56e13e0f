"""Arrays whose values a recording never needs: the inputs, copies and outputs of a recorded call.

They keep a collective's shapes and byte counts (what a schedule depends on) and hold no data, so
recording a 1 GiB reduce_scatter allocates nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from lab.sim.limits import SimulationTooLarge


class VirtualArray(np.ndarray):
    """An array whose values the recording never needs: writing into it does nothing, and a copy
    of it is a stride-0 array of one element, whatever its length (numpy keeps the class through
    slices, views and reshapes, so every chunk an algorithm takes of it is one too).

        x = virtual(1 << 28, np.float32)     # 1 GiB as the collectives see it, 4 bytes in memory
        x.copy().nbytes, x[5:9].nbytes       # (1073741824, 16)
        x[:] = 1.0                           # nothing happens

    Which is what reduce_scatter's work copy, reduce's scratch copy, Bruck's packed slots and
    allgather's output are while recording. An operation it does not know (``np.array(x)``,
    ``astype``) still works: it reads zeros and allocates a real array.

    Inside :func:`counting_passes`, the bytes each copy and write would move (a pass over memory
    that is not a message: Bruck's rotations, reduce_scatter's work copy) go to its counter.
    """
    def __setitem__(self, key: Any, value: Any) -> None:
        _passed(np.ndarray.__getitem__(self, key).nbytes)  # values never matter to a schedule; bytes do

    def copy(self, order: str = "C") -> VirtualArray:
        _passed(self.nbytes)
        return virtual(self.shape, self.dtype)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        make = _VIRTUAL_RESULTS.get(func)
        if make is not None:
            return make(*args, **kwargs)
        return super().__array_function__(func, types, args, kwargs)


def virtual(shape: int | tuple[int, ...], dtype: Any) -> VirtualArray:
    """A :class:`VirtualArray` of ``shape`` that occupies one element: every index aliases it."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    one = np.zeros(1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape)).view(VirtualArray)


#: The counter of the recording in progress in this thread (or task): bytes of local passes.
_PASSES: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("passes", default=None)


def _passed(nbytes: int) -> None:
    count = _PASSES.get()
    if count is not None:
        count(nbytes)


@contextlib.contextmanager
def counting_passes(count: Callable[[int], None]) -> Iterator[None]:
    """Call ``count(nbytes)`` for every copy or write of a :class:`VirtualArray` inside the block
    (recordings in other threads count their own)::

        with counting_passes(seen.append):
            virtual(256, np.float32).copy()     # seen == [1024]
    """
    token = _PASSES.set(count)
    try:
        yield
    finally:
        _PASSES.reset(token)


def _virtual_like(a: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> VirtualArray:
    return virtual(kwargs.get("shape") or np.shape(a), dtype or a.dtype)


def _virtual_copy(a: Any, *args: Any, **kwargs: Any) -> VirtualArray:
    result = _virtual_like(a)
    _passed(result.nbytes)
    return result


def _virtual_concatenate(arrays: Any, axis: int = 0, *args: Any, **kwargs: Any) -> VirtualArray:
    arrays = list(arrays)
    shape = list(np.shape(arrays[0]))
    shape[axis] = sum(np.shape(a)[axis] for a in arrays)
    result = virtual(tuple(shape), kwargs.get("dtype") or arrays[0].dtype)
    _passed(result.nbytes)
    return result


def _virtual_copyto(dst: Any, *args: Any, **kwargs: Any) -> None:
    _passed(np.asarray(dst).nbytes)


#: What numpy's functions return for a VirtualArray (the rest are numpy's own).
_VIRTUAL_RESULTS: dict[Any, Callable[..., Any]] = {
    np.copy: _virtual_copy, np.empty_like: _virtual_like, np.zeros_like: _virtual_like,
    np.ones_like: _virtual_like,
    np.full_like: lambda a, fill_value, dtype=None, *x, **k: _virtual_like(a, dtype),
    np.concatenate: _virtual_concatenate, np.copyto: _virtual_copyto}

#: MAP_NORESERVE: map the input without reserving memory for it (it is never written).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def mapped_input(numel: int) -> VirtualArray:
    """The float32 input every rank passes: contiguous (so the public call takes it as it is, with
    no copy), an anonymous mapping that is never written, so reading it costs no memory either."""
    if numel == 0:
        return np.empty(0, np.float32).view(VirtualArray)
    try:
        mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except (OSError, OverflowError) as exc:
        raise SimulationTooLarge(
            f"too large to simulate: cannot map an input of {numel * 4:,} bytes here ({exc}); "
            "use a smaller nbytes") from exc
    return np.frombuffer(mapping, np.float32).view(VirtualArray)
