"""A cluster fitted to its own nccl-tests logs, and predicted at more hosts than were measured.

    net = lab.sim.fit_cluster([df_1host, df_2hosts])             # a Network with the logs' terms
    report = lab.sim.fit_cluster_report([df_1host, df_2hosts])   # the same, and how well each is known
    lab.sim.predict(net, "allreduce", hosts=16, nbytes=1 << 20)  # ClusterPrediction(time_us, algorithm, times)

The fitted terms are the link terms the logs can see: α and bandwidth inside a host (seen by a
log with several ranks on a host) and between hosts (a log with several hosts). What logs of one
or two hosts cannot tell apart is given, as the cluster is built, in ``network``: NICs per host
and the NIC map, a switch or a bus inside a host, the tier's oversubscription (two hosts on one
leaf switch never cross it). Each row's time is the least simulated time over the simulator's
algorithms for its collective (:mod:`lab.sim.cluster_cases`). ``terms=`` names the terms to fit
instead, the CPU work around each message among them (:data:`CPU_TERMS`): on emulated hosts, whose
ranks share one machine's cores, the links are known (the lab caps them) and the CPU is what the
logs measure. The fit minimises the mean ``|log(predicted / measured)|`` over every row of every
log by Levenberg-Marquardt on the terms' logarithms (:func:`lab.sim.calibrate.least_absolute`, the
calibration's own), replaying the recorded schedules on every trial network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from lab import checks
from lab.catalog import COLLECTIVES as CATALOG
from lab.sim import core
from lab.sim.calibrate import least_absolute
from lab.sim.cluster_cases import OUTPUT_SIZED, Case, input_bytes, log_cases, widest_ranks_per_host
from lab.sim.limits import MAX_NBYTES, MAX_WORLD_SIZE
from lab.sim.network import Network

#: The terms a fit sets by default: (Network field, what it is, its bounds, which logs see it).
TERMS = [("intra_alpha_us", "α inside a host (µs)", (1e-3, 1e6), "intra"),
         ("intra_gbit", "Gbit/s inside a host", (1e-3, 1e7), "intra"),
         ("alpha_us", "α between hosts (µs)", (1e-3, 1e6), "inter"),
         ("gbit", "Gbit/s per NIC", (1e-3, 1e7), "inter")]
#: The CPU work around each message, fitted when ``terms=`` names it: a log of two ranks or more
#: sees it. Where the cores are shared (the network's ``cores``), ranks that work at once wait
#: for each other, which a log whose ranks have a core each cannot show: so the link terms it
#: would trade against (α against an overhead, β against a copy) are best given, as built.
CPU_TERMS = [("send_overhead_us", "CPU µs per message sent", (1e-3, 1e6), "cpu"),
             ("recv_overhead_us", "CPU µs per message received", (1e-3, 1e6), "cpu"),
             ("copy_us_per_byte", "CPU µs per byte copied", (1e-9, 1e-1), "cpu")]
#: A log determines a term when moving the term by ±20 % raises the log's mean |log error| by at
#: least this much (its times move by a tenth of the move or more): below it, other terms set them.
DETERMINED = 0.02
#: busbw / algbw as nccl-tests reports it: factor · (N-1)/N, else 1 (:mod:`lab.catalog`'s bus factor).
BUS_FACTOR = {name: record.bus_scale for name, record in CATALOG.items() if record.per_rank}
#: Size bands the fit's error is reported in (name, the largest size in it): the issue's targets
#: are up to 64 KiB within 2x, 1-32 MiB within 35 %, from 64 MiB within 15 %.
BANDS = [("up to 64 KiB", 64 << 10), ("64 KiB-1 MiB", (1 << 20) - 1), ("1-32 MiB", (64 << 20) - 1),
         ("from 64 MiB", math.inf)]


@dataclass(frozen=True)
class ClusterPrediction:
    """The best algorithm's time at a cluster size, and every candidate's time (µs)."""

    time_us: float
    algorithm: str
    times: dict[str, float]


@dataclass(frozen=True)
class FitReport:
    """A fitted network and how well the logs determine it.

    ``terms``: one row per term: ``term``, ``meaning``, ``value``, ``fitted`` (some log sees it),
    ``determined_by`` (the logs whose error rises by :data:`DETERMINED` or more when it moves ±20 %)
    and ``rise`` (that rise, per log). ``cases``: every timed row of every log with its measured
    and predicted time and the algorithm chosen. ``bands``: per log and size band
    (:data:`BANDS`), the cases and the mean and largest ``|predicted / measured - 1|``.
    """

    network: Network
    error: float  # mean |log(predicted / measured)| over every case
    terms: pd.DataFrame
    cases: pd.DataFrame
    bands: pd.DataFrame


def _sees(case: Case, scope: str) -> bool:
    """Whether a case's time depends on the terms inside a host ("intra"), between hosts
    ("inter") or on the CPU around each message ("cpu")."""
    return {"intra": case.ranks_per_host > 1, "inter": case.hosts > 1, "cpu": case.ranks > 1}[scope]


def _value(network: Network, term: str) -> float:
    """A term's value, the inter-host one where the intra-host term is unset (None: the same)."""
    if term == "intra_alpha_us":
        return network.intra_alpha
    if term == "intra_gbit":
        return network.gbit if network.intra_gbit is None else float(network.intra_gbit)
    return float(getattr(network, term))


def _start(cases: list[Case], scope: str) -> tuple[float, float]:
    """Where the fit of a scope's (α, Gbit/s) starts: from the cases that see it (inside a host
    those of one host first), α from the smallest time over 2·log2 N steps, the bandwidth from
    the largest size's time. A start, not an estimate: the fit moves it by orders of magnitude."""
    seen = [c for c in cases if _sees(c, scope)]
    inside = [c for c in seen if c.hosts == 1] if scope == "intra" else []
    seen = inside or seen
    small = min(seen, key=lambda c: c.measured_us)
    large = max(seen, key=lambda c: (c.size, c.measured_us))
    alpha = small.measured_us / (2 * max(math.log2(small.ranks), 1.0))
    gbit = 2 * 8 * large.size / large.measured_us / 1e3
    return float(np.clip(alpha, 1e-3, 1e6)), float(np.clip(gbit, 1e-3, 1e7))


def _start_value(cases: list[Case], term: str, scope: str) -> float:
    """Where the fit of ``term`` starts (:func:`_start`): a time per message for α and the
    overheads, the bandwidth for Gbit/s, a tenth of that bandwidth's µs per byte for a copy."""
    alpha, gbit = _start(cases, scope)
    if term == "copy_us_per_byte":
        return 0.1 * 8.0 / (gbit * 1e3)
    return gbit if term.endswith("gbit") else alpha


def _chosen(terms: list[str] | None) -> list[tuple]:
    """The entries of :data:`TERMS` and :data:`CPU_TERMS` that ``terms`` names (None: :data:`TERMS`)."""
    if terms is None:
        return TERMS
    known = {entry[0]: entry for entry in [*TERMS, *CPU_TERMS]}
    unknown = [t for t in terms if t not in known] if isinstance(terms, (list, tuple)) else [terms]
    if unknown or not terms:
        raise ValueError(f"terms must name some of {', '.join(known)}; got {terms!r}")
    return [known[t] for t in dict.fromkeys(terms)]


def _with(base: Network, fitted: list[tuple], x: np.ndarray) -> Network:
    """``base`` with the fitted terms whose logarithms are ``x``."""
    return replace(base, **{term: float(math.exp(v)) for (term, *_), v in zip(fitted, x)})


def _residuals(cases: list[Case], network: Network) -> np.ndarray:
    """log(best predicted / measured) per case."""
    return np.array([math.log(max(case.best(network)[0], 1e-9) / case.measured_us) for case in cases])


def _error(cases: list[Case], network: Network) -> float:
    return float(np.mean(np.abs(_residuals(cases, network))))


def _rise(cases: list[Case], network: Network, term: str) -> float:
    """How much the cases' mean |log error| rises when ``term`` alone moves ±20 % (the smaller rise)."""
    error, value = _error(cases, network), _value(network, term)
    return min(_error(cases, replace(network, **{term: value * f})) - error for f in (0.8, 1.2))


def _terms(cases: list[Case], network: Network, fitted: list[tuple], chosen: list[tuple]) -> pd.DataFrame:
    """One row per term (the link terms, and the CPU terms ``chosen``): its value, whether it was
    fitted, and the logs that determine it."""
    logs = list(dict.fromkeys(case.log for case in cases))
    rows = []
    for term, meaning, _, _ in [*TERMS, *(t for t in chosen if t in CPU_TERMS)]:
        is_fitted = any(term == name for name, *_ in fitted)
        rise = ({log: _rise([c for c in cases if c.log == log], network, term)
                 for log in logs} if is_fitted else {})
        rows.append({
            "term": term, "meaning": meaning, "value": _value(network, term), "fitted": is_fitted,
            "determined_by": [log for log, r in rise.items() if r >= DETERMINED], "rise": rise})
    return pd.DataFrame(rows)


def _cases_frame(cases: list[Case], network: Network) -> pd.DataFrame:
    rows = []
    for case in cases:
        time_us, algorithm = case.best(network)
        rows.append({
            "log": case.log, "collective": case.collective, "hosts": case.hosts, "ranks": case.ranks,
            "bytes": case.size, "measured_us": case.measured_us, "predicted_us": time_us,
            "algorithm": algorithm, "ratio": time_us / case.measured_us})
    return pd.DataFrame(rows)


def band_of(size: int) -> str:
    """The name of the size band (:data:`BANDS`) that holds ``size``.

        band_of(4 << 20)      # "1-32 MiB"
    """
    return next(name for name, top in BANDS if size <= top)


def bands(cases: pd.DataFrame) -> pd.DataFrame:
    """Per log and size band: ``cases``, ``mean_error`` and ``max_error`` of ``|ratio - 1|``, in
    the bands' order (a band a log has no size in is left out)."""
    frame = cases.assign(band=[band_of(int(s)) for s in cases["bytes"]], error=(cases["ratio"] - 1).abs())
    frame["band"] = pd.Categorical(frame["band"], [name for name, _ in BANDS], ordered=True)
    grouped = frame.groupby(["log", "hosts", "band"], observed=True, sort=True)["error"]
    return grouped.agg(cases="size", mean_error="mean", max_error="max").reset_index()


def fit_cluster_report(logs: list[pd.DataFrame], network: Network | None = None, *,
                       candidates: list[str] | None = None, terms: list[str] | None = None) -> FitReport:
    """Fit the terms the logs see (the link terms, :data:`TERMS`) to nccl-tests logs of the cluster
    (:func:`lab.sim.read_nccl_tests`'s DataFrames, one or two hosts each, say), keeping the
    rest of ``network`` (default ``Network()``): the cluster as built, its NICs, its fabric inside
    a host and its switch tier. ``candidates``: the algorithms a row's time is the least of
    (default: all the simulator has for the log's collective). ``terms``: the Network fields
    to fit, of :data:`TERMS` and :data:`CPU_TERMS` (default: :data:`TERMS`), each where some log
    sees it; the rest keep ``network``'s values. The fitted network has the ranks per host of the
    log with the most hosts.

        report = fit_cluster_report([read_nccl_tests("1host.log"), read_nccl_tests("2hosts.log")],
                                    Network(nics_per_host=8))
        report.terms[["term", "value", "determined_by"]]; report.bands
        fit_cluster_report(logs, Network(alpha_us=0.0, gbit=1.0, cores=2, ranks_per_cpu=2**24),
                           terms=["recv_overhead_us", "copy_us_per_byte"])   # links given, CPU fitted
        fit_cluster_report([])       # ValueError: fit_cluster needs a non-empty list of nccl-tests logs ...
    """
    base = Network() if network is None else network
    if not isinstance(base, Network):
        raise TypeError(f"network must be a lab.sim.Network; got {type(base).__name__}")
    cases = log_cases(logs, candidates)
    base = replace(base, ranks_per_host=widest_ranks_per_host(logs))
    chosen = _chosen(terms)
    fitted = [t for t in chosen if any(_sees(c, t[3]) for c in cases)]
    x = np.log([_start_value(cases, term, scope) for term, _, _, scope in fitted])
    bounds = np.log([b for _, _, b, _ in fitted]).reshape(-1, 2)

    def residuals(point: np.ndarray) -> np.ndarray:
        return _residuals(cases, _with(base, fitted, point))

    if fitted:
        x, _, _ = least_absolute(residuals, x, bounds[:, 0], bounds[:, 1])
    result = _with(base, fitted, x)
    table = _cases_frame(cases, result)
    return FitReport(result, _error(cases, result), _terms(cases, result, fitted, chosen), table,
                     bands(table))


def fit_cluster(logs: list[pd.DataFrame], network: Network | None = None, *,
                candidates: list[str] | None = None, terms: list[str] | None = None) -> Network:
    """The network :func:`fit_cluster_report` fits (its ``.network``).

        net = lab.sim.fit_cluster([df_1host, df_2hosts])
        lab.sim.predict(net, "allreduce", hosts=16, nbytes=64 << 20).time_us
    """
    return fit_cluster_report(logs, network, candidates=candidates, terms=terms).network


def predict_hosts(network: Network, collective: str, *, hosts: int, nbytes: int,
                  ranks_per_host: int | None = None,
                  candidates: list[str] | None = None) -> ClusterPrediction:
    """The best algorithm's simulated time for ``collective`` on ``hosts`` hosts of
    ``ranks_per_host`` ranks (default: the network's), ``nbytes`` as nccl-tests counts a size
    (allgather's is the whole output); the least over the algorithms (or ``candidates``), as
    NCCL's tuner takes the least.

        predict_hosts(net, "allreduce", hosts=16, nbytes=64 << 20)   # ClusterPrediction(time_us=..., algorithm=...)
    """
    network, world, nbytes = _hosts_case(network, collective, hosts, nbytes, ranks_per_host)
    times = core.compare(collective, world, nbytes, network, candidates=candidates)
    if not times:
        raise ValueError(f"no algorithm of {collective} can be simulated at {hosts} hosts")
    best = min(times, key=times.get)
    return ClusterPrediction(times[best], best, times)


def check_predictable(network: Network, collective: str, *, hosts: int, nbytes: int,
                      ranks_per_host: int | None = None, candidates: list[str] | None = None) -> None:
    """Refuse what :func:`predict_hosts` would refuse (a ValueError, :class:`SimulationTooLarge`),
    from the simulator's estimates alone: cheap beside a fit (``python -m lab cluster fit`` checks
    its ``--predict-hosts`` so, before fitting).

        check_predictable(net, "allreduce", hosts=100_000, nbytes=64 << 20)   # SimulationTooLarge: ...
    """
    network, world, nbytes = _hosts_case(network, collective, hosts, nbytes, ranks_per_host)
    if not core.predictable(collective, world, nbytes, ranks_per_host=network.ranks_per_host,
                            candidates=candidates):
        raise ValueError(f"no algorithm of {collective} can be simulated at {hosts} hosts")


def _hosts_case(network: Network, collective: str, hosts: int, nbytes: int,
                ranks_per_host: int | None) -> tuple[Network, int, int]:
    """(the network at ``ranks_per_host``, the ranks, each rank's input) of a case at ``hosts``
    hosts; a ValueError names what the simulator cannot take."""
    if not isinstance(network, Network):
        raise TypeError(f"network must be a lab.sim.Network; got {type(network).__name__}")
    per_host = network.ranks_per_host if ranks_per_host is None else ranks_per_host
    network = replace(network, ranks_per_host=per_host)  # (checks ranks_per_host)
    most = MAX_WORLD_SIZE // network.ranks_per_host  # the simulator's largest world, in whole hosts
    if not checks.is_int(hosts) or not 1 <= hosts <= most:
        raise ValueError(f"hosts must be an integer >= 1, at most {most:,} ({MAX_WORLD_SIZE:,} ranks at "
                         f"{network.ranks_per_host} a host); got {hosts!r}")
    world = hosts * network.ranks_per_host
    whole = collective in OUTPUT_SIZED
    largest = MAX_NBYTES * (world if whole else 1)  # the simulator's largest input a rank
    if not checks.is_int(nbytes) or not 0 <= nbytes <= largest:
        output = f" ({collective}'s size is its output: {MAX_NBYTES:,} bytes a rank)" if whole else ""
        raise ValueError(f"nbytes must be an integer from 0 to {largest:,}{output}; got {nbytes!r}")
    return network, world, input_bytes(collective, int(nbytes), world)


def predict_table(network: Network, collective: str, hosts: int, sizes: list[int], *,
                  ranks_per_host: int | None = None, candidates: list[str] | None = None) -> pd.DataFrame:
    """An nccl-tests table predicted at ``hosts`` hosts: per size (nccl-tests' count), ``time_us``,
    ``algbw`` and ``busbw`` (GB/s, as nccl-tests computes them; NaN at a time of 0: one rank) and
    the ``algorithm`` chosen.

        predict_table(net, "allreduce", 16, [1 << 20, 64 << 20])   # two rows
    """
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of sizes in bytes; got {sizes!r}")
    rows = []
    for size in sizes:
        if not checks.is_int(size):  # (True is not a size, 1.5 not a whole number of bytes)
            raise ValueError(f"sizes must hold integers (bytes); got {size!r}")
        best = predict_hosts(network, collective, hosts=hosts, nbytes=int(size),
                             ranks_per_host=ranks_per_host, candidates=candidates)
        world = hosts * (network.ranks_per_host if ranks_per_host is None else ranks_per_host)
        # No time, no rate: one rank moves nothing (nccl-tests would time its local copy)
        algbw = size / best.time_us / 1e3 if best.time_us > 0 else math.nan
        busbw = algbw * CATALOG[collective].bus_factor(world)
        rows.append({
            "bytes": int(size), "time_us": best.time_us, "algbw": algbw, "busbw": busbw,
            "algorithm": best.algorithm})
    return pd.DataFrame(rows, columns=["bytes", "time_us", "algbw", "busbw", "algorithm"])


def predict(cluster: Any, *args: Any, **kwargs: Any) -> Any:
    """A cluster model at ``hosts`` hosts: :func:`predict_hosts` for a :class:`Network` (the
    simulator: a :class:`ClusterPrediction`, the best algorithm's µs and which) and
    :func:`lab.sim.nccl.predict_nccl` for an :class:`lab.sim.nccl.NcclModel` (NCCL's closed forms:
    the µs, algorithm and protocol NCCL runs). Every algorithm's time at N ranks is
    :func:`lab.sim.compare`.

        lab.sim.predict(net, "allreduce", hosts=16, nbytes=1 << 20).algorithm     # "tree", say
        lab.sim.predict(nccl_fit.model, "allreduce", hosts=540, nbytes=1 << 30).protocol   # "simple"
    """
    if isinstance(cluster, Network):
        return predict_hosts(cluster, *args, **kwargs)
    from lab.sim.nccl.model import NcclModel, predict_nccl  # (here: lab.sim.nccl imports this module)
    if isinstance(cluster, NcclModel):
        return predict_nccl(cluster, *args, **kwargs)
    raise TypeError(
        f"cluster must be a lab.sim.Network or a lab.sim.nccl.NcclModel; got {type(cluster).__name__} "
        "(every algorithm's time at N ranks: lab.sim.compare(collective, world_size, nbytes, network))")
