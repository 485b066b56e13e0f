"""A pipeline re-targeted to more micro-batches or more stages: its schedule formed again.

A recording holds the schedule it ran: M micro-batches on S stages. :func:`retarget` reads what
each stage cost in it (:func:`stage_costs`: its compute in a step, over its micro-batches, and the
bytes of its forward and backward transfers) and writes the workload of GPipe or 1F1B
(:func:`pipeline_workload`) on ``stages`` stages with ``microbatches`` micro-batches: more
micro-batches keep each one's compute; more stages split the model's compute evenly among them
(each stage ``S / stages`` of the mean stage's), keeping the transfers' bytes. A micro-batch's
compute on a stage is taken as a third forward and two thirds backward (a backward's two products
to a forward's one); what a recording's stages did besides (the optimizer, a first step's shape
exchange) is left out. One stage a rank; the stages' ranks in order.

    w16 = lab.workload.schedule.retarget(w, microbatches=16)        # the same 4 stages, 16 micro-batches
    lab.workload.replay(w16, network=...).stages                    # its bubble per stage
"""

from __future__ import annotations

import statistics

from lab.workload.format import Event, Workload

SCHEDULES = ("gpipe", "1f1b")
FORWARD_SHARE = 1 / 3


def stage_costs(workload: Workload) -> tuple[list[float], int, int]:
    """Each stage's median compute a step (µs; the steps after the first where there are several),
    its micro-batches, and the bytes a transfer carries (the largest labelled one)."""
    ranks = sorted(workload.events)
    held = [{e.stage for e in workload.events[r] if e.stage is not None} for r in ranks]
    if not all(held) or any(stages != {rank} for stages, rank in zip(held, ranks)):
        raise ValueError(
            f"{workload.path or 'the workload'}: a pipeline of one stage a rank, stage r on rank r, is "
            f"re-targeted; its ranks hold stages {[sorted(s) for s in held]}")
    first = 1 if workload.steps > 1 else 0
    compute, microbatches, nbytes = [], set(), 0
    for rank in ranks:
        per_step = [0.0] * workload.steps
        for event in workload.events[rank]:
            if event.step < workload.steps:
                per_step[event.step] += event.compute_us
            if event.microbatch is not None:
                microbatches.add(event.microbatch)
                nbytes = max(nbytes, event.nbytes)
        compute.append(statistics.median(per_step[first:]))
    return compute, len(microbatches), nbytes


def retarget(workload: Workload, microbatches: int | None = None, stages: int | None = None,
             schedule: str = "1f1b") -> Workload:
    """``workload`` (a recorded pipeline) as ``schedule`` on ``stages`` stages with ``microbatches``
    micro-batches (default: as recorded), its steps as many as recorded (see the module's docstring)."""
    compute, recorded_m, nbytes = stage_costs(workload)
    stages = len(compute) if stages is None else stages
    microbatches = recorded_m if microbatches is None else microbatches
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
            raise ValueError(f"{name} must be an integer in [1, 4096]; got {value!r}")
    if stages == len(compute):
        per_microbatch = [c / recorded_m for c in compute]
    else:
        per_microbatch = [sum(compute) / stages / recorded_m] * stages
    return pipeline_workload(schedule, per_microbatch, microbatches, nbytes, max(workload.steps, 1))


def pipeline_workload(schedule: str, per_microbatch_us: list[float], microbatches: int, nbytes: int,
                      steps: int = 1) -> Workload:
    """The workload of ``schedule`` (gpipe, 1f1b) on ``len(per_microbatch_us)`` stages, a stage a
    rank: each stage's forward and backward of a micro-batch take a third and two thirds of its
    ``per_microbatch_us``; a transfer carries ``nbytes``; a blocking receive before each forward
    and backward that has a neighbour to hear from, an asynchronous send after, waited at the step's end."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    n = len(per_microbatch_us)
    workload = Workload(n, None, {"schedule": schedule}, {},
                        f"{schedule} of {n} stages, {microbatches} micro-batches")
    for stage, cost in enumerate(per_microbatch_us):
        events: list[Event] = []
        for step in range(steps):
            _stage_step(events, stage, n, step, _order(schedule, stage, n, microbatches), cost, nbytes)
        workload.events[stage] = events
    return workload


def _order(schedule: str, stage: int, n: int, microbatches: int) -> list[tuple[str, int]]:
    """The stage's passes in order: ("forward" or "backward", micro-batch)."""
    if schedule == "gpipe":
        return [("forward", m) for m in range(microbatches)] + [("backward", m) for m in range(microbatches)]
    warmup = min(n - 1 - stage, microbatches)
    order = [("forward", m) for m in range(warmup)]
    for m in range(microbatches - warmup):  # the steady state: one forward, one backward
        order += [("forward", warmup + m), ("backward", m)]
    return order + [("backward", m) for m in range(microbatches - warmup, microbatches)]


def _stage_step(events: list[Event], stage: int, n: int, step: int, order: list[tuple[str, int]], cost: float,
                nbytes: int) -> None:
    """One step of ``stage``'s passes in ``order``, onto ``events``."""
    carried, sends = 0.0, []
    index = sum(e.kind == "op" for e in events)
    for direction, microbatch in order:
        source, target = (stage - 1, stage + 1) if direction == "forward" else (stage + 1, stage - 1)
        if 0 <= source < n:
            events.append(_transfer(stage, step, index, "recv", source, microbatch, nbytes, carried, False))
            index, carried = index + 1, 0.0
        carried += cost * (FORWARD_SHARE if direction == "forward" else 1 - FORWARD_SHARE)
        if 0 <= target < n:
            events.append(_transfer(stage, step, index, "send", target, microbatch, nbytes, carried, True))
            sends.append(index)
            index, carried = index + 1, 0.0
    for sent in sends:
        events.append(Event(stage, step, "wait", carried, index=sent))
        carried = 0.0
    events.append(Event(stage, step, "step", carried))


def _transfer(stage: int, step: int, index: int, op: str, peer: int, microbatch: int, count: int,
              compute_us: float, is_async: bool) -> Event:
    """A transfer of ``count`` bytes between ``stage`` and ``peer`` (their ranks)."""
    return Event(stage, step, "op", compute_us, index=index, op=op,
                 group=(min(stage, peer), max(stage, peer)), dtype="uint8", count=count, out_count=count,
                 peer=peer, is_async=is_async, stage=stage, peer_stage=peer, microbatch=microbatch)
