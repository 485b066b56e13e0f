"""libc from compiled code, called by symbol name (the way Numba calls its own C helpers).

Each intrinsic declares the C function in the LLVM module and calls it; the JIT linker resolves
the name in the process when the code is loaded, whether just compiled or read from Numba's cache
(a ctypes function pointer would bake this process's address in, which Numba refuses to cache).
Addresses travel as int64: Numba has no pointer arithmetic, but integer arithmetic on an array's
address is fine, and a pointer is a 64-bit integer in the ABI.

- :func:`sched_yield`, :func:`monotonic_ns` (``clock_gettime``, the vDSO), :func:`futex_wait` and
  :func:`futex_wake` (``syscall``), :func:`peer_gone` and :func:`pipes_readable` (``poll``);
- :func:`memcpy` (LLVM's ``memcpy`` intrinsic), :func:`address_of` and :func:`bytes_at` (a buffer
  as two integers and back).

    >>> @njit(cache=True, nogil=True)
    ... def elapsed_ns(start):
    ...     return monotonic_ns() - start

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import platform
import sys

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.atomics import stack_words

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_VOID_P = ir.IntType(8).as_pointer()
_LIBC_SYMBOLS = ("sched_yield", "clock_gettime", "poll", "syscall")

if any(llvm.address_of_symbol(name) is None for name in _LIBC_SYMBOLS):  # e.g. a static Python
    import ctypes.util

    _libc_path = ctypes.util.find_library("c")
    if _libc_path:
        llvm.load_library_permanently(_libc_path)


def _integers(*values) -> bool:
    return all(isinstance(value, types.Integer) for value in values)


def _call_libc(context, builder, signature, args, name, restype, params, var_arg=False):
    """Call the C function ``name`` (``restype name(params...)``, variadic past them with
    ``var_arg``) on integer arguments: each is cast to int64, then to its parameter (a pointer from
    an address, a narrower int); variadic ones go as int64 (a C long)."""
    function = cgutils.get_or_insert_function(builder.module,
                                              ir.FunctionType(restype, params, var_arg=var_arg), name)
    values = []
    for i, (value, value_type) in enumerate(zip(args, signature.args)):
        word = context.cast(builder, value, value_type, types.int64)
        param = params[i] if i < len(params) else _I64
        if isinstance(param, ir.PointerType):
            word = builder.inttoptr(word, param)
        elif param.width < 64:
            word = builder.trunc(word, param)
        values.append(word)
    return builder.call(function, values)


@intrinsic
def sched_yield(typingctx):
    """``sched_yield()``: let another runnable thread have this core; returns 0."""
    def codegen(context, builder, signature, args):
        return _call_libc(context, builder, signature, args, "sched_yield", _I32, [])

    return types.int32(), codegen


@intrinsic
def _clock_gettime(typingctx, clock, timespec_address):
    """``clock_gettime(clock, (struct timespec *) timespec_address)``."""
    if not _integers(clock, timespec_address):
        return None

    def codegen(context, builder, signature, args):
        return _call_libc(context, builder, signature, args, "clock_gettime", _I32, [_I32, _VOID_P])

    return types.int32(clock, timespec_address), codegen


@intrinsic
def _poll(typingctx, fds_address, count, timeout_ms):
    """``poll((struct pollfd *) fds_address, count, timeout_ms)``."""
    if not _integers(fds_address, count, timeout_ms):
        return None

    def codegen(context, builder, signature, args):
        return _call_libc(context, builder, signature, args, "poll", _I32, [_VOID_P, _I64, _I32])

    return types.int32(fds_address, count, timeout_ms), codegen


@intrinsic
def _syscall(typingctx, number, a1, a2, a3, a4, a5, a6):
    """``syscall(number, a1, ..., a6)``: declared variadic, as it is, so the call follows the
    variadic convention (on x86_64, ``al`` holds the number of vector registers used: 0)."""
    if not _integers(number, a1, a2, a3, a4, a5, a6):
        return None

    def codegen(context, builder, signature, args):
        return _call_libc(context, builder, signature, args, "syscall", _I64, [_I64], var_arg=True)

    return types.int64(number, a1, a2, a3, a4, a5, a6), codegen


@intrinsic
def memcpy(typingctx, dst_address, src_address, nbytes):
    """Copy ``nbytes`` from ``src_address`` to ``dst_address`` (not overlapping): LLVM's
    ``llvm.memcpy``, which becomes a call of libc's ``memcpy``."""
    if not _integers(dst_address, src_address, nbytes):
        return None

    def codegen(context, builder, signature, args):
        dst, src, count = (context.cast(builder, value, value_type, types.int64)
                           for value, value_type in zip(args, signature.args))
        cgutils.raw_memcpy(builder, builder.inttoptr(dst, _VOID_P), builder.inttoptr(src, _VOID_P), count, 1)
        return context.get_dummy_value()

    return types.void(dst_address, src_address, nbytes), codegen


@intrinsic
def _byte_pointer(typingctx, address):
    """``address`` (an integer) as a ``uint8*``, for :func:`bytes_at`."""
    if not _integers(address):
        return None

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[0], signature.args[0], types.int64)
        return builder.inttoptr(value, ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(address), codegen


@njit(inline="always", cache=True)
def bytes_at(address, nbytes):
    """The ``nbytes`` bytes at ``address`` as a uint8 array (no copy): a caller passes a buffer
    as two integers, which cross from Python for less than an array does (and need no array made
    first: a torch tensor's ``data_ptr()`` is 40 ns, its ``numpy()`` 500). The memory must stay
    alive for as long as the array is used, which the caller of a synchronous call guarantees."""
    return carray(_byte_pointer(address), nbytes)


CLOCK_MONOTONIC = 1
SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower(), -1)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
POLLIN, POLLERR, POLLHUP = 0x001, 0x008, 0x010
# struct pollfd {int fd; short events; short revents} in one int64 word: where fd, events and revents sit.
_FD_SHIFT, _EVENTS_SHIFT, _REVENTS_SHIFT = (0, 32, 48) if sys.byteorder == "little" else (32, 16, 0)


@njit(inline="always", cache=True)
def address_of(arr):
    """The address of ``arr``'s first element as an int64 (``ctypes.data`` is uint64, and uint64
    mixed with int64 arithmetic is float64 in Numba)."""
    return np.int64(arr.ctypes.data)


@njit(cache=True, nogil=True)
def monotonic_ns():
    """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds (the vDSO: no system call)."""
    timespec = stack_words(2)
    _clock_gettime(CLOCK_MONOTONIC, address_of(timespec))
    return timespec[0] * 1_000_000_000 + timespec[1]


@njit(cache=True, nogil=True)
def futex_wait(words, index, expected, timeout_ns):
    """Sleep while ``words[index]`` (int32, shared) is ``expected``, at most ``timeout_ns``; returns
    at once if it differs, on a wake, on a signal or at the timeout (the caller re-checks)."""
    if SYS_FUTEX < 0:
        sched_yield()
        return -1
    timespec = stack_words(2)
    timespec[0], timespec[1] = timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000
    return _syscall(SYS_FUTEX,
                    address_of(words) + index * 4, FUTEX_WAIT, expected, address_of(timespec), 0, 0)


@njit(cache=True, nogil=True)
def futex_wake(words, index, count):
    """Wake up to ``count`` sleepers on ``words[index]``; returns how many were woken."""
    if SYS_FUTEX < 0:
        return 0
    return _syscall(SYS_FUTEX, address_of(words) + index * 4, FUTEX_WAKE, count, 0, 0, 0)


@njit(cache=True, nogil=True)
def peer_gone(fd):
    """Whether the pipe ``fd`` reads from has lost its writer (the peer process died): a
    non-blocking ``poll`` with no events asked, which still reports POLLHUP and POLLERR.
    ``fd < 0``: no liveness check, never gone."""
    if fd < 0:
        return False
    pollfd = stack_words(1)
    pollfd[0] = (fd & 0xFFFFFFFF) << _FD_SHIFT  # events 0: only POLLHUP, POLLERR and POLLNVAL can come
    if _poll(address_of(pollfd), 1, 0) <= 0:
        return False
    return ((pollfd[0] >> _REVENTS_SHIFT) & (POLLHUP | POLLERR)) != 0


@njit(cache=True, nogil=True)
def pipes_readable(fds):
    """Whether any of the pipes ``fds`` (-1: none) has something to read now."""
    pollfd = stack_words(1)
    for fd in fds:
        if fd >= 0:
            pollfd[0] = ((fd & 0xFFFFFFFF) << _FD_SHIFT) | (POLLIN << _EVENTS_SHIFT)
            if _poll(address_of(pollfd), 1, 0) > 0 and ((pollfd[0] >> _REVENTS_SHIFT) & POLLIN) != 0:
                return True
    return False
