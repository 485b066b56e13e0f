"""Replicas that must not drift: an allreduce's result compared across the ranks before it is used.

Every rank of an allreduce must end with the same bits (DDP's replicas stay equal only so). With
``pg_options=lab.backend.Options(check_replicas=True)`` the ``"lab"`` backend hashes each
allreduce's result on every rank (CRC-32 of its bytes) and compares the hashes in one small
allgather, right after the allreduce and before its Work completes, so before DDP copies a bucket
into the gradients and the optimizer reads them. ``check_replicas=K`` checks every K-th allreduce
of each size and dtype (a DDP bucket's every K-th step; buckets of one size and dtype share their
count). Where the hashes differ, every rank gathers the whole result, and the allreduce fails on
every rank with :class:`ReplicaMismatchError` naming the rank that differs, the elements and, for
a DDP bucket, the parameters they belong to::

    ReplicaMismatchError: allreduce #7 (float32[1,234]) left rank 2 with other bits than ranks 0, 1, 3:
    3 elements differ, from 17 to 40: parameter 'fc1.bias' (elements 17-40 of the bucket)

A DDP bucket is told from its size: the module's bucket layout is read after a forward (the
reducer's own buckets, outside its lock: a hook registered at the first check), and a gradient
that is a view of the bucket (``gradient_as_bucket_view=True``) is found by its address.
Cost: one hash of the result and a 8-byte allgather per checked allreduce.
"""

from __future__ import annotations

import gc
import threading
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from lab.collectives import calls
from lab.errors import LabError

_making = threading.Lock()
#: Sizes and dtypes whose allreduces are counted (the least recently seen forgotten beyond this).
COUNTED_KEYS = 4096


class ReplicaMismatchError(LabError):
    """An allreduce left the ranks with different bits; names the rank, elements and parameters."""


def replicas_every(value: Any) -> int:
    """``Options.check_replicas`` as "every how many allreduces of a size and dtype" (0: never)."""
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"Options.check_replicas must be True, False or a whole number K >= 1 (every K-th "
                         f"allreduce); got {value!r}")
    return value


def content_hash(tensor: torch.Tensor) -> int:
    """CRC-32 of ``tensor``'s bytes in element order (the same bits: the same hash on every rank)."""
    flat = tensor.detach().reshape(-1).contiguous()
    return zlib.crc32(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def checked(group: Any, op: str, run: Callable[[], Any], outputs: list) -> Callable[[], Any]:
    """``run``, torch's ``op`` on ``group`` (a :class:`lab.backend.group.LabProcessGroup`), then,
    where ``op`` is an allreduce and the group's ``Options.check_replicas`` asks, the check of each
    of its ``outputs`` (on the group's thread, in issue order: every rank checks the same calls)."""
    every = group.options.check_replicas
    if op != "allreduce" or not every:
        return run
    with _making:  # (one check per group, made at its first allreduce, whichever thread issues it)
        check = vars(group).get("replica_check")
        if check is None:
            check = vars(group)["replica_check"] = ReplicaCheck(group, replicas_every(every))

    def run_and_check() -> Any:
        result = run()
        for tensor in outputs:
            if check.due(tensor):
                check.check(tensor)
        return result

    return run_and_check


class ReplicaCheck:
    """The check of one group (``group``: its :class:`lab.backend.group.LabProcessGroup`), every
    ``every``-th allreduce of each size and dtype."""
    def __init__(self, group: Any, every: int) -> None:
        self._group, self._every = group, every
        self._counts: OrderedDict[tuple, int] = OrderedDict()
        self._modules: list[Any] = []  # the DDP modules over this group, found at the first check
        self._looked = False

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated in rank order (run where the group's calls run)."""
        return calls.prepare_allgather(self._group.mesh, tensor).run()

    def due(self, tensor: torch.Tensor) -> bool:
        """Whether this allreduce of ``tensor`` is checked (the same answer on every rank: the
        count is of sizes and dtypes, which every rank's call agrees on)."""
        key = (tensor.numel(), tensor.dtype)
        count = self._counts.pop(key, 0)
        self._counts[key] = count + 1
        if len(self._counts) > COUNTED_KEYS:
            self._counts.popitem(last=False)
        return count % self._every == 0

    def check(self, tensor: torch.Tensor) -> None:
        """Compare ``tensor``'s hash across the ranks; where it differs, raise
        :class:`ReplicaMismatchError` on every rank (all of them see the same hashes)."""
        if not self._looked:
            self._looked = True
            self._modules = _ddp_modules(self._group)
            for module in self._modules:
                _watch_layout(module)
        mine = torch.tensor([content_hash(tensor)], dtype=torch.int64)
        hashes = self._gather(mine).tolist()
        if len(set(hashes)) == 1:
            return
        # the whole result of every rank, to name the elements (once: the job stops here)
        flat = tensor.detach().reshape(-1).contiguous()
        rows = self._gather(flat).reshape(len(hashes), -1)
        votes = Counter(hashes)
        reduced = [r for r in self._group.mesh.flight_records() if r.collective == "allreduce"]
        what = f"allreduce #{reduced[-1].seq}" if reduced else "an allreduce"
        what += f" ({str(tensor.dtype).removeprefix('torch.')}[{tensor.numel():,}])"
        common = max(votes, key=lambda h: (votes[h], -hashes.index(h)))  # a tie: rank 0's side
        reference = rows[hashes.index(common)]
        odd = [rank for rank, h in enumerate(hashes) if h != common]
        agreeing = [r for r, h in enumerate(hashes) if h == common]
        headline = (
            f"{what} left rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} with other bits "
            f"than rank{'s' if len(agreeing) > 1 else ''} {', '.join(map(str, agreeing))}:")
        lines = [headline]
        for rank in odd:
            differ = _differing(rows[rank], reference)
            if not differ:
                continue
            where = f"{len(differ)} element{'s' if len(differ) > 1 else ''} differ{'s' if len(differ) == 1 else ''}"
            where += f", from {differ[0]} to {differ[-1]}"
            first = differ[0]
            where += f" (element {first}: {rows[rank][first].item()!r} on rank {rank}, " \
                     f"{reference[first].item()!r} on the others)"
            named = _parameters_at(self._modules or _ddp_modules(self._group), tensor, differ)
            lines.append(f"  rank {rank}: {where}" + (f": {named}" if named else ""))
        raise ReplicaMismatchError("\n".join(lines))


def _differing(row: torch.Tensor, reference: torch.Tensor) -> list[int]:
    """The element indices where ``row``'s bits differ from ``reference``'s (NaN is NaN here)."""
    size = row.element_size()
    mine, theirs = row.view(torch.uint8).reshape(-1, size), reference.view(torch.uint8).reshape(-1, size)
    return torch.nonzero((mine != theirs).any(dim=1)).reshape(-1).tolist()


def _ddp_modules(group: Any) -> list[Any]:
    """The DistributedDataParallel modules whose process group is ``group`` (found among the
    live objects: the backend is never handed the module)."""
    from torch.nn.parallel import DistributedDataParallel

    # (type(), not isinstance: some live objects warn when their __class__ is read)
    return [
        o for o in gc.get_objects()
        if issubclass(type(o), DistributedDataParallel) and o.process_group is group]


#: A DDP module's bucket layout, read after its forwards: [(bucket's numel, [(name, numel), ...]), ...].
_LAYOUTS: dict[int, list[tuple[int, list[tuple[str, int]]]]] = {}
#: How many forwards a layout is read after (DDP rebuilds its buckets once, at the second forward).
LAYOUT_READS = 3


def _watch_layout(module: Any) -> None:
    """Read ``module``'s bucket layout after each of its next ``LAYOUT_READS`` forwards (outside
    the reducer's lock, which the reducer holds while it calls the backend)."""
    names = {id(p): name for name, p in module.module.named_parameters()}
    reads = [0]

    def after_forward(ddp: Any, _inputs: Any, _output: Any) -> None:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        _LAYOUTS[id(ddp)] = [(b.buffer().numel(), [(names.get(id(p), "?"), p.numel())
                                                   for p in b.parameters()]) for b in buckets]
        reads[0] += 1
        if reads[0] >= LAYOUT_READS:
            handle.remove()

    handle = module.register_forward_hook(after_forward)


def _parameters_at(modules: list[Any], tensor: torch.Tensor, elements: list[int]) -> str:
    """The DDP parameters that ``elements`` of the bucket ``tensor`` belong to, named."""
    found: dict[str, list[int]] = {}
    for module in modules:
        spans = _spans_by_address(module, tensor) or _spans_by_layout(module, tensor)
        for name, start, stop in spans:
            inside = [e for e in elements if start <= e < stop]
            if inside:
                found.setdefault(name, [inside[0] - start, inside[-1] - start, start, stop])
    return "; ".join(f"parameter {name!r} (its elements {a}-{b}; bucket elements {start}-{stop - 1})"
                     for name, (a, b, start, stop) in found.items())


def _spans_by_address(module: Any, tensor: torch.Tensor) -> list[tuple[str, int, int]]:
    """Where gradients are views of the bucket (``gradient_as_bucket_view``): (name, start, stop)."""
    base, size = tensor.data_ptr(), tensor.element_size()
    spans = []
    for name, p in module.module.named_parameters():
        if p.grad is not None and p.grad.dtype == tensor.dtype and p.grad.untyped_storage().data_ptr() == \
                tensor.untyped_storage().data_ptr():
            start = (p.grad.data_ptr() - base) // size
            spans.append((name, start, start + p.numel()))
    return spans


def _spans_by_layout(module: Any, tensor: torch.Tensor) -> list[tuple[str, int, int]]:
    """From the layout read after a forward: the parameters of the bucket of ``tensor``'s size
    (buckets of one size: each one's, the names joined)."""
    spans = []
    for numel, params in _LAYOUTS.get(id(module), []):
        if numel != tensor.numel():
            continue
        offset = 0
        for name, count in params:
            spans.append((name, offset, offset + count))
            offset += count
    return spans
