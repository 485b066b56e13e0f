"""A pipeline transfer's labels in a workload file: its ``stage``, ``peer_stage`` and
``microbatch`` (:mod:`lab.workload.pipeline` says what they mean and records them), read and
checked as :func:`lab.workload.load` reads a line and pairs a send with its receive."""

from __future__ import annotations

from typing import Any

#: A pipeline transfer's labels (all or none), each an integer in [0, MAX_LABEL].
PIPELINE_LABELS, MAX_LABEL = ("stage", "peer_stage", "microbatch"), 2**31 - 1


def read_labels(row: dict, event: Any, where: str, transfer: bool) -> None:
    """A transfer's ``stage``, ``peer_stage`` and ``microbatch`` (all or none), into ``event``
    (``transfer``: whether it is a send or receive): what :func:`lab.workload.load` reads where a
    line has any (a ``ValueError`` naming the field)."""
    if not transfer:
        raise ValueError(
            f"{where}: field {next(n for n in PIPELINE_LABELS if row.get(n) is not None)!r} labels a pipeline's "
            f"send or receive, not a {event.op}")
    missing = [name for name in PIPELINE_LABELS if row.get(name) is None]
    if missing:
        raise ValueError(
            f"{where}: field {missing[0]!r} must come with the others of {', '.join(PIPELINE_LABELS)} "
            "(a pipeline's transfer names its stage, its peer's stage and its micro-batch)")
    for name in PIPELINE_LABELS:
        value = row[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LABEL:
            raise ValueError(
                f"{where}: field {name!r} must be an integer in [0, {MAX_LABEL:,}]; got {value!r:.80}")
    event.stage, event.peer_stage, event.microbatch = (row[name] for name in PIPELINE_LABELS)
    if event.stage == event.peer_stage:
        raise ValueError(f"{where}: field 'peer_stage' must be another stage than {event.stage}; "
                         f"got {event.peer_stage}")


def check_pair(event: Any, paired: Any, where: str, there: str) -> None:
    """A labelled send and the labelled receive it pairs with (the k-th of one rank to another
    with a tag) name each other's stages and one micro-batch: else a ``ValueError``."""
    send, receive = (event, paired) if event.op == "send" else (paired, event)
    sent = (send.stage, send.peer_stage, send.microbatch)
    if sent != (receive.peer_stage, receive.stage, receive.microbatch):
        raise ValueError(
            f"{where}: fields 'stage', 'peer_stage', 'microbatch': this {event.op} (rank {send.rank} to "
            f"rank {receive.rank}, tag {event.tag}) pairs with the {paired.op} at {there}, but the send "
            f"is stage {send.stage}'s to stage {send.peer_stage} of micro-batch {send.microbatch} and "
            f"the receive stage {receive.stage}'s from stage {receive.peer_stage} of micro-batch "
            f"{receive.microbatch}")
