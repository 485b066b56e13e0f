"""Sections that other commands (``--hosts``, ``simulate``) splice into ``results/REPORT.md``, and
keeping them when the main report is written again."""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"<!-- (?P<marker>[\w-]+):begin -->\n.*?\n<!-- (?P=marker):end -->", re.DOTALL)


def _markers(marker: str) -> tuple[str, str]:
    """The lines around a spliced section (:data:`_BLOCK` finds them again)."""
    return f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"


def splice(report_path: Path, section: str, marker: str) -> None:
    """Put ``section`` into the report between ``<!-- marker:begin/end -->`` (replacing an older
    one), if the report exists: ``python -m lab results`` writes it first."""
    if not report_path.exists():
        return
    begin, end = _markers(marker)
    text = report_path.read_text()
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    report_path.write_text(text)


def with_spliced(report_path: Path, text: str) -> str:
    """``text`` (a freshly rendered report) followed by the sections other commands spliced into
    the report at ``report_path``, in their order: each names the run that measured it, and
    regenerating the main results does not drop them."""
    old = report_path.read_text() if report_path.exists() else ""
    blocks = [match.group(0) for match in _BLOCK.finditer(old)]
    return "\n\n".join([text.rstrip("\n"), *blocks]) + "\n"
