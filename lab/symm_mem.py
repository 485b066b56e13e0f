"""Symmetric memory in the shape of ``torch.distributed._symmetric_memory``: a buffer every rank
maps, signals between ranks, and a one-shot allreduce that reads the peers' buffers in place.

On the shm transport every rank maps the mesh's scratch (:mod:`lab.transport.peer_memory`), so a
buffer in one rank's arena is memory every other rank can read and write. :func:`empty` places a
tensor there behind a signal pad of its own; :func:`rendezvous` (a collective) tells every rank
where the others' lie and returns a :class:`SymmetricMemory` handle (torch's names: ``rank``,
``world_size``, ``buffer_size``, ``get_buffer``, ``get_signal_pad``, ``put_signal``,
``wait_signal``, ``barrier``); :func:`one_shot_all_reduce` reduces every rank's tensor into a new
one, each rank folding the N inputs in rank order 0..N-1 (bit-identical on every rank).

A signal pad holds, per channel (:data:`CHANNELS`) and per peer, two int64 counters: the signals
that peer put (it alone writes that word) and the ones this rank took (this rank alone writes
it). ``put_signal(dst)`` waits until ``dst`` took our last signal, then counts one more in
``dst``'s pad (a release store, and a wake-up if ``dst`` sleeps); ``wait_signal(src)`` waits
until ``src`` put one more than we took (an acquire load), then takes it. So at most one signal
per (sender, receiver, channel) is outstanding, as torch's 0/1 flags, and what a rank wrote
before ``put_signal`` is visible to the peer after its ``wait_signal``. Every wait keeps the
mesh's deadline (``recv_timeout_ms``: ``DeadlineError`` naming the peer) and watches the peer's
liveness (``PeerLostError``), as every other wait of the lab does.

Where: the shm transport's root mesh, N >= 2, and a single rank (its buffer is private memory).
Elsewhere (queue, tcp, ``transport="auto"``, a sub-mesh) no rank can map another's memory:
:func:`empty` and :func:`rendezvous` are a ``LabError`` saying so, and
:func:`one_shot_all_reduce` runs the one-shot's message form (same bits).

Per rank, N=2::

    buf = lab.symm_mem.empty(mesh, (4,), torch.float32)
    buf.copy_(torch.arange(4.0) + mesh.rank)           # rank 0: [0, 1, 2, 3]   rank 1: [1, 2, 3, 4]
    handle = lab.symm_mem.rendezvous(buf, mesh)
    handle.barrier()                                    # every rank's buffer is written
    handle.get_buffer(1 - mesh.rank, (4,), torch.float32)   # the other rank's buffer
    lab.symm_mem.one_shot_all_reduce(buf, "sum", mesh)  # both: [1, 3, 5, 7] (a new tensor)
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels import two_shot as flags
from kernels.doorbell import PEER_LOST, SILENCE
from lab import checks
from lab.algorithms.registry import ALGORITHMS
from lab.buffers import as_buffer
from lab.collectives.calls import allgather, allreduce
from lab.collectives.prepared import Lane, dense, find_lane, in_order, lane_key, parse_op, remembered
from lab.compiled.plane import deadline_ns as compiled_deadline_ns
from lab.errors import CollectiveMismatchError, LabError, PeerLostError
from lab.fingerprint import Signature
from lab.ops import DTYPES_BY_CODE, check_reduces, dtype_of
from lab.transport.base import silence_error
from lab.transport.peer_memory import ALIGN

if TYPE_CHECKING:
    from lab.comm.mesh import Mesh

#: Signal channels per (sender, receiver) pair, as torch's ``symm_max_nblocks``.
CHANNELS = 32


def pad_bytes(world_size: int) -> int:
    """A signal pad's size: two int64 counters per channel and rank, in whole cache lines."""
    return -(-2 * CHANNELS * world_size * 8 // ALIGN) * ALIGN


@dataclass(frozen=True)
class _Block:
    """Where one :func:`empty` allocation lies: ``region`` (the mesh's scratch, or this rank's own
    memory for one rank), its signal pad's and its data's offsets in it, the data's bytes, and the
    scratch it came from (None: private)."""

    region: np.ndarray
    pad: int
    data: int
    nbytes: int
    scratch: Any


#: The fingerprint a signal's wait hands the hook that drains the pipes meanwhile: no collective's.
_NO_COLLECTIVE = np.zeros(32, np.uint8)
#: Each live :func:`empty` allocation, by the address where its storage starts.
_BLOCKS: dict[int, _Block] = {}


def _scratch(mesh: Mesh, what: str) -> Any:
    """``mesh``'s shared scratch (None for one rank), or a ``LabError`` where no rank can map another's memory."""
    if mesh.closed:
        raise LabError(f"rank {mesh.rank}: {what} on a closed mesh")
    if mesh.world_size == 1:
        return None
    if mesh.exchange.scratch is None or mesh.exchange.position.mesh:  # (a sub-mesh's ranks are not the scratch's)
        raise LabError(
            f"rank {mesh.rank}: {what} needs memory every rank maps: the shm transport's root mesh "
            f"(this one: transport {mesh.transport!r}{', a sub-mesh' if mesh.exchange.scratch is not None else ''}); "
            "lab.symm_mem.one_shot_all_reduce runs everywhere")
    return mesh.exchange.scratch


def empty(mesh: Mesh, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` that every rank of ``mesh`` can map
    once :func:`rendezvous` ran (torch's ``symm_mem.empty``, with the mesh in the device's place).

    It lies in this rank's arena of the mesh's scratch (``LAB_SHM_REGISTERED_BYTES``, as
    :func:`lab.empty`'s tensors; a ``LabError`` when full) behind a zeroed signal pad, and returns
    there when the tensor and its views are gone. Every rank allocates its own: the same shape and
    dtype on every rank, as torch requires (:func:`rendezvous` checks).

    Per rank, N=2::

        buf = lab.symm_mem.empty(mesh, (2, 3), torch.int64)   # each rank: its own (2, 3) buffer
    """
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    for size in shape:
        if not checks.is_int(size) or size < 0:
            raise ValueError(f"shape must be non-negative ints; got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype; got {dtype!r}")
    lab_dtype = dtype_of(torch.empty(0, dtype=dtype), "dtype")
    scratch = _scratch(mesh, "lab.symm_mem.empty")
    pad, nbytes = pad_bytes(mesh.world_size), math.prod(shape) * lab_dtype.storage.itemsize
    if scratch is None:  # one rank: a control area (the waits' doorbell), the pad, the data
        start = flags.control_bytes(1)
        block = np.zeros(-(-(start + pad + nbytes) // ALIGN) * ALIGN, np.uint8)  # (int64 words throughout)
        region = block
    else:
        block = scratch.allocate(pad + nbytes, np.uint8)
        region, start = scratch.region, scratch.registered_offset(block)
        block[:pad] = 0  # (the arena's memory may hold an earlier tensor's)
    _BLOCKS[block.ctypes.data] = _Block(region, start, start + pad, nbytes, scratch)
    weakref.finalize(block, _BLOCKS.pop, block.ctypes.data, None)
    first = pad if scratch is not None else start + pad
    data = torch.from_numpy(block)[first:first + nbytes]  # holds the block: see SharedScratch.allocate
    return data.view(dtype).view(shape)


class SymmetricMemory:
    """What :func:`rendezvous` returns on one rank: every rank's buffer and signal pad, as torch's
    ``_SymmetricMemory`` (``rank``, ``world_size``, ``buffer_size``, ``get_buffer``,
    ``get_signal_pad``, ``put_signal``, ``wait_signal``, ``barrier``). Signals are not
    collectives: they keep no issue order with the mesh's collectives."""
    def __init__(self, mesh: Mesh, block: _Block, data: list[int], pads: list[int], buffer_size: int) -> None:
        self._mesh, self._region, self._data, self._pads = mesh, block.region, data, pads
        self.rank, self.world_size, self.buffer_size = mesh.rank, mesh.world_size, buffer_size
        self._words = block.region.view(np.int64)
        scratch = block.scratch
        self._liveness = scratch.liveness_fds if scratch is not None else np.full(1, -1, np.int64)
        self._scratch = scratch

    def get_buffer(self, rank: int, sizes: Any, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        """A tensor of ``sizes`` and ``dtype`` over rank ``rank``'s buffer from element
        ``storage_offset``: this rank's own memory for its own rank, the peer's memory (read and
        written in place) for another."""
        rank = self._check_rank(rank, "rank")
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list, torch.Size)) else (sizes,)
        if not all(checks.is_int(s) and s >= 0 for s in sizes):
            raise ValueError(f"sizes must be non-negative ints; got {sizes!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype; got {dtype!r}")
        lab_dtype = dtype_of(torch.empty(0, dtype=dtype), "dtype")
        itemsize = lab_dtype.storage.itemsize
        if not checks.is_int(storage_offset) or storage_offset < 0:
            raise ValueError(f"storage_offset must be a non-negative int; got {storage_offset!r}")
        start, nbytes = storage_offset * itemsize, math.prod(sizes) * itemsize
        if start + nbytes > self.buffer_size:
            raise ValueError(
                f"sizes {sizes} of {dtype} from storage_offset {storage_offset} need {start + nbytes} "
                f"bytes; each rank's buffer has {self.buffer_size}")
        self._check_open("get_buffer")
        at = self._data[rank] + start
        return torch.from_numpy(self._region[at:at + nbytes]).view(dtype).view(sizes)

    def get_signal_pad(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s signal pad as an int64 tensor of shape (2, CHANNELS, world_size):
        ``[0, c, p]`` the signals rank p put on channel c, ``[1, c, p]`` those ``rank`` took."""
        rank = self._check_rank(rank, "rank")
        self._check_open("get_signal_pad")
        at = self._pads[rank]
        return torch.from_numpy(self._region[at:at + 2 * CHANNELS * self.world_size * 8].view(np.int64)) \
            .view(2, CHANNELS, self.world_size)

    def put_signal(self, dst_rank: int, channel: int = 0, timeout_ms: float = 0) -> None:
        """Signal rank ``dst_rank`` on ``channel``, once it took our last signal there; what this
        rank wrote before is visible to ``dst_rank`` after its :meth:`wait_signal`.
        ``timeout_ms`` 0: the mesh's ``recv_timeout_ms``."""
        dst = self._check_rank(dst_rank, "dst_rank")
        put, took = self._counters(dst, self.rank, channel)
        sent = int(self._words[put >> 3])  # (we alone write it)
        self._wait(dst, took, sent, timeout_ms, f"put_signal to rank {dst} on channel {channel}")
        flags.store_word(self._region, dst, put, sent + 1)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout_ms: float = 0) -> None:
        """Wait for rank ``src_rank``'s next signal on ``channel`` and take it.
        ``timeout_ms`` 0: the mesh's ``recv_timeout_ms``."""
        src = self._check_rank(src_rank, "src_rank")
        put, took = self._counters(self.rank, src, channel)
        taken = int(self._words[took >> 3])  # (we alone write it)
        self._wait(src, put, taken + 1, timeout_ms, f"wait_signal from rank {src} on channel {channel}")
        flags.store_word(self._region, src, took, taken + 1)

    def barrier(self, channel: int = 0, timeout_ms: float = 0) -> None:
        """Signal every other rank on ``channel``, then wait for each one's signal there."""
        for step in range(1, self.world_size):
            self.put_signal((self.rank + step) % self.world_size, channel, timeout_ms)
        for step in range(1, self.world_size):
            self.wait_signal((self.rank - step) % self.world_size, channel, timeout_ms)

    def _counters(self, owner: int, sender: int, channel: Any) -> tuple[int, int]:
        """The byte offsets of (signals ``sender`` put, signals ``owner`` took) in ``owner``'s pad."""
        if not checks.is_int(channel) or not 0 <= channel < CHANNELS:
            raise ValueError(f"channel must be an int in [0, {CHANNELS}); got {channel!r}")
        word = channel * self.world_size + sender
        return self._pads[owner] + 8 * word, self._pads[owner] + 8 * (CHANNELS * self.world_size + word)

    def _wait(self, peer: int, offset: int, target: int, timeout_ms: Any, where: str) -> None:
        if not isinstance(timeout_ms, (int, float)) or isinstance(timeout_ms, bool) or not timeout_ms >= 0:
            raise ValueError(f"timeout_ms must be a non-negative number (0: the mesh's recv_timeout_ms); "
                             f"got {timeout_ms!r}")
        self._check_open(where)
        deadline_ns = compiled_deadline_ns(timeout_ms or self._mesh.recv_timeout_ms)
        hook = self._scratch.hook if self._scratch is not None else 0  # (it drains the pipes; no collective's)
        status = flags.wait_word(self._region, self.rank, peer, offset, target, deadline_ns, self._liveness,
                                 hook, _NO_COLLECTIVE)
        if status == SILENCE:
            raise silence_error(self.rank, [peer], where)
        if status == PEER_LOST:
            raise PeerLostError(f"rank {self.rank}: rank {peer} is gone (waiting in {where})")

    def _check_rank(self, rank: Any, name: str) -> int:
        if not checks.is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"{name} must be a rank in [0, {self.world_size}); got {rank!r}")
        return int(rank)

    def _check_open(self, what: str) -> None:
        if self._mesh.closed:
            raise LabError(f"rank {self.rank}: {what} on a closed mesh")


def rendezvous(tensor: torch.Tensor, mesh: Mesh) -> SymmetricMemory:
    """Every rank's :func:`empty` buffer, mapped (a collective: every rank calls it, in the same
    order as its other collectives, with the same shape and dtype). Returns this rank's
    :class:`SymmetricMemory`. A tensor :func:`empty` did not make is a ``ValueError``; ranks whose
    tensors differ in shape or dtype get ``CollectiveMismatchError`` naming the rank.

    Per rank, N=2::

        handle = lab.symm_mem.rendezvous(buf, mesh)   # handle.rank == mesh.rank, handle.world_size == 2
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"tensor must be a torch.Tensor made by lab.symm_mem.empty; got {type(tensor).__name__}")
    block = _BLOCKS.get(tensor.untyped_storage().data_ptr())
    if block is None:
        raise ValueError(
            "tensor must be made by lab.symm_mem.empty (its buffer lies behind a signal pad every rank maps)")
    scratch = _scratch(mesh, "lab.symm_mem.rendezvous")
    if block.scratch is not scratch:
        raise ValueError("tensor was made by lab.symm_mem.empty on another mesh")
    lab_dtype = dtype_of(tensor)
    # Every rank's (data, pad, bytes, dtype, shape): one allgather, so mismatches surface everywhere.
    mine = torch.tensor([
        block.data, block.pad, block.nbytes, lab_dtype.code,
        tensor.dim(), *tensor.shape[:8], *[0] * (8 - min(tensor.dim(), 8)),
        hash(tuple(tensor.shape))], dtype=torch.int64)
    everyone = allgather(mesh, mine).view(mesh.world_size, -1)
    for peer in range(mesh.world_size):
        if not torch.equal(everyone[peer, 2:], mine[2:]):
            dim = int(everyone[peer, 4])
            theirs = tuple(everyone[peer, 5:5 + min(dim, 8)].tolist())
            raise CollectiveMismatchError(
                f"rank {mesh.rank} called lab.symm_mem.rendezvous with a {tuple(tensor.shape)} "
                f"{lab_dtype.name} tensor; rank {peer} with a {theirs} {DTYPES_BY_CODE[int(everyone[peer, 3])].name} one"
            )
    return SymmetricMemory(mesh, block, everyone[:, 0].tolist(), everyone[:, 1].tolist(), block.nbytes)


def one_shot_all_reduce(tensor: torch.Tensor, reduce_op: Any, mesh: Mesh) -> torch.Tensor:
    """Every rank's ``tensor`` reduced with ``reduce_op`` into a new tensor, each rank reading every
    peer's input and folding all N in rank order 0..N-1 (torch's ``one_shot_all_reduce``, with the
    mesh in the group's place). :func:`one_shot_all_reduce_out` says where it reads from.

    Per rank, N=2::

        x = lab.symm_mem.empty(mesh, (2,), torch.float32)
        x.copy_(torch.tensor([1.0, 2.0]) + mesh.rank)              # rank 0: [1, 2]   rank 1: [2, 3]
        lab.symm_mem.one_shot_all_reduce(x, "sum", mesh)           # both: [3, 5]; x unchanged
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor; got {type(tensor).__name__}")
    return one_shot_all_reduce_out(tensor, reduce_op, mesh, torch.empty(tensor.shape, dtype=tensor.dtype))


def one_shot_all_reduce_out(tensor: torch.Tensor, reduce_op: Any, mesh: Mesh,
                            out: torch.Tensor) -> torch.Tensor:
    """:func:`one_shot_all_reduce` into ``out`` (contiguous, ``tensor``'s shape and dtype; ``out``
    may be ``tensor`` itself: in place); returns ``out``.

    On the shm transport's root mesh the peers read ``tensor`` where it lies when it is in this
    rank's arena (:func:`empty`, :func:`lab.empty`; out of place: this rank then waits at the end
    until every peer has read it), else from a copy in this rank's slot; in place, and for an
    ``avg`` of float16/bfloat16 (which divides each input first), ``out`` is the copy. Elsewhere
    the one-shot's message form. Every rank ends with the same bits either way. Out of place from
    a registered input, a call with the dtypes, shapes and op of an earlier one takes that call's
    compiled run at once, checking only what may have changed (see :func:`_by_lane`).
    """
    if _by_lane(mesh, tensor, reduce_op, out):
        return out
    source, target = _checked_buffers(tensor, out)
    op = parse_op(reduce_op)
    check_reduces(source.dtype, "allreduce")
    kernels = mesh.kernels(op, source.dtype)
    nbytes = target.nbytes
    first, other = out.data_ptr(), tensor.data_ptr() if source.shared else 0
    if source.shared and nbytes and first < other + nbytes and other < first + nbytes and first != other:
        raise ValueError(
            "out overlaps tensor without being it; pass tensor itself (in place) or separate memory")
    if first == other or kernels.prescales or not source.shared:
        if first != other:
            out.copy_(tensor)
        return allreduce(mesh, out, op, algorithm="one_shot")
    signature = Signature("allreduce", "one_shot", source.dtype, source.numel, op.value)
    one_shot = ALGORITHMS["allreduce"]["one_shot"]
    args = (target.flat, kernels, source.flat)
    # As a recording notes it, the allreduce it is (made where the rank does not record too: a lane
    # made now keeps it for later calls, when it may).
    what = mesh.describe("allreduce", source.dtype, source.numel, source.numel, reduce_op=op.value,
                         algorithm="one_shot")
    # Small enough for the compiled plane: one Numba call (kernels.one_shot), made once per
    # signature, taking out by its address; in issue order as a plan's run.
    call = remembered(mesh, (_LANE, signature),
                      lambda: mesh.compiled_call(signature, one_shot, args, at=True))
    if call is not None:
        mesh.issue_queue.run_alone(call, (first, nbytes, *call.operands(args)[1:]), refused=mesh.refused,
                                   what=what)
        scratch = mesh.exchange.scratch
        if scratch is not None and scratch.registered_at(other, nbytes) >= 0:
            remembered(mesh, lane_key(_LANE, out, *_lane_arguments(tensor, reduce_op, out)),
                       lambda: Lane(mesh, call, nbytes, (), what))
        return out

    def run() -> torch.Tensor:
        with mesh.collective(*signature):
            mesh.run(one_shot, target.flat, kernels, source=source.flat)
        return out

    return mesh.issue(run, async_op=False, what=what)


def _checked_buffers(tensor: Any, out: Any) -> tuple[Any, Any]:
    """:func:`one_shot_all_reduce_out`'s ``tensor`` and ``out`` as buffers, or the error naming
    the parameter that is wrong."""
    for name, value in (("tensor", tensor), ("out", out)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    source = as_buffer(tensor, "tensor", writable=False)
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(f"out must have tensor's shape and dtype {tuple(tensor.shape)} {tensor.dtype}; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (the reduction is written into its memory)")
    return source, as_buffer(out, "out")


#: The name :func:`one_shot_all_reduce_out`'s compiled call and lanes are kept under.
_LANE = "symm_mem.one_shot_all_reduce_out"


def _lane_arguments(tensor: torch.Tensor, reduce_op: Any, out: torch.Tensor) -> tuple:
    """What a lane is keyed by besides ``out``'s dtype and size (:func:`lane_key`): the op as given,
    the input's dtype and shape, and ``out``'s shape."""
    return reduce_op, tensor.dtype, tensor.shape, out.shape


def _by_lane(mesh: Mesh, tensor: Any, reduce_op: Any, out: Any) -> bool:
    """Run :func:`one_shot_all_reduce_out` through the lane (:class:`lab.collectives.prepared.Lane`)
    an earlier call with these arguments made, where what the lane does not check holds (both
    tensors' memory their elements in order, ``out`` writable, apart from ``tensor``, which lies
    in this rank's arena): the first call's checks are not repeated, and the lane keeps nothing of
    either tensor (a buffer it held would not return to its arena); the input goes in as a slice
    of the scratch. Returns whether it ran."""
    if not (dense(tensor) and dense(out) and in_order(tensor)):
        return False
    lane = find_lane(mesh, _LANE, out, *_lane_arguments(tensor, reduce_op, out))
    scratch = mesh.exchange.scratch
    if lane is None or scratch is None:
        return False
    first, other, nbytes = out.data_ptr(), tensor.data_ptr(), out.numel() * out.element_size()
    registered = scratch.registered_at(other, nbytes)
    if registered < 0 or (first < other + nbytes and other < first + nbytes):  # (in place, overlaps)
        return False
    lane(out, scratch.region[registered:registered + nbytes])
    return True
