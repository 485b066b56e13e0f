"""One rank of a job started by hand with the variables torchrun would set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK), so a test can start, stop
and time each rank on its own and read each rank's own error.

    LAB_TEST_TRANSPORT   "auto" (default) or "tcp", passed to Mesh.from_env
    LAB_TEST_GO          a path: a rank other than 0 prints READY right before it joins its peers
                         (takes its shm endpoints from local rank 0, or connects over TCP), when
                         every rank has reported to the store and rank 0 holds the job's secret
                         file (one host, no LAB_TCP_SECRET), and waits for the path to exist
    LAB_TEST_WORK        "allreduce" (default): ring and hierarchical allreduce, checked; "none"
    LAB_TEST_TERM_HOOK   a path: install a SIGTERM handler first that writes it and exits 3

Prints READY (see LAB_TEST_GO), JOINED <monotonic time> sigterm same|changed (whether the
SIGTERM handler is the one from before from_env), then OK ... or FAILED <exception type>:
<message> (exit code 1). CLOCK_MONOTONIC is system-wide on Linux, so the test can order these
times against other processes' events.
"""

import os
import signal
import sys
import time

import torch

import lab
import lab.transport.hand_out
import lab.transport.tcp


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def on_term(signum, frame):  # a program's own SIGTERM handler, which from_env must keep
    with open(os.environ["LAB_TEST_TERM_HOOK"], "w") as file:
        file.write("called")
    os._exit(3)


def work(mesh: lab.Mesh) -> str:
    n, count = mesh.world_size, 3 * 4096 + 5
    want = torch.arange(count, dtype=torch.float32) * n + n * (n - 1) // 2
    wrong = []
    for algorithm in ("ring", "hierarchical"):
        x = torch.arange(count, dtype=torch.float32) + mesh.rank
        lab.allreduce(mesh, x, algorithm=algorithm)
        if not torch.equal(x, want):
            wrong.append(algorithm)
    return f"wrong {wrong}" if wrong else "allreduce ok"


def wait_before_joining(go: str) -> None:
    """Make a rank other than 0 stop right before it joins its peers: before it takes its shm
    endpoints from local rank 0 (a local rank other than 0, "auto") or connects over TCP."""
    share, tcp = lab.transport.hand_out.share_host_endpoints, lab.transport.tcp.TcpTransport

    def wait() -> None:
        say(f"READY rank {os.environ['RANK']}")
        while not os.path.exists(go):
            time.sleep(0.01)

    def sharing(store, prefix, host, local_rank, *args):
        if local_rank:
            wait()
        return share(store, prefix, host, local_rank, *args)

    def connecting(rank, *args, **options):
        if rank and not os.path.exists(go):
            wait()
        return tcp(rank, *args, **options)

    # from_env imports both when it is called, so it finds these
    lab.transport.hand_out.share_host_endpoints, lab.transport.tcp.TcpTransport = sharing, connecting


def main() -> None:
    rank = int(os.environ["RANK"])
    if os.environ.get("LAB_TEST_TERM_HOOK"):
        signal.signal(signal.SIGTERM, on_term)
    if os.environ.get("LAB_TEST_GO"):
        wait_before_joining(os.environ["LAB_TEST_GO"])
    before = signal.getsignal(signal.SIGTERM)
    try:
        mesh = lab.Mesh.from_env(recv_timeout_ms=60_000,
                                 transport=os.environ.get("LAB_TEST_TRANSPORT", "auto"))
        kept = "same" if signal.getsignal(signal.SIGTERM) == before else "changed"
        say(f"JOINED {time.monotonic()!r} sigterm {kept}")
        done = work(mesh) if os.environ.get("LAB_TEST_WORK", "allreduce") == "allreduce" else "no work"
        say(f"OK rank {rank} host {mesh.host} local {mesh.local_rank} of {mesh.local_world_size} "
            f"hosts {mesh.host_count}: {done}")
        mesh.close()
    except Exception as exc:  # noqa: BLE001 (one line the test can read: the type and the message)
        say(f"FAILED {type(exc).__name__}: {exc}")
        sys.exit(1)


main()
