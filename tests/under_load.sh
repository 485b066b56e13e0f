#!/usr/bin/env bash
# The suite under load: a busy loop on every core while `python -m pytest` runs twice in a row.
# Timing in the tests is asserted as an order of events or derived from what they measure, so
# both runs must pass. Extra arguments go to pytest (e.g. tests/test_faults.py).
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=()
trap '[ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null' EXIT
for _ in $(seq "$(nproc)"); do
    python3 -c 'while True: pass' &
    hogs+=($!)
done
for run in 1 2; do
    echo "== run $run of 2, with $(nproc) busy loops =="
    python -m pytest "$@"
done
