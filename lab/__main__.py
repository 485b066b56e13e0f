"""``python -m lab``: the validation table (every primitive, lab vs gloo) and the byte counters.

    python -m lab                              # shm and queue transports, 3 and 4 ranks
    python -m lab --world-sizes 2 5 --transports shm

Exits non-zero if any row fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import pandas as pd

from lab.validate import byte_table, validation_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["shm", "queue"], choices=["shm", "queue"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[3, 4], metavar="N")
    parser.add_argument("--elements", type=int, default=1001, help="elements per rank (default 1001: not divisible)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    started = time.monotonic()
    table = validation_table(args.transports, args.world_sizes, args.elements, args.seed)
    pd.set_option("display.width", 200)
    print("Validation: lab vs torch.distributed (gloo), random inputs, same ranks\n")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2e}"))

    n, numel = 4, 256 * 1024
    counters = byte_table(n, numel)
    print(f"\nPayload bytes per rank, one allreduce of T = {numel * 4:,} bytes (float32) on N = {n} ranks")
    print(f"ring: 2T(N-1)/N = {2 * numel * 4 * (n - 1) // n:,} each way; naive root: (N-1)T = {(n - 1) * numel * 4:,}\n")
    print(counters.to_string(index=False))

    failed = int((table["result"] == "FAIL").sum() + (counters["result"] == "FAIL").sum())
    print(f"\n{len(table) + len(counters) - failed} passed, {failed} failed in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
