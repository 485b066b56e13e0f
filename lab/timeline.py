"""``python -m lab timeline run.jsonl -o timeline.json``: a trace as a Chrome/Perfetto timeline.

One track per rank; each collective is a slice, and with ``LAB_TRACE_STEPS=1`` each of its
transfers is a slice inside it (who it sent to and received from, how many bytes), so the ring's
steps and who waited for whom are visible. Open the JSON in https://ui.perfetto.dev or
chrome://tracing; ``--png`` also draws it with matplotlib.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab import checks

#: The longest line a trace row takes (a step's sends and receives at thousands of ranks fit).
MAX_LINE_CHARS = 1 << 20
#: What the timeline reads of each row: a whole number per key; a step's sends and receives.
_COUNTS = ("rank", "seq", "start_ns", "duration_ns")


def _check_row(row: object, where: str) -> dict:
    """A trace row the timeline can draw, or a ``ValueError`` naming ``where`` (file, line)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a trace row must be a JSON object; got {type(row).__name__}")
    step = row.get("kind") == "step"
    for key in (*_COUNTS, "step" if step else "nbytes"):
        if not checks.is_int(row.get(key)) or row[key] < 0:
            raise ValueError(f"{where}: {key!r} must be a whole number; got {row.get(key)!r}")
    if not isinstance(row.get("op"), str):
        raise ValueError(f"{where}: 'op' must be the collective's name; got {row.get('op')!r}")
    for key in ("sends", "recvs") if step else ():
        pairs = row.get(key)
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(map(checks.is_int, p)) for p in pairs):
            raise ValueError(f"{where}: {key!r} must be a list of [rank, bytes]; got {pairs!r}")
    return row


def read_trace(path: str | Path) -> list[dict]:
    """The rows of a JSONL trace (one JSON object per line); a line that is no row the timeline
    can draw (no JSON, a missing or wrong field, longer than :data:`MAX_LINE_CHARS`) is a
    ``ValueError`` naming the file and the line."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as trace:  # (bytes that are no text: no JSON)
        for number, line in enumerate(iter(lambda: trace.readline(MAX_LINE_CHARS + 1), ""), 1):
            where = f"{path}, line {number}"
            if len(line) > MAX_LINE_CHARS:
                raise ValueError(f"{where}: longer than {MAX_LINE_CHARS:,} characters: no trace row")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
            rows.append(_check_row(row, where))
    return rows


def _slice_name(row: dict) -> str:
    if row.get("kind") == "step":
        parts = [f"→{dst} {nbytes} B" for dst, nbytes in row["sends"]]
        parts += [f"←{src} {nbytes} B" for src, nbytes in row["recvs"]]
        return f"step {row['step']}: " + ", ".join(parts)
    algorithm = f" ({row['algorithm']})" if row.get("algorithm") else ""
    return f"{row['op']} #{row['seq']}{algorithm} {row['nbytes']} B"


def trace_events(tracks: dict[int, str], slices: list[dict]) -> dict:
    """The Trace Event Format that Perfetto and chrome://tracing open, the lab's one writer of it:
    a named thread per track (``tracks``: tid -> name) and a complete ("X") event per slice, each
    its ``tid``, ``name``, ``cat``, ``ts`` and ``dur`` (µs) and, where it has them, ``args``."""
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
              for tid, name in tracks.items()]
    events += [{"ph": "X", "pid": 0, **piece} for piece in slices]
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def to_chrome_trace(rows: list[dict]) -> dict:
    """The Trace Event Format (:func:`trace_events`): one thread per rank, a slice per row, times
    in µs from the start."""
    if not rows:
        return {"traceEvents": []}
    origin = min(row["start_ns"] for row in rows)
    tracks = {rank: f"rank {rank}" for rank in sorted({row["rank"] for row in rows})}
    slices = [{
        "name": _slice_name(row), "cat": row.get("kind", "collective"), "tid": row["rank"],
        "ts": (row["start_ns"] - origin) / 1e3, "dur": row["duration_ns"] / 1e3,
        "args": {k: v
                 for k, v in row.items() if k not in ("start_ns", "duration_ns")}} for row in rows]
    return trace_events(tracks, slices)


def plot_timeline(rows: list[dict], path: str | Path) -> None:
    """Collectives as wide bars and transfers as thin ones, one row per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(row["start_ns"] for row in rows)
    ops = sorted({row["op"] for row in rows if row.get("kind", "collective") == "collective"})
    colours = {op: plt.cm.tab10(i % 10) for i, op in enumerate(ops)}
    ranks = sorted({row["rank"] for row in rows})
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(ranks)))
    for row in rows:
        start, width = (row["start_ns"] - origin) / 1e3, max(row["duration_ns"] / 1e3, 1e-3)
        if row.get("kind") == "step":
            ax.broken_barh([(start, width)], (row["rank"] - 0.1, 0.2), color="black", alpha=0.5)
        else:
            ax.broken_barh([(start, width)], (row["rank"] - 0.35, 0.7), color=colours[row["op"]], alpha=0.7)
    for op, colour in colours.items():
        ax.bar(0, 0, color=colour, label=op)
    ax.set(yticks=ranks, yticklabels=[f"rank {r}" for r in ranks], xlabel="µs since the first event",
           title="collectives per rank (black: transfers)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
