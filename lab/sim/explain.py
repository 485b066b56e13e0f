"""``python -m lab explain``: what ``auto`` picks for a call, each algorithm's predicted time, and why.

    python -m lab explain allreduce --ranks 8 --bytes 1M
    python -m lab explain allreduce ring --ranks 4 --bytes 1M --plot ring.png     # and its picture

The predictions are :func:`lab.tuning.decide`'s, the ones ``auto`` compares: the fitted models
where they were measured, else the simulator on the transport's calibrated network. The reason is
derived from them: each prediction is a latency part A (its α terms, plus the simulator's waits)
and a per-byte part B·n, so the pick and the runner-up trade places, if ever, at n = ΔA / ΔB.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lab import checks, tuning
from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.collectives.choice import forced_algorithm
from lab.command_line import checked, output_file, refused, whole
from lab.sim.limits import MAX_NBYTES, MAX_WORLD_SIZE, SimulationUnsupported
from lab.sim.sweep import parse_size


def _size(nbytes: float) -> str:
    """``1 MB``, ``1.5 KB``, ``512 B`` (binary units)."""
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _why_source(choice: tuning.Choice, world_size: int, transport: str, collective: str) -> str:
    """Which predictions decided, and why those."""
    worlds = ", ".join(map(str, tuning.swept_worlds())) or "none"
    if choice.source == "simulator":
        from lab.sim.network import Network

        fitted = len(tuning.fitted_models().get(transport, {}).get(collective, {}))
        why = (f"tuning.json's fits were measured at N = {worlds}, not {world_size}" if fitted >= 2 else
               f"{transport} has fits for {fitted} of {collective}'s algorithms (auto needs two)")
        return (
            f"simulator: {why}; simulated on {transport}'s calibrated network ({Network(**choice.network).describe()})"
            f" at {_size(choice.nbytes)}, the choice auto keeps for every size from {choice.nbytes:,} to "
            f"{max(2 * choice.nbytes - 1, 0):,} bytes")
    if choice.source == "fitted model":
        if world_size in tuning.swept_worlds():
            return (
                f"fitted model: {transport}'s medians measured at N = {world_size} (tuning.json; between two "
                "measured sizes the line through them, past the largest its α-β fit's per-byte term)")
        return (
            f"fitted model: {transport}'s α-β fits, measured at N = {worlds}, extrapolated to N = {world_size} "
            f"(no calibrated network for {transport})")
    small, large = registry.fallback(collective)
    return (f"size threshold: no fits and no calibrated network for {transport}, so {large} from "
            f"{_size(tuning.AUTO_LARGE_MIN_BYTES)} up, {small} below")


def why_pick(choice: tuning.Choice) -> str:
    """Why the pick beats the runner-up, from their α-β terms (no canned text)."""
    ranked = sorted(choice.predictions.values(), key=lambda p: p.time_us)
    if len(ranked) < 2:
        return f"{choice.algorithm}: the only candidate with a prediction"
    best, second = ranked[0], ranked[1]
    n = choice.nbytes
    fixed_best, fixed_second = best.time_us - best.bandwidth_us, second.time_us - second.bandwidth_us
    terms = (
        f"{best.algorithm}: {best.steps} latency steps ({fixed_best:,.0f} µs) and {_size(best.path_bytes)} on its "
        f"critical path ({best.bandwidth_us:,.0f} µs) against {second.algorithm}'s {second.steps} steps "
        f"({fixed_second:,.0f} µs) and {_size(second.path_bytes)} ({second.bandwidth_us:,.0f} µs)")
    if n == 0 or best.bandwidth_us == second.bandwidth_us:
        return terms + f": {second.time_us - best.time_us:,.0f} µs less at every size where the paths keep this shape"
    slope_gap = (second.bandwidth_us - best.bandwidth_us) / n  # µs per byte of size
    crossover = (fixed_best - fixed_second) / slope_gap
    if fixed_best <= fixed_second and slope_gap >= 0:
        return terms + ": fewer or cheaper latency terms and no more bytes, so it wins at every size"
    if fixed_best <= fixed_second:
        return (terms + f": its latency terms win below the crossover of about {_size(crossover)} "
                f"({crossover:,.0f} bytes), where {second.algorithm}'s fewer bytes would take over")
    return (terms + f": its fewer bytes win above the crossover of about {_size(crossover)} "
            f"({crossover:,.0f} bytes), below which {second.algorithm}'s latency terms would take over")


def auto_bytes(collective: str, nbytes: int, world_size: int) -> int:
    """The size ``auto`` weighs for a call whose ranks each give ``nbytes`` (allgather's and
    gather's: the result, N times it; see :mod:`lab.tuning`)."""
    return nbytes * world_size if CATALOG[collective].sized_by_output else nbytes


def explain(collective: str, world_size: int, nbytes: int, transport: str = "shm",
            algorithm: str | None = None) -> str:
    """The text ``python -m lab explain`` prints: what ``auto`` picks, the table, the reason.

        print(explain("allreduce", 8, 1 << 20))   # auto picks ... (simulator: ... measured at N = 4, not 8)
    """
    _check(collective, world_size, nbytes, transport, algorithm)
    choice = tuning.decide(auto_bytes(collective, nbytes, world_size), world_size, transport, collective)
    forced = forced_algorithm(collective)
    lines = [
        f"{collective} of {_size(nbytes)} ({nbytes:,} bytes) per rank on {world_size} ranks, transport {transport}",
        f"auto picks {forced or choice.algorithm}" +
        (f" (LAB_ALGO={os.environ.get('LAB_ALGO')!r} forces it; without it: {choice.algorithm})"
         if forced else "") + f" -- {_why_source(choice, world_size, transport, collective)}", ""]
    if choice.predictions:
        header = f"{'algorithm':<20} {'predicted':>12}  {'source':<13} {'steps':>5} {'bytes on path':>13} " \
                 f"{'α terms':>10} {'β terms':>10} {'other':>9}"
        lines += [header, "-" * len(header)]
        for p in sorted(choice.predictions.values(), key=lambda p: p.time_us):
            mark = " <- auto" if p.algorithm == choice.algorithm else (
                " <- asked" if p.algorithm == algorithm else "")
            lines.append(f"{p.algorithm:<20} {p.time_us:>9,.0f} µs  {p.source:<13} {p.steps:>5} "
                         f"{_size(p.path_bytes):>13} {p.latency_us:>7,.0f} µs {p.bandwidth_us:>7,.0f} µs "
                         f"{p.other_us if abs(p.other_us) >= 0.5 else 0.0:>6,.0f} µs{mark}")
        lines += [f"{name:<20} {'-':>12}  {why}" for name, why in choice.left_out.items()]
        lines += ["", "Why " + why_pick(choice)]
        if algorithm is not None and algorithm in choice.predictions and algorithm != choice.algorithm:
            ratio = choice.predictions[algorithm].time_us / choice.predictions[choice.algorithm].time_us
            lines.append(f"{algorithm}: {ratio:.2f}x auto's pick")
    return "\n".join(lines)


def plot(collective: str, algorithm: str, world_size: int, nbytes: int, transport: str,
         path: str | Path) -> str:
    """Draw ``algorithm``'s recorded schedule to ``path`` (:mod:`lab.sim.plot`), timed on the
    transport's calibrated network (or the default ``Network()``); returns a line saying so."""
    from lab.sim.core import simulate
    from lab.sim.network import Network
    from lab.sim.plot import draw
    from lab.sim.schedule import record

    network_kwargs = tuning.calibrated_networks().get(transport)
    network = Network(**network_kwargs) if network_kwargs else Network()
    sim_bytes = nbytes - nbytes % 4
    result = simulate(collective, algorithm, world_size, sim_bytes, network)
    schedule = record(collective, algorithm, world_size, sim_bytes, 0, network.ranks_per_host)
    where = f"{transport}'s calibrated network" if network_kwargs else "the default network"
    title = (
        f"{collective} {algorithm}, {world_size} ranks, {_size(sim_bytes)} per rank: {result.time_us:,.0f} µs\n"
        f"on {where} ({network.describe()}); critical path {len(result.critical_path)} messages")
    drawn = draw(schedule, result.critical_path, path, title)
    return f"{len(drawn)} messages -> {path}"


def _check(collective: object, world_size: object, nbytes: object, transport: object,
           algorithm: object) -> None:
    """:func:`explain`'s arguments, each a ``ValueError`` naming it (``True`` is no count)."""
    if collective not in registry.ALGORITHMS:
        raise ValueError(f"collective must be one of {', '.join(registry.ALGORITHMS)}; got {collective!r}")
    if not checks.is_int(world_size) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an integer from 1 to {MAX_WORLD_SIZE:,}; got {world_size!r}")
    if not checks.is_int(nbytes) or not 0 <= nbytes <= MAX_NBYTES:
        raise ValueError(f"nbytes must be an integer from 0 to {MAX_NBYTES:,}; got {nbytes!r}")
    if transport not in tuning.TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(tuning.TRANSPORTS)}; got {transport!r}")
    names = registry.names(collective)
    if algorithm is not None and algorithm not in names:
        raise ValueError(f"algorithm must be one of {collective}'s: {', '.join(names)}; got {algorithm!r}")


def _bytes(text: str) -> int:
    """``--bytes``: a size (4096, 1K, 16MB) up to the simulator's 1 TiB."""
    size = parse_size(text)
    if size > MAX_NBYTES:
        raise ValueError(f"must be at most {MAX_NBYTES:,} bytes (1 TiB); got {text!r}")
    return size


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``python -m lab explain``."""
    parser = commands.add_parser(
        "explain", help="what auto picks for a call, each algorithm's predicted time, "
        "why; --plot draws an algorithm's schedule")
    parser.add_argument("collective", choices=list(registry.ALGORITHMS))
    parser.add_argument(
        "algorithm", nargs="?", help="an algorithm of the collective: marked in the table, "
        "drawn by --plot (default: auto's pick)")
    parser.add_argument("--ranks", type=whole(1, MAX_WORLD_SIZE), required=True, metavar="N")
    parser.add_argument("--bytes", type=checked(_bytes), required=True, metavar="B",
                        help="each rank's tensor: 4096, 1K, 1M, 16M")
    parser.add_argument("--transport", default="shm", choices=list(tuning.TRANSPORTS))
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the algorithm's schedule (ranks down, steps across)")
    parser.set_defaults(run=_run, parser=parser)


def _run(args: argparse.Namespace) -> int:
    names = registry.names(args.collective)
    if args.algorithm is not None and args.algorithm not in names:
        args.parser.error(
            f"argument algorithm: {args.collective} has {', '.join(names)}; got {args.algorithm!r}")
    if args.plot:
        try:
            output_file(args.plot, "--plot")
        except ValueError as exc:
            args.parser.error(str(exc))
    print(explain(args.collective, args.ranks, args.bytes, args.transport, args.algorithm))
    if args.plot:
        algorithm = args.algorithm or tuning.decide(auto_bytes(args.collective, args.bytes, args.ranks),
                                                    args.ranks, args.transport, args.collective).algorithm
        try:  # a schedule too large to record, or a file matplotlib cannot write
            print(plot(args.collective, algorithm, args.ranks, args.bytes, args.transport, args.plot))
        except (SimulationUnsupported, OSError, ValueError) as exc:
            args.parser.error(f"argument --plot: {refused(exc)}")
    return 0
