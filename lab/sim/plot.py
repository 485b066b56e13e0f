"""Pictures of an algorithm: its recorded schedule, ranks down, steps across, one arrow per message.

    python -m lab explain allreduce ring --ranks 8 --bytes 256K --plot ring_8.png

:func:`arrows` lays the recorded schedule (:mod:`lab.sim.schedule`) out in logical steps, the way
the lesson draws the ring: a rank's step starts one column after its previous step ended, a
message leaves at the start of the sender's step and lands at the end of the receiver's step, which
ends no earlier than the message left. Each arrow says whether the receiver added the chunk into
its buffer (reduce) or stored it (copy), and whether it is on the critical path that the replay
(:mod:`lab.sim.event_loop`) found on the network. :func:`draw` makes the PNG (matplotlib, imported
only here).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lab.sim.event_loop import Message, ScheduleError, match_messages
from lab.sim.schedule import Schedule


@dataclass(frozen=True)
class Arrow:
    """One message of a schedule, placed in logical steps."""

    src: int
    dst: int
    nbytes: int
    sent_at: int  # the column where the sender's step starts (the message leaves)
    received_at: int  # the column where the receiver's step ends (the message has landed)
    reduces: bool  # the receiver adds it into its buffer (else it copies it)
    critical: bool  # on the critical path of the replay


def _columns(schedule: Schedule, match: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each step's start and end column: a step starts one column after its rank's previous step
    ends, and ends when it started or, if it receives, no earlier than its message's step started."""
    n, steps = schedule.world_size, schedule.steps
    sender_of = np.full(steps, -1, dtype=np.int64)  # per receiving step: the step that sent its message
    sends = np.flatnonzero(match >= 0)
    sender_of[match[sends]] = sends
    start = np.full(steps, -1, dtype=np.int64)
    end = np.full(steps, -1, dtype=np.int64)
    nxt = schedule.step_ptr[:-1].copy()
    # Each pass moves every rank as far as its messages allow; a recorded schedule that replays
    # never stalls here (replay raises ScheduleError for one that deadlocks).
    remaining = steps
    while remaining:
        progressed = False
        for rank in range(n):
            k = int(nxt[rank])
            while k < schedule.step_ptr[rank + 1]:
                if start[k] < 0:
                    start[k] = end[k - 1] + 1 if k > schedule.step_ptr[rank] else 0
                    progressed = True
                m = sender_of[k]
                if m >= 0 and start[m] < 0:
                    break  # its message's step has not started yet: come back next pass
                end[k] = max(start[k], start[m]) if m >= 0 else start[k]
                k += 1
                remaining -= 1
                progressed = True
            nxt[rank] = k
        if not progressed:
            raise ScheduleError(f"{schedule.collective} ({schedule.algorithm}): the schedule deadlocks")
    return start, end


def arrows(schedule: Schedule, critical_path: list[Message]) -> list[Arrow]:
    """Every message of ``schedule`` as an :class:`Arrow`, in the senders' step order, the
    messages of ``critical_path`` (a replay of this schedule's, which names each one's recorded
    send) marked.

        s = record("allreduce", "ring", 2, 1024)          # two steps, each rank sends one chunk per step
        len(arrows(s, []))                               # 4
    """
    match = match_messages(schedule)
    start, end = _columns(schedule, match)
    rank_of = np.repeat(np.arange(schedule.world_size), np.diff(schedule.step_ptr))
    sends = np.flatnonzero(match >= 0)
    critical = {message.step for message in critical_path}
    for message in critical_path:
        k = message.step
        if not (0 <= k < len(match) and match[k] >= 0 and rank_of[k] == message.src and
                schedule.send_peer[k] == message.dst and schedule.send_bytes[k] == message.nbytes):
            raise ScheduleError(
                f"the critical path's message {message.src} -> {message.dst} ({message.nbytes} "
                f"bytes) is not send {k} of {schedule.algorithm}'s schedule: another recording?")
    return [
        Arrow(int(rank_of[k]), int(schedule.send_peer[k]), int(schedule.send_bytes[k]), int(start[k]),
              int(end[match[k]]), bool(schedule.reduces[match[k]]), k in critical) for k in sends.tolist()]


def _bytes_label(nbytes: int) -> str:
    """1536 -> ``1.5K``: short enough to sit on an arrow."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g}{unit}"
    return f"{nbytes}B"


def draw(schedule: Schedule, critical_path: list[Message], path: str | Path, title: str) -> list[Arrow]:
    """Draw ``schedule`` to the PNG ``path``: ranks down, steps across, an arrow per message
    labelled with its bytes (orange: reduced into the receiver's buffer, blue: copied), the
    critical path thick and red. Returns the arrows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    drawn = arrows(schedule, critical_path)
    n = schedule.world_size
    columns = max((a.received_at for a in drawn), default=0) + 1
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.85 * columns + 2.0), 60.0), max(3.0, 0.65 * n + 1.6)))
    for rank in range(n):
        ax.axhline(rank, color="0.85", lw=0.8, zorder=0)
    label_size = 7 if len(drawn) <= 120 else 5
    for arrow in sorted(drawn, key=lambda a: a.critical):  # the critical path on top
        color = "tab:orange" if arrow.reduces else "tab:blue"
        x0, x1 = arrow.sent_at + 0.15, arrow.received_at + 0.85
        if arrow.critical:
            ax.annotate("", (x1, arrow.dst), (x0, arrow.src), zorder=2,
                        arrowprops={"arrowstyle": "-", "color": "red", "lw": 5, "alpha": 0.35})
        ax.annotate(
            "", (x1, arrow.dst), (x0, arrow.src), zorder=3, arrowprops={
                "arrowstyle": "-|>", "color": color, "lw": 1.8 if arrow.critical else 1.0, "shrinkA": 0,
                "shrinkB": 2, "mutation_scale": 9})
        ax.text((x0 + x1) / 2, (arrow.src + arrow.dst) / 2, _bytes_label(arrow.nbytes), fontsize=label_size,
                ha="center", va="center", zorder=4,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xlim(0, columns)
    step_ticks = range(columns) if columns <= 40 else range(0, columns, max(1, columns // 20))
    ax.set_xticks([c + 0.5 for c in step_ticks], [str(c) for c in step_ticks])
    ax.set_xlabel(
        "step (a message leaves when its sender's step starts and lands by the end of its receiver's)")
    # The title's lines wrap to the figure's width (about 12 characters an inch at 10 points).
    width = int(fig.get_size_inches()[0] * 12)
    ax.set_title("\n".join(textwrap.fill(line, width) for line in title.splitlines()), fontsize=10)
    ax.legend(
        handles=[
            Line2D([], [], color="tab:orange", lw=1.5, label="reduce: added into the receiver's chunk"),
            Line2D([], [], color="tab:blue", lw=1.5, label="copy: stored as received"),
            Line2D([], [], color="red", lw=5, alpha=0.35, label="critical path")], loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.3 / max(n, 1)), ncol=3, fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
