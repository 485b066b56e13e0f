"""Atomics and the other LLVM instructions compiled waits need, as Numba intrinsics.

Numba has no atomics of its own and its JIT no inline-assembly parser, so each is an intrinsic
that emits the LLVM instruction: :func:`load_acquire`, :func:`store_release` (the whole memory
protocol of the mailboxes and of the two-shot's flags), :func:`atomic_add` (a doorbell's ring),
:func:`fence_seq_cst` (the sleeping flag's store-then-load, which release/acquire does not order),
:func:`cpu_relax` (``pause``/``yield`` in a spin) and :func:`stack_words` (scratch on the stack
for a ``timespec`` or a ``pollfd``, without an allocation). None of them bakes an address of
this process into the code, so a caller compiled with ``cache=True`` caches.

    >>> @njit
    ... def publish(words, value):
    ...     store_release(words, 0, value)   # a reader's load_acquire(words, 0) sees what came before

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _is_integer_vector(arr) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(arr.dtype, types.Integer)


def _element_pointer(context, builder, array_type, array, index, index_type):
    ary = context.make_array(array_type)(context, builder, array)
    i = context.cast(builder, index, index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [i], wraparound=False)


@intrinsic
def load_acquire(typingctx, arr, index):
    """``arr[index]`` (a 1-D integer array) as an acquire load: later reads see what the writer
    stored before its matching release, and the load is redone on every call (never hoisted)."""
    if not (_is_integer_vector(arr) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        pointer = _element_pointer(context, builder, array_type, args[0], args[1], index_type)
        return builder.load_atomic(pointer, "acquire", array_type.dtype.bitwidth // 8,
                                   typ=context.get_value_type(array_type.dtype))

    return arr.dtype(arr, index), codegen


@intrinsic
def store_release(typingctx, arr, index, value):
    """``arr[index] = value`` as a release store: everything written before it is visible to a
    reader whose acquire load sees ``value``."""
    if not (_is_integer_vector(arr) and isinstance(index, types.Integer) and
            isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type, value_type = signature.args
        pointer = _element_pointer(context, builder, array_type, args[0], args[1], index_type)
        stored = context.cast(builder, args[2], value_type, array_type.dtype)
        builder.store_atomic(stored, pointer, "release", array_type.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def atomic_add(typingctx, arr, index, value):
    """``arr[index] += value`` as one sequentially consistent read-modify-write; returns the old value."""
    if not (_is_integer_vector(arr) and isinstance(index, types.Integer) and
            isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type, value_type = signature.args
        pointer = _element_pointer(context, builder, array_type, args[0], args[1], index_type)
        added = context.cast(builder, args[2], value_type, array_type.dtype)
        return builder.atomic_rmw("add", pointer, added, "seq_cst")

    return arr.dtype(arr, index, value), codegen


@intrinsic
def fence_seq_cst(typingctx):
    """A full fence: no load after it is satisfied before a store ahead of it is visible."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def stack_words(typingctx, count):
    """``count`` (a constant) int64 words on the calling function's stack, as an array: scratch for
    a timespec or a pollfd without an allocation. Valid until that function returns: never return
    or store it."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    array_type = types.Array(types.int64, 1, "C")

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        storage = cgutils.alloca_once(builder, context.get_value_type(types.int64), size=count.literal_value)
        array = context.make_array(array_type)(context, builder)
        context.populate_array(array, data=storage, shape=[ir.Constant(intp, count.literal_value)],
                               strides=[ir.Constant(intp, 8)], itemsize=ir.Constant(intp, 8), meminfo=None)
        return array._getvalue()

    return array_type(count), codegen


# The spin-wait hint: x86 ``pause``, aarch64 ``yield`` (hint #1); nothing elsewhere.
_RELAX_INTRINSIC = {
    "x86_64": "llvm.x86.sse2.pause", "amd64": "llvm.x86.sse2.pause", "aarch64": "llvm.aarch64.hint",
    "arm64": "llvm.aarch64.hint"}.get(platform.machine().lower())


@intrinsic
def cpu_relax(typingctx):
    """Tell the core this is a spin-wait (frees the sibling hyperthread, saves power). Through an
    LLVM intrinsic: Numba's JIT has no inline-assembly parser."""
    def codegen(context, builder, signature, args):
        if _RELAX_INTRINSIC == "llvm.x86.sse2.pause":
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                  _RELAX_INTRINSIC)
            builder.call(hint, [])
        elif _RELAX_INTRINSIC == "llvm.aarch64.hint":
            i32 = ir.IntType(32)
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i32]),
                                                  _RELAX_INTRINSIC)
            builder.call(hint, [ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(), codegen
