"""What every ``prepare_*`` of :mod:`lab.collectives` makes, and the argument checks they share.

A collective is prepared in the caller (arguments checked, algorithm chosen, before any message)
and run later, in issue order: :class:`Prepared` holds its ``run`` and the :class:`Signature`
every rank must agree on.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lab import checks
from lab.buffers import known_writable
from lab.chunking import split_bounds
from lab.collectives.choice import lab_algo
from lab.comm.operations import Operation
from lab.fingerprint import Signature
from lab.ops import ReduceOp
from lab.ops import parse_op as parse_any_op

if TYPE_CHECKING:
    from lab.comm.planned_run import PlannedRun
    from lab.comm.protocols import CallMesh

_OPS_BY_NAME = {o.value: o for o in ReduceOp}


def parse_op(op: Any) -> ReduceOp:
    """:func:`lab.ops.parse_op`, with the common lower-case names looked up directly."""
    return _OPS_BY_NAME.get(op) or parse_any_op(op) if isinstance(op, str) else parse_any_op(op)


def check_root(mesh: CallMesh, root: Any, name: str) -> int:
    """``root`` as an int if it is a rank of ``mesh``, else a ``ValueError`` naming ``name``."""
    if not checks.is_int(root) or not 0 <= root < mesh.world_size:
        raise ValueError(f"{name} must be a rank in [0, {mesh.world_size}); got {root!r}")
    return int(root)


class Prepared(NamedTuple):
    """A collective whose arguments are checked and whose algorithm is chosen: ``run()`` does its
    communication on the tensor's current contents and returns what the public call returns.
    ``planned()``, where given, makes a leaner ``run`` for a plan (the compiled call looked up
    once), or returns None where there is none. ``what``: the call as a recording notes it (None
    where nothing records: :func:`describe`)."""

    run: Callable[[], Any]
    signature: Signature
    planned: Callable[[], Callable[[], Any] | None] | None = None
    what: Operation | None = None


def recording(mesh: CallMesh) -> bool:
    """Whether ``mesh``'s rank records its calls (:attr:`lab.Mesh.recording`; the simulator's
    recording mesh, which moves nothing, never does)."""
    return mesh.recording


def describe(mesh: CallMesh, op: str, dtype: Any, count: int, out_count: int,
             **rest: Any) -> Operation | None:
    """A call of ``op`` as a recording notes it (:meth:`lab.Mesh.describe`), or None where nothing
    records: an unrecorded call builds nothing."""
    return mesh.describe(op, dtype, count, out_count, **rest) if recording(mesh) else None


def issue(mesh: CallMesh, prepared: Prepared, async_op: bool) -> Any:
    """Run ``prepared`` in ``mesh``'s issue order, now or (``async_op``) on its communication
    thread; noted as ``prepared.what``, with the algorithm it runs, where the rank records."""
    if prepared.what is None:
        return mesh.issue(prepared.run, async_op)
    return mesh.issue(prepared.run, async_op,
                      what=prepared.what._replace(algorithm=prepared.signature.algorithm))


def compiled_run(mesh: CallMesh, signature: Signature, algorithm: Any, args: tuple, after: Callable[[], Any],
                 in_place: bool = True) -> Callable[[], Any] | None:
    """A plan's run of the collective of ``signature``: ``algorithm`` on ``args`` through the
    compiled call made once, then ``after()`` (what the plain run returns); None where it would
    not run compiled, or where the buffers are not the caller's memory (``in_place`` False: a
    non-contiguous tensor, copied at each run)."""
    call = mesh.compiled_call(signature, algorithm, args) if in_place else None
    if call is None:
        return None
    operands = call.operands(args)

    def run() -> Any:
        call(operands)
        return after()

    return run


class Lane:
    """A plain allreduce's, broadcast's, allgather's or reduce_scatter's shortest way, made by its
    first call (a broadcast's once that call went through) and kept with its template: a later
    call with the same arguments on an exact ``torch.Tensor`` of the same dtype and size,
    contiguous and on the CPU, runs the compiled call on the tensor's memory by its address (no
    checks repeated, no buffer wrapped, no numpy view made, nothing of the tensor kept), in issue
    order as a plan's run (:meth:`lab.comm.issue.IssueQueue.run_alone`; ``what``, the call as a
    recording notes it, where the rank records); an allgather's and a reduce_scatter's on a new
    tensor the input is copied into at that turn (:meth:`through`)."""

    __slots__ = ("_nbytes", "_refused", "_rest", "_run", "_run_alone", "_what")

    def __init__(self, mesh: CallMesh, run: PlannedRun, nbytes: int, rest: tuple,
                 what: Operation | None) -> None:
        self._run, self._nbytes, self._rest, self._run_alone = run, nbytes, rest, mesh.issue_queue.run_alone
        self._refused, self._what = mesh.refused, what

    def __call__(self, tensor: torch.Tensor, *operands: Any) -> None:
        """Run on ``tensor``; ``operands``: any the call takes after the lane's own (a symmetric
        one-shot's input, where it lies this time: :mod:`lab.symm_mem`)."""
        self._run_alone(self._run, (tensor.data_ptr(), self._nbytes, *self._rest, *operands),
                        refused=self._refused, what=self._what)

    def through(self, work: torch.Tensor, copy_in: Callable[[], Any]) -> None:
        """Run on ``work`` after ``copy_in()`` fills it, both at the lane's turn in the issue order:
        an input read any sooner could miss the write of a call issued before (by another thread,
        too)."""
        self._run_alone(_in_turn, copy_in, self._run, (work.data_ptr(), self._nbytes, *self._rest),
                        refused=self._refused, what=self._what)


def _in_turn(copy_in: Callable[[], Any], run: PlannedRun, operands: tuple) -> None:
    copy_in()
    run(operands)


def lane_key(collective: str, tensor: torch.Tensor, *arguments: Any) -> tuple:
    """Where the :class:`Lane` of a plain call of ``collective`` on ``tensor`` with ``arguments``
    (as the caller passed them) is kept in ``mesh.templates``. Keyed by their types too: ``True``,
    ``1.0`` and ``1+0j`` hash as ``1`` does, and a call with one of them must meet its checks."""
    if len(arguments) == 2:  # (an op or a root, and an algorithm: the same key 0.17 µs sooner)
        first, second = arguments
        return (collective, tensor.dtype, tensor.numel(), lab_algo(), first, second, type(first),
                type(second))
    return (collective, tensor.dtype, tensor.numel(), lab_algo(), *arguments, *map(type, arguments))


def find_lane(mesh: CallMesh, collective: str, tensor: Any, *arguments: Any,
              writes: bool = True) -> Lane | None:
    """The :class:`Lane` that a plain call of ``collective`` on ``tensor`` with ``arguments`` may
    take, or None (the full path: its first call, a numpy array, a subclass, a view whose memory
    is not its elements in order, memory not yet known writable (:func:`lab.buffers.known_writable`:
    the full path asks), an argument that is wrong or unhashable). ``writes`` False: the lane
    writes another tensor (an allgather's result), so ``tensor`` is only read."""
    if not dense(tensor):
        return None
    try:
        lane = mesh.templates.get(lane_key(collective, tensor, *arguments))
    except TypeError:
        return None
    if lane is None or not in_order(tensor) or (writes and not known_writable(tensor)):
        return None
    return lane


def dense(tensor: Any) -> bool:
    """Whether ``tensor`` is an exact ``torch.Tensor``, strided and not nested (a lane's key can be
    read from it)."""
    return type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_nested


def in_order(tensor: torch.Tensor) -> bool:
    """Whether a dense ``tensor``'s memory is its elements in order, on the CPU (as a lane reads it
    by its address)."""
    return tensor.is_contiguous() and tensor.is_cpu and not tensor.is_conj() and not tensor.is_neg()


def make_lane(mesh: CallMesh, key: tuple, signature: Signature, algorithm: Any, args: tuple,
              world_count: bool = False, out_count: int | None = None) -> None:
    """Keep a :class:`Lane` under ``key`` (:func:`lane_key`) for the compiled call of ``signature``
    running ``algorithm`` on arguments like ``args``, whose first is the buffer the lane is given
    (``world_count``: it holds N times ``signature.count`` elements, an allgather's result);
    ``out_count``: the elements a call returns, as a recording notes it (default: the buffer's)."""
    if key not in mesh.templates:
        run = mesh.compiled_call(signature, algorithm, args, at=True)
        if run is not None:  # (the operands after the buffer, as the compiled call takes them)
            count = signature.count * (mesh.world_size if world_count else 1)
            # (made once, whether the rank records now or not: it may start later)
            root = None if signature.root < 0 else signature.root
            what = mesh.describe(signature.collective, signature.dtype, signature.count,
                                 count if out_count is None else out_count, reduce_op=signature.op or None,
                                 root=root, algorithm=signature.algorithm)
            nbytes = count * signature.dtype.storage.itemsize
            remembered(mesh, key, lambda: Lane(mesh, run, nbytes, run.operands(args)[1:], what))


def gathered_by_lane(mesh: CallMesh, lane: Lane, tensor: torch.Tensor) -> torch.Tensor:
    """A plain allgather of ``tensor`` through its ``lane``: a new result, ``tensor`` copied into
    this rank's block at the lane's turn, gathered at its address."""
    n = mesh.world_size
    out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (n,), dtype=tensor.dtype)
    lane.through(out, functools.partial(gather_into, out, tensor, mesh.rank))
    return out


def gather_into(out: torch.Tensor, tensor: torch.Tensor, rank: int) -> None:
    """Copy ``tensor`` into block ``rank`` of ``out`` (an allgather's result, before its lane runs)."""
    # (both contiguous, one dtype: torch's slicing and copy_ cost 10 µs)
    nbytes = tensor.numel() * tensor.element_size()
    ctypes.memmove(out.data_ptr() + rank * nbytes, tensor.data_ptr(), nbytes)


def scattered_by_lane(mesh: CallMesh, lane: Lane, tensor: torch.Tensor) -> torch.Tensor:
    """A plain reduce_scatter of ``tensor`` through its ``lane`` (keyed by the row count too: the
    blocks are rows): this rank's rows of :func:`scatter_through`'s reduced copy, a new tensor."""
    first, last = split_bounds(tensor.shape[0], mesh.world_size)[mesh.rank]
    out = torch.empty((last - first, *tensor.shape[1:]), dtype=tensor.dtype)
    scatter_through(lane, tensor, out, first * math.prod(tensor.shape[1:]) * tensor.element_size())
    return out


def scatter_through(lane: Lane, tensor: torch.Tensor, out: torch.Tensor, offset: int) -> None:
    """A reduce_scatter's ``lane`` run on a copy of ``tensor`` (made at its turn: the caller's
    tensor stays as it was), then ``out`` filled from the copy's bytes at ``offset``."""
    work = torch.empty(tensor.shape, dtype=tensor.dtype)
    copy = functools.partial(ctypes.memmove, work.data_ptr(), tensor.data_ptr(),
                             tensor.numel() * tensor.element_size())
    lane.through(work, copy)  # (memmove: torch's clone costs microseconds more)
    ctypes.memmove(out.data_ptr(), work.data_ptr() + offset, out.numel() * out.element_size())


#: Kept per mesh at most (a program's distinct shapes of call are few; past this, start over).
MAX_REMEMBERED = 256


def remembered(mesh: CallMesh, key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``mesh.templates`` under ``key``: what a plain call needs besides its
    tensor (checks passed, ``auto`` resolved, the compiled call looked up) is made once per
    distinct ``key``. ``key`` must hold every argument ``make`` depends on; an unhashable one
    (an algorithm given as a list, say) skips the memory and lets ``make`` raise."""
    templates = mesh.templates
    try:
        found = templates.get(key)
    except TypeError:
        return make()
    if found is None:
        found = make()
        if len(templates) >= MAX_REMEMBERED:
            templates.clear()
        templates[key] = found
    return found
