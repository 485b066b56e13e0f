"""Rank 1 of a tcp pool dies while starting (ranks start with LAB_START_METHOD=spawn, which
imports this module in each rank); prints how long after that death spawn failed (a loaded
machine's slow imports left out) and the error's headline."""

import multiprocessing
import os
import tempfile
import time

import lab

if multiprocessing.current_process().name == "MainProcess":  # the ranks inherit the variable
    os.environ["DIED_AT"] = os.path.join(tempfile.gettempdir(), f"lab-startup-failure-{os.getpid()}")
DIED_AT = os.environ["DIED_AT"]

if multiprocessing.current_process().name == "lab-rank1":
    time.sleep(0.5)  # the others are already waiting for it in the tcp handshake
    with open(DIED_AT, "w") as file:
        file.write(repr(time.time()))
    raise SystemExit(3)


def nothing(mesh):
    return mesh.rank


if __name__ == "__main__":
    try:
        lab.spawn(nothing, 3, transport="tcp")
    except lab.RankError as error:
        with open(DIED_AT) as file:
            died_at = float(file.read())
        os.remove(DIED_AT)
        print(f"failed after {time.time() - died_at:.1f} s: {str(error).splitlines()[0]}")
    else:
        raise SystemExit("spawn succeeded although rank 1 died at start")
