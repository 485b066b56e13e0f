"""Is ``auto`` within 25 % of the best allreduce algorithm, measured afresh?

At a world size ``tuning.json`` has models for (``worlds``: 4 and the ``results/ranks/N`` runs)
``auto`` follows the medians measured there; at any other it asks the simulator. This measures
what either picks against every candidate, in a run of its own.

    python bench/auto_choice.py                           # 8 ranks, shm, 1 KB, 1 MB and 16 MB
    python bench/auto_choice.py --ranks 6 8 --sizes 1K 256K 1M --rounds 3 --transport tcp

Per ranks and size: every ``auto`` candidate and ``auto`` itself, timed in one pool with
:func:`lab.benchmark.measure` (median of the slowest rank per call), ``--rounds`` times
alternating, keeping each case's best median (shared cores: noise only ever adds time). Prints
what ``auto`` runs there (its own call inside a rank, compiled path included), what the fitted
models alone would have picked (``tuning.choose`` without networks: no simulator), auto's median
over the best candidate's, and the picked algorithm's own median over the best's (the same
choice, measured as a candidate: on a loaded machine the two differ by noise). The load average
is printed: on a shared machine compare runs only at similar loads.
"""

from __future__ import annotations

import argparse
import os

import pandas as pd

import lab
from lab import tuning
from lab.algorithms import registry
from lab.benchmark import measure
from lab.collectives import choice as collectives
from lab.sim.sweep import parse_size


def auto_runs(mesh: lab.Mesh, nbytes: int) -> str:
    """In a rank: the algorithm ``auto`` resolves to for an ``nbytes`` allreduce on this mesh."""
    return collectives.pick(mesh, "allreduce", "auto", nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8])
    parser.add_argument("--sizes", nargs="+", default=["1K", "1M", "16M"])
    parser.add_argument("--transport", default="shm", choices=["shm", "queue", "tcp"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    candidates = list(registry.auto_candidates("allreduce"))
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for ranks in args.ranks:
        with lab.launch(ranks, transport=args.transport) as cluster:
            for nbytes in sizes:
                picked = cluster.run(auto_runs, nbytes)
                assert len(set(picked)) == 1, picked  # every rank runs the same algorithm
                best: dict[str, float] = {}
                for _ in range(args.rounds):
                    for algorithm in [*candidates, "auto"]:
                        median = measure(cluster, "allreduce", "lab", nbytes, algorithm)["median_us"]
                        best[algorithm] = min(best.get(algorithm, float("inf")), median)
                fastest = min(candidates, key=best.get)
                rows.append({
                    "ranks": ranks, "bytes": nbytes, "auto runs": picked[0],
                    "fitted alone": tuning.choose(nbytes, ranks, args.transport,
                                                  networks={}), "best": fastest, "best_us": best[fastest],
                    "auto_us": best["auto"], "auto / best": best["auto"] / best[fastest],
                    "picked / best": best[picked[0]] / best[fastest] if picked[0] in best else float("nan"),
                    **{f"{a}_us": best[a]
                       for a in candidates}})
                print(
                    pd.DataFrame(rows[-1:]).to_string(index=False, float_format=lambda v: f"{v:.3g}"),
                    flush=True)
    print(f"load average after: {os.getloadavg()}")
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 250)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    main()
