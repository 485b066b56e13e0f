"""Another bucket size for a DDP recording: its gradients' allreduces formed again at another cap.

DDP reduces a model's gradients in buckets. In the order it reduces them (its parameters'
reversed), a bucket closes once it holds at least the cap's bytes (torch's
``_compute_bucket_assignment_by_size``: the first bucket's cap, then the cap for every later one),
and each bucket's allreduce is issued once its last gradient is ready in the backward. A recording
that knows its gradients (:func:`lab.workload.record_gradients`) is re-bucketed step by step, on
every rank:

- the step's gradient allreduces are the consecutive allreduces on the gradients' group, in their
  dtype, whose bytes split the gradients at their boundaries and add up to all of them;
- they give way to DDP's buckets at the new cap (``bucket_mb`` MiB, as DDP's ``bucket_cap_mb``:
  its first bucket takes the same cap), each issued where its last gradient was ready. The
  backward's timeline is known where the recorded buckets were issued: at each one's last
  gradient, on the rank's compute clock (its compute since the step began, what the replay's clock
  advances by). Between two recorded buckets it is taken as linear in the gradients' bytes; before
  the first, at the rate between the first and the last (and not before the event the first
  followed); with one recorded bucket no rate is known, and every new bucket is issued when it was;
- the new buckets' waits go where the recorded buckets' first wait after the last of them was (DDP
  waits on all of its buckets at the end of its backward);
- a step whose gradients went in one allreduce where the recorded cap makes several is DDP's first,
  before it rebuilt its buckets in the order its gradients came: DDP reduces them in one at any
  cap, and the step is kept as recorded. A step whose allreduces on the group carry fewer bytes
  than the gradients (``no_sync``'s accumulation, a loss) is kept too.

What it ignores: the backward's real pace between two recorded buckets; the copies of gradients
into a bucket's buffer; gradients of several dtypes (DDP buckets each dtype apart); DDP's
``bucket_cap_mb_list``. A DDP whose gradients came in another order than its parameters' reversed
forms buckets that split them elsewhere: such a step is a ``ValueError``.

    w2 = rebucket(w, bucket_mb=1.0)      # a Workload whose steps reduce the gradients in 1 MiB buckets
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from lab.workload.format import DTYPE_BYTES, Event, Gradients, Workload

#: DDP's MiB (``torch.nn.parallel.distributed._MB_TO_BYTES``).
MIB = 1 << 20


def ddp_buckets(sizes: list[int], caps: list[int]) -> list[int]:
    """Where DDP ends its buckets of gradients of ``sizes`` bytes (in the order it reduces them):
    the number of gradients through each bucket's last. A bucket closes once it holds at least its
    cap, ``caps`` in turn (the last for every later bucket); what is left is the last bucket.

        ddp_buckets([400, 800, 1200, 1600], [2000])      # [3, 4]: 2,400 bytes, then 1,600
    """
    ends, held, which = [], 0, 0
    for count, size in enumerate(sizes, 1):
        held += size
        if held >= caps[which]:
            ends.append(count)
            held, which = 0, min(which + 1, len(caps) - 1)
    if not ends or ends[-1] != len(sizes):
        ends.append(len(sizes))
    return ends


def rebucket(workload: Workload, bucket_mb: float) -> Workload:
    """``workload`` with every rank's gradient allreduces re-bucketed at ``bucket_mb`` MiB (see the
    module's docstring); ``ValueError`` naming ``bucket_mb`` where the recording cannot say how."""
    if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or not 0 < bucket_mb < math.inf:
        raise ValueError(f"bucket_mb must be a finite number of MiB > 0; got {bucket_mb!r}")
    cap = int(bucket_mb * MIB)
    if cap < 1:
        raise ValueError(f"bucket_mb must be at least one byte (1 / 2**20); got {bucket_mb!r}")
    if not workload.gradients:
        raise ValueError(f"bucket_mb: {workload.path or 'the workload'} knows no gradients: call "
                         "lab.workload.record_gradients(ddp_model) on every rank while recording")
    events = {}
    for rank, recorded in workload.events.items():
        gradients = workload.gradients.get(rank)
        if gradients is None:
            raise ValueError(f"bucket_mb: rank {rank} recorded no gradients (record_gradients on every rank)")
        copies: dict[int, Event] = {}  # the rank's operations as replayed, by their recorded index
        pairs = []
        for _, step in itertools.groupby(recorded, _step_of(recorded)):
            pairs += _step(list(step), gradients, cap, copies)
        events[rank] = _numbered(pairs)
    return dataclasses.replace(workload, events=events)


def _step_of(events: list[Event]):
    """A key that changes after each step's end: groups a rank's events by step (the tail too)."""
    ends = itertools.accumulate(event.kind == "step" for event in events)
    marks = dict(zip(map(id, events), itertools.chain([0], ends)))
    return lambda event: marks[id(event)]


def _step(events: list[Event], gradients: Gradients, cap: int, copies: dict[int, Event]) -> list[tuple]:
    """One step's events re-bucketed, as new events: ``(event, the operation it waits on)`` pairs
    (None: an operation, or a step's end) in issue order, with their compute as re-bucketed.
    ``copies``: the rank's operations so far, by recorded index (this step's are added)."""
    sizes = gradients.sizes
    run = _gradient_run(events, gradients, sizes)
    recorded_caps = [gradients.first_bucket_cap_bytes, gradients.bucket_cap_bytes]
    if run is None or len(run) == 1 and len(ddp_buckets(sizes, recorded_caps)) > 1:
        run = []  # (kept as recorded)
    positions = list(itertools.accumulate(event.compute_us for event in events))
    gradient_ops = {events[i].index for i in run}
    waits = [i for i, event in enumerate(events) if event.kind == "wait" and event.index in gradient_ops]
    placed = _buckets(events, run, waits, positions, gradients, cap) if run else []
    dropped = {*run, *waits}
    for i, event in enumerate(events):
        if i in dropped or event.kind == "wait" and event.index not in copies:
            continue  # (a wait on an operation re-bucketed in a step before: none in DDP)
        copy = dataclasses.replace(event)
        if event.kind == "op":
            copies[event.index] = copy
        placed.append(((positions[i], i, -1), copy, copies[event.index] if event.kind == "wait" else None))
    placed.sort(key=lambda item: item[0])
    before, out = 0.0, []
    for (at, _, _), event, waits_on in placed:
        event.compute_us, before = at - before, at
        out.append((event, waits_on))
    return out


def _buckets(events: list[Event], run: list[int], waits: list[int], positions: list[float],
             gradients: Gradients, cap: int) -> list[tuple]:
    """The new buckets' allreduces and their waits, each under its sort key (its position on the
    rank's compute clock, then the recorded event it takes the place of, then its bucket)."""
    issued = [positions[i] for i in run]
    bounds = list(itertools.accumulate(events[i].nbytes for i in run))
    floor = positions[run[0] - 1] if run[0] else 0.0
    rate = (issued[-1] - issued[0]) / (bounds[-1] - bounds[0]) if bounds[-1] > bounds[0] else 0.0
    ends = list(itertools.accumulate(gradients.sizes))
    template, itemsize = events[run[0]], DTYPE_BYTES[gradients.dtype]
    # DDP waits on every bucket at the end of its backward: where the first recorded wait after the
    # last recorded bucket was (else just before the step's end)
    after = [i for i in waits if i > run[-1]]
    wait_at = (positions[after[0]], after[0]) if after else (positions[-1], len(events) - 1.5)
    placed, start = [], 0
    for j, end in enumerate(ddp_buckets(gradients.sizes, [cap])):
        ready = ends[end - 1]  # the bucket's last gradient is ready once this many bytes are
        k = next(k for k, bound in enumerate(bounds) if ready <= bound)
        at = (max(floor, issued[0] - (bounds[0] - ready) * rate) if k == 0 else issued[k - 1] +
              (issued[k] - issued[k - 1]) * (ready - bounds[k - 1]) / (bounds[k] - bounds[k - 1]))
        count = (ready - start) // itemsize
        op = dataclasses.replace(template, count=count, out_count=count, algorithm=None)
        placed += [((at, run[k], j), op, None),
                   ((*wait_at, j), Event(template.rank, template.step, "wait", 0.0), op)]
        start = ready
    return placed


def _gradient_run(events: list[Event], gradients: Gradients, sizes: list[int]) -> list[int] | None:
    """Where the step's gradient allreduces are (their positions in ``events``), or None where
    the step's allreduces on the gradients' group carry fewer bytes than the gradients."""
    candidates = [
        i for i, event in enumerate(events) if event.kind == "op" and event.op == "allreduce" and
        event.group == gradients.group and event.dtype == gradients.dtype]
    bounds, total = set(itertools.accumulate(sizes)), sum(sizes)
    for first in range(len(candidates)):
        held = 0
        for last in range(first, len(candidates)):
            held += events[candidates[last]].nbytes
            if held not in bounds:
                break
            if held == total:
                return candidates[first:last + 1]
    if sum(events[i].nbytes for i in candidates) < total:
        return None
    step = events[0].step
    raise ValueError(
        f"bucket_mb: step {step} of rank {events[0].rank} has allreduces on the gradients' group that do not "
        f"split its {len(sizes)} gradients ({total:,} bytes) at their boundaries in the order recorded (DDP "
        "reduced them in another order than its parameters' reversed?)")


def _numbered(pairs: list[tuple[Event, Event | None]]) -> list[Event]:
    """The events with the rank's operations numbered again from 0, each wait on its operation's number."""
    numbered = {}
    for event, waits_on in pairs:
        if event.kind == "op":
            numbered[id(event)] = event.index = len(numbered)
        elif event.kind == "wait":
            event.index = numbered[id(waits_on)]
    return [event for event, _ in pairs]
