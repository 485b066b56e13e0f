"""The logs people have: nccl-tests' ``*_perf`` tables and the OSU micro-benchmarks', as DataFrames.

    df = lab.sim.read_nccl_tests("all_reduce_16.log")   # bytes, oop_time_us, oop_busbw, ip_time_us...
    df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"]            # "allreduce", 16, 2
    df = lab.sim.read_osu("osu_allreduce.txt")          # bytes, avg_us (-f: min_us, max_us, iterations)

A log is read as it comes off a cluster: a launcher's tag on every line (Open MPI's
``[1,0]<stdout>:``, srun's ``0: ``, ``[host:pid] ``), one rank's line cut by another rank's output
(the tags say whose each piece is, so the pieces are put back together), lines a terminal wrapped,
NCCL's own log among the rows, ``N/A``. A log cut off mid-run reads up to where it stops, its
unfinished last line dropped. What cannot be read raises ValueError naming the file and the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

#: One logical line of a log: the file's line number where it starts, and its text.
Line = tuple[int, str]
#: One table row: the file's line number where it starts, and its fields.
Row = tuple[int, list[str]]
#: The collectives a log can hold, by the lab's names.
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all", "reduce", "gather",
               "scatter")

#: Launcher tags that may stand anywhere in a line (a piece of one rank's line after another's):
#: Open MPI's ``--tag-output``, torchrun's ``--tee``.
_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:|\[default\d+\]:")
#: Tags that stand only at a line's start: srun ``--label``'s ``0: ``, ``[host:pid] ``.
_LEAD = re.compile(r" *\d+: |\[[\w.-]+:\d+\] ")
#: NCCL's own log line (``NCCL_DEBUG=INFO``: ``host:pid:tid [dev] NCCL INFO ...``; a WARN names its
#: source line before NCCL; a timestamp in brackets may come first) and its banner, on the table's stdout.
_NCCL_LOG = re.compile(r"(?:\[[^\]]*\] *)?\S+:\d+:\d+ \[\d+\] (?:\S+:\d+ )?NCCL [A-Z]+\b.*"
                       r"|NCCL version \S+.*")
#: nccl-tests' last words when a run fails (``node1: Test NCCL failure common.cu:1004 '...'``).
_FAILURE = re.compile(r"[A-Za-z][\w.-]*: Test (?:\w+ )?(?:failure|timeout)\b.*")
#: A comment: ``# Using devices``, ``#``; not a wrapped line's tail that starts ``#wrong ...``.
_COMMENT = re.compile(r"\s*#(?:\s|$)")
_INT = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|N/A|-?nan|-?inf")
#: A text field: a name (``float``, ``sum``, ``Pass``), or the date and time of nccl-tests' timestamp column.
_NAME = re.compile(r"[A-Za-z][\w.+-]*|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_KINDS = {int: (_INT, "an integer"), float: (_NUMBER, "a number"), str: (_NAME, "a name")}

_NCCL_HEADER = re.compile(r"#\s*size\s+count\s")
_NCCL_COLUMNS = {"size": "bytes", "type": "dtype", "#wrong": "wrong", "time": "time_us", "cputime": "time_us",
                 "i_min": "i_min_us", "i_max": "i_max_us", "i_p99": "i_p99_us", "i_cv%": "i_cv_pct"}
_NCCL_KINDS = {"bytes": int, "count": int, "root": int, "dtype": str, "redop": str, "timestamp": str}
_DEVICE = re.compile(r"#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+"
                     r"\[[^\]]*\]\s*(.*)")
_PARAMS = re.compile(r"#\s*nThread\s")
_PARAM = re.compile(r"([A-Za-z][A-Za-z ]*?):?\s+(\d+)(?:\((\w+)\))?")
_PROGRAM = re.compile(r"\b(?:all_reduce|all_gather|reduce_scatter|broadcast|alltoall|reduce|gather|scatter)"
                      r"_perf")
#: A collective in a program's or a file's name; the first match wins (reduce_scatter before reduce).
_NAMED = [(re.compile(pattern), name) for pattern, name in (
    (r"all_?reduce", "allreduce"), (r"all_?gather", "allgather"), (r"reduce_?scatter", "reduce_scatter"),
    (r"broadcast|bcast", "broadcast"), (r"all_?to_?all", "all_to_all"), (r"reduce", "reduce"),
    (r"gather", "gather"), (r"scatter", "scatter"))]
#: What a log says outside its table, and the type of each.
_SAYS = {"avg_busbw": (re.compile(r"#\s*Avg bus bandwidth\s*:\s*(\S+)"), float),
         "out_of_bounds": (re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)"), int),
         "program": (re.compile(r"#\s*Collective test starting:\s*(\S+)"), str),
         "nccl_tests_version": (re.compile(r"#\s*nccl-tests version (\S+)"), str),
         "nccl_version": (re.compile(r"NCCL version (\S+)"), str)}
#: busbw / algbw as nccl-tests computes it (its doc/PERFORMANCE.md): factor·(N-1)/N.
_BUS_FACTOR = {"allreduce": 2.0, "allgather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}

_OSU_START = re.compile(r"#\s*OSU\s+\S")   # the title's start: a wrap may have cut the rest off
_OSU_TITLE = re.compile(r"#\s*OSU\s+([A-Za-z]+)(?:-(\w+))?\s+(.+?)\s+Test\s+v(\S+)")
_OSU_COLUMNS = {"Size": "bytes", "Avg Latency(us)": "avg_us", "Latency (us)": "avg_us",
                "Min Latency(us)": "min_us", "Max Latency(us)": "max_us", "P50 Tail Lat(us)": "p50_us",
                "P90 Tail Lat(us)": "p90_us", "P99 Tail Lat(us)": "p99_us", "Bandwidth (MB/s)": "mb_per_s"}
_OSU_COLLECTIVES = {"Allreduce": "allreduce", "Broadcast": "broadcast", "Allgather": "allgather",
                    "Allgatherv": "allgather", "Reduce_scatter": "reduce_scatter",
                    "Reduce_scatter_block": "reduce_scatter", "Reduce": "reduce", "Gather": "gather",
                    "All-to-All Personalized Exchange": "all_to_all", "Gatherv": "gather",
                    "All-to-Allv Personalized Exchange": "all_to_all", "Scatter": "scatter",
                    "Scatterv": "scatter", "Barrier": "barrier"}
_DATATYPE = re.compile(r"#\s*Datatype:\s*(\w+)")


def _error(path: Path, line: int, message: str) -> ValueError:
    return ValueError(f"{path}, line {line}: {message}")


def _tagged(lines: list[str]) -> bool:
    """Whether a launcher tagged this log: a third of its lines or more start with a tag (a line a
    terminal wrapped starts with none; a stray ``[host:pid] `` warning in an untagged log is rare)."""
    text = [line for line in lines if line.strip()]
    return 3 * sum(bool(_LEAD.match(line) or _TAG.match(line)) for line in text) >= len(text) > 0


def _pieces(text: str, tagged: bool) -> list[tuple[str | None, str]]:
    """One line of the file cut at its tags: (tag, text) pairs, tag None for text before any tag.
    In a log that is not ``tagged`` the tags are only dropped: one piece, its tag None.

    >>> _pieces("[1,0]<stdout>:  1048576  262144[1,3]<stdout>:more", True)
    [('[1,0]<stdout>:', '  1048576  262144'), ('[1,3]<stdout>:', 'more')]
    """
    lead = _LEAD.match(text)
    key, start = (lead.group().strip(), lead.end()) if lead else (None, 0)
    pieces = []
    for tag in _TAG.finditer(text, start):
        if tag.start() > start or key is not None:
            pieces.append((key, text[start:tag.start()]))
        key, start = tag.group(), tag.end()
    pieces.append((key, text[start:]))
    return pieces if tagged else [(None, "".join(piece for _, piece in pieces))]


def _streams(path: Path) -> dict[str | None, list[Line]]:
    """The log's lines per launcher tag, each rank's pieces put back together in order. A line cut
    by another rank's piece goes on with the next piece of its own tag; an untagged piece goes on
    with the line left unfinished, else it is of the line above's stream (a terminal's wrap). A
    line its stream never finished (the log was cut off there) is dropped."""
    physical = path.read_text(errors="replace").replace("\r\n", "\n").split("\n")
    tagged = _tagged(physical)
    streams: dict[str | None, list[Line]] = {}
    unfinished: dict[str | None, Line] = {}
    above = None
    for number, text in enumerate(physical, 1):
        pieces = _pieces(text, tagged)
        for index, (key, piece) in enumerate(pieces):
            key = key if key is not None else next(reversed(unfinished), above)
            start, before = unfinished.pop(key, (number, ""))
            # Cut by the next tag, or by the end of the file (the text after the last newline).
            if index < len(pieces) - 1 or number == len(physical):
                unfinished[key] = (start, before + piece)
            else:
                streams.setdefault(key, []).append((start, before + piece))
            above = key
    return streams


def _run(path: Path, header: re.Pattern, what: str) -> tuple[list[Line], int]:
    """The lines of the one stream that holds a ``what`` table, and where its ``header`` is (one
    run per log: a second table, in the same stream or another rank's, is an error)."""
    streams = _streams(path)
    found = sorted(((number, key, index) for key, lines in streams.items()
                    for index, (number, text) in enumerate(lines) if header.match(text.lstrip())),
                   key=lambda hit: hit[0])
    if not found:
        end = max((number for lines in streams.values() for number, _ in lines), default=1)
        raise _error(path, end, f"no {what} table in the log (read to its end)")
    if len(found) > 1:
        raise _error(path, found[1][0], f"a second {what} table (the first is at line {found[0][0]}): "
                                        "one run per log")
    _, key, index = found[0]
    return streams[key], index


def _starts_row(text: str) -> bool:
    fields = text.split()
    return bool(fields) and bool(_INT.fullmatch(fields[0]))


def _head(lines: list[Line], is_header: Callable[[str], bool]) -> tuple[list[Line], int]:
    """The lines down to the table's column header, and where its rows start. A terminal's wrap is
    undone: no row comes before the header, so a line there that is neither a comment nor NCCL's
    log goes on with the comment above it, and the header goes on with the lines after it that
    start no row and hold no ``: `` (no column's title does; a message such as ``srun: error: ...``
    or ``Warning: ...`` does)."""
    head: list[Line] = []
    seen = False
    for index, (number, text) in enumerate(lines):
        comment = bool(_COMMENT.match(text))
        if seen and (comment or _starts_row(text) or ": " in text):
            return head, index
        if _NCCL_LOG.fullmatch(text.strip()):
            continue
        if comment or not head:
            head.append((number, text))
        else:
            head[-1] = (head[-1][0], head[-1][1] + text)
        seen = seen or is_header(head[-1][1])
    return head, len(lines)


def _rows(path: Path, lines: list[Line], width: int, log: re.Pattern) -> tuple[list[Row], str | None]:
    """The table's rows, each of ``width`` fields, and nccl-tests' failure message if the run ended
    in one. A row a wrap cut short goes on with the next line; NCCL's ``log`` is taken out of a row
    it landed in; a line that starts with no number is another program's (a warning) and skipped.
    A row still short where the log ends is where it was cut off: dropped."""
    rows, pending, failure = [], None, None
    for number, text in lines:
        text = "" if _NCCL_LOG.fullmatch(text.strip()) else log.sub("", text)
        if _FAILURE.search(text):  # the run stopped: the row it cut is no measurement
            failure, pending = _FAILURE.search(text).group().strip(), None
            continue
        comment = _COMMENT.match(text)
        if comment and pending:
            raise _error(path, pending[0], f"a row cut short ({len(pending[1].split())} of {width} fields)")
        if comment or not text.strip() or not (pending or _starts_row(text)):
            continue
        start, text = (pending[0], pending[1] + text) if pending else (number, text)
        fields = text.split()
        if len(fields) > width:
            raise _error(path, start, f"{len(fields)} fields where the header has {width}: {text.strip()!r}")
        pending = (start, text) if len(fields) < width else None
        if len(fields) == width:
            rows.append((start, fields))
    return rows, failure


def _frame(path: Path, rows: list[Row], names: list[str], kinds: dict[str, type]) -> pd.DataFrame:
    """The rows as a DataFrame, each column of its kind (``kinds``, else float; ``N/A`` is NaN)."""
    import pandas as pd  # here, not at the top: ``import lab`` imports lab.sim in every rank process

    table: dict[str, list] = {name: [] for name in names}
    for number, fields in rows:
        for name, field in zip(names, fields):
            kind = kinds.get(name, float)
            pattern, what = _KINDS[kind]
            if not pattern.fullmatch(field):
                raise _error(path, number, f"{name} is {field!r}, not {what}")
            table[name].append(math.nan if field == "N/A" else kind(field))
    return pd.DataFrame(table)


def _glued_log(hosts: list[str]) -> re.Pattern:
    """NCCL's log line wherever it starts: glued to a row (``-1node1:12:34 [0] NCCL INFO ...``) only
    the host's name tells where the row ends, so the names are the device lines' where known."""
    names = "|".join(map(re.escape, hosts)) or r"[A-Za-z][\w.-]*"
    return re.compile(rf"(?:{names}):\d+:\d+ \[\d+\] (?:\S+:\d+ )?NCCL [A-Z]+\b.*")


def _nccl_columns(fields: list[str]) -> list[str]:
    """Column names for nccl-tests' header fields: those after the first time column are the
    out-of-place run's (``oop_``), after the second the in-place run's (``ip_``).

    >>> _nccl_columns("size count type redop root time algbw busbw #wrong time".split())[3:]
    ['redop', 'root', 'oop_time_us', 'oop_algbw', 'oop_busbw', 'oop_wrong', 'ip_time_us']
    """
    names, prefix = [], ""
    for field in fields:
        if field in ("time", "cputime"):
            prefix = "ip_" if prefix else "oop_"
        name = _NCCL_COLUMNS.get(field) or re.sub(r"\W+", "_", field).strip("_")
        names.append(prefix + name if prefix and field != "timestamp" else name)
    return names


def _devices(head: list[Line]) -> dict:
    """Ranks, hosts and GPUs from the "Using devices" lines (one per rank, each naming its host)."""
    found = [match.groups() for _, text in head if (match := _DEVICE.match(text.strip()))]
    hosts = list(dict.fromkeys(host for _, host, _ in found))
    gpus = list(dict.fromkeys(name.strip() for *_, name in found if name.strip()))
    return {"ranks": len({rank for rank, _, _ in found}) or None, "hosts": len(hosts) or None,
            "host_names": hosts, "devices": gpus}


def _params(head: list[Line]) -> dict[str, int]:
    """The run's parameters from its ``# nThread 1 nGpus 8 minBytes 8 ... step: 2(factor) ...`` line:
    ``{"n_thread": 1, "n_gpus": 8, "min_bytes": 8, ..., "step_factor": 2, "warmup_iters": 5, ...}``."""
    line = next((text for _, text in head if _PARAMS.match(text.strip())), "")
    params = {}
    for key, value, unit in _PARAM.findall(line):
        key = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", key.strip()).lower().replace(" ", "_")
        params[f"{key}_{unit}" if unit else key] = int(value)
    return params


def _says(lines: list[Line]) -> dict:
    """What the log says outside its table (:data:`_SAYS`): the footer's average busbw and
    out-of-bounds count, the program, nccl-tests' and NCCL's versions; None where it does not say."""
    says = {}
    for name, (pattern, kind) in _SAYS.items():
        match = next((found for _, text in lines if (found := pattern.search(text))), None)
        says[name] = kind(match.group(1)) if match else None
    return says


def _collective(path: Path, lines: list[Line], program: str | None, given: str | None) -> str:
    """The collective: ``given``, else the program the log names (its "Collective test starting"
    line, or the one ``*_perf`` its text names), else the file's name."""
    if given is not None:
        if given not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, not {given!r}")
        return given
    named = {match.group() for _, text in lines for match in _PROGRAM.finditer(text)}
    sources = [program] if program else sorted(named) if len(named) == 1 else []
    for source in [*sources, path.name]:
        for pattern, name in _NAMED:
            if pattern.search(source.lower()):
                return name
    raise ValueError(f"{path}: the log does not say which collective it measured (no program named in it "
                     "or in the file's name): pass collective=")


def _ranks_from_bandwidth(df: pd.DataFrame, collective: str) -> int | None:
    """N from busbw / algbw = factor·(N-1)/N, for a log that lists no devices; None where the ratio
    cannot tell (it is 1 whatever N for broadcast and reduce). The largest algbw has the most digits."""
    factor = _BUS_FACTOR.get(collective)
    algbw = df["oop_algbw"].dropna() if "oop_algbw" in df else None
    if factor is None or algbw is None or algbw.empty or algbw.max() <= 0:
        return None
    row = df.loc[algbw.idxmax()]
    ratio = row["oop_busbw"] / row["oop_algbw"]
    n = factor / (factor - ratio) if ratio < factor else math.inf
    return round(n) if math.isfinite(n) and abs(n - round(n)) < 0.1 and round(n) >= 1 else None


def read_nccl_tests(path: str | Path, collective: str | None = None) -> pd.DataFrame:
    """One nccl-tests run (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``,
    ``broadcast_perf``, ``alltoall_perf``, ``reduce_perf``, ``gather_perf``, ``scatter_perf``) as a
    DataFrame, one row per size, its columns the header's: ``bytes``, ``count``, ``dtype``, ``redop``
    and ``root`` (where the version prints them), then ``oop_time_us``, ``oop_algbw``, ``oop_busbw``
    (GB/s), ``oop_wrong`` (older versions: ``oop_error``) and the same with ``ip_`` (in place).

    ``df.attrs``: ``collective`` (the lab's name; pass ``collective=`` where neither the log nor the
    file's name says it), ``ranks``, ``hosts`` and ``host_names`` (from the "Using devices" lines;
    without them ranks from busbw/algbw: ``ranks_from``), ``ranks_per_process`` (nThread × nGpus),
    ``params`` (the ``# nThread ...`` line's), ``avg_busbw``, ``out_of_bounds``, ``complete`` (the
    footer was read), ``failure``, ``devices``, ``program``, ``nccl_version``, ``path``.

    >>> df = read_nccl_tests("tests/data/logs/all_reduce_8gpus_1host.log")
    >>> df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"], int(df["bytes"].iloc[-1])
    ('allreduce', 8, 1, 67108864)
    """
    path = Path(path)
    lines, _ = _run(path, _NCCL_HEADER, "nccl-tests")
    head, body = _head(lines, lambda text: bool(_NCCL_HEADER.match(text.lstrip())))
    number, header = head[-1]
    fields = header.lstrip().lstrip("#").split()
    devices = _devices(head)
    width = len(fields) + ("timestamp" in fields)  # a timestamp is two fields, a date and a time
    rows, failure = _rows(path, lines[body:], width, _glued_log(devices["host_names"]))
    if not rows:
        raise _error(path, number, "a column header with no rows under it")
    if "timestamp" in fields:
        rows = [(start, row[:-2] + [" ".join(row[-2:])]) for start, row in rows]
    df = _frame(path, rows, _nccl_columns(fields), _NCCL_KINDS)
    params, says = _params(head), _says(lines)
    name = _collective(path, lines, says["program"], collective)
    ranks = devices["ranks"] or _ranks_from_bandwidth(df, name)
    per_process = params["n_thread"] * params["n_gpus"] if {"n_thread", "n_gpus"} <= params.keys() else None
    df.attrs.update({"path": str(path), "format": "nccl-tests", "collective": name, **devices, "ranks": ranks,
                     "ranks_from": "devices" if devices["ranks"] else "busbw/algbw" if ranks else None,
                     "ranks_per_process": per_process, "params": params, "cputime": "cputime" in fields,
                     "complete": says["avg_busbw"] is not None, "failure": failure, **says})
    return df


def _osu_column(title: str) -> str:
    """A column's name from its title: ``Size`` is bytes, ``Avg Latency(us)`` avg_us, ``Pure
    Comm.(us)`` pure_comm_us, ``Overlap(%)`` overlap_pct."""
    if title in _OSU_COLUMNS:
        return _OSU_COLUMNS[title]
    return re.sub(r"[^a-z0-9]+", "_", title.lower().replace("(us)", " us").replace("(%)", " pct")).strip("_")


def _is_osu_header(text: str) -> bool:
    """OSU's column header: the first comment under its title that is no ``# Key: value`` line."""
    text = text.strip()
    return bool(_COMMENT.match(text)) and ": " not in text and not _OSU_START.match(text)


def read_osu(path: str | Path) -> pd.DataFrame:
    """One OSU micro-benchmark run (``osu_allreduce``, ``osu_bcast``, ``osu_allgather``,
    ``osu_reduce_scatter``, ``osu_alltoall``, ``osu_latency``, ...) as a DataFrame, one row per
    size: ``bytes``, ``avg_us`` and, with ``-f``, ``min_us``, ``max_us``, ``iterations``; other
    columns by their titles (``p50_us``, ``mb_per_s``, ``validation``). Times in µs.

    ``df.attrs``: ``collective`` (the lab's name; None for point-to-point tests), ``benchmark``
    (OSU's name: ``Allreduce Latency``, ``Latency``), ``version``, ``library`` (``MPI``),
    ``accelerator`` (``CUDA`` for ``MPI-CUDA``, else None), ``datatype``, ``path``; ``ranks`` and
    ``hosts`` are None: OSU does not print them.

    >>> df = read_osu("tests/data/logs/osu_allreduce.txt")
    >>> df.attrs["collective"], df.attrs["version"], list(df.columns)
    ('allreduce', '7.3', ['bytes', 'avg_us'])
    """
    path = Path(path)
    lines, at = _run(path, _OSU_START, "OSU")
    head, body = _head(lines[at:], _is_osu_header)
    (first, text), (number, header) = head[0], head[-1]
    title = _OSU_TITLE.match(text.strip())
    if not title:
        raise _error(path, first, f"an OSU title without its test and version: {text.strip()!r}")
    if not _is_osu_header(header):
        raise _error(path, number, "no column header (# Size  Avg Latency(us)) under the OSU title")
    names = [_osu_column(column) for column in re.split(r"\s{2,}", header.strip().lstrip("#").strip())]
    rows, _ = _rows(path, lines[at + body:], len(names), _NCCL_LOG)
    if not rows:
        raise _error(path, number, "a column header with no rows under it")
    df = _frame(path, rows, names, {"bytes": int, "iterations": int, "validation": str})
    library, accelerator, benchmark, version = title.groups()
    datatype = next((m.group(1) for _, line in lines[at:] if (m := _DATATYPE.match(line.strip()))), None)
    df.attrs.update({"path": str(path), "format": "osu", "benchmark": benchmark, "version": version,
                     "collective": _OSU_COLLECTIVES.get(re.sub(r"^Non-blocking |\s+Latency$", "", benchmark)),
                     "library": library, "accelerator": accelerator, "datatype": datatype,
                     "ranks": None, "hosts": None})
    return df
