"""A log's text as :mod:`lab.sim.logs` reads it: line by line within a limit, each launcher tag's
lines apart from the others', and where a terminal wrapped a line.

    streams(path)    # {tag: [(number, text, wraps), ...]}: one rank's lines per launcher tag

A launcher's tag stands on every line (Open MPI's ``[1,0]<stdout>:``, srun's ``0: ``,
``[host:pid] ``), and one rank's line may be cut by another rank's output: the tags say whose
each piece is, so the pieces are put back together. A file past :data:`MAX_LOG_BYTES`, or with a
line past :data:`MAX_LINE_BYTES` (``/dev/zero``: one endless line), is refused as it is read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

#: The most a log may hold: its lines are kept while it is read (a run of nccl-tests with
#: ``NCCL_DEBUG=INFO`` on a thousand ranks writes tens of MB).
MAX_LOG_BYTES = 256 << 20
#: The most one line may hold: nccl-tests' lines are a few hundred bytes, NCCL's a few thousand.
MAX_LINE_BYTES = 1 << 20
_BLOCK_BYTES = 1 << 20

#: Launcher tags that may stand anywhere in a line (a piece of one rank's line after another's):
#: Open MPI's ``--tag-output``, torchrun's ``--tee``.
_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:|\[default\d+\]:")
#: Tags that stand only at a line's start: srun ``--label``'s ``0: ``, ``[host:pid] ``.
_LEAD = re.compile(r" *\d+: |\[[\w.-]+:\d+\] ")

#: One logical line of a log: the file's line number where it starts, its text, and whether it
#: may go on in the next line (its last piece ends the file's widest line, where a terminal
#: wraps: the next line then holds the rest). A plain tuple: a log has millions.
Line = tuple[int, str, bool]
#: One table row: the file's line number where it starts, and its fields.
Row = tuple[int, list[str]]


def error(path: Path, line: int, message: str) -> ValueError:
    """The readers' error: the file, the line, what is wrong there."""
    return ValueError(f"{path}, line {line}: {message}")


def excerpt(text: str, limit: int = 120) -> str:
    """``text`` quoted for an error message, its middle left out past ``limit`` characters."""
    text = text.strip()
    return repr(text) if len(text) <= limit else f"{text[:limit // 2]!r}...{text[-limit // 2:]!r}"


def physical_lines(path: Path) -> list[str]:
    """The file's lines as ``text.split("\\n")`` has them (the last one is what follows the last
    newline), ``\\r\\n`` read as ``\\n``; read a block at a time, within the limits."""
    lines: list[str] = []
    rest, total = b"", 0  # the line the last block ended in, unfinished
    with path.open("rb") as handle:
        info = os.fstat(handle.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_LOG_BYTES:
            raise ValueError(f"{path}: {info.st_size:,} bytes, more than a log may hold "
                             f"({MAX_LOG_BYTES:,}: lab.sim.log_lines.MAX_LOG_BYTES)")
        while block := handle.read(min(_BLOCK_BYTES, MAX_LOG_BYTES + 1 - total)):
            total += len(block)
            pieces = (rest + block).split(b"\n")
            if total > MAX_LOG_BYTES:  # in the last piece read: the line that holds the byte past the limit
                raise error(
                    path,
                    len(lines) + len(pieces), f"the log goes on past {MAX_LOG_BYTES:,} bytes "
                    "(lab.sim.log_lines.MAX_LOG_BYTES)")
            if max(map(len, pieces)) > MAX_LINE_BYTES:
                index = next(i for i, piece in enumerate(pieces) if len(piece) > MAX_LINE_BYTES)
                raise error(
                    path,
                    len(lines) + index + 1, f"a line longer than {MAX_LINE_BYTES:,} bytes "
                    "(lab.sim.log_lines.MAX_LINE_BYTES): not a log's")
            rest = pieces.pop()
            lines += [piece.removesuffix(b"\r").decode(errors="replace") for piece in pieces]
    lines.append(rest.decode(errors="replace"))
    return lines


def _tagged(lines: list[str]) -> bool:
    """Whether a launcher tagged this log: a third of its lines or more start with a tag (a line a
    terminal wrapped starts with none; a stray ``[host:pid] `` warning in an untagged log is rare)."""
    text = [line for line in lines if line.strip()]
    return 3 * sum(bool(_LEAD.match(line) or _TAG.match(line)) for line in text) >= len(text) > 0


def _untagged(text: str) -> str:
    """A line of a log that is not tagged, its tags dropped."""
    lead = _LEAD.match(text)
    text = text[lead.end():] if lead else text
    return _TAG.sub("", text) if "]" in text else text


def _pieces(text: str) -> list[tuple[str | None, str]]:
    """One line of the file cut at its tags: (tag, text) pairs, tag None for text before any tag.

    >>> _pieces("[1,0]<stdout>:  1048576  262144[1,3]<stdout>:more")
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
    return pieces


def _wrap_width(lines: list[str]) -> int:
    """Where a terminal wrapped the log: the widest line's width, where two lines or more have
    it (a wrapped log has many; one line, the longest of an unwrapped log, is no wrap); else -1."""
    lengths = list(map(len, lines))
    width = max(lengths)
    return width if lengths.count(width) >= 2 else -1


def streams(path: Path) -> dict[str | None, list[Line]]:
    """The log's lines per launcher tag, each rank's pieces put back together in order. A line cut
    by another rank's piece goes on with the next piece of its own tag; an untagged piece goes on
    with the line left unfinished, else it is of the line above's stream (a terminal's wrap). A
    line its stream never finished (the log was cut off there) is dropped."""
    physical = physical_lines(path)
    width = _wrap_width(physical)
    if not _tagged(physical):  # each line its own, but the last: unfinished
        return {
            None: [(number, _untagged(text), len(text) == width)
                   for number, text in enumerate(physical[:-1], 1)]}
    found: dict[str | None, list[Line]] = {}
    unfinished: dict[str | None, tuple[int, list[str]]] = {}
    above = None
    for number, text in enumerate(physical, 1):
        pieces = _pieces(text)
        for index, (key, piece) in enumerate(pieces):
            key = key if key is not None else next(reversed(unfinished), above)
            start, parts = unfinished.pop(key, (number, []))
            parts.append(piece)
            # Cut by the next tag, or by the end of the file (the text after the last newline).
            if index < len(pieces) - 1 or number == len(physical):
                unfinished[key] = (start, parts)
            else:
                found.setdefault(key, []).append((start, "".join(parts), len(text) == width))
            above = key
    return found
