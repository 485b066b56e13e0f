"""Point-to-point messages between processes through one shared memory region, in nopython mode.

``MailboxPeers`` is a Numba structref with the Peers interface the algorithms are written against
(``send_buffer``, ``recv_buffer``, ``sendrecv_buffer``, ``host_of``, ``rank``, ``world_size``),
so a whole small collective (a recursive-doubling allreduce of 1 KB) can run as ONE compiled call:
no interpreter, no system call on the fast path, only loads, stores and ``memcpy`` on memory that
every rank maps (measured: 0.6-1 µs a call for 2 ranks spinning on their own cores, where a
prototype took 1.3 µs). Linux only (futex, poll); x86_64 and aarch64.

Layout. The creator maps ``region_bytes(world_size, slot_bytes, depth)`` zeroed bytes (an
anonymous ``mmap`` or a ``memfd``: fresh pages are zero) and hands every rank the same mapping as a
64-byte aligned uint8 array. Every field below sits on its own 64-byte cache line, so a line has
one writer and two ranks never fight over it::

    per rank r (128 bytes)      doorbell (int32: the futex word r sleeps on; any peer bumps it)
                                sleeping (int64: 1 while r may be asleep on its doorbell; r writes)
    per ordered pair (s -> d)   sent     (int64: pieces s has published; s writes)
                                taken    (int64: pieces d has consumed;  d writes)
                                depth x  slot: 64-byte header (fingerprint[32], piece bytes,
                                               message bytes), then slot_bytes of payload
                                               (the stride rounded up to 64 bytes)

Each pair's slots form a single-producer/single-consumer ring: piece number n goes to slot
n % depth. Counters start at 0 and only grow (int64: they never wrap). A message larger than
``slot_bytes`` goes as consecutive pieces of whole elements; a message of 0 bytes is one empty
piece, so its fingerprint is still checked. ``sendrecv_buffer`` interleaves the pieces of its send
and of its receive, so two ranks exchanging messages larger than a ring never both wait on a full one.

Memory ordering. ``s`` writes slot n (header and payload, plain stores), then publishes it with a
release store ``sent = n + 1``; ``d`` sees it with an acquire load of ``sent``, so every store
to the slot happens-before ``d``'s reads of it. ``d`` reads the slot (copy or combine), then
frees it with a release store ``taken = n + 1``; ``s`` reuses slot n only after an acquire load
shows ``taken > n``, so ``d``'s reads happen-before ``s``'s overwrite. Each counter has one writer,
so no read-modify-write is needed: release/acquire pairs are the whole protocol (on x86 they
compile to plain ``mov``; the atomics are there so LLVM neither hoists a flag load out of a wait
loop nor sinks a slot store past the publication). The one exception is sleeping: "I set my
sleeping flag, then look at ``sent``" against "I store ``sent``, then look at the sleeping
flag" is a store-then-load on both sides (Dekker), which release/acquire does not order; a
seq_cst fence on each side does, so a waiter that missed the message is always woken.

Waiting. A wait spins ``spin_limit`` times on acquire loads (``pause`` between them), then calls
``sched_yield`` ``yield_limit`` times, then sleeps on its doorbell with a futex of at most 1 ms,
after raising its sleeping flag; a sender or receiver that makes progress bumps the doorbell of
a sleeping peer and wakes it. While waiting it reads the monotonic clock: past ``deadline_ns``
without progress the status becomes SILENCE; every millisecond it polls the liveness pipe of
each peer it waits for, and a pipe whose writer died (POLLHUP/POLLERR) makes it PEER_LOST,
unless a last look finds the peer's message published after all. A mailbox whose ``hook`` is
set (:func:`register_hook`) calls it every 10 ms of a wait and whenever a peer's pipe has
something (:func:`call_hook`: signal handlers run, the pipes are drained). Failures never raise
nor hang inside compiled code: ``status`` is set, every later transfer of the collective returns
at once, and the caller checks ``status`` after the call and raises a proper Python error; only
what a hook (or a signal handler) raises propagates. After a
failure the rings of that mesh are not reusable (a message may be half sent).
:func:`pending_fingerprints` reads, from plain Python after a failure, the fingerprint of each
message published to a rank and not yet taken.

API. ``open_mailbox(region, rank, world_size, slot_bytes, depth, liveness_fds)`` builds this
rank's ``MailboxPeers`` inside compiled code (the fast path: nothing crosses from Python but
arrays and integers); it attaches to a region already in use where its counters stand, so a
compiled call may open the mailboxes afresh every time. Called from Python (or as
``MailboxPeers(...)``) it returns a proxy whose ``begin``, ``send_buffer``, ``recv_buffer``,
``sendrecv_buffer`` and ``host_of`` and whose fields work from Python too (the copy path only).
``recv_buffer(src, out, reduction=None)`` and ``sendrecv_buffer(dst, data, src, out,
reduction=None)`` copy what arrives into ``out``, or, given a reduction (any Numba value whose
type has a ``combine`` method, such as :func:`kernels.coded.coded_reduction`), fold each
slot-sized piece in with ``reduction.combine(out_piece, incoming)``, ``incoming`` being the slot
viewed with ``out``'s dtype (payloads are 64-byte aligned and pieces whole items).
``bytes_sent[p]``/``bytes_received[p]`` count payload bytes, ``messages_sent[p]``/
``messages_received[p]`` whole messages (one per call, however many pieces; an empty one too).

Numba. Every function here is compiled with ``cache=True``: libc is called through intrinsics
that declare ``sched_yield``, ``clock_gettime``, ``poll`` and ``syscall`` by symbol name in the
LLVM module (the JIT linker finds them among the process's symbols when it loads the code, just
compiled or from the cache), the copy is LLVM's ``memcpy`` intrinsic, so no address of this
process is baked into the code, and ``MailboxPeers`` is a structref (a jitclass cannot be
cached). So a caller's function that opens or takes the mailboxes can be cached too: a rank
process then loads it from disk in about 0.1 s instead of compiling it (tens of seconds of CPU
the first time, all the mailbox code it links in included). ``None`` as the reduction picks the
byte-copy path when Numba compiles: it works on addresses and byte counts, so one compilation
serves every dtype; only a fold compiles per (dtype, reduction type). Numba's cache knows only
the source file of the function it caches: a caller's cached function elsewhere holds a copy of
this module's code and does not see an edit of it (nor of ``kernels.coded``); clear that cache
(its ``__pycache__/*.nbi`` and ``*.nbc``) after one.

Per rank (every rank runs the same compiled function)::

    >>> from kernels.coded import FAMILY_CODES, OP_CODES, coded_reduction
    >>> SUM, NATIVE = OP_CODES["sum"], FAMILY_CODES["native"]  # constants: compiled code reads no dict
    >>> @njit(cache=True, nogil=True)
    ... def allreduce_pair(region, rank, buf, fingerprint):
    ...     peers = open_mailbox(region, rank, 2, 4096, 4, np.full(2, -1, np.int32))
    ...     peers.begin(fingerprint, 1_000_000_000)  # give up after 1 s without progress
    ...     partner = 1 - peers.rank
    ...     reduction = coded_reduction(SUM, NATIVE, -1, False)
    ...     peers.sendrecv_buffer(partner, buf.copy(), partner, buf, reduction)  # buf += theirs
    ...     return peers.status
    >>> region = np.frombuffer(shared_mapping, np.uint8)  # region_bytes(2, 4096, 4) bytes, zeroed
    >>> buf = np.arange(256, dtype=np.float32) + rank
    >>> allreduce_pair(region, rank, buf, fingerprint)
    0
    >>> buf[:3]                                           # on both ranks
    array([1., 3., 5.], dtype=float32)

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.experimental import structref
from numba.extending import intrinsic, overload, overload_method, register_jitable

# --- status codes -------------------------------------------------------------------------------

OK = 0
MISMATCH = 1  # a peer's fingerprint or byte count differs from ours (peer_fingerprint, peer_bytes)
SILENCE = 2  # no progress from failed_peer for deadline_ns
PEER_LOST = 3  # failed_peer's liveness pipe hung up before its message came
INVALID = 4  # a usage error: a peer rank out of range or our own, a bad fingerprint, items over a slot
STATUS_NAMES = ("ok", "mismatch", "silence", "peer lost", "invalid")

# --- layout -------------------------------------------------------------------------------------

LINE = 64
FINGERPRINT_BYTES = 32
HEADER_BYTES = LINE  # fingerprint[32], piece bytes (int64), message bytes (int64), padding
MIN_SLOT_BYTES = 64  # room for whole elements of every numpy scalar type
RANK_AREA_BYTES = 2 * LINE
DOORBELL = 0  # int32 futex word, within the rank's area
SLEEPING = LINE  # int64 flag, within the rank's area
SENT = 0  # within a channel
TAKEN = LINE
SLOTS = 2 * LINE
# The header's int64 words: fingerprint 0-3, then these.
PIECE_WORD = 4
MESSAGE_WORD = 5

# --- waiting ------------------------------------------------------------------------------------

# Spinning wins when every rank has a core (a wake through the futex costs microseconds), and
# loses badly when ranks outnumber cores (a spinner burns the time slice its peer needs), so by
# default a wait spins only briefly: a benchmark on dedicated cores sets spin_limit high. On an
# oversubscribed machine yielding beats both spinning and sleeping (it hands the core to the
# peer at once): the lab's compiled plane opens its mailboxes with 50 spins and 1,000 yields
# (lab/plane.py, measured there).
DEFAULT_SPIN_LIMIT = 500  # pause-spins before yielding (about 20 microseconds)
DEFAULT_YIELD_LIMIT = 8  # sched_yield calls before sleeping on the futex
FUTEX_TIMEOUT_NS = 1_000_000  # a sleep's longest nap: bounds a missed wake and the clock checks
LIVENESS_INTERVAL_NS = 1_000_000  # how often a wait polls its peers' liveness pipes
CLOCK_EVERY_SPINS = 256  # a spinning wait reads the clock only this often
HOOK_INTERVAL_NS = 10_000_000  # how often a wait calls its hook when no pipe has anything (see call_hook)


# Plain Python that compiled code calls too (register_jitable): the shm transport sizes the region
# in its parent process, which must not pay for a compilation.
@register_jitable
def _slot_stride(slot_bytes):
    return HEADER_BYTES + (slot_bytes + LINE - 1) // LINE * LINE


@register_jitable
def _channel_bytes(slot_bytes, depth):
    return SLOTS + depth * _slot_stride(slot_bytes)


@register_jitable
def _channel_offsets(rank, peer, world_size, slot_bytes, depth):
    """Where the channels ``rank -> peer`` and ``peer -> rank`` start in the region. Channel
    (src, dst) is number src * (N - 1) + dst, not counting dst == src."""
    channel_bytes = _channel_bytes(slot_bytes, depth)
    first_channel = world_size * RANK_AREA_BYTES
    out_channel = first_channel + (rank * (world_size - 1) + peer - (1 if peer > rank else 0)) * channel_bytes
    in_channel = first_channel + (peer * (world_size - 1) + rank - (1 if rank > peer else 0)) * channel_bytes
    return out_channel, in_channel


@register_jitable
def region_bytes(world_size, slot_bytes, depth):
    """The bytes of the shared region ``open_mailbox(..., world_size, slot_bytes, depth, ...)`` uses
    (a multiple of 64). Plain Python from Python, inlined in compiled code."""
    return world_size * RANK_AREA_BYTES + world_size * (world_size - 1) * _channel_bytes(slot_bytes, depth)


# --- atomics (LLVM instructions through intrinsics) -------------------------------------------


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
    if not (_is_integer_vector(arr) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
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
    if not (_is_integer_vector(arr) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
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


_MACHINE = platform.machine().lower()
# The spin-wait hint: x86 ``pause``, aarch64 ``yield`` (hint #1); nothing elsewhere.
_RELAX_INTRINSIC = {"x86_64": "llvm.x86.sse2.pause", "amd64": "llvm.x86.sse2.pause",
                    "aarch64": "llvm.aarch64.hint", "arm64": "llvm.aarch64.hint"}.get(_MACHINE)


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


# --- libc by symbol name (the way Numba calls its own C helpers) -----------------------------------
# Each intrinsic declares the C function in the LLVM module and calls it; the JIT linker resolves
# the name in the process when the code is loaded, whether just compiled or read from Numba's cache
# (a ctypes function pointer would bake this process's address in, which Numba refuses to cache).
# Addresses travel as int64: Numba has no pointer arithmetic, but integer arithmetic on an array's
# address is fine, and a pointer is a 64-bit integer in the ABI.

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
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(restype, params, var_arg=var_arg),
                                              name)
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
def _memcpy(typingctx, dst_address, src_address, nbytes):
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
SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(_MACHINE, -1)
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
    return _syscall(SYS_FUTEX, address_of(words) + index * 4, FUTEX_WAIT, expected, address_of(timespec), 0, 0)


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


# --- a long wait's hook into Python -----------------------------------------------------------------
# A compiled wait holds no GIL and runs no bytecode, so while it lasts the main thread's signal
# handlers cannot run and nobody reads the pipes that the Python path's messages travel on (a peer
# that sends a large message there waits for credits this rank would return). So a wait with a
# hook calls it, with the GIL, every HOOK_INTERVAL_NS and whenever a peer's pipe has something:
# entering Python runs the pending handlers, and the hook drains the pipes. What a handler or the
# hook raises propagates through the compiled caller (a collective interrupted half-way: its rings
# are not reusable, as after a failure).
#
# The call goes through the C API alone (no object mode): object mode enters Python through
# Numba's own Python helpers (unpickling the callee, boxing arrays), and a pending handler that
# raises in one of those leaves the call without its callee or arguments, so what propagates is a
# SystemError or TypeError of Numba's instead of what the handler raised.

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
        add_module = pyapi._get_function(ir.FunctionType(pyapi.pyobj, [pyapi.cstring]), name="PyImport_AddModule")
        module = builder.call(add_module, [context.insert_const_string(builder.module, __name__)])  # borrowed
        run_hook = pyapi.object_getattr_string(module, "_run_hook")
        arguments = [pyapi.long_from_longlong(args[0]),
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
def pipes_readable(fds):
    """Whether any of the pipes ``fds`` (-1: none) has something to read now."""
    pollfd = stack_words(1)
    for fd in fds:
        if fd >= 0:
            pollfd[0] = ((fd & 0xFFFFFFFF) << _FD_SHIFT) | (POLLIN << _EVENTS_SHIFT)
            if _poll(address_of(pollfd), 1, 0) > 0 and ((pollfd[0] >> _REVENTS_SHIFT) & POLLIN) != 0:
                return True
    return False


@njit(cache=True, nogil=True)
def hook_due(hook, fds, now, last_called):
    """Whether a wait that last called ``hook`` at ``last_called`` calls it at ``now``."""
    return hook != 0 and (now - last_called >= HOOK_INTERVAL_NS or pipes_readable(fds))


# --- the mailbox --------------------------------------------------------------------------------

# Rows of MailboxPeers.rings (one column per peer): where the two channels with that peer start,
# and their counters. Our own counters are ours alone to write, so we keep them; the peer's are
# as last loaded (a sender reloads ``taken`` only when the ring looks full).
OUT_CHANNEL, IN_CHANNEL = 0, 1  # byte offsets of the channels rank -> peer and peer -> rank
SENT_BY_ME, TAKEN_BY_PEER = 2, 3  # of the channel rank -> peer
TAKEN_BY_ME, SENT_BY_PEER = 4, 5  # of the channel peer -> rank
# MailboxPeers.waiting: the current wait's rounds without progress, when it began (0: not yet
# timed), when it last polled liveness and when it last called its hook.
IDLE_ROUNDS, WAIT_STARTED, LIVENESS_CHECKED, HOOK_CALLED = 0, 1, 2, 3

_FIELDS = [
    ("region", types.uint8[::1]),
    ("words", types.int64[::1]),  # the region as int64: counters, flags, headers
    ("doorbells", types.int32[::1]),  # the region as int32: futex words
    ("rank", types.int64),
    ("world_size", types.int64),
    ("slot_bytes", types.int64),
    ("depth", types.int64),
    ("liveness_fds", types.int32[::1]),
    ("status", types.int64),
    ("failed_peer", types.int64),
    ("fingerprint", types.uint8[::1]),
    ("fingerprint_words", types.int64[::1]),  # the same 32 bytes, compared 8 at a time
    ("peer_fingerprint", types.uint8[::1]),
    ("peer_bytes", types.int64),
    ("deadline_ns", types.int64),
    ("bytes_sent", types.int64[::1]),
    ("bytes_received", types.int64[::1]),
    ("messages_sent", types.int64[::1]),
    ("messages_received", types.int64[::1]),
    ("spin_limit", types.int64),
    ("yield_limit", types.int64),
    ("rings", types.int64[:, ::1]),
    ("waiting", types.int64[::1]),
    ("hook", types.int64),
]


@structref.register
class MailboxPeersType(types.StructRef):
    """The Numba type of ``MailboxPeers`` (one instance: :data:`mailbox_peers_type`)."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


mailbox_peers_type = MailboxPeersType(_FIELDS)

# Fields as the Python proxy reads them: the scalars in one call, the arrays in another.
_SCALARS = ("rank", "world_size", "slot_bytes", "depth", "status", "failed_peer", "peer_bytes", "deadline_ns",
            "spin_limit", "yield_limit", "hook")
_ARRAYS = ("region", "liveness_fds", "fingerprint", "peer_fingerprint", "bytes_sent", "bytes_received",
           "messages_sent", "messages_received")


@njit(cache=True, nogil=True)
def open_mailbox(region, rank, world_size, slot_bytes, depth, liveness_fds):
    """This rank's end of the mailboxes in ``region`` (uint8, 64-byte aligned, at least
    ``region_bytes(world_size, slot_bytes, depth)`` bytes, shared by every rank), as a
    ``MailboxPeers``. ``liveness_fds[r]``: the pipe rank r holds the only write end of (-1: no
    liveness check of r). Attaches where the region's counters stand, so the region may be in use.
    Raises ValueError on bad arguments (the only raise in this module)."""
    if world_size < 1 or rank < 0 or rank >= world_size:
        raise ValueError("MailboxPeers: rank must be in [0, world_size)")
    if slot_bytes < MIN_SLOT_BYTES or depth < 1:
        raise ValueError("MailboxPeers: slot_bytes must be at least 64 and depth at least 1")
    if liveness_fds.size != world_size:
        raise ValueError("MailboxPeers: liveness_fds needs one fd (or -1) per rank")
    used = region_bytes(world_size, slot_bytes, depth)
    if region.size < used:
        raise ValueError("MailboxPeers: the region is smaller than region_bytes(world_size, slot_bytes, depth)")
    if address_of(region) % LINE != 0:
        raise ValueError("MailboxPeers: the region must be 64-byte aligned")
    peers = structref.new(mailbox_peers_type)
    peers.region = region[:used]
    peers.words = peers.region.view(np.int64)
    peers.doorbells = peers.region.view(np.int32)
    peers.rank, peers.world_size = rank, world_size
    peers.slot_bytes, peers.depth = slot_bytes, depth
    peers.liveness_fds = liveness_fds.astype(np.int32)  # a copy
    peers.status, peers.failed_peer, peers.peer_bytes, peers.deadline_ns = OK, -1, -1, 0
    peers.fingerprint = np.zeros(FINGERPRINT_BYTES, np.uint8)
    peers.fingerprint_words = peers.fingerprint.view(np.int64)
    peers.peer_fingerprint = np.zeros(FINGERPRINT_BYTES, np.uint8)
    peers.bytes_sent = np.zeros(world_size, np.int64)
    peers.bytes_received = np.zeros(world_size, np.int64)
    peers.messages_sent = np.zeros(world_size, np.int64)
    peers.messages_received = np.zeros(world_size, np.int64)
    peers.spin_limit, peers.yield_limit = DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT
    rings = np.full((6, world_size), -1, np.int64)
    words = peers.words
    for peer in range(world_size):
        if peer == rank:
            continue
        out_channel, in_channel = _channel_offsets(rank, peer, world_size, slot_bytes, depth)
        rings[OUT_CHANNEL, peer], rings[IN_CHANNEL, peer] = out_channel, in_channel
        # A mailbox may be attached to a region already in use: start where its counters stand.
        rings[SENT_BY_ME, peer] = load_acquire(words, (out_channel + SENT) >> 3)
        rings[TAKEN_BY_PEER, peer] = load_acquire(words, (out_channel + TAKEN) >> 3)
        rings[TAKEN_BY_ME, peer] = load_acquire(words, (in_channel + TAKEN) >> 3)
        rings[SENT_BY_PEER, peer] = load_acquire(words, (in_channel + SENT) >> 3)
    peers.rings = rings
    peers.waiting = np.zeros(4, np.int64)
    peers.hook = 0
    return peers


class MailboxPeers(structref.StructRefProxy):
    """This rank's end of the shared-memory mailboxes (see the module docstring), as Python sees
    it: ``MailboxPeers(region, rank, world_size, slot_bytes, depth, liveness_fds)`` is
    ``open_mailbox(...)``, in Python and in compiled code.

    ``status`` (OK, MISMATCH, SILENCE, PEER_LOST, INVALID) and ``failed_peer`` (-1: none) say how
    the current collective went; on MISMATCH ``peer_fingerprint`` and ``peer_bytes`` hold what
    the peer's message declared. ``bytes_sent[p]``/``bytes_received[p]``: payload bytes so far;
    ``messages_sent[p]``/``messages_received[p]``: whole messages so far.
    ``spin_limit``/``yield_limit``: the waiting policy (set both large to spin, 0 to block at once).
    One rank's instance is used by one thread at a time.

    From Python, fields and methods each cost a compiled call (microseconds), and ``recv_buffer``
    and ``sendrecv_buffer`` only copy: a reduction is a compiled value (``coded_reduction``).
    """

    __slots__ = ()

    def __new__(cls, region, rank, world_size, slot_bytes, depth, liveness_fds):
        return open_mailbox(region, rank, world_size, slot_bytes, depth, liveness_fds)

    def begin(self, fingerprint, deadline_ns):
        _py_begin(self, fingerprint, deadline_ns)

    def send_buffer(self, dst, data):
        _py_send(self, dst, data)

    def recv_buffer(self, src, out, reduction=None):
        if reduction is not None:
            raise TypeError("MailboxPeers.recv_buffer from Python only copies: fold inside compiled code")
        _py_recv(self, src, out)

    def sendrecv_buffer(self, dst, data, src, out, reduction=None):
        if reduction is not None:
            raise TypeError("MailboxPeers.sendrecv_buffer from Python only copies: fold inside compiled code")
        _py_sendrecv(self, dst, data, src, out)

    def host_of(self, rank):
        return 0

    @property
    def spin_limit(self):
        return int(_scalars(self)[_SCALARS.index("spin_limit")])

    @spin_limit.setter
    def spin_limit(self, value):
        _set_waiting_policy(self, value, self.yield_limit)

    @property
    def yield_limit(self):
        return int(_scalars(self)[_SCALARS.index("yield_limit")])

    @yield_limit.setter
    def yield_limit(self, value):
        _set_waiting_policy(self, self.spin_limit, value)


def _read_only(name: str, getter) -> property:
    index = (_SCALARS if getter == "scalars" else _ARRAYS).index(name)
    if getter == "scalars":
        return property(lambda self: int(_scalars(self)[index]), doc=f"``{name}`` (read only from Python)")
    return property(lambda self: _arrays(self)[index], doc=f"``{name}`` (the array itself, not a copy)")


for _name in _SCALARS:
    if _name not in ("spin_limit", "yield_limit"):
        setattr(MailboxPeers, _name, _read_only(_name, "scalars"))
for _name in _ARRAYS:
    setattr(MailboxPeers, _name, _read_only(_name, "arrays"))

structref.define_boxing(MailboxPeersType, MailboxPeers)


@overload(MailboxPeers)
def _construct(region, rank, world_size, slot_bytes, depth, liveness_fds):
    """``MailboxPeers(...)`` in compiled code is ``open_mailbox(...)`` too (not a constructor
    taking every field, which ``structref.define_proxy`` would define)."""

    def impl(region, rank, world_size, slot_bytes, depth, liveness_fds):
        return open_mailbox(region, rank, world_size, slot_bytes, depth, liveness_fds)

    return impl


# --- the Peers interface (methods in compiled code) ----------------------------------------------

_NOBODY, _NOTHING, _ONE = np.int64(-1), np.int64(0), np.int64(1)  # not literals: one compilation serves all


# The methods' bodies are compiled like every function here (cache=True): a caller compiled afresh
# then loads them from the cache instead of compiling them.
_METHOD_OPTIONS = {"cache": True, "nogil": True}


def _absent(reduction) -> bool:
    return reduction is None or isinstance(reduction, (types.NoneType, types.Omitted))


@overload_method(MailboxPeersType, "begin", jit_options=_METHOD_OPTIONS)
def _begin_method(peers, fingerprint, deadline_ns):
    """Start one collective: every message carries ``fingerprint`` (uint8[32]); a wait gives up
    after ``deadline_ns`` without progress (0: never). Clears the last collective's failure."""
    return lambda peers, fingerprint, deadline_ns: _begin(peers, fingerprint, deadline_ns)


@overload_method(MailboxPeersType, "send_buffer", jit_options=_METHOD_OPTIONS)
def _send_buffer_method(peers, dst, data):
    """Send ``data`` (1-D, C-contiguous, any dtype) to ``dst``; returns once it is in the ring
    (at once, if the collective has failed)."""
    return lambda peers, dst, data: _send(peers, np.int64(dst), address_of(data), data.nbytes, data.itemsize)


@overload_method(MailboxPeersType, "recv_buffer", jit_options=_METHOD_OPTIONS)
def _recv_buffer_method(peers, src, out, reduction=None):
    """Receive ``src``'s next message into ``out``: a copy (``reduction`` None), or
    ``reduction.combine(out_piece, incoming)`` per slot-sized piece, ``incoming`` being the slot
    viewed with ``out``'s dtype."""
    if _absent(reduction):  # the byte-level path: one compilation serves every dtype
        def copy(peers, src, out, reduction=None):
            _recv(peers, np.int64(src), address_of(out), out.nbytes, out.itemsize)
        return copy

    def fold(peers, src, out, reduction=None):
        _recv_fold(peers, np.int64(src), out, reduction)
    return fold


@overload_method(MailboxPeersType, "sendrecv_buffer", jit_options=_METHOD_OPTIONS)
def _sendrecv_buffer_method(peers, dst, data, src, out, reduction=None):
    """Send ``data`` to ``dst`` and receive from ``src`` into ``out`` at once, piece by piece,
    so two ranks exchanging with each other never both wait on a full ring (a copy, or a fold
    with ``reduction`` as in ``recv_buffer``). ``out`` must not overlap ``data`` (a piece may
    arrive before the same piece of ``data`` has gone)."""
    if _absent(reduction):
        def copy(peers, dst, data, src, out, reduction=None):
            _sendrecv(peers, np.int64(dst), address_of(data), data.nbytes, data.itemsize,
                      np.int64(src), address_of(out), out.nbytes, out.itemsize)
        return copy

    def fold(peers, dst, data, src, out, reduction=None):
        _sendrecv_fold(peers, np.int64(dst), address_of(data), data.nbytes, data.itemsize,
                       np.int64(src), out, reduction)
    return fold


@overload_method(MailboxPeersType, "host_of", jit_options=_METHOD_OPTIONS)
def _host_of_method(peers, rank):
    """Every rank of one shared region is on one host."""
    return lambda peers, rank: np.int64(0)


@njit(cache=True, nogil=True)
def _begin(peers, fingerprint, deadline_ns):
    peers.status, peers.failed_peer, peers.peer_bytes = OK, -1, -1
    peers.deadline_ns = deadline_ns
    if fingerprint.size != FINGERPRINT_BYTES:
        peers.status = INVALID
        return
    for i in range(FINGERPRINT_BYTES):
        peers.fingerprint[i] = fingerprint[i]


@njit(cache=True, nogil=True)
def _send(peers, dst, address, nbytes, itemsize):
    if _usable(peers, dst, itemsize, dst, itemsize):
        _exchange(peers, dst, address, nbytes, itemsize, _NOBODY, _NOTHING, _NOTHING, _ONE, peers.region, None)


@njit(cache=True, nogil=True)
def _recv(peers, src, address, nbytes, itemsize):
    if _usable(peers, src, itemsize, src, itemsize):
        _exchange(peers, _NOBODY, _NOTHING, _NOTHING, _ONE, src, address, nbytes, itemsize, peers.region, None)


@njit(cache=True, nogil=True)
def _recv_fold(peers, src, out, reduction):
    if _usable(peers, src, out.itemsize, src, out.itemsize):
        _exchange(peers, _NOBODY, _NOTHING, _NOTHING, _ONE, src, address_of(out), out.nbytes, out.itemsize,
                  out, reduction)


@njit(cache=True, nogil=True)
def _sendrecv(peers, dst, send_address, send_bytes, send_itemsize, src, recv_address, recv_bytes, recv_itemsize):
    if _usable(peers, dst, send_itemsize, src, recv_itemsize):
        _exchange(peers, dst, send_address, send_bytes, send_itemsize, src, recv_address, recv_bytes, recv_itemsize,
                  peers.region, None)


@njit(cache=True, nogil=True)
def _sendrecv_fold(peers, dst, send_address, send_bytes, send_itemsize, src, out, reduction):
    if _usable(peers, dst, send_itemsize, src, out.itemsize):
        _exchange(peers, dst, send_address, send_bytes, send_itemsize, src, address_of(out), out.nbytes,
                  out.itemsize, out, reduction)


# --- from Python (the proxy's methods and fields) -------------------------------------------------


@njit(cache=True, nogil=True)
def _py_begin(peers, fingerprint, deadline_ns):
    peers.begin(fingerprint, deadline_ns)


@njit(cache=True, nogil=True)
def _py_send(peers, dst, data):
    peers.send_buffer(dst, data)


@njit(cache=True, nogil=True)
def _py_recv(peers, src, out):
    peers.recv_buffer(src, out)


@njit(cache=True, nogil=True)
def _py_sendrecv(peers, dst, data, src, out):
    peers.sendrecv_buffer(dst, data, src, out)


@njit(cache=True)
def _scalars(peers):
    return (peers.rank, peers.world_size, peers.slot_bytes, peers.depth, peers.status, peers.failed_peer,
            peers.peer_bytes, peers.deadline_ns, peers.spin_limit, peers.yield_limit, peers.hook)


@njit(cache=True)
def _arrays(peers):
    return (peers.region, peers.liveness_fds, peers.fingerprint, peers.peer_fingerprint, peers.bytes_sent,
            peers.bytes_received, peers.messages_sent, peers.messages_received)


@njit(cache=True)
def _set_waiting_policy(peers, spin_limit, yield_limit):
    peers.spin_limit, peers.yield_limit = spin_limit, yield_limit


# --- transfers ----------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _exchange(peers, dst, send_address, send_bytes, send_itemsize,
              src, recv_address, recv_bytes, recv_itemsize, out, reduction):
    """Send ``send_bytes`` at ``send_address`` to ``dst`` (none if -1) and receive ``recv_bytes``
    to ``recv_address`` from ``src`` (none if -1; folded into ``out`` with ``reduction`` unless it
    is None), interleaving pieces, waiting only when neither can move. Pieces are whole items:
    ``slot_bytes`` rounded down to the itemsize. The peers were checked by ``_usable``. A message
    counts once all its pieces are through."""
    send_piece = peers.slot_bytes // send_itemsize * send_itemsize
    recv_piece = peers.slot_bytes // recv_itemsize * recv_itemsize
    # An empty message is one empty piece: its fingerprint is still checked.
    send_pieces = 0 if dst < 0 else 1 if send_bytes == 0 else (send_bytes + send_piece - 1) // send_piece
    recv_pieces = 0 if src < 0 else 1 if recv_bytes == 0 else (recv_bytes + recv_piece - 1) // recv_piece
    sent = got = 0
    waiting = peers.waiting
    waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
    while sent < send_pieces or got < recv_pieces:
        progressed = False
        if sent < send_pieces:
            offset = sent * send_piece
            piece = min(send_piece, send_bytes - offset)
            if _try_send(peers, dst, send_address + offset, piece, send_bytes):
                sent += 1
                progressed = True
                if sent == send_pieces:
                    peers.messages_sent[dst] += 1
        if got < recv_pieces:
            offset = got * recv_piece
            piece = min(recv_piece, recv_bytes - offset)
            if _try_recv(peers, src, recv_address + offset, piece, recv_bytes, out, offset // recv_itemsize,
                         reduction):
                if peers.status != OK:  # a mismatch: the slot stays where it is
                    return
                got += 1
                progressed = True
                if got == recv_pieces:
                    peers.messages_received[src] += 1
        if progressed:
            waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
        else:
            _idle(peers, dst if sent < send_pieces else -1, src if got < recv_pieces else -1)
            if peers.status != OK:
                return


@njit(cache=True)
def _usable(peers, dst, send_itemsize, src, recv_itemsize):
    """Whether a transfer may go ahead: the collective has not failed, and both peers are other
    ranks whose items fit a slot (if not, INVALID naming the bad one)."""
    if peers.status != OK:
        return False
    for peer, itemsize in ((dst, send_itemsize), (src, recv_itemsize)):
        if peer < 0 or peer >= peers.world_size or peer == peers.rank or itemsize > peers.slot_bytes:
            peers.status, peers.failed_peer = INVALID, peer
            return False
    return True


@njit(cache=True, nogil=True)
def _try_send(peers, dst, address, piece_bytes, message_bytes):
    """Put one piece into ``dst``'s ring if a slot is free; False if the ring is full."""
    rings, words, depth = peers.rings, peers.words, peers.depth
    channel, n = rings[OUT_CHANNEL, dst], rings[SENT_BY_ME, dst]
    if n - rings[TAKEN_BY_PEER, dst] >= depth:
        rings[TAKEN_BY_PEER, dst] = load_acquire(words, (channel + TAKEN) >> 3)
        if n - rings[TAKEN_BY_PEER, dst] >= depth:
            return False
    slot = channel + SLOTS + (n % depth) * _slot_stride(peers.slot_bytes)
    header, fingerprint = slot >> 3, peers.fingerprint_words
    words[header], words[header + 1] = fingerprint[0], fingerprint[1]
    words[header + 2], words[header + 3] = fingerprint[2], fingerprint[3]
    words[header + PIECE_WORD], words[header + MESSAGE_WORD] = piece_bytes, message_bytes
    _memcpy(address_of(words) + slot + HEADER_BYTES, address, piece_bytes)
    rings[SENT_BY_ME, dst] = n + 1
    store_release(words, (channel + SENT) >> 3, n + 1)  # publish: header and payload go first
    peers.bytes_sent[dst] += piece_bytes
    _wake(peers, dst)
    return True


@njit(cache=True, nogil=True)
def _try_recv(peers, src, address, piece_bytes, message_bytes, out, first, reduction):
    """Take one piece from ``src``'s ring if there is one (False if not): copy it to
    ``address``, or fold it into ``out[first:]`` with ``reduction.combine``. A fingerprint or byte
    count that differs from ours sets MISMATCH and leaves the slot (returns True: stop waiting)."""
    rings, words = peers.rings, peers.words
    channel, n = rings[IN_CHANNEL, src], rings[TAKEN_BY_ME, src]
    if n >= rings[SENT_BY_PEER, src]:
        rings[SENT_BY_PEER, src] = load_acquire(words, (channel + SENT) >> 3)
        if n >= rings[SENT_BY_PEER, src]:
            return False
    slot = channel + SLOTS + (n % peers.depth) * _slot_stride(peers.slot_bytes)
    header, fingerprint = slot >> 3, peers.fingerprint_words
    if (words[header] != fingerprint[0] or words[header + 1] != fingerprint[1]
            or words[header + 2] != fingerprint[2] or words[header + 3] != fingerprint[3]
            or words[header + PIECE_WORD] != piece_bytes or words[header + MESSAGE_WORD] != message_bytes):
        _mismatch(peers, src, slot)
        return True
    payload = slot + HEADER_BYTES
    if reduction is None:  # pruned when Numba compiles: the None path has no fold at all
        _memcpy(address, address_of(words) + payload, piece_bytes)
    elif piece_bytes > 0:
        count = piece_bytes // out.itemsize
        reduction.combine(out[first:first + count], peers.region[payload:payload + piece_bytes].view(out.dtype))
    rings[TAKEN_BY_ME, src] = n + 1
    store_release(words, (channel + TAKEN) >> 3, n + 1)  # free the slot: our reads of it go first
    peers.bytes_received[src] += piece_bytes
    _wake(peers, src)
    return True


@njit(cache=True)
def _mismatch(peers, src, slot):
    """``src``'s message at ``slot`` is not the one we expect: say whose it is and what it is."""
    peers.status, peers.failed_peer = MISMATCH, src
    peers.peer_bytes = peers.words[(slot >> 3) + MESSAGE_WORD]
    for i in range(FINGERPRINT_BYTES):
        peers.peer_fingerprint[i] = peers.region[slot + i]


# --- waiting ------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _ready(peers, dst, src):
    """A fresh look: can a piece go to ``dst`` or come from ``src`` now (-1: not waited for)?"""
    rings, words = peers.rings, peers.words
    if dst >= 0:
        rings[TAKEN_BY_PEER, dst] = load_acquire(words, (rings[OUT_CHANNEL, dst] + TAKEN) >> 3)
        if rings[SENT_BY_ME, dst] - rings[TAKEN_BY_PEER, dst] < peers.depth:
            return True
    if src >= 0:
        rings[SENT_BY_PEER, src] = load_acquire(words, (rings[IN_CHANNEL, src] + SENT) >> 3)
        if rings[SENT_BY_PEER, src] > rings[TAKEN_BY_ME, src]:
            return True
    return False


@njit(cache=True, nogil=True)
def _idle(peers, dst, src):
    """One round of waiting for ``dst`` (a free slot) or ``src`` (a message): spin, yield or
    sleep by how long it has lasted, then check the deadline and, every millisecond, liveness."""
    waiting = peers.waiting
    waiting[IDLE_ROUNDS] += 1
    rounds = waiting[IDLE_ROUNDS]
    if rounds <= peers.spin_limit:
        cpu_relax()
        if rounds != 1 and rounds % CLOCK_EVERY_SPINS != 0:
            return
    elif rounds <= peers.spin_limit + peers.yield_limit:
        sched_yield()
    else:
        _sleep(peers, dst, src)
    now = monotonic_ns()
    if waiting[WAIT_STARTED] == 0:
        waiting[WAIT_STARTED] = waiting[LIVENESS_CHECKED] = waiting[HOOK_CALLED] = now
        return
    if peers.deadline_ns > 0 and now - waiting[WAIT_STARTED] >= peers.deadline_ns:
        if not _ready(peers, dst, src):
            peers.status, peers.failed_peer = SILENCE, src if src >= 0 else dst
        return
    if now - waiting[LIVENESS_CHECKED] >= LIVENESS_INTERVAL_NS:
        waiting[LIVENESS_CHECKED] = now
        lost = -1
        if src >= 0 and peer_gone(peers.liveness_fds[src]):
            lost = src
        elif dst >= 0 and peer_gone(peers.liveness_fds[dst]):
            lost = dst
        # A last look: what the peer published before it died is still delivered.
        if lost >= 0 and not _ready(peers, dst if dst == lost else -1, src if src == lost else -1):
            peers.status, peers.failed_peer = PEER_LOST, lost
        elif hook_due(peers.hook, peers.liveness_fds, now, waiting[HOOK_CALLED]):
            waiting[HOOK_CALLED] = now
            call_hook(peers.hook, peers.fingerprint)


@njit(cache=True, nogil=True)
def _sleep(peers, dst, src):
    """Nap on our doorbell (at most FUTEX_TIMEOUT_NS) unless a fresh look finds progress."""
    words, doorbells, area = peers.words, peers.doorbells, peers.rank * RANK_AREA_BYTES
    ring = load_acquire(doorbells, (area + DOORBELL) >> 2)
    store_release(words, (area + SLEEPING) >> 3, 1)
    fence_seq_cst()  # the flag's store before the look (pairs with the fence in _wake)
    if not _ready(peers, dst, src):
        futex_wait(doorbells, (area + DOORBELL) >> 2, ring, FUTEX_TIMEOUT_NS)
    store_release(words, (area + SLEEPING) >> 3, 0)


@njit(cache=True, nogil=True)
def _wake(peers, peer):
    """After publishing to ``peer`` (a piece, or a freed slot): ring its doorbell if it sleeps."""
    area = peer * RANK_AREA_BYTES
    fence_seq_cst()  # the counter's store before the flag's load (pairs with the fence in _sleep)
    if load_acquire(peers.words, (area + SLEEPING) >> 3) != 0:
        atomic_add(peers.doorbells, (area + DOORBELL) >> 2, 1)
        futex_wake(peers.doorbells, (area + DOORBELL) >> 2, 1)


# --- diagnosis, from plain Python ---------------------------------------------------------------


def pending_fingerprints(region, rank: int, world_size: int, slot_bytes: int, depth: int) -> dict[int, bytes]:
    """For each peer that has published a message to ``rank`` that ``rank`` has not taken (its
    ``sent`` ahead of our ``taken``): the 32-byte fingerprint of the next such piece. Plain numpy
    on the shared region (no compilation), for a diagnosis after a failure; a rank still running
    may move the counters meanwhile."""
    region = region if isinstance(region, np.ndarray) else np.frombuffer(region, np.uint8)
    region = region.reshape(-1).view(np.uint8)
    stride = _slot_stride(slot_bytes)

    def word(offset: int) -> int:
        return int(region[offset:offset + 8].view(np.int64)[0])

    pending = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        _, in_channel = _channel_offsets(rank, peer, world_size, slot_bytes, depth)
        sent, taken = word(in_channel + SENT), word(in_channel + TAKEN)
        if sent > taken:
            slot = in_channel + SLOTS + (taken % depth) * stride
            pending[peer] = region[slot:slot + FINGERPRINT_BYTES].tobytes()
    return pending
