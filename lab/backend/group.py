"""The ``"lab"`` backend's process group: every ``torch.distributed`` operation as a lab collective.

Each operation is checked and prepared in the caller (``lab.collectives.calls.prepare_*``: a bad
argument raises there, as torch's own backends do) and runs on the mesh's communication thread in
issue order (a ``new_group``'s mesh has an order and thread of its own: groups progress
independently); it returns a :class:`lab.backend.work.LabWork` at once. torch's tensor lists are
flattened into one tensor per collective, as gloo does.

    group = LabProcessGroup(mesh, Options())        # what lab.backend.create builds
    group.allreduce([grads]).wait()                 # lab.allreduce(mesh, grads) in issue order
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lab.backend import replicas
from lab.backend.args import (
    NamedGroup,
    Options,
    check_count,
    check_gather_lists,
    check_like,
    check_list,
    describe,
    flatten_into,
    lab_op,
    one,
    output_bytes,
    unflatten_into,
)
from lab.backend.send_recv import SendRecv
from lab.backend.work import LabWork, fits, from_lane
from lab.collectives import calls as collectives
from lab.comm.issue import Work
from lab.comm.operations import Operation
from lab.comm.protocols import BackendMesh
from lab.errors import LabError

#: A collective with at most this many bytes of output runs on the calling thread when nothing
#: else is in flight: handing it to the communication thread and waking the caller again cost
#: more than a small collective (measured: bench/torch_backend.py). Where another group has an
#: order of its own, only a synchronous call (``async_op=False``: torch's ``opts.asyncOp``) does:
#: an asynchronous one would hold its caller until its peers join, and a peer that issues another
#: group's collective first may wait for one this caller would issue next.
RUN_NOW_MAX_BYTES = 64 * 1024


class LabProcessGroup(SendRecv, NamedGroup):
    """A ``torch.distributed`` process group whose every operation is a lab collective on
    ``mesh`` (the world's mesh, or a sub-mesh of it for ``new_group``, with ``own_order``: an issue
    order of its own, stopped at ``shutdown``; not ``owns_mesh``: the program's,
    :func:`lab.backend.init_process_group`)."""
    def __init__(self, mesh: BackendMesh, options: Options, owns_mesh: bool = True,
                 own_order: bool = False) -> None:
        super().__init__(mesh.rank, mesh.world_size)
        self.mesh, self.options, self.owns_mesh, self.own_order = mesh, options, owns_mesh, own_order

    def __repr__(self) -> str:
        return f"lab process group {self._group_name or '?'} (rank {self.mesh.rank} of {self.mesh.world_size})"

    def issue(self, run: Callable[[], Any], now: bool = False, p2p: str = "",
              what: Operation | None = None) -> Work:
        """``run`` in the mesh's issue order, on its communication thread; with ``now``, on this
        thread if nothing is in flight (:meth:`lab.comm.issue.IssueQueue.issue_now`); noted as ``what``."""
        if self.mesh.closed:
            raise dist.DistBackendError(f"{self}: the group was shut down")
        if now:
            return self.mesh.issue_now(run, what)
        return self.mesh.issue(run, async_op=True, p2p=p2p, what=what)

    def torch_error(self, exc: BaseException) -> BaseException:
        """``exc`` as torch raises backend failures: ``DistBackendError`` with the lab's message and
        this rank's last collectives; a bad argument stays what it was."""
        if not isinstance(exc, LabError):
            return exc
        records = "\n".join(f"  {record}" for record in self.mesh.flight_records()[-8:])
        error = dist.DistBackendError(
            f"{type(exc).__name__}: {exc}\nflight recorder of rank {self.mesh.rank} "
            f"({self}), oldest first:\n{records}")
        error.__cause__ = exc
        return error

    def _algorithm(self, collective: str) -> str:
        return self.options.algorithms.get(collective, "auto")

    def _work(self, run: Callable[[], Any], outputs: list, op: str, inputs: list, ran: Any = None,
              opts: Any = None, **rest: Any) -> LabWork:
        """The Work of ``run``, torch's ``op`` of ``inputs`` into ``outputs`` (its options ``opts``),
        running the lab collective ``ran`` (``lab.collectives.Prepared``, or a list of them; noted
        as :func:`lab.backend.args.describe` says). A collective of at most ``RUN_NOW_MAX_BYTES`` of
        output runs before this returns when nothing else is in flight, and either no group has an
        order of its own or torch waits on it at once (the Work is then complete); a send or
        receive always goes to the communication thread (an irecv must not block). ``run`` writes
        outside autograd, as torch's backends do (pipelining receives into tensors that require grad)."""
        p2p = op if op in ("send", "recv") else ""
        now = not p2p and output_bytes(outputs) <= RUN_NOW_MAX_BYTES and (
            self.mesh.issue_queue.alone or getattr(opts, "asyncOp", True) is False)
        what = describe(self.mesh, self.dim, op, inputs, outputs, ran=ran, **rest)
        checked = replicas.checked(self, op, torch.no_grad()(run), outputs)
        return LabWork.issued(self, checked, outputs, now, p2p, what)

    # -- collectives: checked here, in the caller (``collectives.prepare_*``); run in issue order

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(tensors, "allreduce")
        op, factor = lab_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        done = None if factor is not None else from_lane(self, opts, "allreduce", tensor, op,
                                                         self._algorithm("allreduce"))
        if done is not None:
            return done
        prepared = collectives.prepare_allreduce(self.mesh, tensor, op, self._algorithm("allreduce"))

        def run() -> None:
            if factor is not None:
                tensor.mul_(factor)  # in place anyway: the result replaces it
            prepared.run()

        return self._work(run, tensors, "allreduce", tensors, ran=prepared, opts=opts, reduce_op=op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        op, factor = lab_op(opts.reduceOp)
        flat = torch.empty(sum(t.numel() for t in tensors),
                           dtype=tensors[0].dtype if tensors else torch.float32)
        prepared = collectives.prepare_allreduce(self.mesh, flat, op, self._algorithm("allreduce"))

        def run() -> None:
            flatten_into(flat, tensors, factor)  # one collective for all, as gloo does
            prepared.run()
            unflatten_into(flat, tensors)

        return self._work(run, tensors, "allreduce", tensors, ran=prepared, opts=opts, reduce_op=op)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LabWork:
        tensor = one(tensors, "broadcast")
        done = from_lane(self, opts, "broadcast", tensor, opts.rootRank, self._algorithm("broadcast"))
        if done is not None:
            return done
        prepared = collectives.prepare_broadcast(self.mesh, tensor, opts.rootRank,
                                                 self._algorithm("broadcast"))
        return self._work(prepared.run, tensors, "broadcast", tensors, ran=prepared, opts=opts,
                          root=opts.rootRank)

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

        return self._work(run, tensors, "reduce", tensors, ran=prepared, opts=opts, root=dst, reduce_op=op)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> LabWork:
        tensor = one(inputs, "all_gather")
        outputs = output_lists[0]
        check_list(outputs, self.mesh.world_size, tensor.numel(), tensor.dtype, "tensor_list")
        # the tensor itself: read when the gather runs, after the collectives issued before it
        prepared = collectives.prepare_allgather(self.mesh, tensor, self._algorithm("allgather"))
        run = lambda: unflatten_into(prepared.run().reshape(-1), outputs)
        return self._work(run, output_lists, "allgather", inputs, ran=prepared, opts=opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.all_gather_single(output, input, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        if fits(input, output, self.mesh.world_size, output):
            done = from_lane(self, opts, "allgather", input, self._algorithm("allgather"), into=output)
            if done is not None:
                return done
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> LabWork:
        # output_lists[r][i]: rank r's inputs[i] (torch's layout: one list per rank)
        check_gather_lists(output_lists, inputs, self.mesh.world_size)
        algorithm = self._algorithm("allgather")
        prepared = [collectives.prepare_allgather(self.mesh, tensor, algorithm) for tensor in inputs]

        def run() -> None:
            for i, gather in enumerate(prepared):
                unflatten_into(gather.run().reshape(-1), [outputs[i] for outputs in output_lists])

        return self._work(run, [t for outputs in output_lists for t in outputs], "allgather", inputs,
                          ran=prepared, opts=opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        for output, tensor in zip(outputs, inputs, strict=True):
            check_like(output, tensor.numel() * self.mesh.world_size, tensor.dtype, "output_tensor")
        algorithm = self._algorithm("allgather")
        prepared = [collectives.prepare_allgather(self.mesh, tensor, algorithm) for tensor in inputs]

        def run() -> None:
            for output, gather in zip(outputs, prepared, strict=True):
                output.copy_(gather.run().view_as(output))

        return self._work(run, outputs, "allgather", inputs, ran=prepared, opts=opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> LabWork:
        output = one(outputs, "reduce_scatter")
        inputs = input_lists[0]
        check_list(inputs, self.mesh.world_size, output.numel(), output.dtype, "input_list")
        op, factor = lab_op(opts.reduceOp)
        flat = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_reduce_scatter(self.mesh, flat, op, self._algorithm("reduce_scatter"))

        def run() -> None:
            flatten_into(flat, inputs, factor)
            output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs, "reduce_scatter", input_lists, ran=prepared, opts=opts, reduce_op=op)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> LabWork:
        op, factor = lab_op(opts.reduceOp)
        if factor is None and fits(output, input, self.mesh.world_size, output):
            flat = input.view(-1)
            done = from_lane(self, opts, "reduce_scatter", flat, op, self._algorithm("reduce_scatter"),
                             flat.numel(), into=output)
            if done is not None:
                return done
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> LabWork:
        op, factor = lab_op(opts.reduceOp)
        steps, ran = [], []
        for output, tensor in zip(outputs, inputs, strict=True):
            check_like(tensor, output.numel() * self.mesh.world_size, output.dtype, "input")
            # Blocks are split along a flat input. A copy (staged) where it cannot be a view, made
            # when the collective runs (an earlier async collective may still write the input);
            # PREMUL_SUM reduces a scaled copy: torch leaves the input as it was.
            staged = factor is not None or not tensor.is_contiguous()
            source = torch.empty(tensor.numel(), dtype=tensor.dtype) if staged else tensor.view(-1)
            prepared = collectives.prepare_reduce_scatter(self.mesh, source, op,
                                                          self._algorithm("reduce_scatter"))
            steps.append((output, tensor, staged, source))
            ran.append(prepared)

        def run() -> None:
            for (output, tensor, staged, source), prepared in zip(steps, ran, strict=True):
                if staged:
                    flatten_into(source, [tensor], factor)
                output.copy_(prepared.run().view_as(output))

        return self._work(run, outputs, "reduce_scatter", inputs, ran=ran, opts=opts, reduce_op=op)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> LabWork:
        row = input[0].numel() if input.dim() else 1
        received = sum(output_split_sizes) * row if output_split_sizes else input.numel()
        check_like(output, received, input.dtype, "output")
        prepared = collectives.prepare_all_to_all(self.mesh, input,
                                                  output_split_sizes=list(output_split_sizes) or None,
                                                  input_split_sizes=list(input_split_sizes) or None,
                                                  algorithm=self._algorithm("all_to_all"))
        return self._work(lambda: output.copy_(prepared.run().view_as(output)), [output], "all_to_all",
                          [input], ran=prepared, opts=opts,
                          split_sizes=(input_split_sizes, output_split_sizes))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> LabWork:
        check_count(outputs, self.mesh.world_size, "output_tensor_list")
        check_count(inputs, self.mesh.world_size, "input_tensor_list")
        # MPI's alltoallv: blocks of any size, one flat tensor each way
        flat = torch.empty(sum(t.numel() for t in inputs), dtype=inputs[0].dtype)
        prepared = collectives.prepare_all_to_all(self.mesh, flat,
                                                  output_split_sizes=[t.numel() for t in outputs],
                                                  input_split_sizes=[t.numel() for t in inputs],
                                                  algorithm=self._algorithm("all_to_all"))

        def run() -> None:
            flatten_into(flat, inputs)
            unflatten_into(prepared.run(), outputs)

        splits = ([t.numel() for t in inputs], [t.numel() for t in outputs])
        return self._work(run, outputs, "all_to_all", inputs, ran=prepared, opts=opts, split_sizes=splits)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> LabWork:
        tensor = one(inputs, "gather")
        dst = opts.rootRank
        outputs = output_lists[0] if self.mesh.rank == dst else []
        if self.mesh.rank == dst:
            check_list(outputs, self.mesh.world_size, tensor.numel(), tensor.dtype, "gather_list")
        prepared = collectives.prepare_gather(self.mesh, tensor, dst)  # read when it runs, in issue order

        def run() -> None:
            gathered = prepared.run()
            if gathered is not None:
                unflatten_into(gathered.reshape(-1), outputs)

        return self._work(run, outputs, "gather", inputs, ran=prepared, opts=opts, root=dst)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> LabWork:
        output = one(outputs, "scatter")
        src = opts.rootRank
        inputs = input_lists[0] if self.mesh.rank == src else []
        if self.mesh.rank == src:
            check_list(inputs, self.mesh.world_size, output.numel(), output.dtype, "scatter_list")
        # every rank passes the whole tensor's shape; only src's contents are read
        whole = torch.empty(output.numel() * self.mesh.world_size, dtype=output.dtype)
        prepared = collectives.prepare_scatter(self.mesh, whole, src)

        def run() -> None:
            if inputs:
                flatten_into(whole, inputs)
            output.copy_(prepared.run().view_as(output))

        # every rank counts the whole, as lab.scatter takes it (only the root's is read)
        return self._work(run, outputs, "scatter", [whole], ran=prepared, opts=opts, root=src)

    def barrier(self, opts: Any = None) -> LabWork:
        prepared = collectives.prepare_barrier(self.mesh)
        return self._work(prepared.run, [], "barrier", [], ran=prepared, opts=opts)

    # -- lifetime

    def shutdown(self) -> None:
        if self.own_order:  # (its sub-mesh owns no channels: the world's mesh closes them)
            self.mesh.issue_queue.close()
        elif self.owns_mesh:  # (the program's mesh outlives torch's groups)
            self.mesh.close()

    def abort(self) -> None:
        self.shutdown()
