"""A cluster's nccl-tests logs as the NCCL model's fit takes them: one :class:`Sample` per size
with a time (:func:`samples_of`, the node count from the log's ranks and the topology), and where
each log's time jumps (:func:`knees`) next to where the fitted tuner switches."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab.sim.nccl.model import NcclModel, collective_name
from lab.sim.nccl.topology import ClusterTopology


@dataclass(frozen=True)
class Sample:
    log: str
    collective: str
    nodes: int
    nbytes: int
    time_us: float


def samples_of(topology: ClusterTopology, logs: Iterable[pd.DataFrame]) -> list[Sample]:
    """Every row of every log with bytes and a time, its node count from the log's ranks."""
    samples = []
    for number, df in enumerate(logs):
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"logs[{number}] must be a DataFrame of read_nccl_tests; got {type(df).__name__}")
        name = Path(str(df.attrs.get("path", f"logs[{number}]"))).name
        if df.attrs.get("collective") is None or df.attrs.get("ranks") is None:
            raise ValueError(f"{name}: the log says neither its collective or its ranks; read it with "
                             "read_nccl_tests(path, collective=...)")
        collective = collective_name(df.attrs["collective"])
        nodes = topology.nodes_of_ranks(df.attrs["ranks"], f"{name}'s ranks")
        hosts = df.attrs.get("hosts")
        if hosts is not None and hosts != nodes:
            raise ValueError(f"{name}: {df.attrs['ranks']} ranks on {hosts} hosts, but gpus_per_node="
                             f"{topology.gpus_per_node} makes {nodes} nodes")
        if nodes < 2:
            raise ValueError(f"{name}: one node; the fit needs logs across nodes")
        for nbytes, time_us in zip(df["bytes"], df["oop_time_us"]):
            if nbytes > 0 and math.isfinite(time_us) and time_us > 0:
                samples.append(Sample(name, collective, nodes, int(nbytes), float(time_us)))
    if not samples:
        raise ValueError("logs: no row with bytes and a time")
    return samples


def knees(samples: Sequence[Sample], chooser: NcclModel) -> pd.DataFrame:
    """Where each log's time jumps from one size to the next by 1.5x or more and by 1.5x the step
    before (a knee, not the doubling of a bandwidth-bound time), next to where the chosen graph's
    tuner switches pair or a call's channel count changes."""
    rows = []
    by_log: dict[str, list[Sample]] = {}
    for s in samples:
        by_log.setdefault(s.log, []).append(s)
    for log, rows_of_log in by_log.items():
        rows_of_log.sort(key=lambda s: s.nbytes)
        for earlier, before, after in zip([None, *rows_of_log], rows_of_log, rows_of_log[1:]):
            old = chooser.pick(before.collective, before.nodes, before.nbytes)
            new = chooser.pick(after.collective, after.nodes, after.nbytes)
            rise = after.time_us / before.time_us
            knee = rise >= 1.5 and (earlier is None or rise >= 1.5 * before.time_us / earlier.time_us)
            channels = [
                chooser.channels_used(pair, s.nbytes, s.nodes) for pair, s in ((old, before), (new, after))]
            if knee or old != new:
                rows.append({
                    "log": log, "nodes": after.nodes, "bytes": after.nbytes, "knee": knee,
                    "time_before_us": before.time_us, "time_us": after.time_us,
                    "switch": f"{'/'.join(old)} -> {'/'.join(new)}" if old != new else "",
                    "channels": f"{channels[0]} -> {channels[1]}" if len(set(channels)) > 1 else ""})
    return pd.DataFrame(rows)
