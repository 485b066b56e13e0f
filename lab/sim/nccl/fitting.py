"""NCCL's cost structure fitted to a cluster's own nccl-tests logs.

    report = fit(topology, [read_nccl_tests("n2.log", collective="allreduce"), ...])
    report.model.predict("allreduce", nodes=256, nbytes=1 << 30)   # time, algorithm, protocol
    print(report.text())                                            # each term: value, source, fit

Each measured size is assigned to the pair NCCL ran there: the cheapest by NCCL's own tuner (its
shipped constants) on the cluster's graph. The graph (channels, and each channel's speed from
NCCL's list) is the one, near the nominal, whose switch points best match the logs' knees. Each
pair's terms are then a weighted linear least squares on the relative error of the rows it ran:
the small sizes fix its latencies (the base and the network hop, told apart by the node counts;
the per-channel hop where the call's channel count changes), the large ones its bandwidth (Simple
ring: each channel's bandwidth; the other pairs: their efficiency on it). A term is fitted only
where its rows can tell it from the others, it carries at least 1 % of some row's time and the
rows know it to within 50 % (its relative standard error); every other term keeps NCCL's
default (the hop inside a node always does: with the same GPUs a node in every log it moves with
the base). The fabric's terms are given, never fitted.

The fitted model is NCCL's structure with one change: its rings are pipelined (a call takes the
longer of its chain of steps and its bytes on the wire, :class:`~lab.sim.nccl.model.NcclModel`),
so a ring's row is either latency-bound or bandwidth-bound; the fit alternates between telling each
row's side from the model and solving, until no row changes side. The tree keeps NCCL's
medium-size bandwidth correction (a tree row's bandwidth is fitted as NCCL's uncorrected one); the
ring's plateau factor, which the pipelined ring replaces, is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from lab.sim.nccl import constants as C
from lab.sim.nccl.model import NODE_CLASSES, PAIRS, NcclModel, Pair, node_class, shipped, steps, tree_depth
from lab.sim.nccl.samples import Sample, knees, samples_of
from lab.sim.nccl.topology import ClusterTopology, Graph, nominal_graph

#: The unknowns of a pair, in the order a term is freed when the rows can tell it apart.
TERMS = ("net_hop_us", "bus_1", "bus_2", "bus_3", "base_us", "overhead_us", "channel_hop_us")
LATENCIES = ("base_us", "net_hop_us", "overhead_us", "channel_hop_us")
MIN_SHARE = 0.01  # a term must carry this share of some row's time to be fitted
MAX_STD_ERROR = 0.5  # and be known to within this relative standard error
INDEPENDENT = 1e-3  # a column whose part outside the others' span is smaller than this is not told apart
ROUNDS = 20  # a pipelined ring's fit: at most this many passes of telling each row's side and solving


@dataclass(frozen=True)
class NcclFitReport:
    """``model`` the fitted model; ``terms`` a row per term (pair, term, value, unit, source: fitted,
    NCCL's default or given, the rows that fixed it, their mean |error|, the term's relative
    standard error); ``samples`` every measured row with its pair and the model's error;
    ``graphs`` each graph tried and its mean |log error|; ``knees`` the logs' knees against the
    switch points of the chosen graph."""

    model: NcclModel
    terms: pd.DataFrame
    samples: pd.DataFrame
    graphs: pd.DataFrame
    knees: pd.DataFrame

    @property
    def error(self) -> float:
        """Mean |predicted / measured - 1| over every measured row."""
        return float(self.samples["error"].abs().mean())

    def text(self) -> str:
        chosen = self.graphs.iloc[0]
        lines = [
            f"fit of {len(self.samples)} sizes from {self.samples['log'].nunique()} logs: mean |error| "
            f"{self.error:.1%}; graph {chosen['channels']} channels x {chosen['gbyte']:g} GB/s "
            f"(nominal {chosen['nominal']})",
            self.terms.to_string(index=False, float_format=lambda v: f"{v:.4g}")]
        return "\n".join(lines)


def _row(model: NcclModel, sample: Sample, pair: Pair,
         wire_bound: bool | None = None) -> tuple[np.ndarray, float, int]:
    """The row's coefficients on the pair's unknowns (:data:`TERMS`; ``overhead_us`` stands for a
    ring step inside a node across nodes, max(intra hop, overhead)), the time the pinned hop
    inside a node and the fabric's given terms take, and the call's channels. A pipelined ring's
    row is its base and either its steps (``wire_bound`` False) or its bytes (True)."""
    gpus = model.topology.gpus_per_node
    ranks = sample.nodes * gpus
    used = model.channels_used(pair, sample.nbytes, sample.nodes)
    fabric = model.topology.fabric
    crossing = model.topology.crossing_us(sample.nodes)
    terms = model.pairs[pair]
    row = np.zeros(len(TERMS))
    row[TERMS.index("base_us")] = 1.0
    extra = used - 1 if sample.nodes > 1 else 0
    if pair[0] == "ring":
        total, net = steps(sample.collective, ranks, sample.nodes)
        row[TERMS.index("net_hop_us")] = net
        row[TERMS.index("channel_hop_us")] = total * extra
        if sample.nodes > 1:
            row[TERMS.index("overhead_us")] = total - net
            fixed = total * crossing
        else:
            fixed = total * terms.intra_hop_us
        per_byte = total / ranks
    else:
        depth = tree_depth(sample.nodes)
        row[TERMS.index("net_hop_us")] = 2 * depth
        row[TERMS.index("channel_hop_us")] = 2 * depth * extra
        across = depth - tree_depth(min(sample.nodes, fabric.nodes_per_group)) if crossing else 0
        fixed = 2 * ((gpus - 1) * terms.intra_hop_us + across * crossing)
        per_byte = 2.0
    share = model.topology.crossing_share(sample.nodes, model.bus_gbyte(pair, sample.nodes))
    share *= model.tree_factor(pair, sample.nbytes)
    row[TERMS.index(f"bus_{node_class(sample.nodes) + 1}")] = sample.nbytes * per_byte / 1000.0 / share
    if wire_bound is True:
        row[[TERMS.index(name) for name in LATENCIES if name != "base_us"]] = 0.0
        fixed = 0.0
    elif wire_bound is False:
        row[[TERMS.index(f"bus_{k}") for k in (1, 2, 3)]] = 0.0
    return row, fixed, used


def _defaults(model: NcclModel, pair: Pair) -> np.ndarray:
    """The unknowns at the model's values (inverse bus bandwidths, 1/(GB/s))."""
    terms = model.pairs[pair]
    inverse = [1.0 / model.bus_gbyte(pair, nodes) for nodes in (1, 2, 3)]
    inside = max(terms.intra_hop_us, terms.overhead_us)
    return np.array([terms.net_hop_us, *inverse, terms.base_us, inside, terms.channel_hop_us])


def _free_terms(a: np.ndarray, weights: np.ndarray, scale: np.ndarray, allowed: list[bool]) -> list[int]:
    """The unknowns the rows can fix, in :data:`TERMS`' order: each carries >= MIN_SHARE of some
    row's time at its default scale and is not (nearly) a combination of those already free."""
    free: list[int] = []
    weighted = a * weights[:, None]
    for j in range(len(TERMS)):
        column = weighted[:, j]
        if not allowed[j]:
            continue
        if np.max(np.abs(column) * scale[j]) < MIN_SHARE or len(free) >= len(a):
            continue
        if free:
            basis = weighted[:, free]
            column = column - basis @ np.linalg.lstsq(basis, column, rcond=None)[0]
        if np.linalg.norm(column) > INDEPENDENT * np.linalg.norm(weighted[:, j]):
            free.append(j)
    return free


@dataclass
class _Block:
    """One pair's rows and its solution."""

    pair: Pair
    index: list[int]
    a: np.ndarray
    fixed: np.ndarray
    times: np.ndarray
    values: np.ndarray
    free: list[int]
    errors: np.ndarray


def _solve(pair: Pair, index: list[int], rows: list[tuple[np.ndarray, float, int]], times: np.ndarray,
           defaults: np.ndarray, intra_hop_us: float) -> _Block:
    a = np.array([row for row, _, _ in rows])
    fixed = np.array([f for _, f, _ in rows])
    weights = 1.0 / times
    scale = np.where(defaults > 0, defaults, defaults[0])  # channel_hop's scale: the network hop's
    # a channel's cost is told from a step's only where the rows' channel counts differ
    counts = {used for _, _, used in rows}
    allowed = [name != "channel_hop_us" or len(counts) > 1 for name in TERMS]
    free = _free_terms(a, weights, scale, allowed)
    values = defaults.copy()
    errors = np.full(len(TERMS), np.nan)
    while free:
        pinned = [j for j in range(len(TERMS)) if j not in free]
        target = (times - fixed - a[:, pinned] @ values[pinned]) * weights
        design = a[:, free] * weights[:, None]
        solution, *_ = np.linalg.lstsq(design, target, rcond=None)
        # a latency below 0, a step inside a node cheaper than its hop, a bandwidth at or past
        # infinity: NCCL's default instead
        negative = [
            j for j, v in zip(free, solution) if v < 0 or v == 0 and TERMS[j].startswith("bus") or
            TERMS[j] == "overhead_us" and v < intra_hop_us]
        if negative:
            free.remove(negative[0])
            continue
        dof = len(times) - len(free)
        spread = np.zeros(len(free))
        if dof > 0:
            residual = design @ solution - target
            covariance = np.linalg.pinv(design.T @ design) * float(residual @ residual) / dof
            spread = np.sqrt(np.diag(covariance)) / np.abs(solution)
        if np.max(spread) > MAX_STD_ERROR:  # the rows cannot pin it down: NCCL's default instead
            free.remove(free[int(np.argmax(spread))])
            continue
        values[free] = solution
        errors[free] = spread if dof > 0 else np.nan  # as many rows as terms: exact, no spread to tell
        break
    return _Block(pair, index, a, fixed, times, values, free, errors)


def _fitted_model(base: NcclModel, blocks: dict[Pair, _Block], chooser: NcclModel) -> NcclModel:
    """The model with each block's terms: the Simple ring's bandwidth sets each channel's, the
    other pairs' bandwidths their efficiency on it; classes no log saw keep NCCL's defaults."""
    channel_gbyte = list(base.channel_gbyte)
    ring = blocks.get(("ring", "simple"))
    seen = {}
    if ring is not None:
        for k in range(3):
            if TERMS.index(f"bus_{k + 1}") in ring.free:
                seen[k] = 1.0 / ring.values[TERMS.index(f"bus_{k + 1}")] / base.channels[k]
    for k in (1, 2):  # a multi-node class no log saw takes the other's measured channel bandwidth
        channel_gbyte[k] = seen.get(k, seen.get(3 - k, channel_gbyte[k]))
    if 0 in seen:
        channel_gbyte[0] = seen[0]
    pairs = dict(base.pairs)
    for pair, block in blocks.items():
        terms = base.pairs[pair]
        efficiency, cap = list(terms.efficiency), list(terms.cap_gbyte)
        for k in range(3):
            j = TERMS.index(f"bus_{k + 1}")
            if j in block.free:
                efficiency[k] = 1.0 / block.values[j] / (base.channels[k] * channel_gbyte[k])
                cap[k] = math.inf
        inside = TERMS.index("overhead_us")
        pairs[pair] = replace(terms, base_us=block.values[TERMS.index("base_us")],
                              net_hop_us=block.values[TERMS.index("net_hop_us")],
                              overhead_us=block.values[inside] if inside in block.free else terms.overhead_us,
                              channel_hop_us=block.values[TERMS.index("channel_hop_us")],
                              efficiency=tuple(efficiency), cap_gbyte=tuple(cap))
    return replace(base, pairs=pairs, channel_gbyte=tuple(channel_gbyte), ring_plateau=1.0, chooser=chooser,
                   name="fitted")


def _fit_pair(base: NcclModel, blocks: dict[Pair, _Block], chooser: NcclModel, samples: Sequence[Sample],
              pair: Pair, index: list[int], times: np.ndarray) -> _Block:
    """One pair's block. A pipelined ring's rows are each its steps' or its bytes': which, the
    model says, so the fit alternates between telling each row's side and solving until no row
    changes side (at most :data:`ROUNDS` times)."""
    model = _fitted_model(base, blocks, chooser)
    defaults, intra_hop = _defaults(model, pair), model.pairs[pair].intra_hop_us
    pipelined = pair[0] == "ring" and base.pipelined_ring

    def sides(current: NcclModel) -> list[bool | None]:
        return [
            current.wire_bound(samples[i].collective, pair, samples[i].nodes, samples[i].nbytes)
            if pipelined else None for i in index]

    side = sides(model)
    for _ in range(ROUNDS):
        block = _solve(pair, index, [_row(model, samples[i], pair, s) for i, s in zip(index, side)], times,
                       defaults, intra_hop)
        changed = sides(_fitted_model(base, {**blocks, pair: block}, chooser))
        if changed == side:
            break
        side = changed
    return block


def _fit_graph(topology: ClusterTopology, samples: Sequence[Sample], graphs: tuple[Graph, Graph, Graph],
               version: str):
    chooser = shipped(topology, graphs, version)
    base = replace(chooser, ring_plateau=1.0, pipelined_ring=True)
    picks = [chooser.pick(s.collective, s.nodes, s.nbytes) for s in samples]
    times = np.array([s.time_us for s in samples])
    blocks: dict[Pair, _Block] = {}
    # the Simple ring first: its bandwidth is every other pair's channel bandwidth
    order = sorted(set(picks), key=lambda pair: pair != ("ring", "simple"))
    model = base
    for pair in order:
        index = [i for i, p in enumerate(picks) if p == pair]
        blocks[pair] = _fit_pair(base, blocks, chooser, samples, pair, index, times[index])
        model = _fitted_model(base, blocks, chooser)
    predicted = np.array([model.time_us(s.collective, p, s.nodes, s.nbytes) for s, p in zip(samples, picks)])
    return model, blocks, picks, predicted


def _candidate_graphs(topology: ClusterTopology) -> list[tuple[Graph, Graph, Graph]]:
    """The nominal graph first, then its neighbours: half and twice the channels, the speeds of
    NCCL's list from 2.5x slower to 1.5x faster."""
    one, nominal = nominal_graph(topology, 1), nominal_graph(topology, 2)
    speeds = [s for s in C.SPEEDS_INTER if nominal.inter_gbyte / 2.5 <= s <= nominal.inter_gbyte * 1.5]
    counts = sorted({max(1, nominal.channels // 2), nominal.channels, nominal.channels * 2})
    candidates = [(one, nominal, nominal)]
    for channels in counts:
        for speed in speeds:
            graph = Graph(channels, speed, speed)
            if graph != nominal:
                candidates.append((one, graph, graph))
    return candidates


def _sizes(samples: Sequence[Sample], index: list[int]) -> str:
    """The logs and size ranges of a term's rows, e.g. ``n2_all_reduce.log 4 B-64 KiB``."""
    spans: dict[str, list[int]] = {}
    for i in index:
        spans.setdefault(samples[i].log, []).append(samples[i].nbytes)
    return "; ".join(f"{log} {_size(min(b))}-{_size(max(b))}" for log, b in spans.items())


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _term_rows(model: NcclModel, blocks: dict[Pair, _Block], samples: Sequence[Sample],
               predicted: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for pair in PAIRS:
        block, terms = blocks.get(pair), model.pairs[pair]
        label = "/".join(pair)
        unseen = f"{len(block.index)} sizes ran it, too few to tell this term" if block else "no log ran it"
        for name in LATENCIES:
            if name == "overhead_us" and pair[0] != "ring":
                continue
            value = getattr(terms, name)
            rows.append(_term(label, name, value, "µs", block, TERMS.index(name), samples, predicted, unseen))
        rows.append(
            _row_of(label, "intra_hop_us", terms.intra_hop_us, "µs", "NCCL default",
                    "the logs' nodes have the same GPUs: a hop inside moves with the base"))
        for k in (1, 2):
            value = model.bus_gbyte(pair, 2 if k == 1 else 3)
            rows.append(
                _term(label, f"bus_gbyte[{NODE_CLASSES[k]}]", value, "GB/s", block,
                      TERMS.index(f"bus_{k + 1}"), samples, predicted, unseen))
    ring = blocks.get(("ring", "simple"))
    for k in (1, 2):
        fitted = ring is not None and TERMS.index(f"bus_{k + 1}") in ring.free
        rows.append(
            _row_of("graph", f"channel_gbyte[{NODE_CLASSES[k]}]", model.channel_gbyte[k], "GB/s",
                    "fitted" if fitted else "the other class's, or nominal",
                    "ring/simple's bus bandwidth over the channels"))
        rows.append(
            _row_of("graph", f"channels[{NODE_CLASSES[k]}]", model.channels[k], "", "fitted (knees)",
                    "the graph whose switch points fit the logs best"))
    fabric = model.topology.fabric
    if fabric is not None:
        for name in ("nodes_per_group", "uplink_share", "crossing_hop_us"):
            rows.append(
                _row_of("fabric", name, float(getattr(fabric, name)), "", "given",
                        "as built: no log inside one group crosses the fabric"))
    return rows


def _row_of(pair: str, term: str, value: float, unit: str, source: str, rows: str) -> dict[str, Any]:
    return {
        "pair": pair, "term": term, "value": value, "unit": unit, "source": source, "rows": rows,
        "error": math.nan, "std_error": math.nan}


def _term(pair: str, name: str, value: float, unit: str, block: _Block | None, j: int,
          samples: Sequence[Sample], predicted: np.ndarray, unseen: str) -> dict[str, Any]:
    if block is None or j not in block.free:
        return _row_of(pair, name, value, unit, "NCCL default", unseen)
    index = [i for row, i in zip(block.a, block.index) if row[j] != 0]
    measured = np.array([samples[i].time_us for i in index])
    return {
        "pair": pair, "term": name, "value": value, "unit": unit, "source": "fitted",
        "rows": _sizes(samples, index), "error": float(np.mean(np.abs(predicted[index] / measured - 1))),
        "std_error": float(block.errors[j])}


def fit(topology: ClusterTopology, logs: Iterable[pd.DataFrame], version: str = "2.21") -> NcclFitReport:
    """The cluster's terms from its nccl-tests logs (DataFrames of :func:`lab.sim.read_nccl_tests`,
    each with its collective and ranks), on the graph whose switch points match the logs best;
    ``version`` the NCCL release that ran them (2.21 or 2.18): its tuner picks each size's pair
    and gives the terms no log sees."""
    if not isinstance(topology, ClusterTopology):
        raise TypeError(f"topology must be a ClusterTopology; got {topology!r}")
    if version not in C.VERSIONS:
        raise ValueError(f"version must be one of {', '.join(C.VERSIONS)}; got {version!r}")
    samples = samples_of(topology, logs)
    measured = np.array([s.time_us for s in samples])
    tried, best = [], None
    nominal = nominal_graph(topology, 2)
    for graphs in _candidate_graphs(topology):
        model, blocks, picks, predicted = _fit_graph(topology, samples, graphs, version)
        score = float(np.mean(np.abs(np.log(predicted / measured))))
        tried.append({
            "channels": graphs[1].channels, "gbyte": graphs[1].inter_gbyte, "log_error": score,
            "nominal": graphs[1] == nominal})
        if best is None or score < best[0] - 1e-9:
            best = (score, model, blocks, picks, predicted)
    _, model, blocks, picks, predicted = best
    terms = pd.DataFrame(_term_rows(model, blocks, samples, predicted))
    table = pd.DataFrame([{
        "log": s.log, "collective": s.collective, "nodes": s.nodes, "bytes": s.nbytes,
        "measured_us": s.time_us, "predicted_us": p, "algorithm": pair[0], "protocol": pair[1],
        "error": p / s.time_us - 1} for s, p, pair in zip(samples, predicted, picks)])
    graphs = pd.DataFrame(tried).sort_values("log_error", kind="stable", ignore_index=True)
    return NcclFitReport(model=model, terms=terms, samples=table, graphs=graphs,
                         knees=knees(samples, model.chooser))
