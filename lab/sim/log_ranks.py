"""How many ranks an nccl-tests log ran, and on which hosts: every source of the count checked
against the others (:func:`lab.sim.read_nccl_tests`' ``ranks``, ``hosts``, ``host_ranks``).

    found = devices(path, head)                                      # the "Using devices" lines
    attrs = ranks_and_hosts(path, found, params, rows, names, "allreduce")

A log says its rank count in up to four places; where one contradicts another, the read fails
naming the file, the line and the counts:

- the device lines (``#  Rank  3 Group  0 Pid  48211 on node1 device  3 [0x5d] NVIDIA H100``),
  one per rank, each naming its process and host;
- the parameter line's ``nThread`` × ``nGpus``: one process's ranks. mpirun's processes are
  counted nowhere else, so it says the ranks are a multiple of it, and that each process (a
  host's Pid in the device lines) holds that many;
- the count column, where the collective splits the buffer in N (allgather, reduce_scatter,
  alltoall, gather, scatter): nccl-tests prints size = count × the type's bytes × N, exactly;
- busbw / algbw = factor · (N-1)/N, both printed rounded to their last digit: the N whose ratio
  lies within what the rounding allows (:func:`bandwidth_ranks`): one N where the bandwidth is
  large, several where it is small.

The same sources say which collective a log measured where neither the log nor its file's name
does (:func:`fitting`): each collective's busbw / algbw, its count column (split in N or not),
and the redop and root columns (``none`` for a collective that does not reduce, ``-1`` for one
without a root) allow some collectives and rule out the rest.
"""

from __future__ import annotations

import decimal
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from lab.catalog import COLLECTIVES as CATALOG
from lab.catalog import MEASURED
from lab.sim.log_lines import Line, Row, error, excerpt

#: The collectives a log can hold, by the lab's names: those nccl-tests has a program for.
COLLECTIVES = MEASURED
#: busbw / algbw as nccl-tests computes it (its doc/PERFORMANCE.md, src/*.cu): factor·(N-1)/N;
#: broadcast's and reduce's is 1 whatever N (:data:`FLAT`).
BUS_FACTOR = {name: CATALOG[name].bus_scale for name in COLLECTIVES if CATALOG[name].per_rank}
FLAT = tuple(name for name in COLLECTIVES if not CATALOG[name].per_rank)
#: Collectives whose count column is each rank's share: size = count × item bytes × N; the
#: others' is the whole buffer: size = count × item bytes.
SPLIT = tuple(name for name in COLLECTIVES if CATALOG[name].splits)
#: What the redop and root columns say of each collective nccl-tests runs: whether it reduces (an
#: op's name, else ``none``) and whether it has a root (a rank, else ``-1``).
REDUCING = tuple(name for name in COLLECTIVES if CATALOG[name].reduces)
ROOTED = tuple(name for name in COLLECTIVES if CATALOG[name].rooted)
#: Bytes per element of nccl-tests' type names (older versions: char, int).
ITEM_BYTES = {
    "int8": 1, "uint8": 1, "char": 1, "int32": 4, "uint32": 4, "int": 4, "int64": 8, "uint64": 8, "half": 2,
    "float": 4, "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}

_DEVICE = re.compile(r"#\s*Rank\s+(\d+)\s+(?:Group\s+(\d+)\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+\d+\s+"
                     r"\[[^\]]*\]\s*(.*)")
_LIKE_DEVICE = re.compile(r"#\s*Rank\b")
_USING = re.compile(r"#\s*Using devices\b")
#: What ends the device lines: a bare ``#``, or the table's column header.
_BLOCK_END = re.compile(r"#\s*$|#\s*size\s+count\s")


class Device(NamedTuple):
    """One device line: where it is, and the rank, group, process, host and GPU it names."""

    line: int
    rank: int
    group: int
    pid: int
    host: str
    name: str


@dataclass(frozen=True)
class Claim:
    """What one source says of the rank count: the multiples of ``step`` from ``low`` to ``high``."""

    source: str
    line: int
    low: int
    high: float  # math.inf: no bound above
    step: int = 1

    def says(self) -> str:
        if self.low == self.high:
            return str(self.low)
        if self.step > 1:
            return f"a multiple of {self.step}"
        return f"{self.low} or more" if self.high == math.inf else f"{self.low} to {int(self.high)}"


def devices(path: Path, head: list[Line]) -> list[Device]:
    """The device lines, one per rank. A line among them (from ``# Using devices`` to the bare
    ``#`` after them) that is no device line, a rank listed twice or left out: an error."""
    found: list[Device] = []
    block = False
    for number, text, _ in head:
        text = text.strip()
        if match := _DEVICE.match(text):
            rank, group, pid, host, name = match.groups()
            found.append(Device(number, int(rank), int(group or 0), int(pid), host, name.strip()))
        elif _USING.match(text):
            block = True
        elif _BLOCK_END.match(text):
            block = False
        elif block or _LIKE_DEVICE.match(text):
            raise error(path, number, f"a device line that cannot be read: {excerpt(text)}")
    first: dict[int, int] = {}
    for device in found:
        if device.rank in first:
            raise error(path, device.line, f"rank {device.rank} listed again (first at line "
                        f"{first[device.rank]})")
        first[device.rank] = device.line
    missing = sorted(set(range(len(found))) - set(first))
    if missing:
        raise error(
            path, found[0].line, f"the device lines list {len(found)} ranks but not rank "
            f"{missing[0]} (they go up to {max(first)})")
    return found


def _printed(field: str) -> tuple[float, float] | None:
    """A printed number and half the unit of its last digit (the most its rounding moved it);
    None for ``N/A``, or a negative or endless number."""
    value = math.nan if field == "N/A" else float(field)
    if not (math.isfinite(value) and value >= 0):
        return None
    exponent = int(decimal.Decimal(field).as_tuple().exponent)
    return value, 0.5 * 10.0**min(max(exponent, -300), 300)


def _ranks_between(least: float, most: float, factor: float) -> tuple[int, float]:
    """The N whose factor·(N-1)/N lies from ``least`` to ``most`` (it rises from 0 at N = 1
    toward ``factor``): (lowest, highest), highest inf where it has no bound, (2, 1) for none."""
    def ratio(n: int) -> float:
        return factor * (n - 1) / n

    if least >= factor:
        return 2, 1
    low = max(1, math.ceil(1 / (1 - least / factor)))  # then exact, where rounding moved it
    while low > 1 and ratio(low - 1) >= least:
        low -= 1
    while ratio(low) < least:
        low += 1
    if most >= factor:
        return low, math.inf
    high = math.floor(1 / (1 - most / factor))
    while ratio(high + 1) <= most:
        high += 1
    while high >= 1 and ratio(high) > most:
        high -= 1
    return low, high


def bandwidth_ranks(algbw: str, busbw: str, factor: float, size: int | None = None,
                    time_us: str | None = None) -> tuple[int, float] | None:
    """The rank counts N that busbw = algbw · factor·(N-1)/N allows, ``algbw`` and ``busbw`` as
    nccl-tests printed them, each within half its last digit of the value it computed, and
    algbw within that of ``size`` / ``time_us`` (its wall time: algbw is computed from it) where
    the two overlap: ``(lowest, highest)``, highest ``inf`` where every N from the lowest fits,
    lowest > highest where none does; None where the row says nothing (N/A, negative, endless).

    >>> bandwidth_ranks("181.82", "318.18", 2.0), bandwidth_ranks("0.07", "0.13", 2.0)
    ((8, 8), (6, inf))
    >>> bandwidth_ranks("0.07", "0.13", 2.0, 1024, "13.91")    # 1024 B in 13.91 µs: 0.0736 GB/s
    (7, 12)
    """
    ratio = _ratio_bounds(algbw, busbw, size, time_us)
    return None if ratio is None else _ranks_between(*ratio, factor)


def _ratio_bounds(algbw: str, busbw: str, size: int | None,
                  time_us: str | None) -> tuple[float, float] | None:
    """The least and the most busbw / algbw can be, as :func:`bandwidth_ranks` reads the row."""
    a, b = _printed(algbw), _printed(busbw)
    if a is None or b is None:
        return None
    low, high = a[0] - a[1], a[0] + a[1]
    t = _printed(time_us) if time_us is not None and size is not None and size > 0 else None
    if t is not None and t[0] > t[1]:
        by_time = size / ((t[0] + t[1]) * 1e3), size / ((t[0] - t[1]) * 1e3)
        if by_time[0] <= high and by_time[1] >= low:
            low, high = max(low, by_time[0]), min(high, by_time[1])
    slack = 1e-9  # the double arithmetic behind the printed digits
    least = max(b[0] - b[1], 0.0) / high * (1 - slack)
    most = (b[0] + b[1]) / low * (1 + slack) if low > 0 else math.inf
    return least, most


def _bandwidth_claim(path: Path, rows: list[Row], names: list[str], collective: str,
                     wall_time: bool) -> Claim | None:
    """What every row's busbw / algbw (out of place and in place) says together, with its time
    where that is the wall time (not ``-C 1``'s CPU time); rows that disagree, or one that fits
    no N, are an error (for broadcast and reduce, a busbw that is not algbw). None where they
    say nothing."""
    factor = BUS_FACTOR.get(collective)
    at = {name: index for index, name in enumerate(names)}
    size_at = at.get("bytes")
    runs = [[at.get(f"{run}_{name}") for name in ("algbw", "busbw", "time_us")] for run in ("oop", "ip")]
    low, high, low_line, high_line = 1, math.inf, 0, 0
    for number, fields in rows if factor or collective in FLAT else []:
        for algbw, busbw, time_at in runs:
            if algbw is None or busbw is None:
                continue
            timed = wall_time and time_at is not None and size_at is not None
            size, time_us = (int(fields[size_at]), fields[time_at]) if timed else (None, None)
            if not factor:  # busbw = algbw: the row says nothing of N, but may say it is no such collective
                ratio = _ratio_bounds(fields[algbw], fields[busbw], size, time_us)
                if ratio is not None and not ratio[0] <= 1 <= ratio[1]:
                    raise error(
                        path, number, f"busbw {fields[busbw]} / algbw {fields[algbw]} is no "
                        f"{collective}'s (busbw = algbw)")
                continue
            span = bandwidth_ranks(fields[algbw], fields[busbw], factor, size, time_us)
            if span is None:
                continue
            if span[0] > span[1]:
                raise error(
                    path, number, f"busbw {fields[busbw]} / algbw {fields[algbw]} fits no rank count "
                    f"of {collective} (busbw = algbw × {factor:g}·(N-1)/N)")
            if span[1] < low or span[0] > high:
                other = low_line if span[1] < low else high_line
                said, kept = Claim("", number, *span).says(), Claim("", other, low, high).says()
                raise error(path, number, f"busbw/algbw says {said} ranks here and {kept} at line {other}")
            if span[0] > low:
                low, low_line = span[0], number
            if span[1] < high:
                high, high_line = span[1], number
    if (low, high) == (1, math.inf):
        return None
    return Claim("busbw/algbw", high_line or low_line, low, high)


def _count_claim(path: Path, rows: list[Row], names: list[str], collective: str) -> Claim | None:
    """N from size = count × item bytes × N, where the collective splits the buffer; rows that
    disagree, or a size no whole N gives, are an error (for the others, a size that is not count
    × item bytes). None where the count says nothing of N."""
    if not {"bytes", "count", "dtype"} <= set(names):
        return None
    at_size, at_count, at_type = names.index("bytes"), names.index("count"), names.index("dtype")
    claim = None
    for number, fields in rows:
        size, count, item = int(fields[at_size]), int(fields[at_count]), ITEM_BYTES.get(fields[at_type])
        if item is None or count <= 0 or size <= 0:
            continue
        if collective not in SPLIT:
            if size != count * item:
                raise error(
                    path, number, f"size {size} is not count {count} × {item} bytes "
                    f"({fields[at_type]}): no {collective}'s row")
            continue
        n, left = divmod(size, count * item)
        if left:
            raise error(
                path, number, f"size {size} is not count {count} × {item} bytes "
                f"({fields[at_type]}) × a whole number of ranks")
        if claim and n != claim.low:
            raise error(path, number, f"size / count says {n} ranks here and {claim.low} at line "
                        f"{claim.line}")
        claim = claim or Claim("count", number, n, n)
    return claim


def _agreed(path: Path, claims: list[Claim]) -> int | None:
    """The one count every claim allows, None where several are; none at all is an error that
    names the line of the claim that left none, and what each says."""
    low, high, step = 1, math.inf, 1
    for index, claim in enumerate(claims):
        low, high, step = max(low, claim.low), min(high, claim.high), math.lcm(step, claim.step)
        if -(-low // step) * step > high:
            told = "; ".join(f"{c.source} (line {c.line}) says {c.says()}" for c in claims[:index + 1])
            raise error(path, claim.line, f"the log's rank counts disagree: {told}")
    first = -(-low // step) * step
    return first if first + step > high else None


def _check_processes(path: Path, found: list[Device], per_process: int, line: int) -> None:
    """Each process (a host's Pid) of the device lines holds nThread × nGpus ranks."""
    processes: dict[tuple[str, int], list[Device]] = {}
    for device in found:
        processes.setdefault((device.host, device.pid), []).append(device)
    for (host, pid), held in processes.items():
        if len(held) != per_process:
            raise error(
                path, held[0].line, f"process {pid} on {host} has {len(held)} device lines; "
                f"nThread x nGpus (line {line}) gives each process {per_process}")


def ranks_and_hosts(path: Path, found: list[Device], params: tuple[int, dict[str, int]], rows: list[Row],
                    names: list[str], collective: str, wall_time: bool = True) -> dict:
    """``df.attrs``' ``ranks`` (the count every source allows; None where they leave several),
    ``ranks_from``, ``hosts``, ``host_names``, ``host_ranks`` (ranks on each, in order: uneven
    where they differ), ``groups`` (communicators run at once, ``NCCL_TESTS_SPLIT``: the ranks
    are rank 0's), ``ranks_per_process`` and ``devices`` (the GPUs' names). ``params``: the
    parameter line's number and what it says; ``wall_time``: the time columns are the wall time
    algbw is computed from (not ``-C 1``'s CPU time)."""
    line, said = params
    per_process = said["n_thread"] * said["n_gpus"] if {"n_thread", "n_gpus"} <= said.keys() else None
    group = next((d.group for d in found if d.rank == 0), None)
    ours = [d for d in found if d.group == group]
    claims = [Claim("devices", ours[0].line, len(ours), len(ours))] if ours else []
    if per_process:
        _check_processes(path, found, per_process, line)
        if per_process > 1:  # a multiple of 1 says nothing
            claims.append(Claim("nThread x nGpus", line, per_process, math.inf, per_process))
    claims += [
        c for c in (_count_claim(path, rows, names, collective),
                    _bandwidth_claim(path, rows, names, collective, wall_time)) if c]
    ranks = _agreed(path, claims)
    exact = [c.source for c in claims if c.low == c.high]
    host_ranks: dict[str, int] = {}
    for device in ours:
        host_ranks[device.host] = host_ranks.get(device.host, 0) + 1
    ranks_from = (exact[0] if exact else " and ".join(c.source for c in claims)) if ranks else None
    return {
        "ranks": ranks, "ranks_from": ranks_from, "hosts": len(host_ranks) or None,
        "host_names": list(host_ranks), "host_ranks": list(host_ranks.values()),
        "groups": len({d.group
                       for d in found}) or None, "ranks_per_process": per_process,
        "devices": list(dict.fromkeys(d.name for d in found if d.name))}


def _column_says(rows: list[Row], names: list[str], column: str, none: str) -> bool | None:
    """Whether every row's ``column`` holds something other than ``none`` (True), every row's is
    ``none`` (False), or the log does not say (no such column, or rows that differ): None."""
    if column not in names:
        return None
    at = names.index(column)
    found = {fields[at] == none for _, fields in rows}
    return not found.pop() if len(found) == 1 else None


def fitting(path: Path, found: list[Device], params: tuple[int, dict[str, int]], rows: list[Row],
            names: list[str], wall_time: bool = True) -> tuple[dict[str, dict], dict[str, str]]:
    """Which collectives the log's numbers allow, where nothing names the one it measured: each
    allowed one with :func:`ranks_and_hosts`' attrs for it, and for each other, why not (the
    redop column's ``none``, the root column's ``-1``, the line whose busbw / algbw or count it
    cannot have printed)."""
    reduces = _column_says(rows, names, "redop", "none")
    rooted = _column_says(rows, names, "root", "-1")
    allowed, refused = {}, {}
    for collective in COLLECTIVES:
        if reduces is not None and (collective in REDUCING) != reduces:
            refused[collective] = f"the redop column says {'an op' if reduces else 'none'}"
        elif rooted is not None and (collective in ROOTED) != rooted:
            refused[collective] = f"the root column says {'a rank' if rooted else '-1'}"
        else:
            try:
                allowed[collective] = ranks_and_hosts(path, found, params, rows, names, collective, wall_time)
            except ValueError as problem:
                refused[collective] = str(problem).removeprefix(f"{path}, ")
    return allowed, refused


def inferred(path: Path, found: list[Device], params: tuple[int, dict[str, int]], rows: list[Row],
             names: list[str], wall_time: bool = True) -> tuple[str, dict]:
    """The one collective the log's numbers allow (:func:`fitting`) and its attrs, where nothing
    names it; several, or none, is an error naming the file and each candidate."""
    allowed, refused = fitting(path, found, params, rows, names, wall_time)
    unsaid = (f"{path}: the log does not say which collective it measured (no program named in it or in "
              "the file's name)")
    if len(allowed) == 1:
        return next(iter(allowed.items()))
    if allowed:
        raise ValueError(f"{unsaid}, and its numbers fit {len(allowed)}: {', '.join(allowed)} (busbw/algbw, "
                         "the count, redop and root columns say the same of each): pass collective= "
                         "(python -m lab cluster fit: --collective)")
    if len(set(refused.values())) == 1:  # a reason that is no collective's: the device lines, say
        raise ValueError(f"{path}, {next(iter(refused.values()))}")
    why = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
    raise ValueError(f"{unsaid}, and its numbers fit none of the collectives it could be ({why})")
