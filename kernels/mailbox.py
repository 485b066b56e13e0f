"""Point-to-point messages between processes through one shared memory region, in nopython mode.

``MailboxPeers`` is a Numba jitclass with the Peers interface the algorithms are written against
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
unless a last look finds the peer's message published after all. Failures never raise nor hang
inside compiled code: ``status`` is set, every later transfer of the collective returns at once,
and the caller checks ``status`` after the call and raises a proper Python error. After a
failure the rings of that mesh are not reusable (a message may be half sent).

Numba. ``combine`` is an ``@njit`` function passed as a value (its dispatcher), to the methods
from Python or from compiled code; ``recv_buffer``'s default ``combine=None`` works from both,
and the None branch is pruned at compile time. The copy path works on addresses and byte counts,
so one compilation serves every dtype; only a combine compiles per (dtype, kernel), viewing the
slot's bytes as ``out``'s dtype (payloads are 64-byte aligned and pieces whole items). Each new
compiled entry point re-optimizes the mailbox code it links in (about a second): compile what a
rank will call before it forks or starts (``dispatcher.compile(signature)``).

Per rank (every rank runs the same compiled function; ``sum_into`` is
``kernels.reduce.sum_into``, or any ``@njit`` ``dst += src`` kernel)::

    >>> region = np.frombuffer(shared_mapping, np.uint8)  # region_bytes(2, 4096, 4) bytes, zeroed
    >>> peers = MailboxPeers(region, rank, 2, 4096, 4, np.full(2, -1, np.int32))
    >>> @njit
    ... def allreduce_pair(peers, buf, incoming, fingerprint, combine):
    ...     peers.begin(fingerprint, 1_000_000_000)  # give up after 1 s without progress
    ...     partner = 1 - peers.rank
    ...     peers.sendrecv_buffer(partner, buf, partner, incoming)
    ...     combine(buf, incoming)
    ...     return peers.status
    >>> buf = np.arange(256, dtype=np.float32) + rank
    >>> allreduce_pair(peers, buf, np.empty_like(buf), fingerprint, sum_into)
    0
    >>> buf[:3]                                           # on both ranks
    array([1., 3., 5.], dtype=float32)

This module imports nothing from ``lab``.
"""

from __future__ import annotations

import ctypes
import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.experimental import jitclass
from numba.extending import intrinsic

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
# default a wait spins only briefly: a benchmark on dedicated cores sets spin_limit high, one on
# an oversubscribed machine 0.
DEFAULT_SPIN_LIMIT = 500  # pause-spins before yielding (about 20 microseconds)
DEFAULT_YIELD_LIMIT = 8  # sched_yield calls before sleeping on the futex
FUTEX_TIMEOUT_NS = 1_000_000  # a sleep's longest nap: bounds a missed wake and the clock checks
LIVENESS_INTERVAL_NS = 1_000_000  # how often a wait polls its peers' liveness pipes
CLOCK_EVERY_SPINS = 256  # a spinning wait reads the clock only this often


@njit
def _slot_stride(slot_bytes: int) -> int:
    return HEADER_BYTES + (slot_bytes + LINE - 1) // LINE * LINE


@njit
def _channel_bytes(slot_bytes: int, depth: int) -> int:
    return SLOTS + depth * _slot_stride(slot_bytes)


@njit
def region_bytes(world_size: int, slot_bytes: int, depth: int) -> int:
    """The bytes of the shared region ``MailboxPeers(..., world_size, slot_bytes, depth, ...)`` uses
    (a multiple of 64)."""
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


# --- libc through ctypes (Numba calls a typed ctypes function pointer directly) ------------------
# Addresses travel as int64 (not c_void_p): Numba has no pointer arithmetic, but integer
# arithmetic on an array's address is fine, and a pointer is a 64-bit integer in the ABI.


def _libc_function(name: str, restype, *argtypes):
    function = getattr(ctypes.CDLL(None), name)  # a private CDLL: its argtypes are ours alone
    function.restype, function.argtypes = restype, list(argtypes)
    return function


_i32, _i64 = ctypes.c_int32, ctypes.c_int64
sched_yield = _libc_function("sched_yield", _i32)
_clock_gettime = _libc_function("clock_gettime", _i32, _i32, _i64)
_memcpy = _libc_function("memcpy", _i64, _i64, _i64, _i64)
_poll = _libc_function("poll", _i32, _i64, _i64, _i32)
# syscall is variadic; its integer arguments sit in the same registers as a fixed call's.
_syscall = _libc_function("syscall", _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64)

CLOCK_MONOTONIC = 1
SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(_MACHINE, -1)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
POLLERR, POLLHUP = 0x008, 0x010
# struct pollfd {int fd; short events; short revents} in one int64 word: where fd and revents sit.
_FD_SHIFT, _REVENTS_SHIFT = (0, 48) if sys.byteorder == "little" else (32, 0)


@njit(inline="always")
def address_of(arr):
    """The address of ``arr``'s first element as an int64 (``ctypes.data`` is uint64, and uint64
    mixed with int64 arithmetic is float64 in Numba)."""
    return np.int64(arr.ctypes.data)


@njit(nogil=True)
def monotonic_ns():
    """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds (the vDSO: no system call)."""
    timespec = stack_words(2)
    _clock_gettime(CLOCK_MONOTONIC, address_of(timespec))
    return timespec[0] * 1_000_000_000 + timespec[1]


@njit(nogil=True)
def futex_wait(words, index, expected, timeout_ns):
    """Sleep while ``words[index]`` (int32, shared) is ``expected``, at most ``timeout_ns``; returns
    at once if it differs, on a wake, on a signal or at the timeout (the caller re-checks)."""
    if SYS_FUTEX < 0:
        sched_yield()
        return -1
    timespec = stack_words(2)
    timespec[0], timespec[1] = timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000
    return _syscall(SYS_FUTEX, address_of(words) + index * 4, FUTEX_WAIT, expected, address_of(timespec), 0, 0)


@njit(nogil=True)
def futex_wake(words, index, count):
    """Wake up to ``count`` sleepers on ``words[index]``; returns how many were woken."""
    if SYS_FUTEX < 0:
        return 0
    return _syscall(SYS_FUTEX, address_of(words) + index * 4, FUTEX_WAKE, count, 0, 0, 0)


@njit(nogil=True)
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


# --- the mailbox --------------------------------------------------------------------------------

# Rows of MailboxPeers.rings (one column per peer): where the two channels with that peer start,
# and their counters. Our own counters are ours alone to write, so we keep them; the peer's are
# as last loaded (a sender reloads ``taken`` only when the ring looks full).
OUT_CHANNEL, IN_CHANNEL = 0, 1  # byte offsets of the channels rank -> peer and peer -> rank
SENT_BY_ME, TAKEN_BY_PEER = 2, 3  # of the channel rank -> peer
TAKEN_BY_ME, SENT_BY_PEER = 4, 5  # of the channel peer -> rank
# MailboxPeers.waiting: the current wait's rounds without progress, when it began (0: not yet
# timed) and when it last polled liveness.
IDLE_ROUNDS, WAIT_STARTED, LIVENESS_CHECKED = 0, 1, 2

_SPEC = [
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
    ("spin_limit", types.int64),
    ("yield_limit", types.int64),
    ("rings", types.int64[:, ::1]),
    ("waiting", types.int64[::1]),
]


@jitclass(_SPEC)
class MailboxPeers:
    """This rank's end of the shared-memory mailboxes (see the module docstring).

    ``status`` (OK, MISMATCH, SILENCE, PEER_LOST, INVALID) and ``failed_peer`` (-1: none) say how
    the current collective went; on MISMATCH ``peer_fingerprint`` and ``peer_bytes`` hold what
    the peer's message declared. ``bytes_sent[p]``/``bytes_received[p]``: payload bytes so far.
    ``spin_limit``/``yield_limit``: the waiting policy (set both large to spin, 0 to block at once).
    One rank's instance is used by one thread at a time.
    """

    def __init__(self, region, rank, world_size, slot_bytes, depth, liveness_fds):
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
        self.region = region[:used]
        self.words = self.region.view(np.int64)
        self.doorbells = self.region.view(np.int32)
        self.rank, self.world_size = rank, world_size
        self.slot_bytes, self.depth = slot_bytes, depth
        self.liveness_fds = liveness_fds.copy()
        self.status, self.failed_peer, self.peer_bytes, self.deadline_ns = OK, -1, -1, 0
        self.fingerprint = np.zeros(FINGERPRINT_BYTES, np.uint8)
        self.fingerprint_words = self.fingerprint.view(np.int64)
        self.peer_fingerprint = np.zeros(FINGERPRINT_BYTES, np.uint8)
        self.bytes_sent = np.zeros(world_size, np.int64)
        self.bytes_received = np.zeros(world_size, np.int64)
        self.spin_limit, self.yield_limit = DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT
        self.rings = np.full((6, world_size), -1, np.int64)
        self.waiting = np.zeros(3, np.int64)
        channel_bytes = _channel_bytes(slot_bytes, depth)
        first_channel = world_size * RANK_AREA_BYTES
        for peer in range(world_size):
            if peer == rank:
                continue
            # Channel (src, dst) is number src * (N - 1) + dst, not counting dst == src.
            out_channel = first_channel + (rank * (world_size - 1) + peer - (peer > rank)) * channel_bytes
            in_channel = first_channel + (peer * (world_size - 1) + rank - (rank > peer)) * channel_bytes
            self.rings[OUT_CHANNEL, peer], self.rings[IN_CHANNEL, peer] = out_channel, in_channel
            # A mailbox may be attached to a region already in use: start where its counters stand.
            self.rings[SENT_BY_ME, peer] = load_acquire(self.words, (out_channel + SENT) >> 3)
            self.rings[TAKEN_BY_PEER, peer] = load_acquire(self.words, (out_channel + TAKEN) >> 3)
            self.rings[TAKEN_BY_ME, peer] = load_acquire(self.words, (in_channel + TAKEN) >> 3)
            self.rings[SENT_BY_PEER, peer] = load_acquire(self.words, (in_channel + SENT) >> 3)

    # --- the Peers interface ------------------------------------------------------------------

    def begin(self, fingerprint, deadline_ns):
        """Start one collective: every message carries ``fingerprint`` (uint8[32]); a wait gives up
        after ``deadline_ns`` without progress (0: never). Clears the last collective's failure."""
        self.status, self.failed_peer, self.peer_bytes = OK, -1, -1
        self.deadline_ns = deadline_ns
        if fingerprint.size != FINGERPRINT_BYTES:
            self.status = INVALID
            return
        for i in range(FINGERPRINT_BYTES):
            self.fingerprint[i] = fingerprint[i]

    def send_buffer(self, dst, data):
        """Send ``data`` (1-D, C-contiguous, any dtype) to ``dst``; returns once it is in the ring
        (at once, if the collective has failed)."""
        if self._usable(dst, data.itemsize, dst, data.itemsize):
            nobody, nothing = np.int64(-1), np.int64(0)  # not literals: one compilation for every caller
            self._exchange(dst, address_of(data), data.nbytes, data.itemsize,
                           nobody, nothing, nothing, np.int64(1), self.region, None)

    def recv_buffer(self, src, out, combine=None):
        """Receive ``src``'s next message into ``out``: a copy (``combine`` None), or
        ``combine(out_piece, incoming)`` per slot-sized piece, ``incoming`` being the slot viewed
        with ``out``'s dtype (an ``@njit`` ``dst ⊕= src`` kernel, passed as a function value)."""
        if not self._usable(src, out.itemsize, src, out.itemsize):
            return
        nobody, nothing, one = np.int64(-1), np.int64(0), np.int64(1)
        if combine is None:  # the byte-level path: one compilation serves every dtype
            self._exchange(nobody, nothing, nothing, one, src, address_of(out), out.nbytes, out.itemsize,
                           self.region, None)
        else:
            self._exchange(nobody, nothing, nothing, one, src, address_of(out), out.nbytes, out.itemsize,
                           out, combine)

    def sendrecv_buffer(self, dst, data, src, out, combine=None):
        """Send ``data`` to ``dst`` and receive from ``src`` into ``out`` at once, piece by piece,
        so two ranks exchanging with each other never both wait on a full ring. ``out`` must not
        overlap ``data`` (a piece may arrive before the same piece of ``data`` has gone)."""
        if not self._usable(dst, data.itemsize, src, out.itemsize):
            return
        if combine is None:
            self._exchange(dst, address_of(data), data.nbytes, data.itemsize,
                           src, address_of(out), out.nbytes, out.itemsize, self.region, None)
        else:
            self._exchange(dst, address_of(data), data.nbytes, data.itemsize,
                           src, address_of(out), out.nbytes, out.itemsize, out, combine)

    def host_of(self, rank):
        """Every rank of one shared region is on one host."""
        return 0

    # --- transfers ----------------------------------------------------------------------------

    def _exchange(self, dst, send_address, send_bytes, send_itemsize,
                  src, recv_address, recv_bytes, recv_itemsize, out, combine):
        """Send ``send_bytes`` at ``send_address`` to ``dst`` (none if -1) and receive ``recv_bytes``
        to ``recv_address`` from ``src`` (none if -1; into ``out`` through ``combine`` unless it is
        None), interleaving pieces, waiting only when neither can move. Pieces are whole items:
        ``slot_bytes`` rounded down to the itemsize. The peers were checked by ``_usable``."""
        send_piece = self.slot_bytes // send_itemsize * send_itemsize
        recv_piece = self.slot_bytes // recv_itemsize * recv_itemsize
        # An empty message is one empty piece: its fingerprint is still checked.
        send_pieces = 0 if dst < 0 else 1 if send_bytes == 0 else (send_bytes + send_piece - 1) // send_piece
        recv_pieces = 0 if src < 0 else 1 if recv_bytes == 0 else (recv_bytes + recv_piece - 1) // recv_piece
        sent = got = 0
        waiting = self.waiting
        waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
        while sent < send_pieces or got < recv_pieces:
            progressed = False
            if sent < send_pieces:
                offset = sent * send_piece
                piece = min(send_piece, send_bytes - offset)
                if self._try_send(dst, send_address + offset, piece, send_bytes):
                    sent += 1
                    progressed = True
            if got < recv_pieces:
                offset = got * recv_piece
                piece = min(recv_piece, recv_bytes - offset)
                if self._try_recv(src, recv_address + offset, piece, recv_bytes, out, offset // recv_itemsize, combine):
                    if self.status != OK:  # a mismatch: the slot stays where it is
                        return
                    got += 1
                    progressed = True
            if progressed:
                waiting[IDLE_ROUNDS] = waiting[WAIT_STARTED] = 0
            else:
                self._idle(dst if sent < send_pieces else -1, src if got < recv_pieces else -1)
                if self.status != OK:
                    return

    def _usable(self, dst, send_itemsize, src, recv_itemsize):
        """Whether a transfer may go ahead: the collective has not failed, and both peers are other
        ranks whose items fit a slot (if not, INVALID naming the bad one)."""
        if self.status != OK:
            return False
        for peer, itemsize in ((dst, send_itemsize), (src, recv_itemsize)):
            if peer < 0 or peer >= self.world_size or peer == self.rank or itemsize > self.slot_bytes:
                self.status, self.failed_peer = INVALID, peer
                return False
        return True

    def _try_send(self, dst, address, piece_bytes, message_bytes):
        """Put one piece into ``dst``'s ring if a slot is free; False if the ring is full."""
        rings, words, depth = self.rings, self.words, self.depth
        channel, n = rings[OUT_CHANNEL, dst], rings[SENT_BY_ME, dst]
        if n - rings[TAKEN_BY_PEER, dst] >= depth:
            rings[TAKEN_BY_PEER, dst] = load_acquire(words, (channel + TAKEN) >> 3)
            if n - rings[TAKEN_BY_PEER, dst] >= depth:
                return False
        slot = channel + SLOTS + (n % depth) * _slot_stride(self.slot_bytes)
        header, fingerprint = slot >> 3, self.fingerprint_words
        words[header], words[header + 1] = fingerprint[0], fingerprint[1]
        words[header + 2], words[header + 3] = fingerprint[2], fingerprint[3]
        words[header + PIECE_WORD], words[header + MESSAGE_WORD] = piece_bytes, message_bytes
        _memcpy(address_of(words) + slot + HEADER_BYTES, address, piece_bytes)
        rings[SENT_BY_ME, dst] = n + 1
        store_release(words, (channel + SENT) >> 3, n + 1)  # publish: header and payload go first
        self.bytes_sent[dst] += piece_bytes
        self._wake(dst)
        return True

    def _try_recv(self, src, address, piece_bytes, message_bytes, out, first, combine):
        """Take one piece from ``src``'s ring if there is one (False if not): copy it to
        ``address``, or ``combine`` it into ``out[first:]``. A fingerprint or byte count that
        differs from ours sets MISMATCH and leaves the slot (returns True: stop waiting)."""
        rings, words = self.rings, self.words
        channel, n = rings[IN_CHANNEL, src], rings[TAKEN_BY_ME, src]
        if n >= rings[SENT_BY_PEER, src]:
            rings[SENT_BY_PEER, src] = load_acquire(words, (channel + SENT) >> 3)
            if n >= rings[SENT_BY_PEER, src]:
                return False
        slot = channel + SLOTS + (n % self.depth) * _slot_stride(self.slot_bytes)
        header, fingerprint = slot >> 3, self.fingerprint_words
        if (words[header] != fingerprint[0] or words[header + 1] != fingerprint[1]
                or words[header + 2] != fingerprint[2] or words[header + 3] != fingerprint[3]
                or words[header + PIECE_WORD] != piece_bytes or words[header + MESSAGE_WORD] != message_bytes):
            self._mismatch(src, slot)
            return True
        payload = slot + HEADER_BYTES
        if combine is None:
            _memcpy(address, address_of(words) + payload, piece_bytes)
        elif piece_bytes > 0:
            count = piece_bytes // out.itemsize
            combine(out[first:first + count], self.region[payload:payload + piece_bytes].view(out.dtype))
        rings[TAKEN_BY_ME, src] = n + 1
        store_release(words, (channel + TAKEN) >> 3, n + 1)  # free the slot: our reads of it go first
        self.bytes_received[src] += piece_bytes
        self._wake(src)
        return True

    def _mismatch(self, src, slot):
        """``src``'s message at ``slot`` is not the one we expect: say whose it is and what it is."""
        self.status, self.failed_peer = MISMATCH, src
        self.peer_bytes = self.words[(slot >> 3) + MESSAGE_WORD]
        for i in range(FINGERPRINT_BYTES):
            self.peer_fingerprint[i] = self.region[slot + i]

    # --- waiting ------------------------------------------------------------------------------

    def _ready(self, dst, src):
        """A fresh look: can a piece go to ``dst`` or come from ``src`` now (-1: not waited for)?"""
        rings, words = self.rings, self.words
        if dst >= 0:
            rings[TAKEN_BY_PEER, dst] = load_acquire(words, (rings[OUT_CHANNEL, dst] + TAKEN) >> 3)
            if rings[SENT_BY_ME, dst] - rings[TAKEN_BY_PEER, dst] < self.depth:
                return True
        if src >= 0:
            rings[SENT_BY_PEER, src] = load_acquire(words, (rings[IN_CHANNEL, src] + SENT) >> 3)
            if rings[SENT_BY_PEER, src] > rings[TAKEN_BY_ME, src]:
                return True
        return False

    def _idle(self, dst, src):
        """One round of waiting for ``dst`` (a free slot) or ``src`` (a message): spin, yield or
        sleep by how long it has lasted, then check the deadline and, every millisecond, liveness."""
        waiting = self.waiting
        waiting[IDLE_ROUNDS] += 1
        rounds = waiting[IDLE_ROUNDS]
        if rounds <= self.spin_limit:
            cpu_relax()
            if rounds != 1 and rounds % CLOCK_EVERY_SPINS != 0:
                return
        elif rounds <= self.spin_limit + self.yield_limit:
            sched_yield()
        else:
            self._sleep(dst, src)
        now = monotonic_ns()
        if waiting[WAIT_STARTED] == 0:
            waiting[WAIT_STARTED] = waiting[LIVENESS_CHECKED] = now
            return
        if self.deadline_ns > 0 and now - waiting[WAIT_STARTED] >= self.deadline_ns:
            if not self._ready(dst, src):
                self.status, self.failed_peer = SILENCE, src if src >= 0 else dst
            return
        if now - waiting[LIVENESS_CHECKED] >= LIVENESS_INTERVAL_NS:
            waiting[LIVENESS_CHECKED] = now
            lost = -1
            if src >= 0 and peer_gone(self.liveness_fds[src]):
                lost = src
            elif dst >= 0 and peer_gone(self.liveness_fds[dst]):
                lost = dst
            # A last look: what the peer published before it died is still delivered.
            if lost >= 0 and not self._ready(dst if dst == lost else -1, src if src == lost else -1):
                self.status, self.failed_peer = PEER_LOST, lost

    def _sleep(self, dst, src):
        """Nap on our doorbell (at most FUTEX_TIMEOUT_NS) unless a fresh look finds progress."""
        words, doorbells, area = self.words, self.doorbells, self.rank * RANK_AREA_BYTES
        ring = load_acquire(doorbells, (area + DOORBELL) >> 2)
        store_release(words, (area + SLEEPING) >> 3, 1)
        fence_seq_cst()  # the flag's store before the look (pairs with the fence in _wake)
        if not self._ready(dst, src):
            futex_wait(doorbells, (area + DOORBELL) >> 2, ring, FUTEX_TIMEOUT_NS)
        store_release(words, (area + SLEEPING) >> 3, 0)

    def _wake(self, peer):
        """After publishing to ``peer`` (a piece, or a freed slot): ring its doorbell if it sleeps."""
        area = peer * RANK_AREA_BYTES
        fence_seq_cst()  # the counter's store before the flag's load (pairs with the fence in _sleep)
        if load_acquire(self.words, (area + SLEEPING) >> 3) != 0:
            atomic_add(self.doorbells, (area + DOORBELL) >> 2, 1)
            futex_wake(self.doorbells, (area + DOORBELL) >> 2, 1)
