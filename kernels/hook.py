"""A long compiled wait's hook into Python.

A compiled wait holds no GIL and runs no bytecode, so while it lasts the main thread's signal
handlers cannot run and nobody reads the pipes that the Python path's messages travel on (a peer
that sends a large message there waits for credits this rank would return). So a wait with a
hook calls it, with the GIL, every ``HOOK_INTERVAL_NS`` and whenever a peer's pipe has something:
entering Python runs the pending handlers, and the hook drains the pipes. What a handler or the
hook raises propagates through the compiled caller (a collective interrupted half-way: its rings
are not reusable, as after a failure).

The call goes through the C API alone (no object mode): object mode enters Python through
Numba's own Python helpers (unpickling the callee, boxing arrays), and a pending handler that
raises in one of those leaves the call without its callee or arguments, so what propagates is a
SystemError or TypeError of Numba's instead of what the handler raised.

    number = register_hook(lambda fingerprint: drain_the_pipes())   # Python, once
    call_hook(number, fingerprint)                                    # compiled, in a wait

This module imports nothing from ``lab``.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.libc import address_of, pipes_readable

FINGERPRINT_BYTES = 32  # what a hook is handed: the waiting collective's fingerprint
HOOK_INTERVAL_NS = 10_000_000  # how often a wait calls its hook when no pipe has anything

#: Python callables by number (``MailboxPeers.hook``; 0: none), each taking the waiting
#: collective's fingerprint (32 bytes); see :func:`register_hook`.
_HOOKS: dict[int, Callable[[bytes], None]] = {}


def register_hook(hook: Callable[[bytes], None]) -> int:
    """Register ``hook`` for waits to call (see :func:`call_hook`); its number (never 0)."""
    number = max(_HOOKS, default=0) + 1
    _HOOKS[number] = hook
    return number


def unregister_hook(number: int) -> None:
    """Forget hook ``number`` (a wait that still names it calls nothing)."""
    _HOOKS.pop(number, None)


def _run_hook(number: int, fingerprint: bytes) -> None:
    """What :func:`call_hook` calls: hook ``number``, if it is still registered."""
    hook = _HOOKS.get(number)
    if hook is not None:
        hook(fingerprint)


@intrinsic
def _call_run_hook(typingctx, number, fingerprint_address):
    """``_run_hook(number, the 32 bytes at fingerprint_address)`` with the GIL held; what it
    raises is raised by the compiled caller."""
    def codegen(context, builder, signature, args):
        pyapi = context.get_python_api(builder)
        gil = pyapi.gil_ensure()
        add_module = pyapi._get_function(ir.FunctionType(pyapi.pyobj, [pyapi.cstring]),
                                         name="PyImport_AddModule")
        module = builder.call(add_module, [context.insert_const_string(builder.module, __name__)])  # borrowed
        run_hook = pyapi.object_getattr_string(module, "_run_hook")
        arguments = [
            pyapi.long_from_longlong(args[0]),
            pyapi.bytes_from_string_and_size(builder.inttoptr(args[1], pyapi.cstring),
                                             context.get_constant(types.intp, FINGERPRINT_BYTES))]
        result = pyapi.call_function_objargs(run_hook, arguments)
        raised = cgutils.is_null(builder, result)
        for obj in (result, run_hook, *arguments):
            pyapi.decref(obj)  # (Py_DecRef: NULL is nothing)
        pyapi.gil_release(gil)
        with builder.if_then(raised, likely=False):
            context.call_conv.return_exc(builder)  # the exception is set: the wrapper raises it
        return context.get_dummy_value()

    return types.none(types.int64, types.int64), codegen


@njit(cache=True, nogil=True)
def call_hook(number, fingerprint):
    """Call hook ``number`` (0: none) with ``fingerprint``, holding the GIL meanwhile."""
    if number != 0:
        _call_run_hook(number, address_of(fingerprint))


@njit(cache=True, nogil=True)
def hook_due(hook, fds, now, last_called):
    """Whether a wait that last called ``hook`` at ``last_called`` calls it at ``now``."""
    return hook != 0 and (now - last_called >= HOOK_INTERVAL_NS or pipes_readable(fds))
