"""The compiled data plane: ``@compilable`` (this module), the plane that runs a small collective
as one Numba call over the shm mailboxes (:mod:`lab.compiled.plane`), registered tensors
(:mod:`lab.compiled.registered`) and the guard of the sources compiled code is built from
(:mod:`lab.compiled.sources`). A floor below the transports and the algorithms.

One source, two runs: ``@compilable`` functions run as Python on any :class:`lab.algorithms.peers.Peers`
and, compiled by Numba, against the shared-memory mailboxes in one call.

A small-message algorithm (recursive-doubling allreduce, binomial broadcast, ...) is written once,
in the subset of Python that Numba compiles. Called as usual, it runs as plain Python: on a mesh
over any transport, on a :class:`lab.algorithms.peers.GroupView`, on the simulator's recorder. Its
``.compiled`` face is the same source compiled with ``numba.njit(cache=True)``; the shm transport
runs a whole collective through it in one call (:mod:`kernels.mailbox`), so a 1 KB allreduce
pays one Numba dispatch instead of an interpreter loop per message.

Inside a compilable function, a call to another compilable function (``fold_of``,
``enter_allreduce``) is Python in the Python run and compiled in the compiled run: Numba sees a
``Compilable`` global as its ``.compiled`` dispatcher (the ``typeof`` registration below).

    @compilable
    def barrier_dissemination(peers):
        ...
    barrier_dissemination(mesh)                # Python, over mesh's transport
    barrier_dissemination.compiled(mailboxes)  # one Numba call over the mailboxes
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from numba import njit
from numba.core import types
from numba.extending import typeof_impl


class Compilable:
    """A function with a Python run (calling it) and a compiled run (``.compiled``: the same
    source, or ``twin``'s where the compiled run differs, :func:`compiled_as`)."""
    def __init__(self, function: Callable[..., Any], twin: Callable[..., Any] | None = None) -> None:
        self.py_func = function
        self.twin = function if twin is None else twin
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.py_func(*args, **kwargs)

    @functools.cached_property
    def compiled(self):
        """The Numba dispatcher (compiled on first use per argument types; cached on disk)."""
        return njit(cache=True)(self.twin)

    def __repr__(self) -> str:
        return f"<compilable {self.py_func.__module__}.{self.py_func.__qualname__}>"

    def __reduce__(self) -> tuple:
        # By name, as a function pickles: Numba keys its disk cache of a closure over this object
        # on these bytes, so they must be the same in every process.
        return _named, (self.py_func.__module__, self.py_func.__qualname__)


def _named(module: str, qualname: str) -> Compilable:
    return getattr(importlib.import_module(module), qualname)


def compilable(function: Callable[..., Any]) -> Compilable:
    """Mark ``function`` as written in the subset Numba compiles (see the module docstring)."""
    return Compilable(function)


def compiled_as(twin: Callable[..., Any]) -> Callable[[Callable[..., Any]], Compilable]:
    """Mark a function whose compiled run is ``twin`` (same arguments, the subset Numba compiles)
    rather than its own source: the one-shot allreduce, whose Python run reads the peers'
    memory through ``peers.shared_allreduce`` and whose compiled run reads it through the
    mailboxes' view of the same memory (``kernels.one_shot``)."""
    return lambda function: Compilable(function, twin)


@typeof_impl.register(Compilable)
def _typeof_compilable(value: Compilable, context: Any) -> types.Type:
    return types.Dispatcher(value.compiled)
