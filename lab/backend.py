"""The lab as a ``torch.distributed`` backend: ``dist.init_process_group("lab")``.

``import lab`` registers the name ``"lab"`` (as out-of-tree backends do on import). A torch
program then runs on the lab's algorithms, deadlines, mismatch detection, flight recorder,
counters and trace by changing one word::

    import lab, torch.distributed as dist
    dist.init_process_group("lab")                  # torchrun, tcp://, file:// or store=
    dist.all_reduce(grads)                          # lab.allreduce on the group's mesh
    model = torch.nn.parallel.DistributedDataParallel(model)   # DDP, FSDP2, DeviceMesh: unmodified

The world is one :class:`lab.Mesh` built from the store torch hands over
(:meth:`lab.Mesh.from_store`; ``transport="auto"``: shared memory inside a host, TCP across).
``new_group`` makes a sub-mesh of it: the same channels, a context id agreed through the store,
no new socket. ``timeout=`` of ``init_process_group`` is the lab's silence deadline;
``pg_options=lab.backend.Options(...)`` takes the rest.

Every call returns a :class:`LabWork` at once and runs on the mesh's communication thread in
issue order. ``wait()`` raises ``torch.distributed.DistBackendError`` carrying the lab's message
(rank, peer, collective, step) and the group's flight recorder, with the lab's exception as its
``__cause__``. A failed collective's future is completed with a value that raises that same
error when anything reads it (torch's C++ consumers, DDP among them, crash on a future completed
with an exception): DDP's ``backward()`` then raises it too.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lab import collectives
from lab.errors import LabError
from lab.fingerprint import MAX_CONTEXT
from lab.issue import Work
from lab.mesh import Mesh

NAME = "lab"

#: Sub-groups' context ids count down from here (``Mesh.split``'s count up from 1).
_GROUP_CONTEXT_TOP = MAX_CONTEXT


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


# -- the Work torch gets back -----------------------------------------------------------------


class _Failed:
    """The value of a failed collective's future: reading it in any way raises the failure.

    C++ consumers take the tensors out of a future's Python value by pickling it, so
    ``__reduce__`` raising turns into an exception where they are (DDP's backward), where a
    future completed with ``set_exception`` would crash them."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error

    def __getitem__(self, index: Any) -> Any:
        raise self.error

    def __iter__(self) -> Any:
        raise self.error

    def __len__(self) -> int:
        raise self.error


class LabWork(dist._Work):
    """A lab collective issued for torch: ``wait()``, ``is_completed()``, ``get_future()``."""

    def __init__(self, group: LabProcessGroup, run: Callable[[], Any], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._group, self._outputs = group, outputs
        self._future: torch.futures.Future = torch.futures.Future()
        self._error: BaseException | None = None
        self._converting = threading.Lock()
        self._source = -1
        self._work = group.issue(run)
        self._work.add_done_callback(self._complete)

    def _torch_error(self, exc: BaseException) -> BaseException:
        """``exc`` as torch's error, converted once (by the waiter or the completing thread)."""
        with self._converting:
            if self._error is None:
                self._error = self._group.torch_error(exc)
            return self._error

    def _complete(self, work: Work) -> None:
        try:
            result = work.result()
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the future's readers
            self._future.set_result(_Failed(self._torch_error(exc)))
            return
        if isinstance(result, int):  # a receive: the sender
            self._source = result
        self._future.set_result(self._outputs)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective completes; raise ``DistBackendError`` if it failed."""
        seconds = None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()
        try:
            self._work.wait(seconds)
        except BaseException as exc:  # noqa: BLE001 - the collective's failure, or our wait's limit
            if not self._work.is_completed():  # our wait's own limit, not the collective's failure
                raise dist.DistBackendError(f"{self._group}: wait(timeout={timeout}) expired; the collective "
                                            "is still running") from None
            raise self._torch_error(exc)  # its __cause__ is the lab's error
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future:
        """Completes with the output tensors (a value that raises the error, on failure)."""
        return self._future

    def _source_rank(self) -> int:
        self.wait()
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()


# -- the process group ------------------------------------------------------------------------

_REDUCE_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min", dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "avg", dist.ReduceOp.RedOpType.PREMUL_SUM: "sum",
    dist.ReduceOp.RedOpType.BAND: "band", dist.ReduceOp.RedOpType.BOR: "bor", dist.ReduceOp.RedOpType.BXOR: "bxor",
}


def _lab_op(reduce_op: Any) -> tuple[str, float | None]:
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


def _flatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], factor: float | None = None) -> None:
    """Copy ``tensors`` one after the other into ``flat`` (times PREMUL_SUM's ``factor``)."""
    offset = 0
    for tensor in tensors:
        part = flat[offset:offset + tensor.numel()]
        if factor is None:
            part.copy_(tensor.reshape(-1))
        else:
            torch.mul(tensor.reshape(-1), factor, out=part)
        offset += tensor.numel()


def _unflatten_into(flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    offset = 0
    for out in outputs:
        out.copy_(flat[offset:offset + out.numel()].view_as(out))
        offset += out.numel()


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"the lab backend takes one tensor per call ({what}); got {len(tensors)}")
    tensor = tensors[0]
    if tensor.device.type != "cpu":
        raise ValueError(f"the lab backend moves CPU tensors; got one on {tensor.device}")
    return tensor


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

    def issue(self, run: Callable[[], Any]) -> Work:
        if self.mesh.closed:
            raise dist.DistBackendError(f"{self}: the group was shut down")
        return self.mesh.issue(run, async_op=True)

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

    def _work(self, run: Callable[[], Any], outputs: list[torch.Tensor]) -> LabWork:
        return LabWork(self, run, outputs)

    # -- collectives: checked here, in the caller (``collectives.prepare_*``); run in issue order

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = _one(tensors, "allreduce")
        op, factor = _lab_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        prepared = collectives.prepare_allreduce(self.mesh, tensor, op, self._algorithm("allreduce"))

        def run() -> None:
            if factor is not None:
                tensor.mul_(factor)  # in place anyway: the result replaces it
            prepared.run()

        return self._work(run, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        op, factor = _lab_op(opts.reduceOp)
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype if tensors else torch.float32)
        prepared = collectives.prepare_allreduce(self.mesh, flat, op, self._algorithm("allreduce"))

        def run() -> None:
            _flatten_into(flat, tensors, factor)  # one collective for all, as gloo does
            prepared.run()
            _unflatten_into(flat, tensors)

        return self._work(run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = _one(tensors, "broadcast")
        prepared = collectives.prepare_broadcast(self.mesh, tensor, opts.rootRank, self._algorithm("broadcast"))
        return self._work(prepared.run, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = _one(tensors, "reduce")
        op, factor = _lab_op(opts.reduceOp)
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
        tensor = _one(inputs, "all_gather")
        outputs = output_lists[0]
        self._check_count(outputs, "tensor_list")
        prepared = collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
        return self._work(lambda: _unflatten_into(prepared.run(), outputs), output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> LabWork:
        # output_lists[r][i]: rank r's inputs[i] (torch's layout: one list per rank)
        self._check_count(output_lists, "output_tensor_lists")
        for outputs in output_lists:
            if len(outputs) != len(inputs):
                raise ValueError(f"output_tensor_lists[r] must hold one tensor per input ({len(inputs)}); "
                                 f"got {len(outputs)}")
        prepared = [collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
                    for tensor in inputs]

        def run() -> None:
            for i, gather in enumerate(prepared):
                _unflatten_into(gather.run(), [outputs[i] for outputs in output_lists])

        return self._work(run, [t for outputs in output_lists for t in outputs])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        for output, tensor in zip(outputs, inputs, strict=True):
            self._check_sizes(output, tensor.numel() * self.mesh.world_size, "output_tensor")
        prepared = [collectives.prepare_allgather(self.mesh, tensor.reshape(-1), self._algorithm("allgather"))
                    for tensor in inputs]

        def run() -> None:
            for output, gather in zip(outputs, prepared, strict=True):
                output.copy_(gather.run().view_as(output))

        return self._work(run, outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> LabWork:
        output = _one(outputs, "reduce_scatter")
        inputs = input_lists[0]
        self._check_count(inputs, "input_list")
        for tensor in inputs:
            self._check_sizes(tensor, output.numel(), "input_list[i]")
        op, factor = _lab_op(opts.reduceOp)
        flat = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_reduce_scatter(self.mesh, flat, op, self._algorithm("reduce_scatter"))

        def run() -> None:
            _flatten_into(flat, inputs, factor)
            output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        op, factor = _lab_op(opts.reduceOp)
        steps = []
        for output, tensor in zip(outputs, inputs, strict=True):
            self._check_sizes(tensor, output.numel() * self.mesh.world_size, "input")
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
        self._check_count(outputs, "output_tensor_list")
        self._check_count(inputs, "input_tensor_list")
        # MPI's alltoallv: blocks of any size, one flat tensor each way
        flat = torch.empty(sum(t.numel() for t in inputs), dtype=inputs[0].dtype)
        prepared = collectives.prepare_all_to_all(self.mesh, flat, output_split_sizes=[t.numel() for t in outputs],
                                                  input_split_sizes=[t.numel() for t in inputs],
                                                  algorithm=self._algorithm("all_to_all"))

        def run() -> None:
            _flatten_into(flat, inputs)
            _unflatten_into(prepared.run(), outputs)

        return self._work(run, outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = _one(inputs, "gather")
        dst = opts.rootRank
        outputs = output_lists[0] if self.mesh.rank == dst else []
        if self.mesh.rank == dst:
            self._check_count(outputs, "gather_list")
        prepared = collectives.prepare_gather(self.mesh, tensor.reshape(-1), dst)

        def run() -> None:
            gathered = prepared.run()
            if gathered is not None:
                _unflatten_into(gathered, outputs)

        return self._work(run, outputs)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> LabWork:
        output = _one(outputs, "scatter")
        src = opts.rootRank
        inputs = input_lists[0] if self.mesh.rank == src else []
        if self.mesh.rank == src:
            self._check_count(inputs, "scatter_list")
        # every rank passes the whole tensor's shape; only src's contents are read
        whole = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_scatter(self.mesh, whole, src)

        def run() -> None:
            if inputs:
                _flatten_into(whole, inputs)
            output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs)

    def barrier(self, opts: Any = None) -> LabWork:
        return self._work(collectives.prepare_barrier(self.mesh).run, [])

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # -- point-to-point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LabWork:
        tensor = _one(tensors, "send")
        self._check_tag(tag)
        return self._work(lambda: self.mesh.send(dst, tensor), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LabWork:
        tensor = _one(tensors, "recv")
        self._check_tag(tag)

        def run() -> int:
            self._receive_into(tensor, self.mesh.recv(src), src)
            return src

        return self._work(run, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LabWork:
        tensor = _one(tensors, "recv")
        self._check_tag(tag)

        def run() -> int:
            src, received = self.mesh.recv(None)
            self._receive_into(tensor, received, src)
            return src

        return self._work(run, tensors)

    def _receive_into(self, tensor: torch.Tensor, received: torch.Tensor, src: int) -> None:
        if received.dtype != tensor.dtype or received.numel() != tensor.numel():
            raise LabError(f"rank {self.mesh.rank}: rank {src} sent {received.dtype}[{received.numel()}], "
                           f"but this rank receives into {tensor.dtype}[{tensor.numel()}]")
        tensor.copy_(received.view_as(tensor))

    # -- lifetime

    def shutdown(self) -> None:
        self.mesh.close()

    def abort(self) -> None:
        self.mesh.close()

    # -- checks (before anything is sent: torch raises these in the caller)

    def _check_count(self, tensors: list[torch.Tensor], name: str) -> None:
        if len(tensors) != self.mesh.world_size:
            raise ValueError(f"{name} must hold one tensor per rank ({self.mesh.world_size}); got {len(tensors)}")

    def _check_sizes(self, tensor: torch.Tensor, numel: int, name: str) -> None:
        if tensor.numel() != numel:
            raise ValueError(f"{name} must hold {numel} elements (the input's times the group's size); "
                             f"got {tensor.numel()}")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if tag != 0:
            raise ValueError(f"tag must be 0: the lab matches point-to-point messages in order per pair of "
                             f"ranks, not by tag; got tag={tag}")


# -- creation ---------------------------------------------------------------------------------

#: The world's mesh in this process, which every group of the world shares.
_world: dict[str, Mesh] = {}


def create(options: Any, pg_options: Any = None) -> LabProcessGroup:
    """torch's creator: the world's group (a new mesh through torch's store) or a ``new_group``
    (a sub-mesh of the world's, with a context id agreed through the group's store)."""
    lab_options = pg_options if isinstance(pg_options, Options) else Options()
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options must be lab.backend.Options; got {type(pg_options).__name__}")
    members = list(options.global_ranks_in_group)
    world = _world.get("mesh")
    if world is None or world.closed:
        if members and members != list(range(len(members))):
            raise LabError("a lab group other than the world was created before the world's")
        timeout_ms = lab_options.recv_timeout_ms
        if timeout_ms is None:
            timeout_ms = options.timeout.total_seconds() * 1000
        world = Mesh.from_store(options.store, options.group_rank, options.group_size, transport=lab_options.transport,
                                recv_timeout_ms=timeout_ms, trace=lab_options.trace)
        _world["mesh"] = world
        return LabProcessGroup(world, lab_options)
    # A new_group (any group after the world's, even one of every rank: its collectives may
    # interleave with the world's in any order): a sub-mesh with a context id of its own.
    return LabProcessGroup(world.sub_mesh(members or list(range(world.world_size)), _agree_context(options)),
                           lab_options)


def _agree_context(options: Any) -> int:
    """A context id for a new group, the same on its every member: its rank 0 draws the next one
    from a counter in the world's store and leaves it in the group's (c10d gives each group its
    own store prefix)."""
    store = options.store
    if options.group_rank == 0:
        drawn = store.underlying_store.add("lab/groups", 1) if hasattr(store, "underlying_store") else \
            store.add("lab/groups", 1)
        if drawn >= _GROUP_CONTEXT_TOP // 2:
            raise LabError(f"this job has made {drawn - 1:,} lab groups; context ids are spent")
        store.set("lab/context", str(_GROUP_CONTEXT_TOP - drawn))
    return int(store.get("lab/context"))


def register() -> None:
    """Register ``"lab"`` with ``torch.distributed`` (done by ``import lab``; idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


__all__ = ["NAME", "LabProcessGroup", "LabWork", "Options", "register"]
