"""A cluster's nccl-tests logs as the cases a fit replays: each row, with the recorded schedule of
every algorithm the simulator has for its collective on the log's ranks and hosts.

    cases = log_cases([df_1host, df_2hosts])    # one Case per timed row
    cases[0].best(network)                      # (µs, algorithm): the least over the algorithms

A row's time is taken as the best algorithm's (NCCL's tuner runs the fastest it knows), on the
log's hosts: ``df.attrs``' ranks and hosts (:func:`lab.sim.read_nccl_tests`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from lab.catalog import COLLECTIVES as CATALOG
from lab.sim import core
from lab.sim.event_loop import finish_times, match_messages
from lab.sim.limits import SimulationUnsupported
from lab.sim.network import Network
from lab.sim.schedule import Schedule, algorithms

#: Collectives whose nccl-tests size is every rank's output together (each rank's input is size / N).
OUTPUT_SIZED = tuple(name for name, record in CATALOG.items() if record.sized_by_output)


def input_bytes(collective: str, size: int, ranks: int) -> int:
    """Each rank's input (the simulator's ``nbytes``, float32) for nccl-tests' ``size`` column
    (:meth:`lab.catalog.Collective.input_bytes`).

        input_bytes("allgather", 1 << 20, 16)     # 65536: allgather's size is the whole output
    """
    return CATALOG[collective].input_bytes(size, ranks)


def _log_name(df: pd.DataFrame, index: int) -> str:
    return str(df.attrs.get("path") or f"log {index}")


def check_log(df: object, index: int) -> tuple[str, int, int]:
    """A log's collective, ranks and hosts, or a ValueError naming the log and what it lacks: the
    simulator lays out the same ranks on every host, so hosts of uneven ranks are refused."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"log {index} must be a DataFrame from lab.sim.read_nccl_tests; "
                        f"got {type(df).__name__}")
    name, attrs = _log_name(df, index), df.attrs
    collective, ranks, hosts = attrs.get("collective"), attrs.get("ranks"), attrs.get("hosts")
    if collective not in algorithms():
        raise ValueError(f"{name}: the simulator has no {collective!r} (df.attrs['collective']); it has "
                         f"{', '.join(algorithms())}")
    for what, value in (("ranks", ranks), ("hosts", hosts)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: df.attrs[{what!r}] must be a count >= 1 (the log's 'Using devices' "
                             f"lines say it; set it by hand where they are missing); got {value!r}")
    host_ranks = attrs.get("host_ranks") or []
    if len(set(host_ranks)) > 1:
        on = ", ".join(map(str, attrs.get("host_names") or []))
        raise ValueError(f"{name}: uneven hosts, {' + '.join(map(str, host_ranks))} ranks on {on} "
                         "(df.attrs['host_ranks']): the simulator lays out the same ranks on every host")
    if (attrs.get("groups") or 1) > 1:
        raise ValueError(f"{name}: {attrs['groups']} communicators ran at once (NCCL_TESTS_SPLIT; "
                         "df.attrs['groups']): the simulator times one alone")
    if ranks % hosts:
        raise ValueError(f"{name}: {ranks} ranks do not split evenly over {hosts} hosts")
    if "bytes" not in df or "oop_time_us" not in df:
        raise ValueError(f"{name}: no 'bytes' and 'oop_time_us' columns "
                         "(read it with lab.sim.read_nccl_tests)")
    return str(collective), int(ranks), int(hosts)


def widest_ranks_per_host(logs: list[pd.DataFrame]) -> int:
    """The ranks per host of the log with the most hosts (of those, the most ranks a host): the
    fitted network's, where predictions are made."""
    layouts = [check_log(df, index) for index, df in enumerate(logs)]  # (collective, ranks, hosts)
    _, ranks, hosts = max(layouts, key=lambda layout: (layout[2], layout[1] // layout[2]))
    return ranks // hosts


@dataclass(frozen=True)
class Case:
    """One row of a log, with the recorded schedule of every candidate algorithm on its ranks."""

    log: str
    collective: str
    ranks: int
    hosts: int
    size: int
    measured_us: float
    schedules: dict[str, tuple[Schedule, np.ndarray]]  # algorithm: (schedule, its pairing)

    @property
    def ranks_per_host(self) -> int:
        return self.ranks // self.hosts

    def times(self, network: Network) -> dict[str, float]:
        """Each algorithm's simulated time on ``network`` laid out on this case's hosts."""
        network = replace(network, ranks_per_host=self.ranks_per_host)
        return {
            name: float(finish_times(s, match, network)[0].max(initial=0.0))
            for name, (s, match) in self.schedules.items()}

    def best(self, network: Network) -> tuple[float, str]:
        times = self.times(network)
        name = min(times, key=times.get)
        return times[name], name


def _schedules(collective: str, ranks: int, per_host: int, nbytes: int,
               candidates: tuple[str, ...]) -> dict[str, tuple[Schedule, np.ndarray]]:
    """The recorded schedule (and pairing) of every candidate the recorder can run."""
    found = {}
    for name in candidates:
        try:
            schedule, _ = core.recorded_schedule(collective, name, ranks, nbytes, 0, per_host,
                                                 core.DEFAULT_MAX_STEPS)
        except SimulationUnsupported:
            continue  # an algorithm that splits the mesh: the simulator cannot time it
        found[name] = (schedule, match_messages(schedule))
    return found


def log_cases(logs: list[pd.DataFrame], candidates: list[str] | None = None) -> list[Case]:
    """Every timed row of every log as a :class:`Case` (rows without a positive time, or too small
    to hold one float32 per rank, are left out)."""
    if not isinstance(logs, (list, tuple)) or not logs:
        raise ValueError("fit_cluster needs a non-empty list of nccl-tests logs (lab.sim.read_nccl_tests)")
    cases = []
    for index, df in enumerate(logs):
        collective, ranks, hosts = check_log(df, index)
        names = tuple(candidates or algorithms()[collective])
        for size, time_us in zip(df["bytes"], df["oop_time_us"]):
            nbytes = input_bytes(collective, int(size), ranks)
            if nbytes > 0 and np.isfinite(time_us) and time_us > 0:
                schedules = _schedules(collective, ranks, ranks // hosts, nbytes, names)
                cases.append(
                    Case(_log_name(df, index), collective, ranks, hosts, int(size), float(time_us),
                         schedules))
        if not any(case.log == _log_name(df, index) for case in cases):
            raise ValueError(f"{_log_name(df, index)}: no row with a positive out-of-place time to fit")
    return cases
