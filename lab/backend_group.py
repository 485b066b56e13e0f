"""The ``"lab"`` backend's process group: every ``torch.distributed`` operation as a lab collective.

Each operation is checked and prepared in the caller (``lab.collectives.prepare_*``: a bad
argument raises there, as torch's own backends do) and runs on the mesh's communication thread in
issue order; it returns a :class:`lab.backend_work.LabWork` at once. torch's tensor lists are
flattened into one tensor per collective, as gloo does.

    group = LabProcessGroup(mesh, Options())        # what lab.backend.create builds
    group.allreduce([grads]).wait()                 # lab.allreduce(mesh, grads) in issue order
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lab import checks, collectives
from lab.backend_work import LabWork
from lab.errors import DeadlineError, LabError
from lab.issue import Work
from lab.mesh import Mesh
from lab.transport.base import Silence

NAME = "lab"
#: A collective with at most this many bytes of output runs on the calling thread when nothing
#: else is in flight: handing it to the communication thread and waking the caller again cost
#: more than a small collective (measured: bench/torch_backend.py).
RUN_NOW_MAX_BYTES = 64 * 1024
#: A waiting receive runs the sends issued behind it every this many milliseconds.
POLL_MS = 1.0

# -- torch's arguments as the lab's

_REDUCE_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min", dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "avg", dist.ReduceOp.RedOpType.PREMUL_SUM: "sum",
    dist.ReduceOp.RedOpType.BAND: "band", dist.ReduceOp.RedOpType.BOR: "bor", dist.ReduceOp.RedOpType.BXOR: "bxor",
}


def lab_op(reduce_op: Any) -> tuple[str, float | None]:
    """torch's ReduceOp as the lab's op name, and PREMUL_SUM's factor (None otherwise)."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    if kind not in _REDUCE_OPS:
        raise ValueError(f"reduce op {kind} is not supported by the lab backend; supported: "
                         f"{', '.join(str(k).split('.')[-1] for k in _REDUCE_OPS)}")
    factor = None
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = reduce_op.factor
        factor = factor.item() if isinstance(factor, torch.Tensor) else float(factor)
    return _REDUCE_OPS[kind], factor


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
    if tensor.device.type != "cpu":
        raise ValueError(f"the lab backend moves CPU tensors; got one on {tensor.device}")
    return tensor


# -- checks (before anything is sent: torch raises these in the caller)


def output_bytes(outputs: list) -> int:
    """The bytes of a list of tensors, or of lists of them (an allgather's output lists)."""
    return sum(output_bytes(t) if isinstance(t, list) else t.numel() * t.element_size() for t in outputs)


def check_count(tensors: list[torch.Tensor], world_size: int, name: str) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{name} must hold one tensor per rank ({world_size}); got {len(tensors)}")


def await_message(mesh: Mesh, src: int | None, tag: int, meanwhile: Callable[[], None]) -> int:
    """``src`` (None: any rank) once its next tensor of ``tag`` has arrived, calling
    ``meanwhile()`` between waits of ``POLL_MS``; DeadlineError after the mesh's
    ``recv_timeout_ms`` without one."""
    silence = Silence(mesh.recv_timeout_ms / 1000)
    while (found := mesh.probe(src, tag, POLL_MS)) is None:
        meanwhile()
        if silence.expired():
            peers = [src] if src is not None else [r for r in range(mesh.world_size) if r != mesh.rank]
            raise DeadlineError(f"rank {mesh.rank} timed out waiting for a tensor of tag {tag} from rank(s) "
                                f"{peers} (recv_timeout_ms={mesh.recv_timeout_ms:g})", peers)
    return found


def check_sizes(tensor: torch.Tensor, numel: int, name: str) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{name} must hold {numel} elements (the input's times the group's size); "
                         f"got {tensor.numel()}")


@dataclasses.dataclass(frozen=True)
class Options:
    """The lab's ``pg_options``: ``dist.init_process_group("lab", pg_options=lab.backend.Options(...))``.

    ``algorithms`` maps a collective to one of its algorithms (``{"allreduce": "ring"}``; the
    others stay ``"auto"``; ``LAB_ALGO`` still wins); ``recv_timeout_ms`` overrides the
    ``timeout=`` torch passes; ``trace`` is a JSONL path (``LAB_TRACE`` also works);
    ``transport`` is ``"auto"`` (shm inside a host, tcp across) or ``"tcp"``.
    """

    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    recv_timeout_ms: float | None = None
    trace: str | None = None
    transport: str = "auto"

    def __post_init__(self) -> None:
        for collective, algorithm in self.algorithms.items():
            if collective not in collectives.ALGORITHMS:
                raise ValueError(f"Options.algorithms has no collective {collective!r}; collectives: "
                                 f"{', '.join(collectives.ALGORITHMS)}")
            collectives.check_algorithm(algorithm, collective)


class LabProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose every operation is a lab collective on
    ``mesh`` (the world's mesh, or a sub-mesh of it for ``new_group``)."""

    def __init__(self, mesh: Mesh, options: Options) -> None:
        super().__init__(mesh.rank, mesh.world_size)
        self.mesh, self.options = mesh, options
        self._group_name, self._group_desc = "", ""

    # -- what c10d asks of every process group

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

    def __repr__(self) -> str:
        return f"lab process group {self._group_name or '?'} (rank {self.mesh.rank} of {self.mesh.world_size})"

    def issue(self, run: Callable[[], Any], now: bool = False, p2p: str = "") -> Work:
        """``run`` in the mesh's issue order, on its communication thread; with ``now``, on this
        thread if nothing is in flight (:meth:`lab.issue.IssueQueue.issue_now`)."""
        if self.mesh.closed:
            raise dist.DistBackendError(f"{self}: the group was shut down")
        if now:
            return self.mesh.issue_now(run)
        return self.mesh.issue(run, async_op=True, p2p=p2p)

    def torch_error(self, exc: BaseException) -> BaseException:
        """``exc`` as torch raises backend failures: ``DistBackendError`` with the lab's message and
        this rank's last collectives; a bad argument stays what it was."""
        if not isinstance(exc, LabError):
            return exc
        records = "\n".join(f"  {record}" for record in self.mesh.flight_records()[-8:])
        error = dist.DistBackendError(f"{type(exc).__name__}: {exc}\nflight recorder of rank {self.mesh.rank} "
                                      f"({self}), oldest first:\n{records}")
        error.__cause__ = exc
        return error

    def _algorithm(self, collective: str) -> str:
        return self.options.algorithms.get(collective, "auto")

    def _work(self, run: Callable[[], Any], outputs: list[torch.Tensor], p2p: str = "") -> LabWork:
        """The Work of ``run``. A collective of at most ``RUN_NOW_MAX_BYTES`` of output runs before
        this returns when nothing else is in flight (the Work is then complete); point-to-point
        (``p2p="send"``, ``"recv"``) always goes to the communication thread (an irecv posted
        before its isend must not block)."""
        return LabWork(self, run, outputs, now=not p2p and output_bytes(outputs) <= RUN_NOW_MAX_BYTES, p2p=p2p)

    # -- collectives: checked here, in the caller (``collectives.prepare_*``); run in issue order

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(tensors, "allreduce")
        op, factor = lab_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        prepared = collectives.prepare_allreduce(self.mesh, tensor, op, self._algorithm("allreduce"))

        def run() -> None:
            if factor is not None:
                tensor.mul_(factor)  # in place anyway: the result replaces it
            prepared.run()

        return self._work(run, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        op, factor = lab_op(opts.reduceOp)
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype if tensors else torch.float32)
        prepared = collectives.prepare_allreduce(self.mesh, flat, op, self._algorithm("allreduce"))

        def run() -> None:
            flatten_into(flat, tensors, factor)  # one collective for all, as gloo does
            prepared.run()
            unflatten_into(flat, tensors)

        return self._work(run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(tensors, "broadcast")
        prepared = collectives.prepare_broadcast(self.mesh, tensor, opts.rootRank, self._algorithm("broadcast"))
        return self._work(prepared.run, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(tensors, "reduce")
        op, factor = lab_op(opts.reduceOp)
        dst = opts.rootRank
        # PREMUL_SUM reduces a scaled copy: the other ranks' tensors stay as they were
        source = tensor if factor is None else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        prepared = collectives.prepare_reduce(self.mesh, source, dst, op)

        def run() -> None:
            if factor is not None:
                torch.mul(tensor, factor, out=source)
            prepared.run()
            if factor is not None and self.mesh.rank == dst:
                tensor.copy_(source)

        return self._work(run, tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> LabWork:
        tensor = one(inputs, "all_gather")
        outputs = output_lists[0]
        check_count(outputs, self.mesh.world_size, "tensor_list")
        prepared = collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
        return self._work(lambda: unflatten_into(prepared.run(), outputs), output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> LabWork:
        # output_lists[r][i]: rank r's inputs[i] (torch's layout: one list per rank)
        check_count(output_lists, self.mesh.world_size, "output_tensor_lists")
        for outputs in output_lists:
            if len(outputs) != len(inputs):
                raise ValueError(f"output_tensor_lists[r] must hold one tensor per input ({len(inputs)}); "
                                 f"got {len(outputs)}")
        prepared = [collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
                    for tensor in inputs]

        def run() -> None:
            for i, gather in enumerate(prepared):
                unflatten_into(gather.run(), [outputs[i] for outputs in output_lists])

        return self._work(run, [t for outputs in output_lists for t in outputs])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        for output, tensor in zip(outputs, inputs, strict=True):
            check_sizes(output, tensor.numel() * self.mesh.world_size, "output_tensor")
        prepared = [collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
                    for tensor in inputs]

        def run() -> None:
            for output, gather in zip(outputs, prepared, strict=True):
                output.copy_(gather.run().view_as(output))

        return self._work(run, outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> LabWork:
        output = one(outputs, "reduce_scatter")
        inputs = input_lists[0]
        check_count(inputs, self.mesh.world_size, "input_list")
        for tensor in inputs:
            check_sizes(tensor, output.numel(), "input_list[i]")
        op, factor = lab_op(opts.reduceOp)
        flat = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_reduce_scatter(self.mesh, flat, op, self._algorithm("reduce_scatter"))

        def run() -> None:
            flatten_into(flat, inputs, factor)
            output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        op, factor = lab_op(opts.reduceOp)
        steps = []
        for output, tensor in zip(outputs, inputs, strict=True):
            check_sizes(tensor, output.numel() * self.mesh.world_size, "input")
            # PREMUL_SUM reduces a scaled copy: torch leaves the input as it was
            source = tensor.reshape(-1) if factor is None else torch.empty(tensor.numel(), dtype=tensor.dtype)
            prepared = collectives.prepare_reduce_scatter(self.mesh, source, op, self._algorithm("reduce_scatter"))
            steps.append((output, tensor, source, prepared))

        def run() -> None:
            for output, tensor, source, prepared in steps:
                if factor is not None:
                    torch.mul(tensor.reshape(-1), factor, out=source)
                output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> LabWork:
        prepared = collectives.prepare_all_to_all(self.mesh, input, output_split_sizes=list(output_split_sizes) or None,
                                                  input_split_sizes=list(input_split_sizes) or None,
                                                  algorithm=self._algorithm("all_to_all"))
        return self._work(lambda: output.copy_(prepared.run().view_as(output)), [output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> LabWork:
        check_count(outputs, self.mesh.world_size, "output_tensor_list")
        check_count(inputs, self.mesh.world_size, "input_tensor_list")
        # MPI's alltoallv: blocks of any size, one flat tensor each way
        flat = torch.empty(sum(t.numel() for t in inputs), dtype=inputs[0].dtype)
        prepared = collectives.prepare_all_to_all(self.mesh, flat, output_split_sizes=[t.numel() for t in outputs],
                                                  input_split_sizes=[t.numel() for t in inputs],
                                                  algorithm=self._algorithm("all_to_all"))

        def run() -> None:
            flatten_into(flat, inputs)
            unflatten_into(prepared.run(), outputs)

        return self._work(run, outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(inputs, "gather")
        dst = opts.rootRank
        outputs = output_lists[0] if self.mesh.rank == dst else []
        if self.mesh.rank == dst:
            check_count(outputs, self.mesh.world_size, "gather_list")
        prepared = collectives.prepare_gather(self.mesh, tensor.reshape(-1), dst)

        def run() -> None:
            gathered = prepared.run()
            if gathered is not None:
                unflatten_into(gathered, outputs)

        return self._work(run, outputs)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> LabWork:
        output = one(outputs, "scatter")
        src = opts.rootRank
        inputs = input_lists[0] if self.mesh.rank == src else []
        if self.mesh.rank == src:
            check_count(inputs, self.mesh.world_size, "scatter_list")
        # every rank passes the whole tensor's shape; only src's contents are read
        whole = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_scatter(self.mesh, whole, src)

        def run() -> None:
            if inputs:
                flatten_into(whole, inputs)
            output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs)

    def barrier(self, opts: Any = None) -> LabWork:
        return self._work(collectives.prepare_barrier(self.mesh).run, [])

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # -- point-to-point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LabWork:
        tensor, tag = one(tensors, "send"), checks.p2p_tag(tag)
        return self._work(lambda: self.mesh.send(dst, tensor, tag), tensors, p2p="send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LabWork:
        return self._receive(one(tensors, "recv"), src, checks.p2p_tag(tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LabWork:
        return self._receive(one(tensors, "recv"), None, checks.p2p_tag(tag))

    def _receive(self, tensor: torch.Tensor, src: int | None, tag: int) -> LabWork:
        """Receive into ``tensor``; while the message has not arrived, run the sends issued
        after this receive (torch posts ``irecv`` and ``isend`` at once: see
        :meth:`lab.issue.IssueQueue.run_sends_behind`)."""
        queue = self.mesh.issue_queue
        issued = queue.issued

        def run() -> int:
            source = await_message(self.mesh, src, tag, lambda: queue.run_sends_behind(issued))
            received = self.mesh.recv(source, tag=tag)
            if received.dtype != tensor.dtype or received.numel() != tensor.numel():
                raise LabError(f"rank {self.mesh.rank}: rank {source} sent {received.dtype}[{received.numel()}], "
                               f"but this rank receives into {tensor.dtype}[{tensor.numel()}]")
            tensor.copy_(received.view_as(tensor))
            return source

        return self._work(run, [tensor], p2p="recv")

    # -- lifetime

    def shutdown(self) -> None:
        self.mesh.close()

    def abort(self) -> None:
        self.mesh.close()
