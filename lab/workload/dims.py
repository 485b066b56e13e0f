"""The DeviceMesh a workload's operations describe (:func:`mesh_dims`, of a
:class:`lab.workload.Workload`): :mod:`lab.workload.format` calls it as it loads a file whose
header names none."""

from __future__ import annotations

import itertools
import math
from typing import Any


def mesh_dims(workload: Any) -> dict[str, int] | None:
    """The DeviceMesh the operations describe: each named ``dim``'s group size, outermost first
    (row-major, as torch lays a DeviceMesh out: a dimension's groups step by the product of the
    sizes after it); None where no operation names one, or where their groups are no such mesh of
    ``world_size`` ranks (a 1-D mesh's dimension is torch's default group, which names none).

        {"dp": 2, "tp": 2}    # from groups [0, 1], [2, 3] of "tp" and [0, 2], [1, 3] of "dp"
    """
    steps: dict[str, set[tuple[int, int]]] = {}  # each dimension's (size, the step between its ranks)
    for events in workload.events.values():
        for event in events:
            if event.kind == "op" and event.dim is not None:
                group = sorted(event.group)
                gaps = {b - a for a, b in itertools.pairwise(group)}
                steps.setdefault(event.dim, set()).add((len(group), gaps.pop() if len(gaps) == 1 else -1))
    if not steps or any(len(seen) != 1 for seen in steps.values()):
        return None
    shape = sorted(((step, size, name) for name, ((size, step),) in steps.items()), reverse=True)
    inner = [math.prod(size for _, size, _ in shape[i + 1:]) for i in range(len(shape))]
    if math.prod(size for _, size, _ in shape) != workload.world_size or any(
            size > 1 and step != stride for (step, size, _), stride in zip(shape, inner)):
        return None
    return {name: size for _, size, name in shape}
