"""What the ``"lab"`` backend hands torch for each operation: :class:`LabWork`.

``wait()`` raises ``torch.distributed.DistBackendError`` carrying the lab's message and the
group's flight recorder, with the lab's exception as its ``__cause__``; a failed operation's
future completes with a :class:`Failed` value that raises that same error when anything reads it.

    work = group.allreduce([grads])      # a LabWork, at once
    work.get_future().wait()             # [grads], reduced (or raises the failure)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lab.backend import flight_dumps
from lab.buffers import writable
from lab.collectives.prepared import find_lane, gather_into, scatter_through
from lab.comm.issue import Work
from lab.comm.operations import Operation


class Issuer(Protocol):
    """What a :class:`LabWork` needs of its group (:class:`lab.backend.group.LabProcessGroup`)."""
    def issue(self, run: Callable[[], Any], now: bool, p2p: str, what: Operation | None) -> Work:
        ...

    def torch_error(self, exc: BaseException) -> BaseException:
        ...


class Failed:
    """The value of a failed collective's future: reading it in any way raises the failure.

    C++ consumers take the tensors out of a future's Python value by pickling it, so
    ``__reduce__`` raising turns into an exception where they are (DDP's backward: a
    ``RuntimeError`` whose message carries this error's), where a future completed with
    ``set_exception`` would crash them (its value is the exception, which holds no tensors)."""
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
    def __init__(self, group: Issuer, work: Work, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._group, self._outputs = group, outputs
        self._future: torch.futures.Future = torch.futures.Future()
        self._error: BaseException | None = None
        self._converting = threading.Lock()
        self._source = -1
        self._work = work
        self._work.add_done_callback(self._complete)

    @classmethod
    def issued(cls, group: Issuer, run: Callable[[], Any], outputs: list[torch.Tensor], now: bool = False,
               p2p: str = "", what: Operation | None = None) -> LabWork:
        """The Work of ``run`` issued on ``group`` (``now``: on this thread if nothing is in flight;
        ``what``: noted where the rank records)."""
        return cls(group, group.issue(run, now, p2p, what), outputs)

    def _torch_error(self, exc: BaseException) -> BaseException:
        """``exc`` as torch's error, converted once (by the waiter or the completing thread)."""
        with self._converting:
            if self._error is None:
                self._error = self._group.torch_error(exc)
                flight_dumps.dump_on_failure(self._group, exc)  # (where Options.flight_dump says)
            return self._error

    def _complete(self, work: Work) -> None:
        try:  # (on the thread that completed it: the lab's own reading, no wait of the program's)
            result = work.outcome()
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the future's readers
            self._future.set_result(Failed(self._torch_error(exc)))
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
        self._future.wait()  # (the completion callback notes the sender: it may run after wait returns)
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()


class DoneWork(dist._Work):
    """A collective that completed before its call returned, from its lane
    (:func:`run_lane_now`): no thread, no future until one is asked for."""
    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._outputs)
        return self._future


def run_lane_now(group: Issuer, run: Callable[[], None], outputs: list[torch.Tensor]) -> dist._Work:
    """``run()``, a plain call's lane (``lab.collectives.prepared.Lane``: the compiled collective
    an earlier call like this one made), now, on this thread: a complete Work, or on failure a
    :class:`LabWork` that raises it as every other path's does."""
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 - the Work carries it to wait(), as issue_now's does
        failed: Future = Future()
        failed.set_exception(exc)
        return LabWork(group, Work(failed), outputs)
    return DoneWork(outputs)


def from_lane(group: Any, opts: Any, collective: str, tensor: torch.Tensor, *arguments: Any,
              into: torch.Tensor | None = None) -> dist._Work | None:
    """The Work of ``group``'s call like an earlier one, run from its lane before this returns
    (``lab.collectives.prepared.find_lane``: the lab's plain call's path, ~5 µs less than issuing
    it), or None: where ``group`` would run it now, nothing is in flight (the lane would wait for
    it, in issue order, where torch expects its Work back at once) and nothing records or checks
    replicas. ``into``: the output of an allgather (``tensor`` copied into its block at the
    lane's turn, then gathered there) or of a reduce_scatter (``tensor`` reduced on a copy, its
    block copied out)."""
    mesh = group.mesh
    if mesh.recording or group.options.check_replicas or mesh.closed or mesh.issue_queue.in_flight \
            or not (mesh.issue_queue.alone or getattr(opts, "asyncOp", True) is False):
        return None
    lane = find_lane(mesh, collective, tensor, *arguments, writes=into is None)
    if lane is None:
        return None
    if collective == "reduce_scatter":
        run = functools.partial(scatter_through, lane, tensor, into,
                                mesh.rank * into.numel() * into.element_size())
    elif into is not None:
        run = functools.partial(lane.through, into, functools.partial(gather_into, into, tensor, mesh.rank))
    else:
        run = functools.partial(lane, tensor)
    return run_lane_now(group, run, [tensor if into is None else into])


def fits(block: torch.Tensor, whole: torch.Tensor, world_size: int, output: torch.Tensor) -> bool:
    """Whether an allgather's or reduce_scatter's input and ``output`` (``whole`` or ``block``)
    can take a lane: one dtype, contiguous, ``whole`` N blocks, ``output`` known writable."""
    return type(block) is torch.Tensor and type(whole) is torch.Tensor and block.dtype == whole.dtype \
        and block.is_contiguous() and whole.is_contiguous() and whole.numel() == block.numel() * world_size \
        and writable(output)
