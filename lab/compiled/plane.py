"""The compiled data plane: a small collective as one Numba call over the shm mailboxes.

On the shm transport every rank maps one more shared region, the *mailboxes* (``kernels.mailbox``:
a single-producer/single-consumer ring of slots per ordered pair of ranks, counters published with
release stores, waits that spin, yield, then sleep on a futex). A collective of at most
``max_bytes`` whose algorithm is :func:`lab.compiled.compilable` runs its whole exchange in one
call of that algorithm's compiled face: no interpreter between messages, no system call on the
fast path. Everything the Python path guarantees holds: every message carries the collective's
fingerprint and the receiver compares it (``CollectiveMismatchError``; before its first transfer
a call also looks for a message an earlier call left unread, in the mailboxes and, by counters, on
the pipes: ``kernels.rings.look_back``), a wait reads the clock
(``DeadlineError`` after ``recv_timeout_ms`` of silence) and polls each awaited peer's pipe for a
hang-up (``PeerLostError``), and the counters, flight recorder and trace rows see the call.

Failures never raise inside compiled code: the mailbox records the first one, every later
transfer of the call returns at once, and the call returns the status (with
:meth:`CompiledCall.report`) that :meth:`lab.Mesh.run` turns into the error. A wait that lasts
calls the plane's hook (``kernels.hook.call_hook``) every few milliseconds and whenever a pipe
has something: the main thread's signal handlers run then, the pipes are drained (another
mesh's messages parked, so their senders go on), and what a handler or the hook raises (a
message of this mesh on the pipes: the ranks took different paths) propagates out of the call.
The waiting policy is ``LAB_COMPILED_SPIN`` and ``LAB_COMPILED_YIELD`` (see
:func:`waiting_policy_from_env`).

    plane = CompiledPlane(transport.mailbox)
    if plane.takes(algorithm, nbytes, args):
        call = plane.call(algorithm, args)                    # made once per algorithm and reduction
        status = call(tag, timeout_ms, call.operands(args))   # one Numba call
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import njit

from kernels import doorbell, libc, rings
from kernels import mailbox as mb
from kernels.coded import coded_reduction
from lab import checks, fingerprint
from lab.compiled import Compilable
from lab.flight import FLIGHT_RECORDER_SIZE
from lab.ops import Reduction

#: Tensors up to this many bytes take the compiled path (``LAB_COMPILED_MAX_BYTES``; 0: never).
DEFAULT_MAX_BYTES = 64 * 1024
#: A compiled wait's default policy: 50 ``pause`` spins, then up to 1,000 ``sched_yield`` calls,
#: then futex naps. Yielding hands the core to a descheduled peer when ranks outnumber cores;
#: measured on 2 cores (1 KB plan, µs, 2/4/8 ranks): 500 spins and 8 yields 5.3/99/374, this
#: 5.4/31/105, blocking at once 6.0/101/227, spinning only 5.1/8,001/39,988 (a timeslice per wait).
DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT = 50, 1000
#: Where a host's ranks outnumber its cores a wait spins this many times (it yields at once, as
#: Open MPI's ``mpi_yield_when_idle`` does when oversubscribed): a spin there only delays the yield
#: that lets the awaited peer run. Measured on 2 cores, 1 KB, 5 alternating rounds, 50 spins ->
#: none: plan 25.6 -> 18.4 µs at 4 ranks, 72 -> 59 at 8; plain call 35.7 -> 28.6 and 103 -> 100.
OVERSUBSCRIBED_SPIN_LIMIT = 0
#: The largest ``LAB_COMPILED_SPIN``/``LAB_COMPILED_YIELD`` and ``LAB_COMPILED_MAX_BYTES`` taken.
MAX_WAIT_COUNT, MAX_COMPILED_BYTES = 2**62, 2**62

# Words of the config array: what the compiled call reads (in) and reports (out).
RANK, WORLD_SIZE, SLOT_BYTES, DEPTH, DEADLINE_NS, OP, FAMILY, KIND, DIVIDES = range(9)  # in
STATUS, FAILED_PEER, PEER_BYTES, BYTES_SENT, BYTES_RECEIVED, MESSAGES_SENT, MESSAGES_RECEIVED = range(
    9, 16)  # out
FINGERPRINT, PEER_FINGERPRINT = 16, 20  # 4 words each: ours (in), the failed peer's (out)
SPIN_LIMIT, YIELD_LIMIT = 24, 25  # the waiting policy (in; kernels.mailbox)
BOOKS, RECORD = 26, 27  # in: whether the call keeps its own books in the ledger, and under which record
HOOK = 28  # in: the Python hook a long wait calls (kernels.hook.register_hook; 0: none)
#: In: where the shared scratch starts in the region and its slots' bytes (0: no scratch; kernels.one_shot).
SCRATCH, SCRATCH_SLOT_BYTES = 29, 30
LIVENESS = 31  # one pipe descriptor per rank (-1: none)
#: Deadlines past this many nanoseconds (292 years: what int64 holds) are no deadline.
MAX_DEADLINE_NS = 2**63 - 1

# Words of the ledger (CompiledPlane.ledger): the mesh's books, which a call with config[BOOKS] set
# keeps itself (a plan's run, a plain call's template: no Python between the number and the counts).
SEQ = 0  # the mesh's last collective number: every path numbers from here
BOOKED = 1  # bytes sent, bytes received, messages sent, messages received, collectives: by such calls
RING = 6  # then FLIGHT_RECORDER_SIZE (seq, record) pairs: those calls, each at seq % FLIGHT_RECORDER_SIZE
LEDGER_WORDS = RING + 2 * FLIGHT_RECORDER_SIZE
_SEQ_WORD = FINGERPRINT + fingerprint.SEQ_OFFSET // 8  # the collective's number in our fingerprint


@dataclass
class Report:
    """How one compiled call went (``status``: ``kernels.mailbox`` OK, MISMATCH, SILENCE, PEER_LOST)."""

    status: int
    failed_peer: int
    peer_tag: bytes
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int


class CompiledPlane:
    """One rank's compiled data plane over its transport's mailboxes (see the module docstring)."""
    def __init__(self, mailbox: Any, hook: int = 0) -> None:
        self.region = mailbox.region
        n = mailbox.world_size
        self.config = np.zeros(LIVENESS + n, np.int64)
        self.config[[RANK, WORLD_SIZE, SLOT_BYTES,
                     DEPTH]] = mailbox.rank, n, mailbox.slot_bytes, mailbox.depth
        self.config[[SPIN_LIMIT, YIELD_LIMIT]] = waiting_policy_from_env(n)
        self.config[HOOK] = hook
        self.config[[SCRATCH, SCRATCH_SLOT_BYTES]] = mailbox.scratch_start, mailbox.scratch_slot_bytes
        self.config[LIVENESS:] = mailbox.liveness_fds
        self.max_bytes = max_bytes_from_env()
        #: The books of the mesh this plane serves (see SEQ, BOOKED, RING).
        self.ledger = np.zeros(LEDGER_WORDS, np.int64)
        self._calls: dict[tuple, CompiledCall] = {}
        self._entries: dict[tuple[Compilable, bool, bool],
                            Callable[..., None]] = {}  # one compilation per algorithm
        self._compiling_only = False  # see compiling_only

    @contextlib.contextmanager
    def compiling_only(self) -> Iterator[None]:
        """Within it, a compiled call made compiles its entry if it is this rank's share of the
        entries (the N ranks of a cold disk cache compile N at a time) and runs nothing
        (:func:`lab.warmup.compile_all`'s first pass)."""
        self._compiling_only = True
        try:
            yield
        finally:
            self._compiling_only = False

    def takes(self, algorithm: Any, nbytes: int, args: tuple = ()) -> bool:
        """Whether a collective of ``nbytes`` running ``algorithm`` (a registry entry) on ``args``
        runs here: not a reduction compiled code has no codes for (the bitwise ops)."""
        return 0 < self.max_bytes and nbytes <= self.max_bytes \
            and isinstance(getattr(algorithm, "run", None), Compilable) \
            and not any(isinstance(a, Reduction) and a.codes is None for a in args)  # 0 is off, even for a barrier

    def call(self, algorithm: Any, args: tuple, at: bool = False) -> CompiledCall:
        """``algorithm``'s compiled call for arguments like ``args`` (its arguments after the
        peers), made once per algorithm and reduction and kept. ``at``: the call takes its first
        buffer as an address and a byte count (see :func:`_entry`)."""
        reduction = args[1] if len(args) > 1 and isinstance(args[1],
                                                            Reduction) else None  # (buf, reduction, ...)
        key = (algorithm.run, None if reduction is None else reduction.codes, at)
        call = self._calls.get(key)
        if call is None:
            entry_key = (algorithm.run, reduction is not None, at)
            if entry_key not in self._entries:
                self._entries[entry_key] = _entry(*entry_key)
            if self._compiling_only:  # (not kept: the second pass makes the real call)
                mine = list(self._entries).index(entry_key) % int(
                    self.config[WORLD_SIZE]) == self.config[RANK]
                return _CompileOnly(self, self._entries[entry_key], reduction, mine)
            call = self._calls[key] = CompiledCall(self, self._entries[entry_key], reduction)
        return call


class CompiledCall:
    """One algorithm's compiled call, with a config of its own (the reduction's codes written
    once): ``call(tag, timeout_ms, operands)`` runs one collective and returns its status; the
    operands are :meth:`operands` of the algorithm's arguments, which a plan makes once."""
    def __init__(self, plane: CompiledPlane, entry: Callable[..., None], reduction: Reduction | None) -> None:
        self.region, self.config, self.ledger, self._entry = plane.region, plane.config.copy(
        ), plane.ledger, entry
        self._reduces = reduction is not None
        if reduction is not None:
            self.config[[OP, FAMILY, KIND, DIVIDES]] = reduction.codes
        # The fingerprint's 32 bytes, written in place at each call.
        self._tag = _tag_view(self.config)

    def operands(self, args: tuple) -> tuple:
        """``args`` as the compiled call takes them: buffers as bytes, bounds in bytes (the
        reduction's kind says what the bytes hold: one compilation serves every dtype), the
        reduction left out (its codes are in the config)."""
        if self._reduces:
            args = (args[0], *args[2:])
        # Bounds are scaled by the buffers' itemsize; a lone operand (a buffer) has none to scale.
        itemsize = next((a.itemsize for a in args if isinstance(a, np.ndarray)), 1) if len(args) > 1 else 1
        return tuple([a.view(np.uint8) if isinstance(a, np.ndarray) else _bounds(a, itemsize) for a in args])

    def __call__(self, tag: bytes, timeout_ms: float, operands: tuple) -> int:
        """Run one collective with ``tag`` (32 bytes) on every message; its status."""
        self.prepare(tag, timeout_ms)
        return self.run(operands)

    def prepare(self, tag: bytes, timeout_ms: float) -> None:
        """Write ``tag`` and the deadline into the config (what a call reads besides its operands)."""
        self._tag[:] = tag
        self.config[DEADLINE_NS] = deadline_ns(timeout_ms)

    def run(self, operands: tuple) -> int:
        """Run one collective with the tag and deadline the config holds; its status."""
        return self._entry(self.region, self.config, self.ledger, *operands)

    def keeping_books(self, record: int) -> Callable[..., int]:
        """From now on each run numbers its collective itself (the ledger's next number, written
        into the tag) and, where it succeeds, adds its counts to the ledger and notes ``record``
        with its number in the ledger's ring; the compiled entry, which a caller may call
        directly as ``entry(region, config, ledger, *operands)`` (it returns the status)."""
        self.config[BOOKS], self.config[RECORD] = 1, record
        return self._entry

    def tag(self) -> bytes:
        """The 32-byte tag the config holds."""
        return self._tag.tobytes()

    def copy(self) -> CompiledCall:
        """This call with a config of its own (a plan's: its tag written once, then only numbered)."""
        twin = copy.copy(self)
        twin.config = self.config.copy()
        twin._tag = _tag_view(twin.config)
        return twin

    def counts(self) -> list[int]:
        """The last call's bytes sent, bytes received, messages sent, messages received."""
        return self.config[BYTES_SENT:MESSAGES_RECEIVED + 1].tolist()

    def report(self) -> Report:
        """How the last call went."""
        config = self.config
        return Report(int(config[STATUS]), int(config[FAILED_PEER]),
                      config[PEER_FINGERPRINT:PEER_FINGERPRINT + 4].tobytes(), *self.counts())


class _CompileOnly(CompiledCall):
    """:func:`lab.warmup.compile_all`'s first pass: compile the entry for these operands if it is
    this rank's share (``mine``), run nothing, report success."""
    def __init__(self, plane: CompiledPlane, entry: Callable[..., None], reduction: Reduction | None,
                 mine: bool) -> None:
        super().__init__(plane, entry, reduction)
        self._mine = mine

    def run(self, operands: tuple) -> int:
        if self._mine:  # the arguments as a call passes them: the fixed ones, then *rest as one tuple
            args = (self.region, self.config, self.ledger, *operands)
            fixed = self._entry.py_func.__code__.co_argcount
            self._entry.compile(tuple(numba.typeof(a) for a in (*args[:fixed], args[fixed:])))
        return doorbell.OK

    def keeping_books(self, record: int) -> Callable[..., int]:
        """An "entry" that compiles (this rank's share) and runs nothing, as :meth:`run`."""
        return lambda region, config, ledger, *operands: self.run(operands)


def _tag_view(config: np.ndarray) -> memoryview:
    """The config's fingerprint words as 32 writable bytes."""
    return memoryview(config).cast("B")[FINGERPRINT * 8:FINGERPRINT * 8 + 32]


def _bounds(arg: Any, itemsize: int) -> Any:
    """A list of (start, stop) element bounds as an int64 array, in units of ``itemsize`` bytes;
    anything else as it is."""
    return np.asarray(arg, np.int64) * itemsize if isinstance(arg, list) else arg


def deadline_ns(timeout_ms: float) -> int:
    """``timeout_ms`` as a compiled wait's deadline in nanoseconds: 0 (none) for ``math.inf`` and
    for what int64 nanoseconds cannot hold, at least 1 for any other (a deadline of under a
    nanosecond is the shortest one, not none)."""
    nanoseconds = timeout_ms * 1e6
    return 0 if nanoseconds >= MAX_DEADLINE_NS else max(1, int(nanoseconds))


def waiting_policy_from_env(local_ranks: int = 1) -> tuple[int, int]:
    """``LAB_COMPILED_SPIN`` and ``LAB_COMPILED_YIELD``: how many pause-spins a compiled wait makes
    before it yields, and how many ``sched_yield`` calls before it sleeps on its futex. Where
    unset: :data:`DEFAULT_SPIN_LIMIT` spins, or :data:`OVERSUBSCRIBED_SPIN_LIMIT` where the
    ``local_ranks`` sharing the mailboxes outnumber the cores this process may run on, and
    :data:`DEFAULT_YIELD_LIMIT` yields."""
    cores = len(os.sched_getaffinity(0))
    spins = DEFAULT_SPIN_LIMIT if local_ranks <= cores else OVERSUBSCRIBED_SPIN_LIMIT
    return (checks.env_int("LAB_COMPILED_SPIN", spins, high=MAX_WAIT_COUNT),
            checks.env_int("LAB_COMPILED_YIELD", DEFAULT_YIELD_LIMIT, high=MAX_WAIT_COUNT))


def max_bytes_from_env() -> int:
    """``LAB_COMPILED_MAX_BYTES``: the largest tensor the compiled path takes (0: none)."""
    return checks.env_int("LAB_COMPILED_MAX_BYTES", DEFAULT_MAX_BYTES, high=MAX_COMPILED_BYTES)


@njit(inline="always")
def _open(region, config):
    """The mailboxes as ``kernels.mailbox.MailboxPeers``, for one collective, once it looked back
    for a message an earlier collective left unread (``kernels.rings.look_back``)."""
    n = config[WORLD_SIZE]
    peers = mb.open_mailbox(region, config[RANK], n, config[SLOT_BYTES], config[DEPTH],
                            config[LIVENESS:LIVENESS + n].astype(np.int32))
    peers.begin(config[FINGERPRINT:FINGERPRINT + 4].view(np.uint8), config[DEADLINE_NS])
    peers.spin_limit, peers.yield_limit, peers.hook = config[SPIN_LIMIT], config[YIELD_LIMIT], config[HOOK]
    if config[SCRATCH_SLOT_BYTES] > 0:
        peers.scratch, peers.scratch_slot_bytes = region[config[SCRATCH]:], config[SCRATCH_SLOT_BYTES]
    rings.look_back(peers)
    return peers


@njit(inline="always")
def _close(peers, config):
    """What the call reports (see :class:`Report`)."""
    config[STATUS], config[FAILED_PEER], config[
        PEER_BYTES] = peers.status, peers.failed_peer, peers.peer_bytes
    config[BYTES_SENT], config[BYTES_RECEIVED] = peers.bytes_sent.sum(), peers.bytes_received.sum()
    config[MESSAGES_SENT], config[MESSAGES_RECEIVED] = peers.messages_sent.sum(), peers.messages_received.sum(
    )
    config[PEER_FINGERPRINT:PEER_FINGERPRINT + 4] = peers.peer_fingerprint.view(np.int64)


@njit(inline="always")
def _number(config, ledger):
    """A call that keeps its own books takes the mesh's next collective number."""
    if config[BOOKS] != 0:
        ledger[SEQ] += 1
        config[_SEQ_WORD] = ledger[SEQ]


@njit(inline="always")
def _book(config, ledger):
    """A call that keeps its own books and succeeded: its counts and its flight record."""
    if config[BOOKS] != 0 and config[STATUS] == doorbell.OK:
        for word in range(4):
            ledger[BOOKED + word] += config[BYTES_SENT + word]
        ledger[BOOKED + 4] += 1
        slot = RING + 2 * (ledger[SEQ] % FLIGHT_RECORDER_SIZE)
        ledger[slot], ledger[slot + 1] = ledger[SEQ], config[RECORD]


@njit(inline="always")
def _begin(region, config, ledger):
    """A call's first steps: its number, then its mailboxes."""
    _number(config, ledger)
    return _open(region, config)


@njit(inline="always")
def _end(peers, config, ledger):
    """A call's last steps: its report and books; its status."""
    _close(peers, config)
    _book(config, ledger)
    return config[STATUS]


@njit(inline="always")
def _reduction(config):
    return coded_reduction(config[OP], config[FAMILY], config[KIND], config[DIVIDES] != 0)


def _entry(run: Compilable, reduces: bool, at: bool) -> Callable[..., int]:
    """The compiled call of ``run``, which returns its status: the mailboxes and (where the
    algorithm reduces, as its second argument) the reduction are built inside it, so only arrays
    and integers cross from Python (any other Python object costs microseconds to type at every
    call). ``at``: its first buffer comes as two integers, address and bytes (a plain call's
    lane, :class:`lab.collectives.prepared.Lane`). Cached on disk: Numba keys a closure's cache
    on its variables' pickled bytes, and a ``Compilable`` pickles by name."""
    if reduces and at:

        def entry(region, config, ledger, address, nbytes, *rest):
            peers = _begin(region, config, ledger)
            run(peers, libc.bytes_at(address, nbytes), _reduction(config), *rest)
            return _end(peers, config, ledger)
    elif reduces:

        def entry(region, config, ledger, buf, *rest):
            peers = _begin(region, config, ledger)
            run(peers, buf, _reduction(config), *rest)
            return _end(peers, config, ledger)
    elif at:

        def entry(region, config, ledger, address, nbytes, *rest):
            peers = _begin(region, config, ledger)
            run(peers, libc.bytes_at(address, nbytes), *rest)
            return _end(peers, config, ledger)
    else:

        def entry(region, config, ledger, *args):
            peers = _begin(region, config, ledger)
            run(peers, *args)
            return _end(peers, config, ledger)

    return njit(nogil=True, cache=True)(entry)
