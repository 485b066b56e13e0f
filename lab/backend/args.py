"""torch's arguments as the lab takes them, for the ``"lab"`` backend's process group
(:mod:`lab.backend.group`): its ``pg_options`` (:class:`Options`), reduce ops, tensor lists
flattened into one tensor and back, counts checked, and a receive that waits for its message.

    lab_op(dist.ReduceOp.AVG)                 # ("avg", None)
    flatten_into(flat, [a, b])                # a and b, one after the other, in flat
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lab import checks
from lab.backend.flight_dumps import check_prefix
from lab.backend.replicas import replicas_every
from lab.collectives import choice
from lab.comm.operations import Operation
from lab.comm.protocols import BackendMesh
from lab.errors import DeadlineError, LabError
from lab.ops import DTYPES, dtype_of
from lab.transport.base import Silence

NAME = "lab"
#: A waiting receive runs the sends issued behind it every this many milliseconds.
POLL_MS = 1.0

_REDUCE_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min", dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "avg", dist.ReduceOp.RedOpType.PREMUL_SUM: "sum",
    dist.ReduceOp.RedOpType.BAND: "band", dist.ReduceOp.RedOpType.BOR: "bor",
    dist.ReduceOp.RedOpType.BXOR: "bxor"}
_OP_NAMES = {kind.value: name for kind, name in _REDUCE_OPS.items()}
_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM.value


def lab_op(reduce_op: Any) -> tuple[str, float | None]:
    """torch's ReduceOp as the lab's op name, and PREMUL_SUM's factor (None otherwise)."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    # (by the enum's value: hashing torch's enum itself costs a microsecond, a per-call cost)
    name = _OP_NAMES.get(kind.value) if type(kind) is dist.ReduceOp.RedOpType else None
    if name is None:
        raise ValueError(f"reduce op {kind} is not supported by the lab backend; supported: "
                         f"{', '.join(str(k).split('.')[-1] for k in _REDUCE_OPS)}")
    factor = None
    if kind.value == _PREMUL_SUM:
        factor = reduce_op.factor
        factor = factor.item() if isinstance(factor, torch.Tensor) else float(factor)
    return name, factor


def flatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], factor: float | None = None) -> None:
    """Copy ``tensors`` one after the other into ``flat`` (times PREMUL_SUM's ``factor``)."""
    offset = 0
    for tensor in tensors:
        part = flat[offset:offset + tensor.numel()]
        if factor is None:
            part.copy_(tensor.reshape(-1))
        else:
            torch.mul(tensor.reshape(-1), factor, out=part)
        offset += tensor.numel()


def unflatten_into(flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outputs``, each in its own shape."""
    offset = 0
    for out in outputs:
        out.copy_(flat[offset:offset + out.numel()].view_as(out))
        offset += out.numel()


def one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    """The one CPU tensor of ``tensors`` (a ``ValueError`` naming the call ``what`` otherwise)."""
    if len(tensors) != 1:
        raise ValueError(f"the lab backend takes one tensor per call ({what}); got {len(tensors)}")
    tensor = tensors[0]
    if not tensor.is_cpu:
        raise ValueError(f"the lab backend moves CPU tensors; got one on {tensor.device}")
    return tensor


# -- checks (before anything is sent: torch raises these in the caller)


def check_gather_lists(output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                       world_size: int) -> None:
    """``all_gather_coalesced``'s outputs: ``output_lists[r][i]`` like ``inputs[i]``, for each rank r."""
    check_count(output_lists, world_size, "output_tensor_lists")
    for r, outputs in enumerate(output_lists):
        if len(outputs) != len(inputs):
            raise ValueError(f"output_tensor_lists[{r}] must hold one tensor per input ({len(inputs)}); "
                             f"got {len(outputs)}")
        for i, (output, tensor) in enumerate(zip(outputs, inputs, strict=True)):
            check_like(output, tensor.numel(), tensor.dtype, f"output_tensor_lists[{r}][{i}]")


def output_bytes(outputs: list) -> int:
    """The bytes of a list of tensors, or of lists of them (an allgather's output lists)."""
    return sum(output_bytes(t) if isinstance(t, list) else t.numel() * t.element_size() for t in outputs)


def flat_list(tensors: list) -> list[torch.Tensor]:
    """A list of tensors, or of lists of them (an allgather's output lists), as one list."""
    return [t for item in tensors for t in (flat_list(item) if isinstance(item, list) else [item])]


def describe(mesh: BackendMesh, dim: str | None, op: str, inputs: list, outputs: list,
             split_sizes: tuple | None = None, ran: Any = None, **rest: Any) -> Operation | None:
    """torch's operation ``op`` on the group of ``mesh`` (made for DeviceMesh dimension ``dim``)
    as a recording notes it (None where nothing records): elements in and out counted over its
    tensors (lists of lists too) in the first one's dtype; an all_to_all's ``split_sizes`` (in,
    out; none given: even); ``ran``: the lab collective it runs (``lab.collectives.Prepared``, or
    a list of them), whose algorithm it notes (theirs where they agree on one); ``rest``: roots
    and peers as the group's ranks, and the rest of :class:`lab.comm.operations.Operation`'s fields. A
    receive from any source learns its sender from what its run returns.

        describe(mesh, "dp", "allreduce", [grads], [grads], ran=prepared, reduce_op="sum")
    """
    if not mesh.recording:
        return None
    ran = [] if ran is None else ran if isinstance(ran, list) else [ran]
    algorithms = {prepared.signature.algorithm for prepared in ran}
    if len(algorithms) == 1:  # (a coalesced call of tensors auto runs differently: none)
        rest["algorithm"] = algorithms.pop()
    first = next(iter(flat_list(inputs) or flat_list(outputs)), None)
    dtype = DTYPES["float32"] if first is None else dtype_of(first)
    size = dtype.storage.itemsize  # (a coalesced call's tensors of other dtypes: counted in bytes)
    if split_sizes is not None and any(split_sizes):
        rest["split_sizes"] = {"in": list(split_sizes[0]), "out": list(split_sizes[1])}
    if op == "recv" and rest.get("peer") is None:
        rest["learn"] = lambda source: {"peer": mesh.global_ranks[source]}
    counts = output_bytes(inputs) // size, output_bytes(outputs) // size
    return mesh.describe(op, dtype, *counts, dim=dim, **rest)


def check_count(tensors: list[torch.Tensor], world_size: int, name: str) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{name} must hold one tensor per rank ({world_size}); got {len(tensors)}")


def check_like(tensor: torch.Tensor, numel: int | None, dtype: torch.dtype, name: str) -> None:
    """``tensor`` is a CPU tensor of ``dtype`` with ``numel`` elements (None: any number), or a
    ``ValueError`` naming ``name`` (gloo's "invalid tensor size" and "type"): a copy into or out of
    it would convert or drop elements silently."""
    if not tensor.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor (the lab backend moves CPU tensors); got one on "
                         f"{tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, as the collective's other tensors; got {tensor.dtype}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} must hold {numel} elements; got {tensor.numel()} "
                         f"(shape {list(tensor.shape)})")


def check_list(tensors: list[torch.Tensor], world_size: int, numel: int | None, dtype: torch.dtype,
               name: str) -> None:
    """One tensor per rank, each as :func:`check_like` wants."""
    check_count(tensors, world_size, name)
    for i, tensor in enumerate(tensors):
        check_like(tensor, numel, dtype, f"{name}[{i}]")


def receive_into(mesh: BackendMesh, tensor: torch.Tensor, src: int | None, tag: int,
                 meanwhile: Callable[[], None]) -> int:
    """Receive ``src``'s (None: any rank's) next tensor of ``tag`` into ``tensor`` and return its
    sender, calling ``meanwhile()`` between waits of ``POLL_MS`` until it has arrived;
    DeadlineError after the mesh's ``recv_timeout_ms`` without one, LabError on another shape."""
    silence = Silence(mesh.recv_timeout_ms / 1000)
    while (source := mesh.probe(src, tag, POLL_MS)) is None:
        meanwhile()
        if silence.expired():
            peers = [src] if src is not None else [r for r in range(mesh.world_size) if r != mesh.rank]
            raise DeadlineError(
                f"rank {mesh.rank} timed out waiting for a tensor of tag {tag} from rank(s) "
                f"{peers} (recv_timeout_ms={mesh.recv_timeout_ms:g})", peers)
    received = mesh.recv(source, tag=tag)
    if received.dtype != tensor.dtype or received.numel() != tensor.numel():
        raise LabError(f"rank {mesh.rank}: rank {source} sent {received.dtype}[{received.numel()}], "
                       f"but this rank receives into {tensor.dtype}[{tensor.numel()}]")
    tensor.copy_(received.view_as(tensor))
    return source


@dataclasses.dataclass(frozen=True)
class Options:
    """The lab's ``pg_options``: ``dist.init_process_group("lab", pg_options=lab.backend.Options(...))``.

    ``algorithms`` maps a collective to one of its algorithms (``{"allreduce": "ring"}``; the
    others stay ``"auto"``; ``LAB_ALGO`` still wins); ``recv_timeout_ms`` overrides the
    ``timeout=`` torch passes; ``trace`` is a JSONL path (``LAB_TRACE`` also works);
    ``transport`` is ``"auto"`` (shm inside a host, tcp across) or ``"tcp"``; ``workload``, a
    file every rank records its operations into (:mod:`lab.workload`; ``LAB_WORKLOAD`` also
    works; rank 0 writes its header), given to the world's group; ``flight_dump``, a path prefix:
    a rank writes its flight records in torch's format to ``<prefix><rank>`` when a collective
    fails (``TORCH_FR_DUMP_TEMP_FILE`` also works; :mod:`lab.backend.flight_dumps`); ``check_replicas``:
    True (or K: every K-th allreduce of each size and dtype) compares a hash of every allreduce's result
    across the ranks and fails it, naming the rank and the DDP parameter that differ
    (:mod:`lab.backend.replicas`).
    """

    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    recv_timeout_ms: float | None = None
    trace: str | None = None
    transport: str = "auto"
    workload: str | None = None
    flight_dump: str | None = None
    check_replicas: bool | int = False

    def __post_init__(self) -> None:
        checks.trace_path(self.workload, "Options.workload")
        check_prefix(self.flight_dump, "Options.flight_dump")
        replicas_every(self.check_replicas)
        for collective, algorithm in self.algorithms.items():
            if collective not in choice.ALGORITHMS:
                raise ValueError(f"Options.algorithms has no collective {collective!r}; collectives: "
                                 f"{', '.join(choice.ALGORITHMS)}")
            choice.check_algorithm(algorithm, collective)


class NamedGroup(dist.ProcessGroup):
    """What c10d asks of every process group besides its operations: its backend's name, its own
    name and description, which torch sets; ``dim``, the DeviceMesh dimension that made it."""
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._group_name, self._group_desc = "", ""

    def getBackendName(self) -> str:
        return NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def dim(self) -> str | None:
        """The DeviceMesh dimension that made this group (torch describes its groups as
        ``mesh_<name>``, the one of every rank ``mesh_default``), or None."""
        desc = self._group_desc
        return desc[5:] if desc.startswith("mesh_") and desc != "mesh_default" else None
