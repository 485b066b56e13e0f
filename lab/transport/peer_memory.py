"""The shm transport's shared scratch: a two-shot allreduce that reads its peers' memory in place,
and registered buffers (``lab.empty``) that skip the copy in.

One more memfd per shm mesh, mapped by every rank (sparse: a page costs memory once touched)::

    control   per rank: FILLED, REDUCED, DONE counters, a header, a doorbell (kernels.two_shot)
    slots     per rank: slot_bytes (LAB_SHM_SCRATCH_BYTES, default 4 MiB) for its input
    arenas    per rank: arena_bytes (LAB_SHM_REGISTERED_BYTES, default 256 MiB) for lab.empty tensors

Two-shot, round by round (a round is up to ``slot_bytes`` of the tensor; a larger one takes
several), on rank r of N: wait until every rank has finished the last round (slot r is free),
copy the round's input into slot r (unless the tensor lives in r's arena: then its address is
published instead), publish FILLED; wait for every rank's FILLED and compare their fingerprints;
reduce slice r of the round (``numpy.array_split`` bounds) from the N inputs, block by block in
rank order 0..N-1, into the caller's buffer and back into the published source; publish REDUCED;
copy every other slice from its owner's source as soon as that owner's REDUCED moves; publish
DONE. Memory traffic per rank: T in, T read while reducing (N slices of T/N), T out: about 4T of
loads and stores where a ring makes about 2(N-1)/N·T of copies and 2(N-1)/N·T of reductions,
each reading one more buffer. A registered tensor skips the copy in; its rank waits at the end
until every peer has copied its slice out, since the caller may write the tensor next.

One-shot (:meth:`SharedScratch.one_shot`) takes the same rounds, slots, headers and counters with
one wait each: publish the input, wait for every rank's FILLED, fold all N inputs in rank order
into the caller's buffer, publish DONE. ``lab.symm_mem``'s buffers lie in the arenas too.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np

from kernels import two_shot as flags
from kernels.doorbell import DEFAULT_SPIN_LIMIT, DEFAULT_YIELD_LIMIT, PEER_LOST, SILENCE
from lab import checks
from lab.chunking import split_bounds
from lab.compiled.plane import deadline_ns as compiled_deadline_ns
from lab.errors import CollectiveMismatchError, LabError, PeerLostError
from lab.ops import Reduction
from lab.transport.base import TagMismatch, silence_error

DEFAULT_SLOT_BYTES = 4 * 1024 * 1024
DEFAULT_ARENA_BYTES = 256 * 1024 * 1024
#: The reduction's block: the accumulator stays in the core's cache while N inputs stream past it.
BLOCK_BYTES = 256 * 1024
ALIGN = 64  # registered tensors start on a cache line


def slot_bytes_from_env() -> int:
    """``LAB_SHM_SCRATCH_BYTES``: each rank's two-shot slot (a multiple of 4,096; tests force rounds)."""
    return _bytes_from_env("LAB_SHM_SCRATCH_BYTES", DEFAULT_SLOT_BYTES)


def arena_bytes_from_env() -> int:
    """``LAB_SHM_REGISTERED_BYTES``: the most ``lab.empty`` tensors of one rank hold (a multiple of 4,096)."""
    return _bytes_from_env("LAB_SHM_REGISTERED_BYTES", DEFAULT_ARENA_BYTES)


def _bytes_from_env(name: str, default: int) -> int:
    """At most this machine's memory: the region is sparse, but a size beyond what can be mapped
    would fail later as a bare ENOMEM."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return checks.env_int(name, default, low=4096, high=memory // 4096 * 4096, multiple=4096)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)


def unmap(mapping: mmap.mmap, file: tuple[int, int], keep: list[tuple[int, int]] = ()) -> None:
    """Let go of a shared mapping now, whoever still holds views of it: ``mapping.close()``, or,
    while numpy views of it live (a plan, a lane, a traceback), its pages replaced in place by
    private anonymous memory (``MAP_FIXED``) and its descriptor by /dev/null, so the memfd and
    its resident pages go at once and a view still used reads plain memory instead of faulting. ``keep``: ``(offset, bytes)``
    ranges whose contents stay (the registered tensors that outlive the mesh); ``file``: the
    memfd's ``(st_dev, st_ino)``."""
    try:
        mapping.close()
        return
    except BufferError:
        pass
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    kept = [(offset, bytes(mapping[offset:offset + nbytes])) for offset, nbytes in keep]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
    placed = _libc.mmap(address, len(mapping), mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if placed != address:
        raise OSError(ctypes.get_errno(),
                      f"replacing a closed mesh's shared mapping: {os.strerror(ctypes.get_errno())}")
    for offset, data in kept:
        ctypes.memmove(address + offset, data, len(data))
    # The mmap object holds its own duplicate of the memfd until the views go: point that
    # descriptor at /dev/null (the object still closes it, once), so the memfd goes now.
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for fd in map(int, os.listdir("/proc/self/fd")):
            with contextlib.suppress(OSError):  # (the listing's own descriptor, gone by now)
                if fd != null and (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == file:
                    os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def region_bytes(world_size: int, slot_bytes: int, arena_bytes: int) -> int:
    """The scratch memfd's size for ``world_size`` ranks."""
    return flags.control_bytes(world_size) + world_size * (slot_bytes + arena_bytes)


@dataclass
class Moved:
    """What one two-shot allreduce counts in ``mesh.stats()``: what the same schedule over messages
    sends and receives (``allreduce_two_shot``'s other form, the one ``lab.sim`` records), so the
    counters agree with the simulator and with the other transports. Through shared memory a rank
    reads the same bytes it would receive: (N-1) copies of its slice and every other slice."""

    bytes_received: int
    bytes_sent: int
    messages: int


def schedule_counts(count: int, itemsize: int, rank: int, world_size: int) -> Moved:
    """:class:`Moved` for ``count`` elements: N-1 copies of slice r in and every other slice out,
    then a ring allgather (every slice in but r's, every slice out but r+1's)."""
    bounds = split_bounds(count, world_size)
    mine = bounds[rank][1] - bounds[rank][0]
    after = bounds[(rank + 1) % world_size][1] - bounds[(rank + 1) % world_size][0]
    return Moved(((world_size - 1) * mine + count - mine) * itemsize, (2 * count - mine - after) * itemsize,
                 2 * (world_size - 1))


class SharedScratch:
    """One rank's view of the scratch region (see the module docstring)."""
    def __init__(self, region: np.ndarray, rank: int, world_size: int, slot_bytes: int, arena_bytes: int,
                 liveness_fds: np.ndarray) -> None:
        self.region, self.rank, self.world_size = region, rank, world_size
        self.slot_bytes, self.arena_bytes = slot_bytes, arena_bytes
        self.liveness_fds = liveness_fds
        self._words = region.view(np.int64)
        self._address = region.ctypes.data  # (asking numpy each time costs a µs)
        self._slots = flags.control_bytes(world_size)
        self._arenas = self._slots + world_size * slot_bytes
        self._mine = self._arenas + rank * arena_bytes  # this rank's arena, in region offsets
        self._free = [(0, arena_bytes)]  # (offset in the arena, bytes): first fit
        self._block = np.empty(BLOCK_BYTES, np.uint8)
        #: What a long wait calls to drain the pipes and let signal handlers run (kernels.hook.call_hook; 0: none).
        self.hook = 0
        self.closed = False

    @property
    def rounds(self) -> int:
        """The rounds this rank has completed (every rank agrees): its DONE counter, which the
        compiled one-shot (:mod:`kernels.one_shot`) moves too."""
        return flags.counter(self.region, self.rank, flags.DONE)

    # -- registered buffers --------------------------------------------------------------------

    def allocate(self, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` (64-byte aligned) in this rank's arena, as a 1-D array;
        they go back to the arena when that array object is gone (hand it to ``torch.from_numpy``,
        whose tensors and views hold it: a numpy view of it would not). ``LabError`` when full."""
        nbytes = count * np.dtype(dtype).itemsize
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                self._free[i] = (offset + size, free - size)
                start = self._mine + offset
                array = self.region[start:start + nbytes].view(dtype)
                weakref.finalize(array, self._release, offset, size)
                return array
        used = self.arena_bytes - sum(free for _, free in self._free)
        raise LabError(
            f"rank {self.rank}: lab.empty cannot place {nbytes} bytes: {used} of this rank's "
            f"{self.arena_bytes} registered bytes are in use (LAB_SHM_REGISTERED_BYTES sets the size)")

    def in_use(self) -> list[tuple[int, int]]:
        """This rank's registered blocks still handed out, as ``(offset in the region, bytes)``."""
        used, at = [], 0
        for offset, size in sorted(self._free):
            if offset > at:
                used.append((self._mine + at, offset - at))
            at = offset + size
        if at < self.arena_bytes:
            used.append((self._mine + at, self.arena_bytes - at))
        return used

    def _release(self, offset: int, size: int) -> None:
        # Merge the freed range with its neighbours so the arena does not fragment.
        spans = sorted([*self._free, (offset, size)])
        merged = [spans[0]]
        for start, length in spans[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self._free = [span for span in merged if span[1]]

    def registered_offset(self, buf: np.ndarray) -> int:
        """Where ``buf`` starts in the region if it lies in this rank's arena, else -1."""
        return self.registered_at(buf.ctypes.data, buf.nbytes)

    def registered_at(self, address: int, nbytes: int) -> int:
        """Where the ``nbytes`` at ``address`` start in the region if they lie in this rank's
        arena, else -1 (none for a closed mesh, nor for no bytes)."""
        if self.closed or nbytes == 0:
            return -1
        start = address - self._address - self._mine
        return self._mine + start if 0 <= start and start + nbytes <= self.arena_bytes else -1

    # -- the two-shot allreduce ----------------------------------------------------------------

    def allreduce(self, buf: np.ndarray, reduction: Reduction, tag: bytes, timeout_s: float, where: object,
                  one_shot: bool = False, source: np.ndarray | None = None) -> Moved:
        """Reduce ``buf`` (flat, contiguous) in place with every rank's, round by round (see the
        module docstring); every rank calls it with the same ``tag`` and size. Raises
        TagMismatch, CollectiveMismatchError, DeadlineError or PeerLostError naming the peer.
        ``one_shot``: :meth:`one_shot` instead, from ``source``."""
        if one_shot:
            return self.one_shot(buf, reduction, tag, timeout_s, where, source)
        n, itemsize = self.world_size, buf.itemsize
        deadline_ns = compiled_deadline_ns(timeout_s * 1000)
        fingerprint = np.frombuffer(tag[:32].ljust(32, b"\0"), np.int64)
        self._fingerprint = fingerprint.view(np.uint8)  # what a wait hands its hook
        registered = self.registered_offset(buf)
        data = buf.view(np.uint8)
        per_round = max(1, self.slot_bytes // itemsize)
        for lo in range(0, max(buf.size, 1),
                        per_round):  # an empty tensor: one empty round (fingerprints still meet)
            hi = min(buf.size, lo + per_round)
            goal = self.rounds + 1
            # Steps 1-3: our slot free, our input published, every rank's input in the same collective.
            sources = self._meet(data, registered, lo, hi, itemsize, tag, fingerprint, buf.nbytes, goal,
                                 deadline_ns, where)
            # Step 4: reduce our slice from the N inputs, in rank order, into buf and our source.
            bounds = split_bounds(hi - lo, n)
            start, stop = bounds[self.rank]
            self._reduce(buf, lo, start, stop, sources, registered < 0, reduction)
            flags.publish(self.region, self.rank, n, flags.REDUCED, goal)
            # Step 5: copy every other slice out of its owner's source once it is reduced.
            for step in range(1, n):
                owner = (self.rank + step) % n
                self._wait_one(owner, flags.REDUCED, goal, deadline_ns, where)
                first, last = bounds[owner]
                at = sources[owner] + first * itemsize
                data[(lo + first) * itemsize:(lo + last) * itemsize] = self.region[at:at +
                                                                                   (last - first) * itemsize]
            flags.publish(self.region, self.rank, n, flags.DONE, goal)
        if registered >= 0:
            # The caller may write its tensor as soon as we return: wait until no peer reads it.
            self._wait_all(flags.DONE, self.rounds, deadline_ns, where)
        return schedule_counts(buf.size, itemsize, self.rank, n)

    def _meet(self, data: np.ndarray, registered: int, lo: int, hi: int, itemsize: int, tag: bytes,
              fingerprint: np.ndarray, nbytes: int, goal: int, deadline_ns: int, where: object) -> list[int]:
        """One round's meeting, shared by two-shot and one-shot: wait until our slot is free (every
        rank done with the last round), publish elements ``lo:hi`` of our input (``data``'s bytes,
        copied into our slot, or where they lie in our arena at ``registered``), then wait for every
        rank's and check that it is in the same collective; every rank's input offset."""
        self._wait_all(flags.DONE, goal - 1, deadline_ns, where)
        if registered >= 0:
            at = registered + lo * itemsize
        else:
            at = self._slots + self.rank * self.slot_bytes
            self.region[at:at + (hi - lo) * itemsize] = data[lo * itemsize:hi * itemsize]
        self._write_header(fingerprint, nbytes, at, (hi - lo) * itemsize)
        flags.publish(self.region, self.rank, self.world_size, flags.FILLED, goal)
        self._wait_all(flags.FILLED, goal, deadline_ns, where)
        return self._check_headers(tag, fingerprint, nbytes, (hi - lo) * itemsize, where)

    def one_shot(self, buf: np.ndarray, reduction: Reduction, tag: bytes, timeout_s: float, where: object,
                 source: np.ndarray | None = None) -> Moved:
        """``buf`` = every rank's ``source`` (default ``buf``: in place) reduced in rank order
        0..N-1, each rank reducing the whole tensor itself from the N inputs: one flag wait per
        round (``slot_bytes`` of the tensor) where two-shot has three. The rounds, slots, headers
        and counters are two-shot's (:meth:`allreduce`; the two interleave on one mesh): wait until
        our slot is free, publish our input (copied into the slot, or, out of place, where it lies
        in our arena), publish FILLED, wait for every rank's and compare headers, reduce, publish
        DONE. A registered ``source`` is read in place, so its rank waits at the end until every
        peer is done with it; in place, the input is always copied (``buf`` is written while the
        peers read). Raises as :meth:`allreduce` does."""
        source = buf if source is None else source
        n, itemsize = self.world_size, buf.itemsize
        deadline_ns = compiled_deadline_ns(timeout_s * 1000)
        fingerprint = np.frombuffer(tag[:32].ljust(32, b"\0"), np.int64)
        self._fingerprint = fingerprint.view(np.uint8)
        registered = -1 if source is buf else self.registered_offset(source)
        data = source.view(np.uint8)
        per_round = max(1, self.slot_bytes // itemsize)
        for lo in range(0, max(buf.size, 1),
                        per_round):  # an empty tensor: one empty round (fingerprints still meet)
            hi = min(buf.size, lo + per_round)
            goal = self.rounds + 1
            # Steps 1-3 (two-shot's): the one synchronisation, every rank's input in the same collective.
            sources = self._meet(data, registered, lo, hi, itemsize, tag, fingerprint, buf.nbytes, goal,
                                 deadline_ns, where)
            # Step 4: reduce the whole round from the N inputs, in rank order, into buf.
            self._reduce(buf, lo, 0, hi - lo, sources, False, reduction)
            flags.publish(self.region, self.rank, n, flags.DONE, goal)
        if registered >= 0:
            # The caller may write its input as soon as we return: wait until no peer reads it.
            self._wait_all(flags.DONE, self.rounds, deadline_ns, where)
        moved = (n - 1) * buf.nbytes
        return Moved(moved, moved, n - 1)

    def _write_header(self, fingerprint: np.ndarray, message_bytes: int, source: int,
                      round_bytes: int) -> None:
        header = (self.rank * flags.AREA_BYTES + flags.HEADER) // 8
        self._words[header:header + 4] = fingerprint
        self._words[header + flags.MESSAGE_WORD] = message_bytes
        self._words[header + flags.SOURCE_WORD] = source
        self._words[header + flags.ROUND_WORD] = round_bytes

    def _check_headers(self, tag: bytes, fingerprint: np.ndarray, message_bytes: int, round_bytes: int,
                       where: object) -> list[int]:
        """Every rank's source offset for this round, once its header matches ours (else raise)."""
        sources = []
        for peer in range(self.world_size):
            header = (peer * flags.AREA_BYTES + flags.HEADER) // 8
            words = self._words[header:header + 7]
            if not np.array_equal(words[:4], fingerprint):
                raise TagMismatch(peer, tag[:32].ljust(32, b"\0"), words[:4].tobytes())
            if words[flags.MESSAGE_WORD] != message_bytes or words[flags.ROUND_WORD] != round_bytes:
                raise CollectiveMismatchError(
                    f"rank {self.rank} expected {message_bytes} bytes from rank {peer} in {where}, got a "
                    f"two-shot round of {int(words[flags.ROUND_WORD])} of {int(words[flags.MESSAGE_WORD])}")
            sources.append(int(words[flags.SOURCE_WORD]))
        return sources

    def _reduce(self, buf: np.ndarray, lo: int, start: int, stop: int, sources: list[int], copy_back: bool,
                reduction: Reduction) -> None:
        """buf[lo+start:lo+stop] = input 0 ⊕ input 1 ⊕ ... ⊕ input N-1 (finalized), block by block;
        also into our slot (``copy_back``) where peers copy it from."""
        itemsize, dtype = buf.itemsize, buf.dtype
        block = BLOCK_BYTES // itemsize
        accumulator = self._block.view(dtype)
        own = sources[self.rank]
        for first in range(start, stop, block):
            last = min(stop, first + block)
            count, offset, nbytes = last - first, first * itemsize, (last - first) * itemsize
            acc = accumulator[:count]
            acc[:] = self.region[sources[0] + offset:sources[0] + offset + nbytes].view(dtype)
            for peer in range(1, self.world_size):
                reduction.combine(
                    acc, self.region[sources[peer] + offset:sources[peer] + offset + nbytes].view(dtype))
            reduction.finalize(acc, self.world_size)
            buf[lo + first:lo + last] = acc
            if copy_back:
                self.region[own + offset:own + offset + nbytes] = acc.view(np.uint8)

    def _wait_all(self, field: int, target: int, deadline_ns: int, where: object) -> None:
        status, peer = flags.wait_all(self.region, self.rank, self.world_size, field, target, deadline_ns,
                                      self.liveness_fds, self.hook, self._fingerprint, DEFAULT_SPIN_LIMIT,
                                      DEFAULT_YIELD_LIMIT)
        self._raise(status, peer, where)

    def _wait_one(self, peer: int, field: int, target: int, deadline_ns: int, where: object) -> None:
        status = flags.wait_one(self.region, self.rank, peer, field, target, deadline_ns, self.liveness_fds,
                                self.hook, self._fingerprint)
        self._raise(status, peer, where)

    def _raise(self, status: int, peer: int, where: object) -> None:
        if status == SILENCE:
            raise silence_error(self.rank, [peer], where)
        if status == PEER_LOST:
            raise PeerLostError(f"rank {self.rank}: rank {peer} is gone (waiting in {where})")

    def pending_fingerprints(self) -> dict[int, bytes]:
        """For each peer whose input of a round we have not reached is published: its fingerprint
        (a diagnosis after a failure: the peer may be in another collective)."""
        pending = {}
        for peer in range(self.world_size):
            if peer != self.rank and flags.counter(self.region, peer, flags.FILLED) > self.rounds:
                header = (peer * flags.AREA_BYTES + flags.HEADER) // 8
                pending[peer] = self._words[header:header + 4].tobytes()
        return pending
