"""What authenticating every tcp frame costs: the same allreduces with the frame MAC on (as the
lab always runs) and replaced by a no-op (for this measurement only), interleaved in one pool.

    python bench/tcp_auth_cost.py [--world-size 4] [--rounds 5]

Prints the median per-call time of the slowest rank at 1 KB (tree) and 16 MB (ring) for both, and
the difference. The MAC is keyed BLAKE3 (the blake3 package).
"""

from __future__ import annotations

import argparse
import statistics

import lab
from lab.benchmark import summarize, time_collective
from lab.transport import tcp

CASES = [("1 KB", 1 << 10, "tree"), ("16 MB", 16 << 20, "ring")]


class _NoMac:
    """A stand-in with the MAC's interface and no work: both ends agree on its constant digest."""
    def update(self, data) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(tcp.MAC_BYTES)


def timed(mesh: lab.Mesh, authenticated: bool, nbytes: int, algorithm: str) -> list[int]:
    tcp.frame_mac = _MAC if authenticated else (lambda key, sequence: _NoMac())
    try:
        return time_collective(mesh, "allreduce", "lab", nbytes, algorithm)
    finally:
        tcp.frame_mac = _MAC


_MAC = tcp.frame_mac


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with lab.launch(args.world_size, transport="tcp") as cluster:
        for label, nbytes, algorithm in CASES:
            medians = {True: [], False: []}
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                for authenticated in (True, False):
                    per_rank = cluster.run(timed, authenticated, nbytes, algorithm)
                    medians[authenticated].append(
                        summarize(per_rank, "allreduce", nbytes, args.world_size)["median_us"])
            on, off = statistics.median(medians[True]), statistics.median(medians[False])
            print(f"{label} {algorithm} allreduce, {args.world_size} ranks: authenticated {on:,.0f} us, "
                  f"no MAC {off:,.0f} us, cost {on - off:+,.0f} us ({on / off - 1:+.0%})")


if __name__ == "__main__":
    main()
