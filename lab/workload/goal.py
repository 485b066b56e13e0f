"""A re-targeted workload as GOAL, the text schedule LogGOPSim and ATLAHS replay.

Per rank, in issue order: ``calc <ns>`` for the compute before each event (and for a call's own
time after it, where the recording measured one: :mod:`lab.workload.held`), and each collective
as the messages of the lab's own algorithm at the target group's size and bytes (re-recorded by
:mod:`lab.sim.schedule`, its ranks mapped to the group's global ranks): a step's send and receive
both require the step before; an operation's first step requires its issue point and the rank's
previous operation (one issue order per mesh); a synchronous operation's last step, or the
``wait`` on an asynchronous one, is what the next compute requires. Each collective's messages
carry a tag of their own, so two collectives never match each other's messages::

    num_ranks 2

    rank 0 {
    l1: calc 100000
    l2: send 4000b to 1 tag 1
    l2 requires l1
    l3: recv 4000b from 1 tag 1
    l3 requires l1
    ...
    }
"""

from __future__ import annotations

from pathlib import Path

from lab.sim.core import recorded_schedule
from lab.sim.network import Network
from lab.workload import format as fmt
from lab.workload.rebucket import rebucket
from lab.workload.replay import DEFAULT_MAX_EVENTS, algorithm_for, collective_us, prepare, whole_steps
from lab.workload.retarget import Layout


class _Rank:
    """One rank's GOAL lines, with its labels and what the next operation requires."""
    def __init__(self, rank: int) -> None:
        self.rank, self.lines, self.count = rank, [f"rank {rank} {{"], 0
        self.after: list[int] = []  # what the next compute requires
        self.comm: list[int] = []  # the rank's previous operation's last labels
        self.last_of: dict[int, list[int]] = {}  # operation index -> its last labels

    def add(self, text: str, requires: list[int]) -> int:
        self.count += 1
        self.lines.append(f"l{self.count}: {text}")
        self.lines += [f"l{self.count} requires l{label}" for label in requires]
        return self.count


def _members(layout: Layout, rank: int, event: fmt.Event, spans: tuple[bool, ...] | None,
             groups: dict[tuple, list[int]]) -> list[int]:
    """The target group's global ranks, in group-rank order (each group listed once, in ``groups``)."""
    if spans is None:
        return list(event.group)
    key, _ = layout.group_of(rank, event, spans)
    if (spans, key) not in groups:
        for r in range(layout.world_size):
            groups.setdefault((spans, layout.group_of(r, event, spans)[0]), []).append(r)
    return groups[spans, key]


def export_goal(workload: fmt.Workload, path: str | Path, world_size: int | None = None, *,
                dims: dict[str, int] | None = None, network: Network | None = None,
                algorithms: dict[str, str] | None = None, shard: str = "strong",
                bucket_mb: float | None = None, max_events: int | None = DEFAULT_MAX_EVENTS) -> int:
    """Write ``workload``'s whole steps, re-targeted (and re-bucketed, ``bucket_mb``) as
    :func:`lab.workload.replay` does, as GOAL at ``path``; returns the number of operations
    written. ``network`` only chooses the algorithm where neither ``algorithms`` nor the recording
    says one (the least simulated, as the replay does: :func:`lab.workload.replay.algorithm_for`).
    Its limits are the replay's (``max_events``: :func:`lab.workload.replay.prepare`)."""
    if bucket_mb is not None:
        workload = rebucket(workload, bucket_mb)
    layout = Layout.of(workload, world_size, dims, shard)
    network = network or Network()
    algorithms = algorithms or {}
    prepare(workload, layout, network, algorithms, max_events, timeline=False)
    tags: dict[tuple, int] = {}
    groups: dict[tuple, list[int]] = {}
    written = 0
    with open(path, "w") as out:
        out.write(f"num_ranks {layout.world_size}\n\n")
        for rank in range(layout.world_size):
            goal, seen = _Rank(rank), {}
            template = layout.template(rank)
            for event in whole_steps(workload.events.get(template, []), workload.steps):
                compute = round(event.compute_us * 1000)
                if compute:
                    goal.after = [goal.add(f"calc {compute}", goal.after)]
                if event.kind == "wait":
                    goal.after = goal.after + goal.last_of.get(event.index, [])
                elif event.kind == "op":
                    last = _operation(goal, layout, rank, event, seen, tags, groups, network, algorithms)
                    goal.comm = goal.last_of[event.index] = last
                    if not event.is_async:
                        goal.after = goal.after + last
                    written += 1
                held = round(event.held_us * 1000)  # (the call's own time after it: lab.workload.held)
                if held:
                    goal.after = [goal.add(f"calc {held}", goal.after)]
            out.write("\n".join(goal.lines) + "\n}\n\n")
    return written


def _operation(goal: _Rank, layout: Layout, rank: int, event: fmt.Event, seen: dict, tags: dict[tuple, int],
               groups: dict[tuple, list[int]], network: Network, algorithms: dict[str, str]) -> list[int]:
    """Write one operation's messages; return its last labels (what a wait on it requires)."""
    start = goal.after + goal.comm
    if event.op in fmt.POINT_TO_POINT:
        peer = layout.peer_of(rank, event)
        src, dst = (rank, peer) if event.op == "send" else (peer, rank)
        key = ("p2p", src, dst, event.tag)
        seen[key] = seen.get(key, -1) + 1
        tag = tags.setdefault((*key, seen[key]), len(tags) + 1)
        text = (f"send {event.nbytes}b to {peer}"
                if event.op == "send" else f"recv {event.nbytes}b from {peer}")
        return [goal.add(f"{text} tag {tag}", start)]
    spans = layout.spanned(event)
    members = _members(layout, rank, event, spans, groups)
    key = ("collective", tuple(members))
    seen[key] = seen.get(key, -1) + 1
    tag = tags.setdefault((*key, seen[key]), len(tags) + 1)
    size, nbytes = len(members), layout.nbytes(event, len(members))
    if size == 1:
        return start
    root = min(event.group.index(event.root), size - 1) if event.root is not None else 0
    _, algorithm = collective_us(event.op, algorithm_for(event, size, nbytes, algorithms), size, nbytes, root,
                                 network)
    schedule, _ = recorded_schedule(event.op, algorithm, size, nbytes, root, 1, None)
    me = members.index(rank)
    previous = start
    for step in range(schedule.step_ptr[me], schedule.step_ptr[me + 1]):
        labels = []
        if schedule.send_peer[step] >= 0:
            labels.append(
                goal.add(
                    f"send {schedule.send_bytes[step]}b to {members[schedule.send_peer[step]]} tag {tag}",
                    previous))
        if schedule.recv_peer[step] >= 0:
            labels.append(
                goal.add(
                    f"recv {schedule.recv_bytes[step]}b from {members[schedule.recv_peer[step]]} tag {tag}",
                    previous))
        previous = labels or previous
    return previous
