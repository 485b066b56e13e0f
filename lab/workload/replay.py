"""Replaying a workload: every rank's compute and communication, timed on a network model.

Each target rank runs its template rank's events in order (:mod:`lab.workload.retarget`):
compute for its ``compute_us`` (times ``compute_scale`` and its straggler factor), then the
event. A synchronous operation blocks the rank until it completes; an asynchronous one runs
beside the rank's compute until a ``wait`` on it. A call's own time that the recording measured
(``held_us``, :mod:`lab.workload.held`: an issue's return, and the hand-off back to the program
after a blocking call's operation completed) holds the rank after it, as it held the program. A rank's operations run one after another, in
issue order (the lab's one issue order per mesh, NCCL's stream): an operation is ready on a rank
once issued and once the rank's previous operation completed. A collective starts when its last
member is ready and ends, on every member, after the simulator's time for the lab's own
algorithm at the group's size and bytes (:func:`lab.sim.simulate`, cached per collective,
algorithm, group size, bytes and root). A send is eager, as the lab's are: it takes one message's
α + n·β from when it is ready, whether its receive is posted or not, and the receive completes once
it is ready and that message has arrived (a pipeline's stage issues its sends and goes on). Each
transfer also holds its rank's communication thread for the time the recording saw it take there
(``thread_us``, :mod:`lab.workload.thread_time`): a send for that time less the α + n·β of the
network it was recorded on (``recorded_network``; default: the replay's) and then the replay's
α + n·β (so, on the recorded network, that time where it is longer than α + n·β), a receive for
that time after its message arrived.

What it does not model: contention between collectives of different groups that run at once
(each is timed as if alone on the network), compute slowed by communication, and anything the
recording did not see (data loading outside the lab's calls is compute).
"""

from __future__ import annotations

import functools
import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lab import checks
from lab.algorithms import registry
from lab.sim.core import simulate
from lab.sim.limits import SimulationTooLarge, SimulationUnsupported
from lab.sim.network import Network
from lab.timeline import trace_events
from lab.workload.format import POINT_TO_POINT, Event, Workload
from lab.workload.pipeline import stage_of, stages
from lab.workload.retarget import Layout

if TYPE_CHECKING:
    import pandas as pd

#: The simulator's step limit when the replay picks an algorithm: a candidate past it is left out.
CHOICE_MAX_STEPS = 2_000_000
#: The default limit on the events a replay runs, every target rank's together (``max_events``):
#: about 1 GB (3 GB with its timeline) and half a minute.
DEFAULT_MAX_EVENTS = 5_000_000
#: What a replay costs (measured on this machine's loaded 2 cores, 2-rank groups at 20,000 ranks: 182
#: bytes an event, 370 more with its timeline, 453 a rank, 5 µs an event): memory per event run, per
#: event's timeline slices (``timeline=True``) and per target rank; time per event.
BYTES_PER_EVENT, BYTES_PER_SLICE, BYTES_PER_RANK, S_PER_EVENT = 200, 400, 500, 5e-6


@functools.lru_cache(maxsize=4096)
def collective_us(collective: str, algorithm: str | None, group_size: int, nbytes: int, root: int,
                  network: Network) -> tuple[float, str]:
    """µs of one ``collective`` of ``nbytes`` per rank on ``group_size`` ranks, and the algorithm
    timed: ``algorithm``, or (None) the least simulated of the registry's ``auto`` candidates."""
    if group_size == 1:
        return 0.0, algorithm or "none"
    if algorithm is not None:
        return simulate(collective, algorithm, group_size, nbytes, network, root=root,
                        max_seconds=None).time_us, algorithm
    best: tuple[float, str] | None = None
    for candidate in registry.auto_candidates(collective):
        try:
            time_us = simulate(collective, candidate, group_size, nbytes, network, root=root,
                               max_steps=CHOICE_MAX_STEPS, max_seconds=None).time_us
        except (SimulationTooLarge, SimulationUnsupported):
            continue
        if best is None or time_us < best[0]:
            best = (time_us, candidate)
    if best is None:
        raise ValueError(
            f"no algorithm of {collective} can be simulated at {group_size} ranks and {nbytes} bytes "
            f"within {CHOICE_MAX_STEPS:,} steps: name one in algorithms=")
    return best


def algorithm_for(event: Event, group_size: int, nbytes: int, algorithms: dict[str, str]) -> str | None:
    """The algorithm a replay times collective ``event`` with on ``group_size`` ranks and ``nbytes``
    a rank: the one ``algorithms`` names for it (``"auto"``: the replay's own choice, None); else,
    at the recorded group's size and bytes, the one the lab ran there (the file's ``algorithm``);
    else None, the least simulated of ``auto``'s candidates (the lab's ``auto`` picks again at
    another size, from the fitted models of the machine it runs on, which the file does not hold)."""
    named = algorithms.get(event.op)
    if named is not None:
        return None if named == "auto" else named
    if event.algorithm is None or group_size != len(event.group) or nbytes != event.nbytes:
        return None
    if event.algorithm not in registry.ALGORITHMS[event.op]:
        raise ValueError(
            f"operation {event.index} of recorded rank {event.rank} ran {event.op} algorithm "
            f"{event.algorithm!r}, which this lab does not have: name one in algorithms= ('auto': the replay's)"
        )
    return event.algorithm


@dataclass(slots=True)
class _Op:
    """One issued operation of one target rank."""

    event: Event
    rank: int
    position: int  # in the rank's issue order
    key: tuple
    size: int
    issued: float
    ready: float | None = None
    done: float | None = None
    start: float | None = None


@dataclass
class ReplayResult:
    """What :func:`lab.workload.replay` found: per step and per operation.

    ``step_us``, ``compute_us``, ``exposed_comm_us``: numpy arrays, one value a step (the rank that
    finished the step last: its compute, and the rest of the step, spent waiting on communication).
    ``breakdown``: one row per operation of the step (by its index in the template rank's issue
    order): op, group size, bytes, the algorithm timed and the one the recording says ran
    (``recorded_algorithm``; None where the file does not say), predicted µs, exposed µs (the
    longest any member was blocked on it) and its share of the step. ``stages``: a pipeline's
    breakdown per rank that holds stages and per step (:func:`lab.workload.pipeline.stages`: its
    compute, its time blocked on collectives, and the bubble, the rest of the step; empty where no
    transfer names a stage)."""

    world_size: int
    network: Network
    step_us: np.ndarray
    compute_us: np.ndarray
    exposed_comm_us: np.ndarray
    breakdown: pd.DataFrame
    slices: list[dict]
    stages: pd.DataFrame | None = None

    def timeline(self, path: str | Path) -> None:
        """The simulated steps as a Chrome/Perfetto trace (``python -m lab timeline``'s format): per
        rank, a compute track and a communication track."""
        tracks = {}
        for rank in sorted({s["rank"] for s in self.slices}):
            tracks.update({2 * rank: f"rank {rank}", 2 * rank + 1: f"rank {rank} comm"})
        slices = [{
            "name": s["name"], "cat": s["cat"], "tid": 2 * s["rank"] + (s["cat"] != "compute"),
            "ts": s["start_us"], "dur": max(s["end_us"] - s["start_us"], 0.0)} for s in self.slices]
        Path(path).write_text(json.dumps(trace_events(tracks, slices)))


def timed(event: Event, group_size: int, layout: Layout, algorithms: dict[str, str]) -> tuple:
    """What :func:`collective_us` times collective ``event`` as on a target group of ``group_size``
    (all but the network): the collective, the algorithm, the group's size, its bytes and root."""
    nbytes = layout.nbytes(event, group_size)
    root = 0 if event.root is None else min(event.group.index(event.root), group_size - 1)
    return event.op, algorithm_for(event, group_size, nbytes, algorithms), group_size, nbytes, root


def template_copies(workload: Workload, layout: Layout) -> dict[int, int]:
    """How many target ranks replay each recorded rank's whole steps (those that some do),
    counted from the meshes' sizes: no pass over the target ranks."""
    copies = {}
    for template in workload.events:
        coords = layout.coordinates(template, layout.recorded)
        count = math.prod(len(range(c, t, r)) for c, t, r in zip(coords, layout.target, layout.recorded))
        if count:
            copies[template] = count
    return copies


def prepare(workload: Workload, layout: Layout, network: Network, algorithms: dict[str, str],
            max_events: int | None, timeline: bool) -> None:
    """Before a replay allocates its target ranks: refuse it past ``max_events`` events, every
    target rank's together (:class:`SimulationTooLarge` with the count, the memory and the time
    it would take, and the limit), and time each distinct collective (cached for the run), so
    that one the simulator refuses at its target size is refused now."""
    if max_events is not None and not (checks.is_int(max_events) and max_events >= 1):
        raise ValueError(f"max_events must be an int >= 1 or None (no limit); got {max_events!r}")
    copies = template_copies(workload, layout)
    whole = {template: whole_steps(workload.events[template], workload.steps) for template in copies}
    events = sum(count * len(whole[template]) for template, count in copies.items())
    if max_events is not None and events > max_events:
        memory = events * (BYTES_PER_EVENT + timeline * BYTES_PER_SLICE) + layout.world_size * BYTES_PER_RANK
        raise SimulationTooLarge(
            f"too large to replay: {workload.steps} step(s) of {workload.path or 'the workload'} on "
            f"{layout.world_size:,} ranks run {events:,} events (counted; about {memory / 1e6:,.0f} MB of "
            f"memory and {events * S_PER_EVENT:,.1f} s), past max_events={max_events:,}. Pass max_events="
            f"{events:_} (the command line's --max-events), or max_events=None for no limit, to replay it "
            "anyway")
    for template_events in whole.values():
        for event in template_events:
            if event.kind == "op" and event.op not in POINT_TO_POINT:
                spans = layout.spanned(event)
                size = len(event.group) if spans is None else layout.group_of(0, event, spans)[1]
                collective_us(*timed(event, size, layout, algorithms), network)


def whole_steps(events: list[Event], steps: int) -> list[Event]:
    """``events`` up to the end of the ``steps``-th step (what follows the last mark is left out)."""
    seen = 0
    for i, event in enumerate(events):
        seen += event.kind == "step"
        if seen == steps:
            return events[:i + 1]
    return []


class Replay:
    """The event loop of one replay (see the module's docstring)."""
    def __init__(self, workload: Workload, layout: Layout, network: Network, algorithms: dict[str, str],
                 factors: np.ndarray, record_slices: bool, recorded_network: Network | None = None) -> None:
        self.workload, self.layout, self.network, self.algorithms = workload, layout, network, algorithms
        self.recorded_network = network if recorded_network is None else recorded_network
        n = layout.world_size
        self.factors, self.record_slices = factors, record_slices
        self.templates = [layout.template(r) for r in range(n)]
        self.pos, self.clock = [0] * n, np.zeros(n)
        self.charged = [-1] * n  # the event whose compute was added already
        self.blocked_since: list[float | None] = [None] * n
        self.ops: list[list[_Op]] = [[] for _ in range(n)]
        self.counters: list[dict] = [{} for _ in range(n)]
        self.instances: dict[tuple, list[_Op]] = {}  # a collective's members ready so far
        self.arriving: deque[_Op] = deque()
        self.step_end = np.zeros((n, workload.steps))
        self.step_compute = np.zeros((n, workload.steps))
        self.step_exposed = np.zeros((n, workload.steps))  # blocked on collectives
        self.exposed: dict[tuple[int, int], float] = {}  # (step, index) -> longest block on it
        self.rows: dict[tuple[int, int], dict] = {}
        self.slices: list[dict] = []
        self.spans: dict[tuple[int, int], tuple[bool, ...]] = {}
        self.events = {
            template: whole_steps(workload.events[template], workload.steps)
            for template in set(self.templates)}

    def run(self) -> None:
        ranks = range(self.layout.world_size)
        progressed = True
        while progressed:
            progressed = False
            for rank in ranks:
                progressed |= self._advance(rank)
        stuck = [r for r in ranks if self.pos[r] < len(self._events(r))]
        if stuck:
            rank = stuck[0]
            event = self._events(rank)[self.pos[rank]]
            raise ValueError(
                f"the replay cannot go on: rank {rank} waits on its {event.kind} of step {event.step} "
                f"(operation {event.index}), which some member of its group never issues "
                f"({len(stuck)} ranks stuck)")

    def _events(self, rank: int) -> list[Event]:
        return self.events[self.templates[rank]]

    def _charge(self, rank: int, event: Event) -> None:
        """The compute before the rank's current event, once."""
        if self.charged[rank] == self.pos[rank]:
            return
        self.charged[rank] = self.pos[rank]
        compute = event.compute_us * self.factors[rank]
        if self.record_slices and compute > 0:
            self.slices.append({
                "rank": rank, "cat": "compute", "name": "compute", "start_us": self.clock[rank],
                "end_us": self.clock[rank] + compute})
        self.clock[rank] += compute
        if event.step < self.step_compute.shape[1]:
            self.step_compute[rank, event.step] += compute

    def _advance(self, rank: int) -> bool:
        """Run ``rank``'s events until it blocks; whether it moved."""
        events, moved = self._events(rank), False
        while self.pos[rank] < len(events):
            event = events[self.pos[rank]]
            self._charge(rank, event)
            if event.kind == "op" and len(self.ops[rank]) == event.index:
                self._issue(rank, event)
            if event.kind in ("op", "wait"):
                op = self.ops[rank][event.index]
                if event.kind == "op" and event.is_async:
                    self._hold(rank, event, op, self.clock[rank], self.clock[rank])  # (its issue's return)
                elif op.done is None:
                    if self.blocked_since[rank] is None:
                        self.blocked_since[rank] = self.clock[rank]
                    return moved
                else:
                    self._unblock(rank, event, op)
            else:  # the end of a step
                self.step_end[rank, event.step] = self.clock[rank]
            self.pos[rank] += 1
            moved = True
        return moved

    def _unblock(self, rank: int, event: Event, op: _Op) -> None:
        since = self.clock[rank] if self.blocked_since[rank] is None else self.blocked_since[rank]
        self._hold(rank, event, op, since, max(self.clock[rank], op.done))
        self.blocked_since[rank] = None

    def _hold(self, rank: int, event: Event, op: _Op, since: float, until: float) -> None:
        """The rank's call (``event``) on ``op`` held it from ``since`` until ``until`` (its operation's
        end, or the issue) and then for the call's own time recorded (``event.held_us``: an issue's
        return, the hand-off back to the program; :mod:`lab.workload.held`): exposed time of ``op``."""
        self.clock[rank] = until + event.held_us
        row = (op.event.step, op.event.index)
        self.exposed[row] = max(self.exposed.get(row, 0.0), self.clock[rank] - since)
        if op.event.op not in POINT_TO_POINT:
            self.step_exposed[rank, event.step] += self.clock[rank] - since

    def _issue(self, rank: int, event: Event) -> None:
        if event.op in POINT_TO_POINT:
            peer = self.layout.peer_of(rank, event)
            src, dst = (rank, peer) if event.op == "send" else (peer, rank)
            base, size = ("p2p", src, dst, event.tag), 2
        else:
            key = (self.templates[rank], event.index)
            if key not in self.spans:
                self.spans[key] = self.layout.spanned(event)
            spans = self.spans[key]
            group_key, size = self.layout.group_of(rank, event, spans)
            base = ("collective", spans, group_key)
        seq = self.counters[rank].get(base, 0)
        self.counters[rank][base] = seq + 1
        op = _Op(event, rank, len(self.ops[rank]), (*base, seq), size, self.clock[rank])
        self.ops[rank].append(op)
        if op.position == 0 or self.ops[rank][op.position - 1].done is not None:
            self.arriving.append(op)
            while self.arriving:  # a worklist, not recursion: a resolved collective readies the next ones
                self._arrive(self.arriving.popleft())

    def _arrive(self, op: _Op) -> None:
        """``op`` is ready (issued, and its rank's previous operation done); resolve its collective
        once every member is."""
        op.ready = max(op.issued, self.ops[op.rank][op.position - 1].done if op.position else 0.0)
        if op.event.op in POINT_TO_POINT:
            self._transfer(op)
            return
        instance = self.instances.setdefault(op.key, [])
        if instance:
            self._check_same(instance[0], op)
        instance.append(op)
        if len(instance) == op.size:
            del self.instances[op.key]
            self._resolve(instance)

    def _check_same(self, first: _Op, op: _Op) -> None:
        a, b = first.event, op.event
        if (a.op, a.count, a.dtype) != (b.op, b.count, b.dtype) and b.op not in POINT_TO_POINT:
            raise ValueError(
                f"the recording's ranks disagree: one calls {a.op} of {a.count} {a.dtype} where rank "
                f"{op.rank} (recorded rank {b.rank}) calls {b.op} of {b.count} {b.dtype} on the same group")

    def _transfer(self, op: _Op) -> None:
        """A send or receive ready: a send leaves now (eager) and holds its rank's thread for the
        network's α + n·β and its recorded ``thread_us`` less the recorded network's; a receive
        completes its own ``thread_us`` after its send's message has arrived, the one that left
        first where it has not."""
        waiting = self.instances.setdefault(op.key, [])
        if op.event.op == "send":  # (its thread's time holds the rank's next operation: lab.workload.thread_time)
            recorded = self.recorded_network.alpha_us + op.event.nbytes * self.recorded_network.beta_us_per_byte
            duration = max(op.event.thread_us - recorded, 0.0) + self.network.alpha_us + \
                op.event.nbytes * self.network.beta_us_per_byte
            self._finish(op, op.ready, op.ready + duration, "message", duration)
        if not waiting:  # (the other end is not ready yet: it finds this one)
            waiting.append(op)
            return
        other = waiting.pop()
        del self.instances[op.key]
        send, receive = (op, other) if op.event.op == "send" else (other, op)
        done = max(receive.ready, send.done) + receive.event.thread_us  # (its thread's work once it arrived)
        self._finish(receive, receive.ready, done, "message",
                     send.done - send.start + receive.event.thread_us)

    def _resolve(self, instance: list[_Op]) -> None:
        first = instance[0]
        event = first.event
        start = max(op.ready for op in instance)
        duration, algorithm = collective_us(*timed(event, first.size, self.layout, self.algorithms),
                                            self.network)
        for op in instance:
            self._finish(op, start, start + duration, algorithm, duration)

    def _finish(self, op: _Op, start: float, done: float, algorithm: str, duration: float) -> None:
        """``op`` ran from ``start`` to ``done``: its row, its slice, and its rank's next operation ready."""
        event = op.event
        row = self.rows.setdefault(
            (event.step, event.index), {
                "step": event.step, "index": event.index, "op": event.op, "group_size": op.size,
                "dim": event.dim,
                "nbytes": event.nbytes if event.op in POINT_TO_POINT else self.layout.nbytes(event, op.size),
                "algorithm": algorithm, "recorded_algorithm": event.algorithm, "async": event.is_async,
                "predicted_us": duration})
        row["predicted_us"] = max(row["predicted_us"], duration)
        op.start, op.done = start, done
        if self.record_slices:
            self.slices.append({
                "rank": op.rank, "cat": "communication", "name": f"{event.op} {algorithm}", "start_us": start,
                "end_us": done})
        ops = self.ops[op.rank]
        if op.position + 1 < len(ops) and ops[op.position + 1].ready is None:
            self.arriving.append(ops[op.position + 1])

    def result(self) -> ReplayResult:
        ends = self.step_end
        finish = ends.max(axis=0)
        starts = np.concatenate([[0.0], finish[:-1]])
        step_us = finish - starts
        last = ends.argmax(axis=0)
        compute = self.step_compute[last, np.arange(ends.shape[1])]
        exposed = np.maximum(step_us - compute, 0.0)
        import pandas as pd  # at the first breakdown: a rank that records loads lab.workload, not pandas

        frame = pd.DataFrame(sorted(self.rows.values(), key=lambda r: (r["step"], r["index"])))
        if not frame.empty:
            frame["exposed_us"] = [
                self.exposed.get((s, i), 0.0) for s, i in zip(frame["step"], frame["index"])]
            frame["share"] = frame["exposed_us"] / frame["step"].map(dict(enumerate(step_us)))
        held = {template: stage_of(self.workload, template) for template in set(self.templates)}
        own = {rank: held[template] for rank, template in enumerate(self.templates)}
        per_stage = stages(step_us, self.step_compute, self.step_exposed,
                           {rank: mine
                            for rank, mine in own.items() if mine})
        return ReplayResult(self.layout.world_size, self.network, step_us, compute, exposed, frame,
                            self.slices, per_stage)
