"""Reading torch's flight-recorder dumps: the first collective where the ranks part, and who.

A dump is one rank's pickled dict in torch's format (``TORCH_FR_BUFFER_SIZE``, written to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` or returned by ``_dump_fr_trace``), by nccl, gloo or the lab
(:mod:`lab.backend.flight_dumps`): ``version``, ``pg_config`` (each group's name, description and global
ranks) and ``entries``, one per operation, with ``collective_seq_id`` (its number in its group),
``profiling_name`` (``gloo:all_reduce``), ``input_sizes``, ``output_sizes``, dtypes, ``state``
(scheduled, started, completed), ``time_created_ns`` and ``frames`` (the caller's stack).

Every group's collectives are walked in number order over its members' dumps, and the first
number at which they part is named with its kind (the order torch's ``fr_trace`` checks them in):
``missing`` (a rank never entered it), ``type`` (it entered another collective), ``size``,
``dtype``, ``args`` (another reduce op or root: lab dumps say), ``state`` (it is still in it while
others completed it) or ``failed`` (every rank entered it alike, and it failed: lab dumps say). The
odd ranks are those outside the majority (a tie: outside the lowest rank's side); a rank whose
last collective of the group failed was stopped there, and is not counted behind what follows.

    dumps = read_dumps("/tmp/fr")                  # {rank: dump}
    first = divergences(dumps)[0]                  # group "0", #3, kind "missing", culprits [1]
    print(report(dumps))                           # what python -m lab flight DIR prints

Unlike torch 2.13's ``fr_trace`` this reads a default group whose name in ``pg_config`` is empty
while its entries say ``"0"`` (gloo's dumps: fr_trace raises ``KeyError: ('0', 3)``), and any
backend's names (fr_trace refuses ``lab:``). Point-to-point entries are shown, not matched.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import pickle
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

#: Collectives whose input sizes legitimately differ across ranks (only the root's is read) and
#: whose output sizes do (the root's alone, or uneven blocks), as torch's fr_trace skips them.
INPUTS_MAY_DIFFER = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "scatter"}
OUTPUTS_MAY_DIFFER = {"all_to_all", "all_to_all_single", "all_to_all_v_single", "gather"}
#: ... and, in the lab's dumps, its uneven blocks (numpy.array_split's).
LAB_OUTPUTS_MAY_DIFFER = {"reduce_scatter", "scatter"}


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain containers only (what torch's dumps hold): a dump may come from anywhere."""
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"a flight-recorder dump holds plain data; this one names {module}.{name}")


def read_dump(path: str) -> dict:
    """One rank's dump, checked to be torch's format (a ``ValueError`` naming the file otherwise)."""
    with open(path, "rb") as file:
        data = file.read()
    try:
        dump = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
        raise ValueError(f"{path}: not a flight-recorder dump ({type(exc).__name__}: {exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list) or "pg_config" not in dump:
        raise ValueError(f"{path}: not a flight-recorder dump (no 'entries' and 'pg_config')")
    return dump


_RANK_AT_END = re.compile(r"^(.*?)(\d+)$")


def read_dumps(directory: str, prefix: str | None = None) -> dict[int, dict]:
    """Every rank's dump in ``directory``, by rank: files named ``<prefix><rank>`` (the prefix
    inferred when every file shares one, as torch's reader does)."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is no folder")
    names = sorted(f for f in os.listdir(directory) if os.path.isfile(os.path.join(directory, f)))
    found = {name: m.groups() for name in names if (m := _RANK_AT_END.match(name))}
    if prefix is None:
        prefixes = {p for p, _ in found.values()}
        if len(prefixes) > 1:
            raise ValueError(f"{directory} holds files of several prefixes ({', '.join(sorted(prefixes))}): "
                             "name one with --prefix")
        prefix = prefixes.pop() if prefixes else ""
    dumps = {
        int(rank): read_dump(os.path.join(directory, name))
        for name, (p, rank) in found.items() if p == prefix}
    if not dumps:
        raise ValueError(f"{directory} holds no dump named <prefix><rank>" +
                         (f" with prefix {prefix!r}" if prefix else ""))
    return dumps


# -- entries ------------------------------------------------------------------------------------


def _kind(entry: dict) -> tuple[str, str]:
    """(backend, operation) of an entry: ``gloo:all_reduce`` -> ("gloo", "all_reduce")."""
    backend, _, name = str(entry.get("profiling_name", "?:?")).partition(":")
    return backend, name.split(" ")[0]


def _is_p2p(entry: dict) -> bool:
    return bool(entry.get("is_p2p")) or _kind(entry)[1] in ("send", "recv")


def _group_of(entry: dict) -> tuple[str, str]:
    name, desc = entry.get("process_group", ("", ""))
    return str(name), str(desc)


def _ranks(config: dict) -> list[int]:
    ranks = config.get("ranks", [])
    return list(ast.literal_eval(ranks) if isinstance(ranks, str) else ranks)


def _members(dumps: dict[int, dict], name: str, desc: str) -> list[int]:
    """The global ranks of group ``name``: its ``pg_config`` row on any rank; for the default group
    whose row is named "" (gloo's), that row; else every rank that dumped."""
    for dump in dumps.values():
        config = dump["pg_config"]
        if name in config:
            return _ranks(config[name])
    if desc == "default_pg" or name == "0":
        for dump in dumps.values():
            for key, config in dump["pg_config"].items():
                if key == "" or config.get("desc") == "default_pg":
                    return _ranks(config)
    return sorted(dumps)


def _sizes(entry: dict) -> tuple:
    backend, op = _kind(entry)
    inputs = None if op in INPUTS_MAY_DIFFER else entry.get("input_sizes")
    outputs_differ = op in OUTPUTS_MAY_DIFFER or (backend == "lab" and op in LAB_OUTPUTS_MAY_DIFFER)
    outputs = None if outputs_differ else entry.get("output_sizes")
    return repr(inputs), repr(outputs)


def _dtypes(entry: dict) -> tuple:
    return tuple(sorted(set(entry.get("input_dtypes") or []) | set(entry.get("output_dtypes") or [])))


def _state(entry: dict) -> str:
    return "failed" if entry.get("lab_error") else str(entry.get("state", "?"))


#: What ranks must agree on at one collective number, in the order they are checked (fr_trace's).
_ASPECTS = (("type", lambda es: tuple(_kind(e)[1]
                                      for e in es)), ("size", lambda es: tuple(_sizes(e) for e in es)),
            ("dtype", lambda es: tuple(_dtypes(e) for e in es)), ("args", lambda es: tuple(
                (e.get("lab_reduce_op"), e.get("lab_root")) for e in es)))


def _user_frame(entry: dict) -> str:
    """The first frame of the entry's stack outside torch and the lab: where the program called."""
    for frame in entry.get("frames") or []:
        filename = str(frame.get("filename", ""))
        if "/torch/" not in filename and "/lab/" not in filename and not filename.startswith("<"):
            return f"{os.path.basename(filename)}:{frame.get('line')} in {frame.get('name')}"
    return ""


def describe_entry(entry: dict, since_ns: int | None = None) -> str:
    """``gloo:all_reduce #3 [[8]] Float, scheduled (+0.002 s, at train.py:12 in step)``."""
    dtypes = ",".join(_dtypes(entry))
    seq = entry.get("p2p_seq_id") if _is_p2p(entry) else entry.get("collective_seq_id")
    text = f"{entry.get('profiling_name')} #{seq} {entry.get('input_sizes')} {dtypes}, {entry.get('state')}"
    if entry.get("lab_error"):
        text += f" then failed ({entry['lab_error']})"
    where = []
    created = entry.get("time_created_ns")
    if since_ns is not None and created:
        where.append(f"{(created - since_ns) / 1e9:+.3f} s")
    if frame := _user_frame(entry):
        where.append(f"at {frame}")
    return text + (f" ({', '.join(where)})" if where else "")


# -- the verdict --------------------------------------------------------------------------------


@dataclass
class Divergence:
    """Where one group's ranks part: collective ``seq`` of group ``group`` (``desc``), of
    ``kind``; ``culprits``: the ranks on the odd side; ``expected``: the majority's entry,
    described; ``doing``: each member's entry there, or what it did last."""

    group: str
    desc: str
    seq: int
    kind: str
    culprits: list[int]
    expected: str
    doing: dict[int, str] = field(default_factory=dict)
    first_ns: int | None = None  # when the first rank entered it (orders groups' divergences)

    def __str__(self) -> str:
        how = {
            "missing": "never entered it", "type": "entered another collective", "size": "passed other sizes",
            "dtype": "passed other dtypes", "args": "passed another reduce op or root",
            "state": "are still in it while the others completed it", "failed": "failed in it"}[self.kind]
        who = ", ".join(map(str, self.culprits)) or "every rank"
        ranks = f"rank{'s' if len(self.culprits) != 1 else ''} {who}"
        lines = [
            f"group {self.group} ({self.desc}), collective #{self.seq}: {self.kind} - {ranks} {how}",
            f"  expected: {self.expected}"]
        lines += [f"  rank {rank}: {text}" for rank, text in sorted(self.doing.items())]
        return "\n".join(lines)


def _majority(values: dict[int, Any]) -> Any:
    """The most common value; a tie goes to the side of the lowest rank."""
    counts = Counter(values.values())
    best = max(counts.values())
    return next(value for _, value in sorted(values.items()) if counts[value] == best)


def _last_entry(dump: dict | None) -> dict | None:
    return max(dump["entries"], key=lambda e: e.get("record_id", 0), default=None) if dump else None


def _group_divergence(dumps: dict[int, dict], name: str, desc: str) -> Divergence | None:
    """The first collective number of group ``name`` where its members part, or None."""
    members = _members(dumps, name, desc)
    by_rank: dict[int, dict[int, list[dict]]] = {}
    for rank in members:
        if rank not in dumps:
            continue  # no dump: nothing can be said of it
        numbered: dict[int, list[dict]] = {}
        for entry in sorted(dumps[rank]["entries"], key=lambda e: e.get("record_id", 0)):
            if _group_of(entry)[0] == name and not _is_p2p(entry):
                numbered.setdefault(int(entry["collective_seq_id"]), []).append(entry)
        by_rank[rank] = numbered
    started = [min(n) for n in by_rank.values() if n]
    if not started:
        return None
    low = max(started)  # (a ring buffer forgets the oldest: compare what every rank still holds)
    high = max(max(n) for n in by_rank.values() if n)
    last = {rank: max(numbered, default=0) for rank, numbered in by_rank.items()}
    # A rank whose last collective here failed was stopped: a failure told to it by a peer (the
    # lab's abort notice) may end it in an earlier collective than the one that failed, while its
    # peers had completed that one and moved on; it is not behind what follows.
    stopped = {
        rank
        for rank, numbered in by_rank.items() if numbered and _state(numbered[last[rank]][-1]) == "failed"}
    for seq in range(low, high + 1):
        present = {rank: numbered[seq] for rank, numbered in by_rank.items() if seq in numbered}
        kind, culprits = "", []
        absent = sorted(r for r in set(by_rank) - set(present) if not (r in stopped and last[r] < seq))
        if absent:
            kind, culprits = "missing", absent
        for aspect, value in _ASPECTS:
            if kind:
                break
            values = {rank: value(entries) for rank, entries in present.items()}
            if len(set(values.values())) > 1:
                common = _majority(values)
                kind, culprits = aspect, sorted(r for r, v in values.items() if v != common)
        if not kind:
            states = {rank: _state(entries[-1]) for rank, entries in present.items()}
            moved_on = any(last[rank] > seq for rank in present)
            behind = sorted(
                r for r, state in states.items()
                if state != "completed" and not (state == "failed" and moved_on))  # (failed early: stopped)
            if "completed" in states.values() and behind:
                kind, culprits = "state", behind
            elif set(states.values()) == {"failed"}:
                kind = "failed"
        if kind:
            return _divergence(dumps, members, name, desc, seq, kind, culprits, present)
    return None


def _divergence(dumps: dict[int, dict], members: list[int], name: str, desc: str, seq: int, kind: str,
                culprits: list[int], present: dict[int, list[dict]]) -> Divergence:
    """What each member was doing at collective ``seq``, and the majority's entry there."""
    created = [
        e["time_created_ns"] for entries in present.values() for e in entries if e.get("time_created_ns")]
    since = min(created, default=None)
    expected_side = {rank: entries for rank, entries in present.items() if rank not in culprits} or present
    expected = describe_entry(expected_side[min(expected_side)][0])
    doing = {}
    for rank in members:
        if rank in present:
            doing[rank] = "; ".join(describe_entry(e, since) for e in present[rank])
        elif rank not in dumps:
            doing[rank] = "no dump from this rank"
        else:
            mine = [e for e in dumps[rank]["entries"] if _group_of(e)[0] == name and not _is_p2p(e)]
            last_here = max(mine, key=lambda e: e.get("record_id", 0), default=None)
            text = f"never entered #{seq}; its last in this group: " + (describe_entry(last_here, since)
                                                                        if last_here else "none")
            last = _last_entry(dumps[rank])
            if last is not None and last is not last_here:
                text += f"; its last record: {describe_entry(last, since)} on group {_group_of(last)[0]}"
            doing[rank] = text
    return Divergence(name, desc, seq, kind, culprits, expected, doing, since)


def divergences(dumps: dict[int, dict]) -> list[Divergence]:
    """Each group's first divergence, the earliest entered first (unknown times last)."""
    groups = {_group_of(e) for dump in dumps.values() for e in dump["entries"] if not _is_p2p(e)}
    found = [d for name, desc in sorted(groups) if (d := _group_divergence(dumps, name, desc))]
    return sorted(found, key=lambda d: (d.first_ns is None, d.first_ns or 0, d.group))


def report(dumps: dict[int, dict], source: str = "") -> str:
    """What ``python -m lab flight DIR`` prints: the dumps read, then each group's first divergence."""
    backends = sorted({_kind(e)[0] for dump in dumps.values() for e in dump["entries"]})
    versions = sorted({str(dump.get("version")) for dump in dumps.values()})
    counts = ", ".join(f"rank {rank}: {len(dump['entries'])}" for rank, dump in sorted(dumps.items()))
    lines = [
        f"flight records of {len(dumps)} rank{'s' if len(dumps) != 1 else ''}" +
        (f" in {source}" if source else "") + f" ({', '.join(backends) or 'no entries'}; "
        f"format {', '.join(versions)}); entries: {counts}"]
    found = divergences(dumps)
    if not found:
        lines.append("the ranks agree on every collective they all recorded")
    for i, divergence in enumerate(found):
        lines.append(("first divergence: " if i == 0 else "also: ") + str(divergence))
    return "\n".join(lines)


# -- python -m lab flight ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        dumps = read_dumps(args.dir, args.prefix)
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    if args.json:
        print(json.dumps({"ranks": sorted(dumps), "divergences": [asdict(d) for d in divergences(dumps)]}))
    else:
        print(report(dumps, args.dir))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``python -m lab flight DIR [--prefix P] [--json]``."""
    parser = commands.add_parser(
        "flight", help="read torch-format flight-recorder dumps: where the ranks part",
        description="Reads one flight-recorder dump per rank (nccl, gloo or lab; "
        "files <prefix><rank>) and names each group's first collective "
        "where the ranks part, the ranks behind it and what each was doing.")
    parser.add_argument("dir", help="the folder of dumps ($TORCH_FR_DUMP_TEMP_FILE's folder)")
    parser.add_argument("--prefix", help="the files' common prefix (default: inferred)")
    parser.add_argument("--json", action="store_true", help="the verdicts as JSON")
    parser.set_defaults(run=run, parser=parser)
