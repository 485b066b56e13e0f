"""The forkserver that starts ranks, stopped and then killed: each is named, and a later pool
works (a new forkserver starts). Prints one line per case."""

import os
import signal
import time

import torch

import lab
from lab.launch.forkserver import forkserver_pid


def sum_ranks(mesh):
    return float(lab.allreduce(mesh, torch.tensor([float(mesh.rank)]))[0])


def sleep_then_sum(mesh):
    time.sleep(30)
    return sum_ranks(mesh)


if __name__ == "__main__":
    lab.spawn(sum_ranks, 2)  # the forkserver is up
    server = forkserver_pid()
    os.kill(server, signal.SIGSTOP)
    time.sleep(0.2)
    started = time.monotonic()
    try:
        lab.spawn(sum_ranks, 2)
    except lab.LabError as error:
        print(
            f"stopped: {str(error).split('(pid ')[1].split(')', 1)[1].strip()} after {time.monotonic() - started:.1f} s"
        )
    os.kill(server, signal.SIGCONT)
    with lab.launch(3) as cluster:
        os.kill(forkserver_pid(), signal.SIGKILL)  # the ranks die with it
        try:
            cluster.run(sleep_then_sum)
        except lab.RankError as error:
            print(f"killed: {error.exc_message.split(': ', 1)[1]}")
    print(f"after: {lab.spawn(sum_ranks, 3)}")
