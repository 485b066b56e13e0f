"""NCCL's cost model fitted on two nccl-tests logs and predicted at three node counts, timed.

    python bench/nccl_model.py                                    # Polaris' 2- and 8-node allreduce
    python bench/nccl_model.py --logs a.log b.log --collective allgather --nodes 16 128 1024

Reads the logs (``lab.sim.read_nccl_tests``), fits ``lab.sim.nccl`` on them with the cluster as
built (``--topology polaris``, the only one known here: ``lab.sim.nccl.known``), prints the fit's
terms and an nccl-tests-like table per node count (size, time, algbw, busbw, the algorithm and
protocol NCCL runs), and how long each part took. The target is all of it in under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

START = time.perf_counter()

from lab.sim.logs import read_nccl_tests
from lab.sim.nccl import fit
from lab.sim.nccl.known import POLARIS

POLARIS_LOGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "clusters" / "polaris-nccl-2.21"
SIZES = [1 << k for k in range(2, 31, 2)]  # 4 B to 1 GiB, factor 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", nargs="+", type=Path,
                        default=[POLARIS_LOGS / "n2_all_reduce.log", POLARIS_LOGS / "n8_all_reduce.log"])
    parser.add_argument("--collective", default="allreduce", help="what the logs measured (allreduce)")
    parser.add_argument("--nodes", nargs=3, type=int, default=[16, 256, 1024], help="node counts to predict")
    args = parser.parse_args(argv)
    imported = time.perf_counter()
    logs = [read_nccl_tests(path, collective=args.collective) for path in args.logs]
    read = time.perf_counter()
    report = fit(POLARIS, logs)
    fitted = time.perf_counter()
    tables = {nodes: report.model.table(args.collective, nodes, SIZES) for nodes in args.nodes}
    predicted = time.perf_counter()
    print(report.text())
    for nodes, table in tables.items():
        print(f"\n# {args.collective}, {nodes} nodes of {POLARIS.gpus_per_node} GPUs (predicted)")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"\nimports {imported - START:.2f} s, reading {read - imported:.2f} s, fit {fitted - read:.2f} s, "
          f"{len(SIZES) * len(tables)} predictions {predicted - fitted:.3f} s; "
          f"total {time.perf_counter() - START:.2f} s")


if __name__ == "__main__":
    main()
