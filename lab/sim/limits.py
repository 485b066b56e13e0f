"""The simulator's limits: what a case costs, estimated before it is recorded, and the refusals.

A recording costs about 170 bytes and a few µs per step, so before recording :func:`lab.sim.schedule.estimate`
records a sample of ranks (the root, rank 0, the last rank and 16 others, each standing for its
share of the rest) and a :class:`Meter` refuses with :class:`SimulationTooLarge` past
``max_steps`` or ``max_seconds``, naming the limit and how to raise it.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lab.errors import LabError

STEP_FIELDS = 6  # a recorded step: dst, bytes sent, src, bytes received, reduces, bytes of local passes before it

#: The default limits of ``simulate``, ``predict``, ``best_algorithm`` and ``python -m lab simulate``.
DEFAULT_MAX_STEPS = 10_000_000  # about 1.7 GB at peak, 10-40 s (a 1,024-rank ring is 2.1 million)
DEFAULT_MAX_SECONDS = 300.0  # of recording, estimated from the sampled ranks' own recording time
#: Peak memory per step, recording to replay (measured: 162 bytes on ring allreduce, N = 512 and
#: 1,024), and per rank (the replay's per-rank arrays).
BYTES_PER_STEP, BYTES_PER_RANK = 170, 200
#: The replay's time per step (measured: 0.46 µs, pairing included, on ring allreduce at N = 1,024).
REPLAY_S_PER_STEP = 0.5e-6
#: No larger world is simulated at all (a ValueError, before anything is allocated): 16,777,216
#: ranks, 100 times the largest clusters, and far past any recording's default limits.
MAX_WORLD_SIZE = 1 << 24
#: The largest input per rank: 1 TiB (more than any accelerator's memory; mapped, never touched).
MAX_NBYTES = 1 << 40
#: How many ranks, besides 0, the root and the last, :func:`estimate` records to extrapolate.
SAMPLED_RANKS = 16


class SimulationUnsupported(LabError, NotImplementedError):
    """The algorithm uses something the recording mesh cannot replay without running ranks together
    (``mesh.split``: the sub-mesh depends on every rank's colour)."""


class SimulationTooLarge(SimulationUnsupported):
    """The recording would pass ``max_steps`` steps or take longer than ``max_seconds``; the
    message says how large it is and how to raise the limit."""


def _round_up(value: float) -> int:
    """Two significant digits, rounded up (what to suggest as a new limit): 799,960,000 -> 800,000,000."""
    value = max(int(-(-value // 1)), 1)
    scale = 10**max(len(str(value)) - 2, 0)
    return -(-value // scale) * scale


def _memory(nbytes: float) -> str:
    """``136.0 GB``, ``21 MB``, ``under 1 MB``."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:,.1f} GB"
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else "under 1 MB"


def _raise_it(name: str, needed: float, at_least: bool) -> str:
    if at_least:  # only a lower bound is known: no number to suggest
        return (f"Pass a larger {name}= (lab.sim.estimate says how large), or {name}=None for no limit, "
                "to simulate it anyway.")
    return f"Pass {name}={_round_up(needed):_} (or {name}=None for no limit) to simulate it anyway."


def too_many_steps(case: str, steps: float, max_steps: int, basis: str,
                   at_least: bool = False) -> SimulationTooLarge:
    """The refusal of ``case``, which needs ``steps`` steps (``basis``: how we know), past ``max_steps``.

        too_many_steps("allreduce (ring) on 20,000 ranks of 4,096 bytes", 799_960_000, 10_000_000,
                       "estimated from 19 sampled ranks")
        # too large to simulate: allreduce (ring) on 20,000 ranks of 4,096 bytes needs about 799,960,000
        # steps (estimated from 19 sampled ranks; about 136.0 GB of memory), past max_steps=10,000,000.
        # Pass max_steps=800_000_000 (or max_steps=None for no limit) to simulate it anyway.
    """
    amount = "at least" if at_least else "about"
    return SimulationTooLarge(
        f"too large to simulate: {case} needs {amount} {steps:,.0f} steps ({basis}; {amount} "
        f"{_memory(steps * BYTES_PER_STEP)} of memory), past max_steps={max_steps:,}. " +
        _raise_it("max_steps", steps, at_least))


def too_slow(case: str, seconds: float, max_seconds: float, basis: str,
             at_least: bool = False) -> SimulationTooLarge:
    """The refusal of ``case``, whose recording would take ``seconds``, past ``max_seconds``."""
    amount = "at least" if at_least else "about"
    return SimulationTooLarge(
        f"too large to simulate: {case} would take {amount} {seconds:,.0f} s to record ({basis}), past "
        f"max_seconds={max_seconds:g}. " + _raise_it("max_seconds", seconds, at_least))


def describe(collective: str, algorithm: str | None, world_size: int, nbytes: int) -> str:
    """``allreduce (ring) on 20,000 ranks of 4,096 bytes``: a case, as the errors name it."""
    return f"{collective}{f' ({algorithm})' if algorithm else ''} on {world_size:,} ranks of {nbytes:,} bytes"


def at_least_one_step_per_rank(case: str, world_size: int, max_steps: int | None) -> None:
    """Every rank sends or receives at least once, so N - 1 > max_steps is refused with no recording."""
    if max_steps is not None and world_size - 1 > max_steps:
        raise too_many_steps(case, world_size - 1, max_steps,
                             "every rank but one sends or receives at least once", at_least=True)


@dataclass(frozen=True)
class Estimate:
    """What recording and replaying a case costs, from a sample of its ranks (:func:`estimate`)."""

    world_size: int
    steps: int  # every rank's steps together (a step sends, receives, or both)
    record_s: float  # wall time to record them all: the sampled ranks' own, extrapolated (this machine, now)
    sampled: int  # how many ranks were recorded to estimate
    exact: bool  # every rank was: steps is the count itself

    @property
    def memory_bytes(self) -> int:
        """Peak memory of recording, pairing and replaying it (170 bytes a step, 200 a rank)."""
        return self.steps * BYTES_PER_STEP + self.world_size * BYTES_PER_RANK

    @property
    def seconds(self) -> float:
        """Wall time of recording and replaying it."""
        return self.record_s + self.steps * REPLAY_S_PER_STEP


def sample_ranks(world_size: int, root: int) -> list[tuple[int, bool]]:
    """The ranks :func:`estimate` records, each with whether it stands for itself only.

    Rank 0, the root and the last rank stand for themselves (they are the ones most often unlike
    the rest: naive's root does N-1 times the others' work); 16 others drawn at random (the same
    every time) stand for all the rest. The random ones come first: each weighs most, so a case
    far past a limit shows it within the first of them. Up to 19 ranks: all, each for itself.

        sample_ranks(4, 0)              # [(0, False), (1, False), (2, False), (3, False)]
        sample_ranks(1000, 0)[-2:]      # [(0, True), (999, True)], after 16 random ranks
    """
    special = sorted({0, root, world_size - 1})
    if world_size - len(special) <= SAMPLED_RANKS:
        return [(rank, False) for rank in range(world_size)]
    drawn = random.Random(world_size).sample(range(world_size), SAMPLED_RANKS + len(special))
    picked = sorted(r for r in drawn if r not in special)[:SAMPLED_RANKS]
    return [(rank, False) for rank in picked] + [(rank, True) for rank in special]


class ScheduleRecorder(Protocol):
    """What a :class:`Meter` reads and sets of the recorder (:class:`lab.sim.schedule.RecordingMesh`)."""

    world_size: int
    steps: array  # STEP_FIELDS int64 per recorded step
    check_at: int  # len(steps) at which check() runs next
    check: Callable[[], None]


class Meter:
    """Counts the steps and the recording time of the sampled ranks, and raises
    :class:`SimulationTooLarge` once they show the case past a limit.

    Each random rank stands for ``weight`` = (N - specials) / (random ranks sampled) ranks, so the
    weighted sum of what is recorded so far is a lower bound of the final estimate: checked every
    few steps. Once it passes a limit, the rank being recorded is finished (within a moment: a
    million steps, 10 s) so that the refusal can say how large the case is, projected from the
    ranks done: N × their mean, specials counted as they are.

    The first rank's time before its first step is counted once, not for the ranks it stands for:
    it holds what an algorithm builds once for all N ranks and keeps (the double tree's timetable:
    38 s at a million ranks, then microseconds a rank), which a later rank that stands for others
    does not pay; a cost each rank pays (a schedule made per call) shows in every sampled rank.
    """

    CHECK_EVERY = 8  # steps
    FINISH_STEPS, FINISH_S = 1_000_000, 10.0

    def __init__(self, mesh: ScheduleRecorder, case: str, sample: list[tuple[int, bool]],
                 max_steps: int | None, max_seconds: float | None) -> None:
        self.mesh, self.case, self.sampled = mesh, case, len(sample)
        self.limits = {"max_steps": max_steps, "max_seconds": max_seconds}
        self.world_size = mesh.world_size
        self.specials = sum(special for _, special in sample)
        self.weight = (self.world_size - self.specials) / (len(sample) - self.specials)
        self.done: list[tuple[bool, int, float]] = []  # (special, steps, seconds) per rank recorded
        self.special, self.started, self.passed, self.recording = False, 0.0, "", False
        self.once: float | None = None  # the first rank's seconds before its first step, counted once
        self.crossed = (0, 0.0)  # the rank in progress's steps and seconds when a limit was passed
        mesh.check = self.check

    def begin(self, special: bool) -> None:
        self.special, self.started, self.recording = special, time.perf_counter(), True
        del self.mesh.steps[:]  # only counts are kept: the sample's memory is one rank's
        self.mesh.check_at = STEP_FIELDS * (1 if self.once is None else self.CHECK_EVERY)

    def end(self) -> None:
        seconds = time.perf_counter() - self.started
        if self.once is None:  # a rank without a step: all of its time is its own
            self.once = 0.0
        self.done.append((self.special, len(self.mesh.steps) // STEP_FIELDS, seconds))
        self.recording = False
        if self.passed:
            self.refuse(at_least=False)
        self.check()

    def _bound(self, current: bool) -> tuple[float, float]:
        """The weighted steps and seconds so far (with the rank in progress if ``current``)."""
        current = current and self.recording
        done = self.done + ([(self.special, len(self.mesh.steps) // STEP_FIELDS,
                              time.perf_counter() - self.started)] if current else [])
        factor = [1.0 if special else self.weight for special, _, _ in done]
        once = self.once or 0.0
        return (sum(f * steps for f, (_, steps, _) in zip(factor, done)),
                once + sum(f * seconds for f, (_, _, seconds) in zip(factor, self._own(done))))

    def _own(self, done: list[tuple[bool, int, float]]) -> list[tuple[bool, int, float]]:
        """``done`` with the first rank's seconds less what is counted once."""
        if not done or not self.once:
            return done
        special, steps, seconds = done[0]
        return [(special, steps, seconds - self.once), *done[1:]]

    def projection(self) -> tuple[float, float]:
        """Steps and seconds for every rank, from the ranks done: N × their mean, specials as they
        are, and what the first rank built once."""
        done = self._own(self.done)
        special = [(steps, seconds) for is_special, steps, seconds in done if is_special]
        others = [(steps, seconds) for is_special, steps, seconds in done if not is_special]
        rest = (self.world_size - len(special)) / max(len(others), 1)
        return (sum(s for s, _ in special) + rest * sum(s for s, _ in others),
                (self.once or 0.0) + sum(t for _, t in special) + rest * sum(t for _, t in others))

    def check(self) -> None:
        """At every few steps and after every rank: has the lower bound passed a limit?"""
        steps, seconds = len(self.mesh.steps) // STEP_FIELDS, time.perf_counter() - self.started
        if self.once is None and self.recording and steps:  # the first rank's first step
            self.once = seconds
        if self.passed:  # finishing the rank in progress, for the projection; unless it takes long
            if steps - self.crossed[0] > self.FINISH_STEPS or seconds - self.crossed[1] > self.FINISH_S:
                self.refuse(at_least=True)
        else:
            steps_bound, seconds_bound = self._bound(current=True)
            if self.limits["max_steps"] is not None and steps_bound > self.limits["max_steps"]:
                self.passed, self.crossed = "max_steps", (steps, seconds)
            elif self.limits["max_seconds"] is not None and seconds_bound > self.limits["max_seconds"]:
                self.passed, self.crossed = "max_seconds", (steps, seconds)
        self.mesh.check_at = len(self.mesh.steps) + STEP_FIELDS * self.CHECK_EVERY

    def refuse(self, at_least: bool) -> None:
        """Raise for the limit passed: steps first (they are counted, not timed), then time."""
        steps, seconds = self._bound(current=True) if at_least else self.projection()
        recorded = len(self.done) + at_least
        basis = ("counted on every rank" if recorded == self.world_size and not at_least else
                 f"{'extrapolated' if at_least else 'estimated'} from {len(self.done)}"
                 f"{' and a part' if at_least else ''} of the {self.sampled} ranks sampled")
        max_steps, max_seconds = self.limits["max_steps"], self.limits["max_seconds"]
        if max_steps is not None and steps > max_steps:
            raise too_many_steps(self.case, steps, max_steps, basis, at_least)
        if max_seconds is not None and seconds > max_seconds:
            raise too_slow(self.case, seconds, max_seconds, basis, at_least)
        self.passed = ""  # the ranks done project below the limits after all: go on

    def finish(self) -> Estimate:
        """Every sampled rank recorded: the estimate, or the refusal if it is past a limit."""
        steps, seconds = self._bound(current=False)
        if any(self.limits[name] is not None and value > self.limits[name]
               for name, value in [("max_steps", steps), ("max_seconds", seconds)]):
            self.refuse(at_least=False)
        return Estimate(self.world_size, round(steps), seconds, self.sampled, self.sampled == self.world_size)
