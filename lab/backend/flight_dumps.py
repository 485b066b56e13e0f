"""The lab's flight records in torch's flight-recorder format, so that one reader serves both.

Each ``"lab"`` process group's mesh keeps its last collectives (:mod:`lab.flight`); here they
become the pickled dict torch's recorder dumps (``version``, ``pg_config``, ``pg_status``,
``entries``: format 2.10, as torch 2.13 writes it), which ``python -m lab flight DIR``
(:mod:`lab.backend.flight_verdict`) reads next to nccl's and gloo's. A rank writes
``<prefix><global rank>`` when one of its lab collectives fails, where ``prefix`` is
``Options(flight_dump=...)`` or else ``TORCH_FR_DUMP_TEMP_FILE`` (nothing is written when neither
is set), and on request::

    data = lab.backend.flight_dumps.dump_fr_trace()       # bytes, as torch._C._distributed_c10d._dump_fr_trace
    path = lab.backend.flight_dumps.write_fr_trace()      # $TORCH_FR_DUMP_TEMP_FILE<rank>: /tmp/fr/rank_2 on rank 2

An entry per lab collective: ``profiling_name`` ``lab:all_reduce``, ``collective_seq_id`` the
group's collective number (every member numbers alike), flat ``input_sizes``/``output_sizes``
(``[[count]]``), torch's dtype names, ``state`` completed or started (a failed one stays started,
as a timed-out nccl one does; ``lab_error`` names its error), start and end times (none for a
call that ran compiled, whose books keep no time), and the lab's own ``lab_algorithm``,
``lab_reduce_op``, ``lab_root`` and ``lab_step``. torch's ``fr_trace`` refuses any backend name
but its own list, "lab" included; ``python -m lab flight`` reads these.
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from typing import Any

import torch.distributed as dist

from lab.errors import LabError
from lab.flight import FlightRecord

#: The format version torch 2.13's recorder writes (its reader checks every rank's agrees).
VERSION = "2.10"
#: torch's variable naming where a rank's dump goes (``<prefix><rank>``), and torch's default.
DUMP_ENV = "TORCH_FR_DUMP_TEMP_FILE"
TORCH_DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"

#: The lab's collectives under the names torch's entries give them.
TORCH_NAMES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "all_to_all", "gather": "gather",
    "scatter": "scatter", "barrier": "barrier", "(refused)": "refused"}
#: The lab's dtype names as torch's dumps spell them (c10's ScalarType names).
SCALAR_TYPES = {
    "float32": "Float", "float64": "Double", "int32": "Int", "int64": "Long", "float16": "Half",
    "bfloat16": "BFloat16", "uint8": "Byte", "int8": "Char", "int16": "Short", "bool": "Bool",
    "complex64": "ComplexFloat", "complex128": "ComplexDouble", "complex32": "ComplexHalf",
    "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "float8_e4m3fn": "Float8_e4m3fn",
    "float8_e5m2": "Float8_e5m2", "float8_e4m3fnuz": "Float8_e4m3fnuz", "float8_e5m2fnuz": "Float8_e5m2fnuz",
    "float8_e8m0fnu": "Float8_e8m0fnu", "float4_e2m1fn_x2": "Float4_e2m1fn_x2"}

_writing = threading.Lock()  # (failures on two groups' threads at once write one file)


def check_prefix(value: Any, name: str = "flight_dump") -> str | None:
    """A dump prefix (``/tmp/fr/rank_``): its folder must exist; None or "" is none."""
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path prefix (str or os.PathLike) or None; got {value!r}")
    prefix = os.fspath(value)
    if os.path.isdir(prefix):
        raise ValueError(f"{name} is a prefix each rank's file name starts with (rank 2 writes <prefix>2); "
                         f"{prefix!r} is a folder: end it with a name, as {os.path.join(prefix, 'rank_')!r}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):
        raise ValueError(f"{name}: the folder of {prefix!r} does not exist")
    return prefix


def lab_groups() -> list[Any]:
    """This process's live ``"lab"`` process groups, in the order torch made them."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names",
                    {}) if dist.is_initialized() else {}
    return [
        group for group in names
        if getattr(group, "getBackendName", lambda: "")() == "lab" and hasattr(group, "mesh")]


def _output_sizes(record: FlightRecord, rank: int, world_size: int) -> list[list[int]]:
    """What a lab collective of ``record`` hands back on ``rank`` of ``world_size``, flat."""
    count = record.count
    if record.collective == "allgather" or (record.collective == "gather" and rank == record.root):
        return [[count * world_size]]
    if record.collective == "gather":
        return []
    if record.collective in ("reduce_scatter", "scatter"):  # numpy.array_split's blocks
        return [[count // world_size + (1 if rank < count % world_size else 0)]]
    return [[count]]


def _entry(record: FlightRecord, group: Any, pg_id: int, name: str, desc: str) -> dict[str, Any]:
    """``record`` of ``group`` as one entry of torch's format."""
    mesh = group.mesh
    dtypes = [SCALAR_TYPES.get(record.dtype, record.dtype)] if record.dtype else []
    failed = record.state.startswith("failed")
    return {
        "record_id": 0, "pg_id": pg_id, "process_group": (name, desc), "collective_seq_id": record.seq,
        "p2p_seq_id": 0, "op_id": record.seq, "is_p2p": False,
        "profiling_name": f"lab:{TORCH_NAMES.get(record.collective, record.collective)}",
        "time_created_ns": record.start_ns or None, "time_discovered_started_ns": record.start_ns or None,
        "time_discovered_completed_ns": (record.end_ns or None) if record.state == "done" else None,
        "input_sizes": [[record.count]
                        ], "output_sizes": _output_sizes(record, mesh.rank,
                                                         mesh.world_size), "input_dtypes": dtypes,
        "output_dtypes": dtypes, "state": "completed" if record.state == "done" else "started",
        "retired": record.state != "running", "timeout_ms": int(mesh.recv_timeout_ms), "frames": [],
        "thread_id": "", "thread_name": "", "lab_algorithm": record.algorithm, "lab_reduce_op": record.op or
        None, "lab_root": record.root if record.root >= 0 else None, "lab_step": record.step,
        "lab_error": record.state[len("failed ("):-1] if failed else None}


def fr_trace(groups: list[Any] | None = None) -> dict[str, Any]:
    """This rank's flight records of ``groups`` (default: every live lab group) as torch's dict."""
    groups = lab_groups() if groups is None else groups
    config, status, entries = {}, {}, []
    for pg_id, group in enumerate(groups):
        name = group.getGroupName() or str(pg_id)
        desc = group.getGroupDesc() or "undefined"
        records = group.mesh.flight_records()
        config[name] = {"name": name, "desc": desc, "ranks": str(list(group.mesh.global_ranks))}
        status[name] = {
            "last_enqueued_collective": max((r.seq for r in records), default=-1),
            "last_started_collective": max((r.seq for r in records if r.state == "running"), default=-1),
            "last_completed_collective": max((r.seq for r in records if r.state == "done"), default=-1)}
        entries += [_entry(record, group, pg_id, name, desc) for record in records]
    entries.sort(key=lambda e: (e["time_created_ns"] or 0, e["pg_id"], e["collective_seq_id"]))
    for record_id, entry in enumerate(entries):
        entry["record_id"] = record_id
    return {
        "version": VERSION, "comm_lib_version": "lab", "pg_config": config, "pg_status": status,
        "entries": entries}


def dump_fr_trace(groups: list[Any] | None = None) -> bytes:
    """:func:`fr_trace` pickled, as ``torch._C._distributed_c10d._dump_fr_trace`` returns gloo's."""
    return pickle.dumps(fr_trace(groups))


def _global_rank(groups: list[Any]) -> int:
    if dist.is_initialized():
        return dist.get_rank()
    mesh = groups[0].mesh
    return mesh.global_ranks[mesh.rank]


def write_fr_trace(prefix: str | None = None, groups: list[Any] | None = None) -> str:
    """Write :func:`dump_fr_trace` to ``<prefix><global rank>`` (default prefix: ``$TORCH_FR_DUMP_TEMP_FILE``,
    else torch's ``/tmp/nccl_trace_rank_``), whole or not at all; returns the path."""
    groups = lab_groups() if groups is None else groups
    if not groups:
        raise ValueError("no lab process group in this process: nothing to dump")
    prefix = check_prefix(prefix, "prefix") or check_prefix(os.environ.get(DUMP_ENV), DUMP_ENV) \
        or TORCH_DEFAULT_PREFIX
    path = f"{prefix}{_global_rank(groups)}"
    data = dump_fr_trace(groups)
    with _writing:
        partial = f"{path}.{os.getpid()}.partial"  # (a reader never sees half a dump)
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    return path


def dump_on_failure(group: Any, exc: BaseException) -> str | None:
    """A collective of ``group`` failed with ``exc``: if it is the lab's failure (not a bad
    argument), write this rank's dump where ``Options(flight_dump=...)`` or
    ``TORCH_FR_DUMP_TEMP_FILE`` says (nowhere if neither does). A dump that cannot be written is a
    warning: the collective's own error is the one raised."""
    prefix = getattr(group.options, "flight_dump", None) or os.environ.get(DUMP_ENV)
    if not prefix or not isinstance(exc, LabError):
        return None
    groups = lab_groups()
    try:
        return write_fr_trace(prefix, groups if group in groups else [group, *groups])
    except (OSError, ValueError, TypeError) as problem:
        warnings.warn(f"the lab could not write its flight-recorder dump to {prefix}<rank>: {problem}",
                      stacklevel=2)
        return None
