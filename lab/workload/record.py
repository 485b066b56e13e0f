"""Recording a workload: each rank's operations as issued, and the compute between them.

A :class:`Recorder` belongs to one rank. The lab's issue order (:mod:`lab.comm.operations`, where
this module registers it on import) calls :meth:`Recorder.issue` when a call is issued,
:meth:`Recorder.completed` when it completes, :meth:`Recorder.wait` when the program waits on its
Work, and :meth:`Recorder.returned` when control goes back to the program; the time between a
return and the next call is compute (the program's own work: forward, backward, optimizer).
:func:`mark_step` (the program's, after each ``optimizer.step()``) ends a step.
Lines are kept in memory and written at each step's end, at :meth:`Recorder.close` and whenever
:data:`MAX_HELD` lines are held, one ``write`` each (``O_APPEND``: the ranks' writes to one file do
not interleave within a line), so a recording costs a few microseconds a call and a system call
per step or per 1,024 lines. What it holds is bounded, ``mark_step`` or not: 1,024 lines (an
operation's line waits for its completion, which fills it in: the lines after one still running
wait with it, each an operation the lab holds pending too), and 1,024 asynchronous operations that
completed and were never waited on (past that, their waits are inferred then, as at a step's end).

Waits the lab cannot see: DDP waits on its buckets' futures in C++ (torch's reducer, at the end
of the backward pass), where no Python runs. At a step's end, an asynchronous operation that
completed and that the program never waited on through its Work is taken as waited on right after
the program's last call into the lab (a wait line marked ``"inferred": true``), and the time
until the last of them completed is not compute. Likewise a wait that comes within
:data:`WOKEN_NS` (1 ms) of its operation's completion, after the program's last call, was woken by
it (the program blocked on its future, where the lab cannot see, then waited on its Work): the
time until the completion is not compute, as if the program had waited right after its last call.
The backend reading an outcome as the operation completes (to complete torch's future) is the
lab's, not the program's: no wait.

    recorder = Recorder("step.jsonl", rank=0, world_size=4)
    index = recorder.operation("allreduce", [0, 1, 2, 3], "float32", 1024, 1024, reduce_op="sum",
                               is_async=True)
    recorder.returned()                # the Work went back to the program
    ...                                # compute
    recorder.wait(index); recorder.returned()
    recorder.mark_step()
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.comm import operations as recording
from lab.comm.operations import Operation
from lab.workload.format import DTYPE_BYTES, FORMAT, POINT_TO_POINT, VERSION

#: Distinct operations whose fixed fields a recorder keeps as JSON (past this, it starts over).
MAX_FIXED = 4096
#: Lines a recorder holds before it writes them, and completed asynchronous operations never waited
#: on that it holds before it infers their waits (the module's docstring).
MAX_HELD = 1024
#: A wait this soon after its operation completed was woken by that completion (module docstring).
WOKEN_NS = 1_000_000


def write_header(path: str | Path, world_size: int, dims: dict[str, int] | None = None,
                 recorded: dict | None = None) -> None:
    """Start the workload file at ``path`` (truncating it): its header line. One process does it,
    before any rank records (the pool's parent, or rank 0 under a launcher, before the others)."""
    header = {
        "format": FORMAT, "version": VERSION, "world_size": world_size, "dims": dims, "recorded": recorded or
        {}}
    Path(path).write_text(json.dumps(header) + "\n")


class Recorder:
    """One rank's recording into ``path`` (see the module's docstring)."""
    def __init__(self, path: str | Path, rank: int, world_size: int, clock=time.perf_counter_ns) -> None:
        self.path, self.rank, self.world_size, self._clock = str(path), rank, world_size, clock
        self._lock = threading.Lock()  # (program threads issue, the communication thread completes)
        self._rows: list[dict] = []  # events not written yet (an operation's: its completion fills it in)
        self._ops: dict[int, dict] = {}  # the operations among them, by index
        self._open: dict[int, int | None] = {}  # async operations not waited on: when each completed
        self._done_unwaited = 0  # those of them that completed
        self._fixed: dict[tuple, str] = {}  # each distinct operation's fixed fields, as JSON (_fixed_json)
        self._start = clock()
        self._returned = self._start  # when the program last got control back
        self._inside = 0  # lab calls in progress (a composite call issues others inside it)
        self._gradients: dict | None = None  # what record_gradients noted (once)
        self._labels: list = []  # a pipeline's labels of the transfers about to be issued (expect)
        self.step, self.issued = 0, 0

    @property
    def origin_ns(self) -> int:
        """The clock's reading (``time.perf_counter_ns``: one clock for every process of a machine)
        that the file's times of this rank count from: what lines up the ranks' timelines."""
        return self._start

    def _now_us(self, now: int) -> float:
        return (now - self._start) / 1e3

    def _compute_us(self, now: int) -> float:
        """The program's time since it last got control back, once: what it spent outside the lab."""
        if self._inside:
            return 0.0
        return max(now - self._returned, 0) / 1e3

    def operation(self, op: str, group: Sequence[int], dtype: str, count: int, out_count: int, *,
                  is_async: bool, dim: str | None = None, reduce_op: str | None = None,
                  root: int | None = None, peer: int | None = None, tag: int = 0,
                  split_sizes: dict | None = None) -> int:
        """Note an operation issued now (``group``, ``root``, ``peer``: global ranks); returns its
        index (what :meth:`wait` takes)."""
        what = Operation(op, tuple(group), dtype, DTYPE_BYTES.get(dtype, 1), count, out_count, dim, reduce_op,
                         root, peer, tag, split_sizes)
        return self.issue(what, is_async)

    def issue(self, what: Operation, is_async: bool) -> int:
        """Note ``what`` issued now, asynchronously or not; returns its index."""
        with self._lock:
            now = self._clock()
            if self._done_unwaited >= MAX_HELD:
                self._infer_waits()
            index, self.issued = self.issued, self.issued + 1
            row = {
                "kind": "op", "step": self.step, "index": index, "what": what, "async": is_async,
                "compute_us": self._compute_us(now), "issued_us": self._now_us(now)}
            if self._labels and what.op in POINT_TO_POINT:
                op, peer, label = self._labels.pop(0) or (None, None, None)
                if (op, peer) == (what.op, what.peer):  # (else not the transfer labelled: none)
                    row["label"] = label
            self._rows.append(row)
            self._ops[index] = row
            if is_async:
                self._open[index] = None
            self._inside += 1
            self._write_held()
            return index

    def completed(self, index: int, learned: dict | None = None) -> None:
        """Operation ``index`` completed now; ``learned``: what its result told (a receive's
        source, dtype and size), into its line."""
        with self._lock:
            now = self._clock()
            if index in self._open:
                self._open[index] = now
                self._done_unwaited += 1
            row = self._ops.get(index)
            if row is not None:  # (else written already: it completed after its step's end)
                row["completed_us"] = self._now_us(now)
                if learned:
                    row["learned"] = learned

    def wait(self, index: int) -> None:
        """The program waits on operation ``index`` now: a line for the first wait on an
        asynchronous operation (torch waits twice on some; a later wait finds it done)."""
        with self._lock:
            now = self._clock()
            if index in self._open:
                done = self._open.pop(index)
                if done is not None:
                    self._done_unwaited -= 1
                    if self._returned < done and now - done <= WOKEN_NS:  # woken by its completion:
                        self._returned = done  # blocked on it where the lab cannot see
                self._rows.append({
                    "kind": "wait", "step": self.step, "index": index, "waited_us": self._now_us(now),
                    "compute_us": self._compute_us(now)})
                self._write_held()
            self._inside += 1

    def returned(self) -> None:
        """Control went back to the program (a call returned, or its Work did)."""
        with self._lock:
            self._inside = max(self._inside - 1, 0)
            if not self._inside:
                self._returned = self._clock()

    def expect(self, labels: list) -> None:
        """The pipeline's transfers the program issues next, in order (:mod:`lab.workload.pipeline`):
        each ``(op, peer, {"stage": ..., "peer_stage": ..., "microbatch": ...})`` or None; ``[]``: no
        more. Each send or receive issued takes the next one where its op and peer agree."""
        with self._lock:
            self._labels = list(labels)

    def gradients(self, fields: dict) -> None:
        """Note a DDP model's gradients (:func:`record_gradients`): a ``gradients`` line, the first
        time; the same again adds nothing."""
        with self._lock:
            if fields != self._gradients:
                self._gradients = fields
                self._rows.append({"kind": "gradients", "step": self.step, "fields": fields})

    def mark_step(self) -> None:
        """The end of a training step: the waits the lab could not see, its line, and the step's
        lines written."""
        with self._lock:
            now = self._clock()
            self._infer_waits()
            self._rows.append({"kind": "step", "step": self.step, "compute_us": self._compute_us(now)})
            self._returned, self.step = now, self.step + 1
            self._flush()

    def _infer_waits(self) -> None:
        """A wait line for each asynchronous operation that completed unwaited, right after the
        program's last call into the lab; the time until the last one completed is no compute."""
        done = sorted((index, at) for index, at in self._open.items() if at is not None)
        self._done_unwaited = 0
        for index, _ in done:
            del self._open[index]
            self._rows.append({
                "kind": "wait", "step": self.step, "index": index, "inferred": True,
                "waited_us": self._now_us(self._returned), "compute_us": 0.0})
        if done:
            self._returned = max(self._returned, max(at for _, at in done))

    def _line(self, row: dict) -> str:
        """One event's line. Formatted here, not by ``json.dumps`` (which would cost more than the
        rest of a recording): every field but an operation's fixed ones is a number, times in µs
        to the clock's ns."""
        head = f'{{"rank":{self.rank},"step":{row["step"]},"kind":"{row["kind"]}"'
        if row["kind"] == "gradients":  # (once a recording)
            return f"{head},{json.dumps(row['fields'], separators=(',', ':'))[1:]}\n"
        compute = f'"compute_us":{row["compute_us"]:.3f}'
        if row["kind"] == "step":
            return f"{head},{compute}}}\n"
        if row["kind"] == "wait":
            inferred = ',"inferred":true' if row.get("inferred") else ""
            return f'{head},"index":{row["index"]},"waited_us":{row["waited_us"]:.3f},{compute}{inferred}}}\n'
        completed = f',"completed_us":{row["completed_us"]:.3f}' if "completed_us" in row else ""
        is_async = "true" if row["async"] else "false"
        label = "".join(f',"{name}":{value}'
                        for name, value in row["label"].items()) if "label" in row else ""
        return (f'{head},"index":{row["index"]},{self._fixed_of(row)}{label},"async":{is_async},{compute},'
                f'"issued_us":{row["issued_us"]:.3f}{completed}}}\n')

    def _fixed_of(self, row: dict) -> str:
        """An operation's fixed fields as JSON, made once per distinct operation (not one with
        split sizes, nor one whose result told more)."""
        what, learned = row["what"], row.get("learned")
        if learned or what.split_sizes is not None:
            return _fixed_json(what, learned)
        key = what[:-1]  # (not learn: a receive's may be made for each call)
        found = self._fixed.get(key)
        if found is None:
            if len(self._fixed) >= MAX_FIXED:
                self._fixed.clear()
            found = self._fixed[key] = _fixed_json(what, None)
        return found

    def _write_held(self) -> None:
        """Past :data:`MAX_HELD` lines held, write those before the first operation still running."""
        if len(self._rows) >= MAX_HELD:
            rows = self._rows
            running = (i for i, row in enumerate(rows) if row["kind"] == "op" and "completed_us" not in row)
            self._flush(next(running, len(rows)))

    def _flush(self, count: int | None = None) -> None:
        """Write the first ``count`` lines held (None: all)."""
        written = self._rows[:count]
        if not written:
            return
        data = "".join(map(self._line, written)).encode()
        del self._rows[:len(written)]
        for row in written:
            if row["kind"] == "op":
                del self._ops[row["index"]]
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.write(fd, data) != len(data):  # (a regular file takes it whole, or the disk is full)
                raise OSError(f"{self.path}: the workload's lines were written in part (disk full?)")
        finally:
            os.close(fd)

    def close(self) -> None:
        """Write what is left (the events after the last step's end, which a replay leaves out)."""
        with self._lock:
            self._flush()


def _fixed_json(what: Operation, learned: dict | None) -> str:
    """The fields of ``what``'s line that do not change from call to call, as the inside of a JSON
    object; ``learned``: what its result told (a receive's source, dtype and size)."""
    dtype, count, out_count = _in_format(what.dtype, what.itemsize, what.count, what.out_count)
    fields = {
        "op": what.op, "group": list(what.group), "dim": what.dim, "dtype": dtype, "count": count,
        "out_count": out_count, "reduce_op": what.reduce_op, "root": what.root}
    if what.op in POINT_TO_POINT:
        fields.update(peer=what.peer, tag=what.tag)  # (from any source: the peer comes as it completes)
    if what.split_sizes is not None:
        fields["split_sizes"] = what.split_sizes
    if what.algorithm is not None:
        fields["algorithm"] = what.algorithm
    if learned:
        fields.update(_learned(learned))
    return json.dumps(fields, separators=(",", ":"))[1:-1]


def _learned(learned: dict) -> dict:
    """The fields of an operation's line that its result told (a receive's dtype and size: in the
    file's dtypes, :func:`_in_format`)."""
    learned = dict(learned)
    if "dtype" in learned:
        sized = (learned.pop(name) for name in ("dtype", "itemsize", "count", "out_count"))
        learned.update(zip(("dtype", "count", "out_count"), _in_format(*sized)))
    return learned


def _in_format(dtype: str, itemsize: int, count: int, out_count: int) -> tuple[str, int, int]:
    """A dtype the file names, with its counts; another one (float8, uint32, ...) as its bytes."""
    if dtype in DTYPE_BYTES:
        return dtype, int(count), int(out_count)
    return "uint8", int(count) * itemsize, int(out_count) * itemsize


def mark_step() -> bool:
    """End this rank's training step in its recording: call it after each ``optimizer.step()``.

    Returns True; False, doing nothing, where this process records nothing (no ``workload=``,
    ``LAB_WORKLOAD`` or ``Options(workload=)``), so a training loop may call it always.

        loss.backward(); optimizer.step()
        lab.workload.mark_step()
    """
    recorder = recording.current()
    if not isinstance(recorder, Recorder):
        return False
    recorder.mark_step()
    return True


def record_gradients(model: Any) -> bool:
    """Note ``model``'s gradients in this rank's recording: ``model`` is torch's
    ``DistributedDataParallel``; call it once, on every rank, once it is built. What DDP reduces,
    in its order (its parameters that take a gradient, in ``named_modules`` order without those it
    ignores, reversed), its group and its bucket caps: what ``lab.workload.replay(...,
    bucket_mb=X)`` re-buckets them with. Returns True; False, doing nothing, where this process
    records nothing.

        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2)
        lab.workload.record_gradients(ddp)
    """
    import torch
    import torch.distributed as dist

    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"model must be a torch.nn.parallel.DistributedDataParallel; got {type(model).__name__}")
    recorder = recording.current()
    if not isinstance(recorder, Recorder):
        return False
    ignored, seen, parameters = getattr(model, "parameters_to_ignore", set()), set(), []
    for module_name, module in model.module.named_modules():  # (as DDP lists what it reduces)
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.requires_grad and f"{module_name}.{name}" not in ignored and id(
                    parameter) not in seen:
                seen.add(id(parameter))
                parameters.append(parameter)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in parameters})
    if len(dtypes) != 1:
        raise ValueError(f"model's gradients must be of one dtype (DDP buckets each dtype apart, which "
                         f"re-bucketing does not model); got {', '.join(dtypes) or 'none'}")
    config = getattr(model, "_bucket_config", None)  # (torch 2.13's; before it, the default's flag)
    cap = int(model.bucket_bytes_cap)
    first = config.first_bucket_bytes_cap if config is not None else \
        min(dist._DEFAULT_FIRST_BUCKET_BYTES, cap) if getattr(model, "bucket_bytes_cap_default", False) else cap
    sized = [_in_format(dtypes[0], p.element_size(), p.numel(), p.numel())[:2] for p in reversed(parameters)]
    recorder.gradients({
        "group": dist.get_process_group_ranks(model.process_group), "dtype": sized[0][0],
        "counts": [count for _, count in sized], "bucket_cap_bytes": cap,
        "first_bucket_cap_bytes": int(first)})
    return True
