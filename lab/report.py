"""Sections that other commands (``--hosts``, ``simulate``) splice into ``results/REPORT.md``."""

from __future__ import annotations

from pathlib import Path


def splice(report_path: Path, section: str, marker: str) -> None:
    """Put ``section`` into the report between ``<!-- marker:begin/end -->`` (replacing an older
    one), if the report exists: ``python -m lab results`` writes it first."""
    if not report_path.exists():
        return
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = report_path.read_text()
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    report_path.write_text(text)
