"""The logs people have: nccl-tests' ``*_perf`` tables and the OSU micro-benchmarks', as DataFrames.

    df = lab.sim.read_nccl_tests("all_reduce_16.log")   # bytes, oop_time_us, oop_busbw, ip_time_us...
    df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"]            # "allreduce", 16, 2
    df = lab.sim.read_osu("osu_allreduce.txt")          # bytes, avg_us (-f: min_us, max_us, iterations)

A log is read as it comes off a cluster (:mod:`lab.sim.log_lines`): a launcher's tag on every
line (Open MPI's ``[1,0]<stdout>:``, srun's ``0: ``, ``[host:pid] ``), one rank's line cut by
another rank's output, lines a terminal wrapped, NCCL's own log among the rows, ``N/A``. A log
cut off mid-run reads up to where it stops, its unfinished last line dropped. What cannot be
read, and a rank count one part of the log says and another contradicts
(:mod:`lab.sim.log_ranks`), raises ValueError naming the file and the line (for a run that failed
to start, the lines that say why). A log that names no collective (nccl-tests prints no program's
name) is read as the one its numbers allow, busbw/algbw and the columns. Reading takes time
in proportion to the file's size, and a file past ``lab.sim.log_lines.MAX_LOG_BYTES`` is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lab.catalog import COLLECTIVES as CATALOG
from lab.sim import log_ranks
from lab.sim.log_lines import Line, Row, error, excerpt, streams

if TYPE_CHECKING:
    import pandas as pd

#: The collectives a log can hold, by the lab's names.
COLLECTIVES = log_ranks.COLLECTIVES

#: NCCL's own log line (``NCCL_DEBUG=INFO``: ``host:pid:tid [dev] NCCL INFO ...``; a WARN names its
#: source line before NCCL; a timestamp in brackets may come first) and its banner, on the table's stdout.
_NCCL_LOG = re.compile(r"(?:\[[^\]]*\] *)?\S+:\d+:\d+ \[\d+\] (?:\S+:\d+ )?NCCL [A-Z]+\b.*"
                       r"|NCCL version \S+.*")
#: NCCL's log line glued to a row, after its host's name: found by what follows the name, and
#: the name is then read backwards (a pattern that starts at the name rescans the row at every
#: character of it).
_LOG_AFTER_HOST = re.compile(r":\d+:\d+ \[\d+\] (?:\S+:\d+ )?NCCL [A-Z]+\b")
#: nccl-tests' last words when a run fails (``node1: Test NCCL failure common.cu:1004 '...'``),
#: after the host's name.
_FAILURE_AFTER_HOST = re.compile(r": Test (?:\w+ )?(?:failure|timeout)\b")
#: Words of a line that says why a run stopped (``CXI alloc failed on cxi0: request exceeds ACs
#: limits``, ``srun: error: ...``, ``Segmentation fault``), outside NCCL's INFO lines.
_TROUBLE = re.compile(
    r"\b(?:errors?|fail(?:s|ed|ure)?|abort(?:s|ed)?|exceed(?:s|ed)?|killed|fault|denied"
    r"|cannot|unable)\b", re.IGNORECASE)
#: A comment: ``# Using devices``, ``#``; not a wrapped line's tail that starts ``#wrong ...``.
_COMMENT = re.compile(r"\s*#(?:\s|$)")
_INT = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|N/A|-?nan|-?inf")
#: A text field: a name (``float``, ``sum``, ``Pass``), or the date and time of nccl-tests' timestamp column.
_NAME = re.compile(r"[A-Za-z][\w.+-]*|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_KINDS = {int: (_INT, "an integer"), float: (_NUMBER, "a number"), str: (_NAME, "a name")}
#: A column header is a line of a few hundred characters: a comment longer than this is none.
_MAX_HEADER = 4096

_NCCL_HEADER = re.compile(r"#\s*size\s+count\s")
_NCCL_COLUMNS = {
    "size": "bytes", "type": "dtype", "#wrong": "wrong", "time": "time_us", "cputime": "time_us",
    "i_min": "i_min_us", "i_max": "i_max_us", "i_p99": "i_p99_us", "i_cv%": "i_cv_pct"}
#: Columns that are no floats (``algorithm``: the lab's predicted tables, :func:`lab.perf.table.predicted`).
_NCCL_KINDS = {
    "bytes": int, "count": int, "root": int, "dtype": str, "redop": str, "timestamp": str, "algorithm": str}
_PARAMS = re.compile(r"#\s*nThread\s")
#: A parameter's value, after its name: ``8``, ``4(factor)``.
_PARAM_VALUE = re.compile(r"(?<!\S)(\d+)(?:\((\w+)\))?")
_WORD = re.compile(r"[A-Za-z]+")
_PROGRAM = re.compile(rf"\b(?:{'|'.join(CATALOG[name].program for name in COLLECTIVES)})")
#: A collective in a program's or a file's name; the first match wins (reduce_scatter before reduce).
_NAMED = [(re.compile(pattern), name) for pattern, name in {
    r"all_?reduce": "allreduce", r"all_?gather": "allgather", r"reduce_?scatter": "reduce_scatter",
    r"broadcast|bcast": "broadcast", r"all_?to_?all": "all_to_all", r"reduce": "reduce", r"gather": "gather",
    r"scatter": "scatter"}.items()]
#: What a log says outside its table: the words its line holds, the pattern, the value's type.
_SAYS = dict(avg_busbw=("Avg bus bandwidth", re.compile(r"#\s*Avg bus bandwidth\s*:\s*(\S+)"), float),
             out_of_bounds=("Out of bounds", re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)"), int),
             program=("Collective test", re.compile(r"#\s*Collective test starting:\s*(\S+)"), str),
             nccl_tests_version=("nccl-tests version", re.compile(r"#\s*nccl-tests version (\S+)"), str),
             nccl_version=("NCCL version", re.compile(r"NCCL version (\S+)"), str))

_OSU_START = re.compile(r"#\s*OSU\s+\S")  # the title's start: a wrap may have cut the rest off
_OSU_LIBRARY = re.compile(r"([A-Za-z]+)(?:-(\w+))?")
_OSU_COLUMNS = {
    "Size": "bytes", "Avg Latency(us)": "avg_us", "Latency (us)": "avg_us", "Min Latency(us)": "min_us",
    "Max Latency(us)": "max_us", "P50 Tail Lat(us)": "p50_us", "P90 Tail Lat(us)": "p90_us",
    "P99 Tail Lat(us)": "p99_us", "Bandwidth (MB/s)": "mb_per_s"}
_OSU_COLLECTIVES = {
    "Allreduce": "allreduce", "Broadcast": "broadcast", "Allgather": "allgather", "Allgatherv": "allgather",
    "Reduce_scatter": "reduce_scatter", "Reduce_scatter_block": "reduce_scatter", "Reduce": "reduce",
    "Gather": "gather", "All-to-All Personalized Exchange": "all_to_all", "Gatherv": "gather",
    "All-to-Allv Personalized Exchange": "all_to_all", "Scatter": "scatter", "Scatterv": "scatter",
    "Barrier": "barrier"}
_DATATYPE = re.compile(r"#\s*Datatype:\s*(\w+)")


def _name_start(text: str, end: int) -> int | None:
    """Where the host's name that ends at ``end`` starts: at the first letter of the run of name
    characters before ``end`` (a row's last field may be glued to it: ``-1node1``); None without one."""
    start = end
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_.-"):
        start -= 1
    return next((i for i in range(start, end) if text[i].isascii() and text[i].isalpha()), None)


def _without_log(text: str, hosts: list[str] | None) -> tuple[str, bool]:
    """``text`` without NCCL's log line glued to its end (``-1node1:12:34 [0] NCCL INFO ...``), and
    whether there was one. Only the host's name tells where the row ends: the device lines' names
    where known (``hosts``, longest first), else the name's first letter."""
    if "NCCL" not in text:
        return text, False
    for after in _LOG_AFTER_HOST.finditer(text):
        end = after.start()
        named = (end - len(host) for host in hosts or () if text.endswith(host, 0, end))
        start = next(named, None) if hosts else _name_start(text, end)
        if start is not None:
            return text[:start], True
    return text, False


def _failure(text: str) -> str | None:
    """nccl-tests' failure message in ``text`` (``node1: Test NCCL failure ...``, to the line's end)."""
    if ": Test " not in text:
        return None
    for after in _FAILURE_AFTER_HOST.finditer(text):
        start = _name_start(text, after.start())
        if start is not None:
            return text[start:].strip()
    return None


def _why_stopped(lines: list[Line]) -> str:
    """The lines that say why a run stopped, for an error message: the first that says trouble in
    words of its own (a network library's, the launcher's), NCCL's first WARN and nccl-tests'
    last words, in the order of the log; empty where there are none."""
    found: dict[str, Line] = {}
    for line in lines:
        text = line[1].strip()
        if _failure(text) is not None:
            found.setdefault("nccl-tests", line)
        elif _NCCL_LOG.fullmatch(text):
            if " NCCL WARN " in text:
                found.setdefault("NCCL", line)
        elif not _COMMENT.match(text) and _TROUBLE.search(text):
            found.setdefault("other", line)
    said = sorted(found.values(), key=lambda line: line[0])
    return "; ".join(f"line {number}: {excerpt(text, 240)}" for number, text, _ in said)


def _run(path: Path, header: re.Pattern, what: str) -> tuple[list[Line], int]:
    """The lines of the one stream that holds a ``what`` table, and where its ``header`` is (one
    run per log: a second table, in the same stream or another rank's, is an error)."""
    found_streams = streams(path)
    found = sorted(((number, key, index) for key, lines in found_streams.items()
                    for index, (number, text, _) in enumerate(lines) if header.match(text.lstrip())),
                   key=lambda hit: hit[0])
    if not found:
        every = sorted((line for lines in found_streams.values() for line in lines), key=lambda line: line[0])
        why = _why_stopped(every)
        stopped = f": the run stopped before it ({why})" if why else ""
        end = every[-1][0] if every else 1
        raise error(path, end, f"no {what} table in the log (read to its end){stopped}")
    if len(found) > 1:
        raise error(path, found[1][0], f"a second {what} table (the first is at line {found[0][0]}): "
                    "one run per log")
    _, key, index = found[0]
    return found_streams[key], index


def _starts_row(text: str) -> bool:
    fields = text.split(maxsplit=1)
    return bool(fields) and bool(_INT.fullmatch(fields[0]))


def _head(lines: list[Line], is_header: Callable[[str], bool]) -> tuple[list[Line], int]:
    """The comments down to the table's column header, and where its rows start. No row comes
    before the header: a line there that is neither a comment nor NCCL's log is the rest of the
    comment above where a terminal wrapped that (its line ``wraps``), else another program's
    (left out). The header goes on likewise; the first comment, row or line with ``: `` after it
    (no column's title holds one; ``srun: error: ...`` or ``Warning: ...`` does) ends the head."""
    head: list[Line] = []
    at, parts, goes_on = 0, [], False  # the comment being read: its line, its text, the rest wrapped off it
    size, seen = 0, False
    for index, (number, text, wraps) in enumerate(lines):
        comment = bool(_COMMENT.match(text))
        if seen and (comment or _starts_row(text) or ": " in text):
            return [*head, (at, "".join(parts), goes_on)], index
        if _NCCL_LOG.fullmatch(text.strip()):
            continue
        if comment:
            if parts:
                head.append((at, "".join(parts), goes_on))
            at, parts, size = number, [text], len(text)
        elif parts and goes_on:
            parts.append(text)
            size += len(text)
        else:
            continue
        goes_on = wraps
        if not seen and size <= _MAX_HEADER:
            seen = is_header("".join(parts))
    return ([*head, (at, "".join(parts), goes_on)] if parts else head), len(lines)


def _short(path: Path, start: int, fields: list[str], width: int) -> ValueError:
    return error(path, start, f"a row cut short ({len(fields)} of {width} fields): a column is missing")


def _rows(path: Path, lines: list[Line], width: int, hosts: list[str] | None) -> tuple[list[Row], str | None]:
    """The table's rows, each of ``width`` fields, and nccl-tests' failure message if the run ended
    in one. A row goes on in the next line where a terminal wrapped it (its line ``wraps``) or
    NCCL's log landed in it (taken out); a row short of fields otherwise is an error (a column
    missing), or where the log ends, where it was cut off: dropped. A line that starts with no
    number is another program's (a warning) and skipped."""
    rows, failure = [], None
    start, fields, goes_on, open_field = 0, [], False, False  # the row being read, if any
    for number, text, wraps in lines:
        if _NCCL_LOG.fullmatch(text.strip()):
            continue
        text, cut = _without_log(text, hosts)
        if (said := _failure(text)) is not None:  # the run stopped: the row it cut is no measurement
            failure, fields = said, []
            continue
        comment = _COMMENT.match(text)
        if comment and fields:
            raise _short(path, start, fields, width)
        if comment or not text.strip() or not (fields or _starts_row(text)):
            continue
        if fields and not goes_on:
            if _starts_row(text):
                raise _short(path, start, fields, width)
            continue
        new = text.split()
        if fields and open_field and not text[0].isspace():
            fields[-1] += new.pop(0)  # a wrap inside a number: the characters joined as they were
        start = start if fields else number
        fields += new
        if len(fields) > width:
            raise error(path, start, f"{len(fields)} fields where the header has {width}: "
                        f"{excerpt(' '.join(fields))}")
        if len(fields) == width:
            rows.append((start, fields))
            fields = []
        goes_on, open_field = wraps or cut, not text[-1].isspace()
    return rows, failure


def _frame(path: Path, rows: list[Row], names: list[str], kinds: dict[str, type]) -> pd.DataFrame:
    """The rows as a DataFrame, each column of its kind (``kinds``, else float; ``N/A`` is NaN)."""
    import pandas as pd  # at the first log read: loading lab.sim loads no pandas

    table: dict[str, list] = {name: [] for name in names}
    for number, fields in rows:
        for name, field in zip(names, fields):
            kind = kinds.get(name, float)
            pattern, what = _KINDS[kind]
            if not pattern.fullmatch(field):
                raise error(path, number, f"{name} is {excerpt(field)}, not {what}")
            table[name].append(math.nan if field == "N/A" else kind(field))
    return pd.DataFrame(table)


def _nccl_columns(fields: list[str]) -> list[str]:
    """Column names for nccl-tests' header fields: those after the first time column are the
    out-of-place run's (``oop_``), after the second the in-place run's (``ip_``), but the row's
    own (``timestamp``; ``algorithm``, the lab's predicted tables').

    >>> _nccl_columns("size count type redop root time algbw busbw #wrong time".split())[3:]
    ['redop', 'root', 'oop_time_us', 'oop_algbw', 'oop_busbw', 'oop_wrong', 'ip_time_us']
    """
    names, prefix = [], ""
    for field in fields:
        if field in ("time", "cputime"):
            prefix = "ip_" if prefix else "oop_"
        name = _NCCL_COLUMNS.get(field) or re.sub(r"\W+", "_", field).strip("_")
        names.append(prefix + name if prefix and field not in ("timestamp", "algorithm") else name)
    return names


def _params(head: list[Line]) -> tuple[int, dict[str, int]]:
    """The run's parameters from its ``# nThread 1 nGpus 8 minBytes 8 ... step: 2(factor) ...`` line,
    and its number: ``{"n_thread": 1, "n_gpus": 8, "min_bytes": 8, ..., "step_factor": 2, ...}``.
    A parameter is a value and the words of letters before it (``warmup iters: 5``); the first of
    a name is kept (a line a terminal's wrap may have glued on says no other)."""
    number, line = next(((number, text) for number, text, _ in head if _PARAMS.match(text.strip())), (0, ""))
    params, start = {}, 0
    for value in _PARAM_VALUE.finditer(line):
        words = line[start:value.start()].split()
        start = value.end()
        if words:
            words[-1] = words[-1].removesuffix(":")
        key = []
        for word in reversed(words):
            if not _WORD.fullmatch(word):
                break
            key.insert(0, word)
        if key:
            name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", " ".join(key)).lower().replace(" ", "_")
            params.setdefault(f"{name}_{value.group(2)}" if value.group(2) else name, int(value.group(1)))
    return number, params


def _says(lines: list[Line]) -> dict:
    """What the log says outside its table (:data:`_SAYS`): the footer's average busbw and
    out-of-bounds count, the program, nccl-tests' and NCCL's versions; None where it does not say."""
    says = {}
    for name, (words, pattern, kind) in _SAYS.items():
        match = next((found for _, text, _ in lines if words in text and (found := pattern.search(text))),
                     None)
        says[name] = kind(match.group(1)) if match else None
    return says


def _collective(path: Path, lines: list[Line], program: str | None,
                given: str | None) -> tuple[str | None, str]:
    """The collective and what says it: ``given``, else the program the log names (its
    "Collective test starting" line, or the one ``*_perf`` its text names), else the file's name;
    None where none says it."""
    if given is not None:
        if given not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, not {given!r}")
        return given, "given"
    named = {match.group() for _, text, _ in lines if "_perf" in text for match in _PROGRAM.finditer(text)}
    sources = [program] if program else sorted(named) if len(named) == 1 else []
    for source, said in [*((source, "program") for source in sources), (path.name, "file name")]:
        for pattern, name in _NAMED:
            if pattern.search(source.lower()):
                return name, said
    return None, "busbw/algbw"


def read_nccl_tests(path: str | Path, collective: str | None = None) -> pd.DataFrame:
    """One nccl-tests run (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``,
    ``broadcast_perf``, ``alltoall_perf``, ``reduce_perf``, ``gather_perf``, ``scatter_perf``) as a
    DataFrame, one row per size, its columns the header's: ``bytes``, ``count``, ``dtype``, ``redop``
    and ``root`` (where the version prints them), then ``oop_time_us``, ``oop_algbw``, ``oop_busbw``
    (GB/s), ``oop_wrong`` (older versions: ``oop_error``) and the same with ``ip_`` (in place).

    ``df.attrs``: ``collective`` (the lab's name) and ``collective_from``: ``given``, the log's
    ``program``, the ``file name``, else ``busbw/algbw``, the one collective the numbers allow
    (:func:`lab.sim.log_ranks.inferred`; where they allow several, as allgather's and alltoall's
    do, an error names them: pass ``collective=``), ``ranks`` (the count the device lines,
    nThread × nGpus, the count column and busbw/algbw all allow: :mod:`lab.sim.log_ranks`; None
    where they leave several),
    ``ranks_from``, ``hosts``, ``host_names`` and ``host_ranks`` (ranks on each host, from the
    "Using devices" lines), ``groups``, ``ranks_per_process`` (nThread × nGpus), ``params`` (the
    ``# nThread ...`` line's), ``avg_busbw``, ``out_of_bounds``, ``complete`` (the footer was
    read), ``failure``, ``devices``, ``program``, ``nccl_version``, ``path``.

    >>> df = read_nccl_tests("tests/data/logs/all_reduce_8gpus_1host.log")
    >>> df.attrs["collective"], df.attrs["ranks"], df.attrs["hosts"], int(df["bytes"].iloc[-1])
    ('allreduce', 8, 1, 67108864)
    """
    path = Path(path)
    lines, _ = _run(path, _NCCL_HEADER, "nccl-tests")
    head, body = _head(lines, lambda text: bool(_NCCL_HEADER.match(text.lstrip())))
    number, header, _ = head[-1]
    fields = header.lstrip().lstrip("#").split()
    devices = log_ranks.devices(path, head)
    width = len(fields) + ("timestamp" in fields)  # a timestamp is two fields, a date and a time
    hosts = sorted({device.host for device in devices}, key=len, reverse=True)
    rows, failure = _rows(path, lines[body:], width, hosts)
    if not rows:
        why = _why_stopped(lines[body:])
        raise error(
            path, number, "a column header with no rows under it" +
            (f": the run stopped before its first size ({why})" if why else ""))
    if "timestamp" in fields:
        rows = [(start, row[:-2] + [" ".join(row[-2:])]) for start, row in rows]
    names = _nccl_columns(fields)
    df = _frame(path, rows, names, _NCCL_KINDS)
    params, says = _params(head), _says(lines)
    name, named_by = _collective(path, lines, says["program"], collective)
    wall_time = "cputime" not in fields
    if name is None:
        name, counted = log_ranks.inferred(path, devices, params, rows, names, wall_time)
    else:
        counted = log_ranks.ranks_and_hosts(path, devices, params, rows, names, name, wall_time)
    df.attrs.update(path=str(path), format="nccl-tests", collective=name, collective_from=named_by, **counted,
                    params=params[1], cputime="cputime" in fields, complete=says["avg_busbw"] is not None,
                    failure=failure, **says)
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


def _osu_title(text: str) -> tuple[str, str | None, str, str] | None:
    """(library, accelerator, benchmark, version) from OSU's title, ``# OSU MPI-CUDA Broadcast
    Latency Test v7.4``: the benchmark's name is the words up to the first ``Test v...``."""
    words = text.strip().removeprefix("#").split()
    library = _OSU_LIBRARY.fullmatch(words[1]) if len(words) > 1 and words[0] == "OSU" else None
    tests = (i for i in range(3, len(words) - 1) if words[i] == "Test" and re.fullmatch(r"v.+", words[i + 1]))
    test = next(tests, None)
    if library is None or test is None:
        return None
    return library.group(1), library.group(2), " ".join(words[2:test]), words[test + 1][1:]


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
    (first, text, _), (number, header, _) = head[0], head[-1]
    title = _osu_title(text)
    if not title:
        raise error(path, first, f"an OSU title without its test and version: {excerpt(text)}")
    if not _is_osu_header(header):
        raise error(path, number, "no column header (# Size  Avg Latency(us)) under the OSU title")
    names = [_osu_column(column) for column in re.split(r"\s{2,}", header.strip().lstrip("#").strip())]
    rows, _ = _rows(path, lines[at + body:], len(names), None)
    if not rows:
        raise error(path, number, "a column header with no rows under it")
    df = _frame(path, rows, names, {"bytes": int, "iterations": int, "validation": str})
    library, accelerator, benchmark, version = title
    datatype = next((m.group(1) for _, line, _ in lines[at:] if (m := _DATATYPE.match(line.strip()))), None)
    df.attrs.update({
        "path": str(path), "format": "osu", "benchmark": benchmark, "version": version,
        "collective": _OSU_COLLECTIVES.get(re.sub(r"^Non-blocking |\s+Latency$", "", benchmark)),
        "library": library, "accelerator": accelerator, "datatype": datatype, "ranks": None, "hosts": None})
    return df
