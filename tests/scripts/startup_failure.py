"""Rank 1 of a tcp pool dies while starting (ranks start with LAB_START_METHOD=spawn, which
imports this module in each rank); prints how long spawn took to fail and the error's headline."""

import multiprocessing
import time

import lab

if multiprocessing.current_process().name == "lab-rank1":
    time.sleep(0.5)  # the others are already waiting for it in the tcp handshake
    raise SystemExit(3)


def nothing(mesh):
    return mesh.rank


if __name__ == "__main__":
    started = time.monotonic()
    try:
        lab.spawn(nothing, 3, transport="tcp")
    except lab.RankError as error:
        print(f"failed after {time.monotonic() - started:.1f} s: {str(error).splitlines()[0]}")
    else:
        raise SystemExit("spawn succeeded although rank 1 died at start")
