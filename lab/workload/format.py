"""A workload file: what a training job's ranks issued to the lab, one JSON object a line.

Version 2. The first line describes the recording; every other line is one event of one rank, in
the order that rank issued it::

    {"format": "lab-workload", "version": 2, "world_size": 4, "dims": {"dp": 4}, "recorded": {...}}
    {"rank": 0, "step": 0, "kind": "gradients", "group": [0, 1, 2, 3], "dtype": "float32",
     "counts": [16, 65536, 4096, 262144], "bucket_cap_bytes": 26214400, "first_bucket_cap_bytes": 1048576}
    {"rank": 0, "step": 0, "kind": "op", "index": 0, "op": "allreduce", "group": [0, 1, 2, 3],
     "dim": "dp", "dtype": "float32", "count": 6553600, "out_count": 6553600, "reduce_op": "sum",
     "root": null, "algorithm": "ring", "async": true, "compute_us": 812.5, "issued_us": 812.5,
     "completed_us": 4020.1}
    {"rank": 0, "step": 0, "kind": "wait", "index": 0, "compute_us": 30.2}
    {"rank": 0, "step": 0, "kind": "step", "compute_us": 95.0}

- ``kind`` ``"op"``: a collective or point-to-point call. ``index`` numbers the rank's operations
  from 0; ``group`` is the global ranks the call ran on (its mesh, or torch's process group);
  ``dim`` the DeviceMesh dimension that made the group (null: none); ``count`` and ``out_count``
  the elements of the input and of the output; ``reduce_op`` for reductions; ``root`` for rooted
  collectives, ``peer`` (the global rank) and ``tag`` for ``send``/``recv``; ``split_sizes``
  ``{"in": [...], "out": [...]}`` for an uneven all_to_all; ``algorithm`` the one the lab ran
  (``auto``'s pick resolved; absent for a send or receive); ``async`` whether the call returned a
  Work at once. ``issued_us``, ``waited_us`` and ``completed_us`` are measured on the rank's clock
  from the start of the recording (optional: the replay reads them only for the time a call held
  the program past its operation, :mod:`lab.workload.held`; the per-stage breakdown of a recording
  reads them: :func:`lab.workload.pipeline.measured_stages`).
- A pipeline's transfers may carry ``stage``, ``peer_stage`` and ``microbatch`` (all three or
  none; :mod:`lab.workload.pipeline` says what they mean): a reader that ignores them replays the same.
- ``kind`` ``"wait"``: the program waited on its operation ``index`` (``Work.wait()``).
- ``kind`` ``"step"``: the end of a training step (``lab.workload.mark_step()``).
- ``kind`` ``"gradients"``: a DDP model's gradients (``lab.workload.record_gradients``), at most one
  line a rank: the ``group`` DDP reduces them on, their ``dtype``, each one's element ``counts`` in
  the order DDP reduces them (its parameters' order reversed), and DDP's bucket caps in bytes. Not
  an event: it has no ``compute_us``, and the replay reads it only to re-bucket (``bucket_mb=``).
- ``dims`` in the header: the DeviceMesh's dimensions (names and sizes, outermost first), or null.
  The lab writes null (it starts the file before the program builds its mesh); :func:`load` then
  derives them from the operations' ``dim`` and groups (:func:`mesh_dims`), so a recording of a
  2-D DeviceMesh re-targets each dimension by name.
- ``compute_us`` on every event: the rank's host time since its previous event that was not spent
  inside the lab (the forward, backward and optimizer work between calls).

The version changes where a reader of the one before would misread a file or refuse it (a new
kind of line, a field whose meaning changes); :func:`load` reads every version up to its own.
Version 2 added the ``gradients`` line and the operations' ``algorithm``: a version 1 file has
neither, and loads with none.

:func:`load` reads and checks a file, a line at a time: a field missing, of the wrong kind (``true``
is no number) or out of its bounds, an unknown version, an event that names an operation the rank
never issued or whose ``step`` is not the number of steps its rank marked before it, and a send
and its receive (the k-th of a rank to another with one tag) of different bytes are each a
``ValueError`` naming the file, the line and the field. Bounds: ``world_size`` up to 2**24 (the
simulator's), an operation's bytes up to 1 TiB, times up to a year (:data:`MAX_US`), the file up to
:data:`MAX_FILE_BYTES` and a line up to :data:`MAX_LINE_BYTES`. Only the ranks that have events
take memory, whatever ``world_size`` the header claims.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lab.catalog import COLLECTIVES as CATALOG
from lab.sim.limits import MAX_NBYTES, MAX_WORLD_SIZE
from lab.workload.dims import mesh_dims
from lab.workload.held import derive_held
from lab.workload.labels import PIPELINE_LABELS, check_pair, read_labels
from lab.workload.thread_time import derive_thread_time

FORMAT, VERSION = "lab-workload", 2
#: The versions :func:`load` reads (see the module's docstring).
READS = (1, 2)
COLLECTIVES = tuple(CATALOG)
POINT_TO_POINT = ("send", "recv")
KINDS = ("op", "wait", "step")  # the events; a "gradients" line is none
DTYPE_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2, "int32": 4,
    "int64": 8, "bool": 1, "complex64": 8, "complex128": 16}
#: The most :func:`load` reads: a file of 1 GiB (some 3 million events: a replay needs a few
#: steps, not a whole training run) and a line of 16 MiB (a gradients line lists every gradient).
#: Past either, a ValueError naming the file and the limit, before more is read.
MAX_FILE_BYTES, MAX_LINE_BYTES = 1 << 30, 1 << 24
#: The most a time field (``compute_us`` and the clocks) may say, µs: a year.
MAX_US = 365 * 86_400 * 1e6
# (and from lab.sim.limits: world_size at most MAX_WORLD_SIZE, 2**24; an operation's or the
# gradients' bytes at most MAX_NBYTES, 1 TiB)


@dataclass(slots=True)
class Event:
    """One line after the header: what rank ``rank`` did, and the compute before it."""

    rank: int
    step: int
    kind: str
    compute_us: float
    index: int = -1  # the operation's (op) or the one waited on (wait)
    op: str = ""
    group: tuple[int, ...] = ()
    dim: str | None = None
    dtype: str = "float32"
    count: int = 0
    out_count: int = 0
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    tag: int = 0
    split_sizes: dict | None = None
    algorithm: str | None = None  # the one the lab ran (None: the file does not say)
    is_async: bool = False
    stage: int | None = None  # a pipeline's transfer: the stage on this rank, the one at the other end
    peer_stage: int | None = None
    microbatch: int | None = None
    issued_us: float | None = None  # the rank's clocks (informative)
    waited_us: float | None = None
    completed_us: float | None = None
    inferred: bool = False  # a wait the recorder inferred at a step's end
    held_us: float = 0.0  # the call's time that is the rank's own, from the clocks (lab.workload.held)
    thread_us: float = 0.0  # a transfer's time on the communication thread (lab.workload.thread_time)

    @property
    def nbytes(self) -> int:
        """Bytes of the input, as the simulator and nccl-tests count a collective's size."""
        return self.count * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Gradients:
    """A DDP model's gradients as a rank recorded them (``lab.workload.record_gradients``): the
    ``group`` (global ranks) DDP reduces them on, their ``dtype``, each one's elements in the order
    DDP reduces them, and DDP's bucket caps (bytes)."""

    group: tuple[int, ...]
    dtype: str
    counts: tuple[int, ...]
    bucket_cap_bytes: int
    first_bucket_cap_bytes: int

    @property
    def sizes(self) -> list[int]:
        """Each gradient's bytes, in the order DDP reduces them."""
        return [count * DTYPE_BYTES[self.dtype] for count in self.counts]


@dataclass
class Workload:
    """A loaded workload: the header's fields, each rank's events in issue order, and the
    gradients of a DDP model by rank, where the ranks recorded them."""

    world_size: int
    dims: dict[str, int] | None
    recorded: dict
    events: dict[int, list[Event]] = field(default_factory=dict)
    path: str = ""
    gradients: dict[int, Gradients] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """How many steps every rank marked (a rank's events after its last mark are left out; a
        rank with no event marked none)."""
        if len(self.events) < self.world_size:
            return 0
        return min((sum(e.kind == "step" for e in events) for events in self.events.values()), default=0)


def _kind_name(kinds: type | tuple) -> str:
    if kinds == (int, float):
        return "a number"
    names = {int: "an integer", str: "a string", list: "a list", dict: "an object", bool: "true or false"}
    return names[kinds]


def _need(row: dict, name: str, kinds: type | tuple, where: str) -> Any:
    """``row[name]``, of ``kinds`` (never a bool where a number is asked for: ``true`` is not 1)."""
    value = row.get(name)
    if not isinstance(value, kinds) or isinstance(value, bool) and kinds in (int, (int, float)):
        raise ValueError(f"{where}: field {name!r} must be {_kind_name(kinds)}; got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """``value`` as an error shows it: a long one cut short (a line may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text):,} characters)"


def _integer(row: dict, name: str, where: str, low: int, high: int) -> int:
    value = _need(row, name, int, where)
    if not low <= value <= high:
        raise ValueError(f"{where}: field {name!r} must be an integer in [{low:,}, {high:,}]; "
                         f"got {_shown(value)}")
    return value


def _optional(row: dict, name: str, kinds: type, where: str) -> Any:
    """``row[name]``: of ``kinds``, or null (or absent)."""
    return None if row.get(name) is None else _need(row, name, kinds, where)


def _time_us(row: dict, name: str, where: str) -> float:
    value = _need(row, name, (int, float), where)
    if not 0 <= value <= MAX_US:
        raise ValueError(f"{where}: field {name!r} must be a finite number >= 0 of µs, at most {MAX_US:g} "
                         f"(MAX_US: a year); got {_shown(value)}")
    return float(value)


def _elements(value: Any, itemsize: int) -> bool:
    """An element count whose bytes are within :data:`MAX_NBYTES`."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value * itemsize <= MAX_NBYTES


def _header(row: Any, where: str) -> tuple[int, dict | None, dict]:
    if not isinstance(row, dict) or row.get("format") != FORMAT:
        raise ValueError(f'{where}: not a lab workload (the first line must have "format": "{FORMAT}")')
    version = row.get("version")
    if version not in READS or isinstance(version, bool):
        raise ValueError(f"{where}: field 'version' is {_shown(version)}; this lab reads versions "
                         f"{', '.join(map(str, READS))}")
    world_size = _integer(row, "world_size", where, 1, MAX_WORLD_SIZE)
    dims = _optional(row, "dims", dict, where)
    if dims is not None and (not all(_elements(v, 1) and 1 <= v <= world_size
                                     for v in dims.values()) or math.prod(dims.values()) != world_size):
        raise ValueError(f"{where}: field 'dims' must map names to sizes whose product is world_size "
                         f"({world_size}); got {_shown(dims)}")
    return world_size, dims, _optional(row, "recorded", dict, where) or {}


def _event(row: Any, world_size: int, where: str) -> Event:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an event must be a JSON object; got {type(row).__name__}")
    rank = _integer(row, "rank", where, 0, world_size - 1)
    kind = _need(row, "kind", str, where)
    if kind not in KINDS:
        raise ValueError(f"{where}: field 'kind' must be one of {', '.join(KINDS)}; got {_shown(kind)}")
    event = Event(rank, _need(row, "step", int, where), kind, _time_us(row, "compute_us", where))
    for name in ("issued_us", "waited_us", "completed_us"):  # (informative: checked, kept)
        if name in row:
            setattr(event, name, _time_us(row, name, where))
    if "inferred" in row:
        event.inferred = _need(row, "inferred", bool, where)
    if kind == "step":
        return event
    event.index = _need(row, "index", int, where)  # (the reader checks it against the rank's operations)
    if kind == "op":
        _operation(row, event, world_size, where)
    return event


def _operation(row: dict, event: Event, world_size: int, where: str) -> None:
    """An operation's fields, into ``event``."""
    event.op = _need(row, "op", str, where)
    if event.op not in COLLECTIVES + POINT_TO_POINT:
        raise ValueError(f"{where}: field 'op' must be one of {', '.join(COLLECTIVES + POINT_TO_POINT)}; "
                         f"got {_shown(event.op)}")
    event.group = _group(row, event.rank, world_size, where)
    event.dim, event.reduce_op = _optional(row, "dim", str, where), _optional(row, "reduce_op", str, where)
    event.dtype = _dtype(row, where)
    most = MAX_NBYTES // DTYPE_BYTES[event.dtype]
    event.count = _integer(row, "count", where, 0, most)
    event.out_count = _integer(row, "out_count", where, 0, most)
    event.split_sizes = _split_sizes(row, len(event.group), where)
    event.algorithm = _optional(row, "algorithm", str, where)
    event.is_async = _need(row, "async", bool, where)
    event.root = _optional(row, "root", int, where)
    if event.op in POINT_TO_POINT:
        event.peer = _integer(row, "peer", where, 0, world_size - 1)
        event.tag = 0 if row.get("tag") is None else _integer(row, "tag", where, 0, 2**31 - 1)
        if event.peer == event.rank:
            raise ValueError(f"{where}: field 'peer' must be another rank than {event.rank}; "
                             f"got {event.peer}")
    elif event.root is not None and event.root not in event.group:
        raise ValueError(f"{where}: field 'root' must be a member of the group; got {event.root}")
    if any(row.get(name) is not None for name in PIPELINE_LABELS):  # (a pipeline's transfer)
        read_labels(row, event, where, event.op in POINT_TO_POINT)


def _group(row: dict, rank: int, world_size: int, where: str) -> tuple[int, ...]:
    group = _need(row, "group", list, where)
    if (not group or
            not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < world_size for g in group) or
            len(set(group)) != len(group) or rank not in group):
        raise ValueError(f"{where}: field 'group' must list distinct ranks in [0, {world_size}) that include "
                         f"rank {rank}; got {_shown(group)}")
    return tuple(group)


def _split_sizes(row: dict, group_size: int, where: str) -> dict | None:
    """An uneven all_to_all's rows to each member and from each (``{"in": [...], "out": [...]}``;
    torch's empty list: even), or null."""
    sizes = _optional(row, "split_sizes", dict, where)
    if sizes is not None and not all(
            isinstance(sizes.get(way), list) and len(sizes[way]) in
        (0, group_size) and all(_elements(rows, 1) for rows in sizes[way]) for way in ("in", "out")):
        raise ValueError(f'{where}: field \'split_sizes\' must be {{"in": [...], "out": [...]}}, each '
                         f"empty or {group_size} integers in [0, {MAX_NBYTES:,}]; got {_shown(sizes)}")
    return sizes


def _dtype(row: dict, where: str) -> str:
    dtype = _need(row, "dtype", str, where)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: field 'dtype' must be one of {', '.join(DTYPE_BYTES)}; "
                         f"got {_shown(dtype)}")
    return dtype


def _gradients(row: dict, world_size: int, where: str) -> tuple[int, Gradients]:
    """A ``gradients`` line: its rank and what it says."""
    rank = _integer(row, "rank", where, 0, world_size - 1)
    dtype, counts = _dtype(row, where), _need(row, "counts", list, where)
    itemsize = DTYPE_BYTES[dtype]
    if not counts or not all(_elements(c, itemsize) for c in counts) or sum(counts) * itemsize > MAX_NBYTES:
        raise ValueError(f"{where}: field 'counts' must list each gradient's elements (integers >= 0, "
                         f"{MAX_NBYTES:,} bytes in all at most); got {_shown(counts)}")
    caps = [_integer(row, f"{cap}bucket_cap_bytes", where, 1, MAX_NBYTES) for cap in ("", "first_")]
    return rank, Gradients(_group(row, rank, world_size, where), dtype, tuple(counts), *caps)


def _lines(file: BinaryIO, path: Path) -> Iterator[tuple[str, Any]]:
    """Each line's place (``path:number``) and its JSON, blank lines left out, read a line at a
    time within :data:`MAX_LINE_BYTES` and :data:`MAX_FILE_BYTES`."""
    read = 0
    for number in itertools.count(1):
        line = file.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        read += len(line)
        if read > MAX_FILE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_FILE_BYTES:,} bytes, the most a workload may be "
                             "(lab.workload.format.MAX_FILE_BYTES): record fewer steps")
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES:,} bytes "
                             "(lab.workload.format.MAX_LINE_BYTES): not a workload's")
        if line.strip():
            try:
                row = json.loads(line, parse_constant=_no_constant)
            except (ValueError, RecursionError) as exc:  # (JSONDecodeError, a bad encoding, NaN, too deep)
                raise ValueError(f"{path}:{number}: not JSON ({getattr(exc, 'msg', None) or exc})") from None
            yield f"{path}:{number}", row


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is no number a workload holds")


class _Reader:
    """What :func:`load` keeps as it reads the events: the workload so far, each rank's
    operations issued and steps marked, and the sends and receives not yet paired."""
    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.issued: dict[int, int] = {}
        self.marked: dict[int, int] = {}
        self.unpaired: dict[tuple[int, int, int], deque[tuple[str, int, str, Event]]] = {}

    def add(self, row: Any, where: str) -> None:
        if isinstance(row, dict) and row.get("kind") == "gradients":
            rank, gradients = _gradients(row, self.workload.world_size, where)
            self.check_step(rank, row.get("step", self.marked.get(rank, 0)), where)
            if rank in self.workload.gradients:
                raise ValueError(f"{where}: rank {rank} recorded its gradients twice (a recording knows one "
                                 "DDP model's)")
            self.workload.gradients[rank] = gradients
            return
        event = _event(row, self.workload.world_size, where)
        self.check_step(event.rank, event.step, where)  # (a step past the marks, or before them)
        issued = self.issued.get(event.rank, 0)
        if event.kind == "op" and event.index != issued:
            raise ValueError(f"{where}: field 'index' must be {issued} (rank {event.rank}'s next operation); "
                             f"got {event.index}")
        if event.kind == "wait" and not 0 <= event.index < issued:
            raise ValueError(f"{where}: field 'index': rank {event.rank} waits on operation {event.index}, "
                             "which it has not issued")
        if event.op in POINT_TO_POINT:
            self.pair(event, where)
        self.issued[event.rank] = issued + (event.kind == "op")
        self.marked[event.rank] = self.marked.get(event.rank, 0) + (event.kind == "step")
        self.workload.events.setdefault(event.rank, []).append(event)

    def check_step(self, rank: int, step: Any, where: str) -> None:
        """A line's ``step`` is the number of steps its rank marked before it."""
        marked = self.marked.get(rank, 0)
        if step != marked or isinstance(step, bool):
            raise ValueError(f"{where}: field 'step' must be {marked} (rank {rank} marked {marked} step "
                             f"end{'s' * (marked != 1)} before this line); got {_shown(step)}")

    def pair(self, event: Event, where: str) -> None:
        """The k-th send from a rank to another with a tag pairs with the k-th receive there of
        that tag (as the replay pairs them): both must carry the same bytes."""
        src, dst = (event.rank, event.peer) if event.op == "send" else (event.peer, event.rank)
        key = (src, dst, event.tag)
        waiting = self.unpaired.setdefault(key, deque())
        if not waiting or waiting[0][0] == event.op:
            waiting.append((event.op, event.nbytes, where, event))
            return
        op, nbytes, there, paired = waiting.popleft()
        if not waiting:
            del self.unpaired[key]
        if nbytes != event.nbytes:
            raise ValueError(f"{where}: this {event.op} of {event.nbytes:,} bytes (rank {src} to rank {dst}, "
                             f"tag {event.tag}) pairs with the {op} of {nbytes:,} bytes at {there}: a send "
                             "and its receive must carry the same bytes")
        if event.stage is not None and paired.stage is not None:
            check_pair(event, paired, where, there)


def load(path: str | Path) -> Workload:
    """Read and check the workload at ``path`` (see the module's docstring for the format and
    the limits). ``ValueError`` naming the file, the line and the field; ``OSError`` where the
    file cannot be read."""
    path = Path(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > MAX_FILE_BYTES:  # (a regular file's; a stream's is counted as it is read)
            raise ValueError(f"{path}: {size:,} bytes, more than a workload may be ({MAX_FILE_BYTES:,}: "
                             "lab.workload.format.MAX_FILE_BYTES): record fewer steps")
        lines = _lines(file, path)
        where, row = next(lines, (None, None))
        if where is None:
            raise ValueError(f"{path}: empty (a workload's first line is its header)")
        world_size, dims, recorded = _header(row, where)
        reader = _Reader(Workload(world_size, dims, recorded, {}, str(path)))
        for where, row in lines:
            reader.add(row, where)
    workload = reader.workload
    for events in workload.events.values():
        derive_held(events)
        derive_thread_time(events)
    if workload.dims is None:
        workload.dims = mesh_dims(workload)
    return workload
