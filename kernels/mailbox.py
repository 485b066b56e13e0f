"""Point-to-point messages between processes through one shared memory region, in nopython mode.

``MailboxPeers`` is a Numba structref with the Peers interface the algorithms are written against
(``send_buffer``, ``recv_buffer``, ``sendrecv_buffer``, ``host_of``, ``rank``, ``world_size``),
so a whole small collective (a recursive-doubling allreduce of 1 KB) can run as ONE compiled call:
no interpreter, no system call on the fast path, only loads, stores and ``memcpy`` on memory that
every rank maps (measured: 0.6-1 µs a call for 2 ranks spinning on their own cores, where a
prototype took 1.3 µs). Linux only (futex, poll); x86_64 and aarch64.

The parts: :mod:`kernels.mailbox_layout` (where everything sits in the shared region),
:mod:`kernels.rings` (the transfers and the waiting, with their memory ordering),
:mod:`kernels.doorbell` (sleep and wake), :mod:`kernels.hook` (a long wait's call into Python),
:mod:`kernels.atomics` and :mod:`kernels.libc`. This module is the ``MailboxPeers`` they make:
its Numba type, how it opens, and its Peers methods in compiled code and from Python.

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

Numba. Every function of the mailboxes is compiled with ``cache=True``: libc is called by symbol
name (:mod:`kernels.libc`), so no address of this process is baked into the code, and
``MailboxPeers`` is a structref (a jitclass cannot be cached). So a caller's function that opens or takes the mailboxes can be cached too: a rank
process then loads it from disk in about 0.1 s instead of compiling it (tens of seconds of CPU
the first time, all the mailbox code it links in included). ``None`` as the reduction picks the
byte-copy path when Numba compiles: it works on addresses and byte counts, so one compilation
serves every dtype; only a fold compiles per (dtype, reduction type). Numba's cache knows only
the source file of the function it caches: :mod:`kernels.cache` guards every file of
``kernels/`` (and ``lab.compiled.sources`` the lab's callers) so that no stale code runs.

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

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.extending import overload, overload_method

from kernels import rings
from kernels.atomics import load_acquire
from kernels.doorbell import DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT, OK
from kernels.libc import address_of
from kernels.mailbox_layout import (
    FINGERPRINT_BYTES,
    IN_CHANNEL,
    LINE,
    MIN_SLOT_BYTES,
    OUT_CHANNEL,
    SENT,
    SENT_BY_ME,
    SENT_BY_PEER,
    TAKEN,
    TAKEN_BY_ME,
    TAKEN_BY_PEER,
    channel_offsets,
    region_bytes,
)

# --- the mailbox --------------------------------------------------------------------------------

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
    ("scratch", types.uint8[::1]),  # the shared scratch after the mailboxes (kernels.one_shot; empty: none)
    ("scratch_slot_bytes", types.int64)]


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
        raise ValueError(
            "MailboxPeers: the region is smaller than region_bytes(world_size, slot_bytes, depth)")
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
    ends = np.full((6, world_size), -1, np.int64)
    words = peers.words
    for peer in range(world_size):
        if peer == rank:
            continue
        out_channel, in_channel = channel_offsets(rank, peer, world_size, slot_bytes, depth)
        ends[OUT_CHANNEL, peer], ends[IN_CHANNEL, peer] = out_channel, in_channel
        # A mailbox may be attached to a region already in use: start where its counters stand.
        ends[SENT_BY_ME, peer] = load_acquire(words, (out_channel + SENT) >> 3)
        ends[TAKEN_BY_PEER, peer] = load_acquire(words, (out_channel + TAKEN) >> 3)
        ends[TAKEN_BY_ME, peer] = load_acquire(words, (in_channel + TAKEN) >> 3)
        ends[SENT_BY_PEER, peer] = load_acquire(words, (in_channel + SENT) >> 3)
    peers.rings = ends
    peers.waiting = np.zeros(4, np.int64)
    peers.hook = 0
    peers.scratch, peers.scratch_slot_bytes = region[:0], 0
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

# The methods' bodies are compiled like every function here (cache=True): a caller compiled afresh
# then loads them from the cache instead of compiling them.
_METHOD_OPTIONS = {"cache": True, "nogil": True}


def _absent(reduction) -> bool:
    return reduction is None or isinstance(reduction, (types.NoneType, types.Omitted))


@overload_method(MailboxPeersType, "begin", jit_options=_METHOD_OPTIONS)
def _begin_method(peers, fingerprint, deadline_ns):
    """Start one collective: every message carries ``fingerprint`` (uint8[32]); a wait gives up
    after ``deadline_ns`` without progress (0: never). Clears the last collective's failure."""
    return lambda peers, fingerprint, deadline_ns: rings.begin(peers, fingerprint, deadline_ns)


@overload_method(MailboxPeersType, "send_buffer", jit_options=_METHOD_OPTIONS)
def _send_buffer_method(peers, dst, data):
    """Send ``data`` (1-D, C-contiguous, any dtype) to ``dst``; returns once it is in the ring
    (at once, if the collective has failed)."""
    return lambda peers, dst, data: rings.send(peers, np.int64(dst), address_of(data), data.nbytes, data.
                                               itemsize)


@overload_method(MailboxPeersType, "recv_buffer", jit_options=_METHOD_OPTIONS)
def _recv_buffer_method(peers, src, out, reduction=None):
    """Receive ``src``'s next message into ``out``: a copy (``reduction`` None), or
    ``reduction.combine(out_piece, incoming)`` per slot-sized piece, ``incoming`` being the slot
    viewed with ``out``'s dtype."""
    if _absent(reduction):  # the byte-level path: one compilation serves every dtype

        def copy(peers, src, out, reduction=None):
            rings.recv(peers, np.int64(src), address_of(out), out.nbytes, out.itemsize)

        return copy

    def fold(peers, src, out, reduction=None):
        rings.recv_fold(peers, np.int64(src), out, reduction)

    return fold


@overload_method(MailboxPeersType, "sendrecv_buffer", jit_options=_METHOD_OPTIONS)
def _sendrecv_buffer_method(peers, dst, data, src, out, reduction=None):
    """Send ``data`` to ``dst`` and receive from ``src`` into ``out`` at once, piece by piece,
    so two ranks exchanging with each other never both wait on a full ring (a copy, or a fold
    with ``reduction`` as in ``recv_buffer``). ``out`` must not overlap ``data`` (a piece may
    arrive before the same piece of ``data`` has gone)."""
    if _absent(reduction):

        def copy(peers, dst, data, src, out, reduction=None):
            rings.sendrecv(peers, np.int64(dst), address_of(data), data.nbytes, data.itemsize, np.int64(src),
                           address_of(out), out.nbytes, out.itemsize)

        return copy

    def fold(peers, dst, data, src, out, reduction=None):
        rings.sendrecv_fold(peers, np.int64(dst), address_of(data), data.nbytes, data.itemsize, np.int64(src),
                            out, reduction)

    return fold


@overload_method(MailboxPeersType, "host_of", jit_options=_METHOD_OPTIONS)
def _host_of_method(peers, rank):
    """Every rank of one shared region is on one host."""
    return lambda peers, rank: np.int64(0)


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
