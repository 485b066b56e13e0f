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
  from the start of the recording (informative; the replay does not read them).
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

:func:`load` reads and checks a file: a field missing or of the wrong kind, an unknown version or
an event that names an operation the rank never issued is a ``ValueError`` naming the file, the
line and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT, VERSION = "lab-workload", 2
#: The versions :func:`load` reads (see the module's docstring).
READS = (1, 2)
COLLECTIVES = (
    "allreduce",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "reduce",
    "all_to_all",
    "barrier",
    "gather",
    "scatter",
)
POINT_TO_POINT = ("send", "recv")
KINDS = ("op", "wait", "step")  # the events; a "gradients" line is none
DTYPE_BYTES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


@dataclass
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
        """How many steps every rank marked (a rank's events after its last mark are left out)."""
        return min((sum(e.kind == "step" for e in events) for events in self.events.values()), default=0)


def _need(row: dict, name: str, kinds: type | tuple, where: str) -> Any:
    value = row.get(name)
    if not isinstance(value, kinds) or isinstance(value, bool) and kinds in (int, (int, float)):
        raise ValueError(f"{where}: field {name!r} must be {_kind_name(kinds)}; got {value!r}")
    return value


def _kind_name(kinds: type | tuple) -> str:
    if kinds == (int, float):
        return "a number"
    return {int: "an integer", str: "a string", list: "a list", dict: "an object", bool: "true or false"}[
        kinds
    ]


def _count(row: dict, name: str, where: str) -> int:
    value = _need(row, name, int, where)
    if value < 0:
        raise ValueError(f"{where}: field {name!r} must be an integer >= 0; got {value}")
    return value


def _non_negative(row: dict, name: str, where: str) -> float:
    value = _need(row, name, (int, float), where)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: field {name!r} must be a finite number >= 0; got {value!r}")
    return float(value)


def _header(row: Any, where: str) -> tuple[int, dict | None, dict]:
    if not isinstance(row, dict) or row.get("format") != FORMAT:
        raise ValueError(f'{where}: not a lab workload (the first line must have "format": "{FORMAT}")')
    version = row.get("version")
    if version not in READS or isinstance(version, bool):
        raise ValueError(f"{where}: field 'version' is {version!r}; this lab reads versions "
                         f"{', '.join(map(str, READS))}")
    world_size = _need(row, "world_size", int, where)
    if world_size < 1:
        raise ValueError(f"{where}: field 'world_size' must be >= 1; got {world_size}")
    dims = row.get("dims")
    if dims is not None and (
        not isinstance(dims, dict)
        or not all(isinstance(v, int) and v >= 1 for v in dims.values())
        or math.prod(dims.values()) != world_size
    ):
        raise ValueError(
            f"{where}: field 'dims' must map names to sizes whose product is world_size "
            f"({world_size}); got {dims!r}"
        )
    return world_size, dims, row.get("recorded") or {}


def _event(row: Any, world_size: int, where: str) -> Event:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an event must be a JSON object; got {type(row).__name__}")
    rank = _need(row, "rank", int, where)
    if not 0 <= rank < world_size:
        raise ValueError(f"{where}: field 'rank' must be in [0, {world_size}); got {rank}")
    kind = _need(row, "kind", str, where)
    if kind not in KINDS:
        raise ValueError(f"{where}: field 'kind' must be one of {', '.join(KINDS)}; got {kind!r}")
    event = Event(rank, _need(row, "step", int, where), kind, _non_negative(row, "compute_us", where))
    if kind == "step":
        return event
    event.index = _need(row, "index", int, where)
    if kind == "wait":
        return event
    event.op = _need(row, "op", str, where)
    if event.op not in COLLECTIVES + POINT_TO_POINT:
        raise ValueError(
            f"{where}: field 'op' must be one of {', '.join(COLLECTIVES + POINT_TO_POINT)}; got {event.op!r}"
        )
    event.group = _group(row, rank, world_size, where)
    event.dim = row.get("dim")
    event.dtype = _dtype(row, where)
    event.count, event.out_count = _count(row, "count", where), _count(row, "out_count", where)
    event.reduce_op, event.root, event.split_sizes = (
        row.get("reduce_op"),
        row.get("root"),
        row.get("split_sizes"),
    )
    event.algorithm = row.get("algorithm")
    if event.algorithm is not None and not isinstance(event.algorithm, str):
        raise ValueError(f"{where}: field 'algorithm' must be a string; got {event.algorithm!r}")
    event.is_async = bool(_need(row, "async", bool, where))
    if event.op in POINT_TO_POINT:
        event.peer = _need(row, "peer", int, where)
        event.tag = int(row.get("tag") or 0)
        if not 0 <= event.peer < world_size or event.peer == rank:
            raise ValueError(
                f"{where}: field 'peer' must be another rank in [0, {world_size}); got {event.peer}"
            )
    elif event.root is not None and event.root not in event.group:
        raise ValueError(f"{where}: field 'root' must be a member of the group; got {event.root!r}")
    return event


def _group(row: dict, rank: int, world_size: int, where: str) -> tuple[int, ...]:
    group = _need(row, "group", list, where)
    if (
        not group
        or len(set(group)) != len(group)
        or not all(isinstance(g, int) and 0 <= g < world_size for g in group)
        or rank not in group
    ):
        raise ValueError(
            f"{where}: field 'group' must list distinct ranks in [0, {world_size}) that include "
            f"rank {rank}; got {group!r}"
        )
    return tuple(group)


def _dtype(row: dict, where: str) -> str:
    dtype = _need(row, "dtype", str, where)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: field 'dtype' must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    return dtype


def _gradients(row: dict, world_size: int, where: str) -> tuple[int, Gradients]:
    """A ``gradients`` line: its rank and what it says."""
    rank = _need(row, "rank", int, where)
    if not 0 <= rank < world_size:
        raise ValueError(f"{where}: field 'rank' must be in [0, {world_size}); got {rank}")
    counts = _need(row, "counts", list, where)
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"{where}: field 'counts' must list each gradient's elements (integers >= 0); "
                         f"got {counts!r}")
    caps = []
    for name in ("bucket_cap_bytes", "first_bucket_cap_bytes"):
        caps.append(_count(row, name, where))
        if caps[-1] < 1:
            raise ValueError(f"{where}: field {name!r} must be >= 1; got {caps[-1]}")
    return rank, Gradients(_group(row, rank, world_size, where), _dtype(row, where), tuple(counts), *caps)


def load(path: str | Path) -> Workload:
    """Read and check the workload at ``path`` (see the module's docstring for the format)."""
    path = Path(path)
    rows = []
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not rows:
        raise ValueError(f"{path}: empty (a workload's first line is its header)")
    world_size, dims, recorded = _header(rows[0][1], f"{path}:{rows[0][0]}")
    workload = Workload(world_size, dims, recorded, {rank: [] for rank in range(world_size)}, str(path))
    for number, row in rows[1:]:
        if isinstance(row, dict) and row.get("kind") == "gradients":
            rank, gradients = _gradients(row, world_size, f"{path}:{number}")
            if rank in workload.gradients:
                raise ValueError(f"{path}:{number}: rank {rank} recorded its gradients twice (a recording "
                                 "knows one DDP model's)")
            workload.gradients[rank] = gradients
            continue
        event = _event(row, world_size, f"{path}:{number}")
        events = workload.events[event.rank]
        issued = sum(e.kind == "op" for e in events)
        if event.kind == "op" and event.index != issued:
            raise ValueError(
                f"{path}:{number}: field 'index' must be {issued} (rank {event.rank}'s next "
                f"operation); got {event.index}"
            )
        if event.kind == "wait" and not 0 <= event.index < issued:
            raise ValueError(
                f"{path}:{number}: field 'index': rank {event.rank} waits on operation "
                f"{event.index}, which it has not issued"
            )
        events.append(event)
    if workload.dims is None:
        workload.dims = mesh_dims(workload)
    return workload


def mesh_dims(workload: Workload) -> dict[str, int] | None:
    """The DeviceMesh the operations describe: each named ``dim``'s group size, outermost first
    (row-major, as torch lays a DeviceMesh out: a dimension's groups step by the product of the
    sizes after it); None where no operation names one, or where their groups are no such mesh of
    ``world_size`` ranks (a 1-D mesh's dimension is torch's default group, which names none).

        {"dp": 2, "tp": 2}    # from groups [0, 1], [2, 3] of "tp" and [0, 2], [1, 3] of "dp"
    """
    steps: dict[str, set[tuple[int, int]]] = {}  # each dimension's (size, the step between its ranks)
    for events in workload.events.values():
        for event in events:
            if event.kind == "op" and event.dim is not None:
                group = sorted(event.group)
                gaps = {b - a for a, b in zip(group, group[1:])}
                steps.setdefault(event.dim, set()).add((len(group), gaps.pop() if len(gaps) == 1 else -1))
    if not steps or any(len(seen) != 1 for seen in steps.values()):
        return None
    shape = sorted(((step, size, name) for name, ((size, step),) in steps.items()), reverse=True)
    inner = [math.prod(size for _, size, _ in shape[i + 1:]) for i in range(len(shape))]
    if math.prod(size for _, size, _ in shape) != workload.world_size or any(
            size > 1 and step != stride for (step, size, _), stride in zip(shape, inner)):
        return None
    return {name: size for _, size, name in shape}
