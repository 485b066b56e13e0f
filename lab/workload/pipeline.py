"""Pipelines as workloads: each transfer's stage and micro-batch, and the bubble per stage.

**Recording.** Where a rank records and its program runs ``torch.distributed.pipelining`` (imported
before the program makes its "lab" process group), :func:`label_pipelines` has each point-to-point
transfer a schedule issues noted with its ``stage`` (the stage on this rank that sends or receives
it), its ``peer_stage`` (the stage at the other end: a send feeds that stage's receive, a receive is
fed by that stage's send) and its ``microbatch``. It wraps the stage's four makers of transfers
(``get_fwd_recv_ops``, ``get_bwd_recv_ops``, ``get_fwd_send_ops``, ``get_bwd_send_ops``: each knows
its stage and micro-batch) and the schedule's ``_batch_p2p``, which issues what they made, in their
order: the recorder takes each label as the call it belongs to is issued, once its kind and peer
agree (:meth:`lab.workload.record.Recorder.expect`). The replay pairs a send with the receive it
feeds (the loader checks that the k-th send pairs with the k-th receive of the same labels), and a
rank waits where it waited when recorded: on its wait lines.

**The bubble.** :func:`stages` (the replay's, :attr:`lab.workload.ReplayResult.stages`) and
:func:`measured_stages` (a recording's, against the measured steps) break each step down per rank:
its ``compute_us``, its ``exposed_us`` (blocked on a collective) and its ``bubble_us``, the rest
of the step: idle, waiting on a neighbour stage's transfer (its data in flight included) or for the
step's slowest rank. GPipe with M micro-batches on S stages of uniform compute and a free network
idles (S - 1) / (M + S - 1) of each step on every stage.

    w = lab.workload.load("pipeline.jsonl")
    r = lab.workload.replay(w, network=lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0))
    r.stages          # step, rank, stages, step_us, compute_us, exposed_us, bubble_us, bubble_share
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lab.comm import operations as recording
from lab.workload.format import POINT_TO_POINT, Workload

if TYPE_CHECKING:
    import pandas as pd

#: The stage's makers of transfers: name, whether it sends, and the stage its transfers go to or
#: come from (one after the stage on the forward pass, one before on the backward).
MAKERS = (("get_fwd_recv_ops", "recv", -1), ("get_bwd_recv_ops", "recv", 1), ("get_fwd_send_ops", "send", 1),
          ("get_bwd_send_ops", "send", -1))
#: The columns of a per-stage breakdown (:func:`stages`, :func:`measured_stages`).
COLUMNS = ["step", "rank", "stages", "step_us", "compute_us", "exposed_us", "bubble_us", "bubble_share"]


def label_pipelines() -> None:
    """Label the transfers of ``torch.distributed.pipelining``'s schedules in this process's
    recordings (once; it changes nothing where a process records nothing)."""
    from torch.distributed.pipelining import schedules, stage

    if getattr(schedules._batch_p2p, "lab_labels", False):
        return
    for name, op, step in MAKERS:
        setattr(stage._PipelineStageBase, name, _labelling(getattr(stage._PipelineStageBase, name), op, step))
    issue = schedules._batch_p2p

    @functools.wraps(issue)
    def batch_p2p(p2p_ops: list, *args: Any, **kwargs: Any) -> list:
        recorder = recording.current()
        if recorder is None or not hasattr(recorder, "expect"):
            return issue(p2p_ops, *args, **kwargs)
        recorder.expect([getattr(p2p, "lab_label", None) for p2p in p2p_ops])
        try:
            return issue(p2p_ops, *args, **kwargs)
        finally:
            recorder.expect([])

    batch_p2p.lab_labels = True
    schedules._batch_p2p = batch_p2p


def _labelling(make: Any, op: str, step: int) -> Any:
    """``make`` (a stage's maker of transfers for one micro-batch), its transfers labelled."""
    @functools.wraps(make)
    def labelled(self: Any, microbatch: int, *args: Any, **kwargs: Any) -> list:
        transfers = make(self, microbatch, *args, **kwargs)
        for p2p in transfers:
            p2p.lab_label = (op, p2p.peer, {
                "stage": self.stage_index, "peer_stage": self.stage_index + step, "microbatch": microbatch})
        return transfers

    return labelled


def stage_of(workload: Workload, rank: int) -> tuple[int, ...]:
    """The stages ``rank``'s labelled transfers name as its own, in order (none: no pipeline)."""
    return tuple(sorted({e.stage for e in workload.events.get(rank, ()) if e.stage is not None}))


def measured_stages(workload: Workload, step_us: Sequence[float]) -> pd.DataFrame:
    """The per-stage breakdown of a recording against its measured steps (``step_us``: one a step,
    the slowest rank's, µs): each rank's recorded compute in the step, its time blocked on
    collectives (on its own clock: a blocking one's issue to completion, an asynchronous one's wait
    to completion) and the rest of the step, the bubble."""
    import pandas as pd

    if len(step_us) != workload.steps:
        raise ValueError(
            f"step_us must hold one time per recorded step ({workload.steps}); got {len(step_us)}")
    rows = []
    for rank in sorted(workload.events):
        compute, exposed = [0.0] * workload.steps, [0.0] * workload.steps
        operations = {}
        for event in workload.events[rank]:
            if event.step >= workload.steps:  # (after the last mark: no whole step)
                break
            compute[event.step] += event.compute_us
            if event.kind == "op":
                operations[event.index] = event
            op = operations.get(event.index) if event.kind == "wait" else event
            if event.kind != "step" and op.op not in POINT_TO_POINT:
                exposed[event.step] += event.held_us  # (the call's own time: the replay's exposed too)
            since = event.waited_us if event.kind == "wait" else event.issued_us
            if event.kind == "step" or event.kind == "op" and event.is_async or op.op in POINT_TO_POINT:
                continue
            if since is not None and op.completed_us is not None:
                exposed[event.step] += max(op.completed_us - since, 0.0)
        for step, total in enumerate(step_us):
            rows.append(_row(step, rank, stage_of(workload, rank), total, compute[step], exposed[step]))
    return pd.DataFrame(rows, columns=COLUMNS)


def _row(step: int, rank: int, own: tuple[int, ...], step_us: float, compute: float, exposed: float) -> dict:
    bubble = max(step_us - compute - exposed, 0.0)
    return {
        "step": step, "rank": rank, "stages": own, "step_us": step_us, "compute_us": compute,
        "exposed_us": exposed, "bubble_us": bubble, "bubble_share": bubble / step_us if step_us else 0.0}


def stages(step_us: Sequence[float], compute: Any, exposed: Any, own: dict[int, tuple[int,
                                                                                      ...]]) -> pd.DataFrame:
    """The replay's per-stage breakdown: ``compute`` and ``exposed`` (arrays by rank and step) of
    each rank in ``own`` (a rank: the stages it holds) against the steps ``step_us``."""
    import pandas as pd

    rows = [
        _row(step, rank, own[rank], float(total), float(compute[rank, step]), float(exposed[rank, step]))
        for rank in sorted(own) for step, total in enumerate(step_us)]
    return pd.DataFrame(rows, columns=COLUMNS)
