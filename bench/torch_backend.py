"""The torch.distributed backend's cost: dist.all_reduce on "lab" vs lab.allreduce vs gloo, and a DDP step.

    python bench/torch_backend.py                 # 2 and 4 ranks under torchrun; prints the table
    python bench/torch_backend.py --ranks 2 --steps 20 --out /tmp/backend

The measurement is lab.results.backend's (what ``python -m lab results --backend`` commits to
results/backend.csv and REPORT.md): every time is taken inside the ranks, the slowest rank's per
call, the median over rounds after a warm-up round; gloo runs in the same processes, in the same
run, so read the ratios rather than the absolute times on a shared machine.
"""

import argparse
import sys
import tempfile

from lab.results import backend

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10, help="DDP steps timed (after two warm-up steps)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of calls per size")
    parser.add_argument("--out", help="where to write backend.csv (default: a temporary directory)")
    args = parser.parse_args()
    sys.exit(
        backend.main(args.out or tempfile.mkdtemp(prefix="lab-backend-"), args.ranks, args.steps,
                     args.rounds))
