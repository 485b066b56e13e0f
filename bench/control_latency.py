"""One-way latency of small control messages between two processes.

A parent and one "spawn"-ed child ping-pong a small control descriptor
(seq, op, offset, nbytes) over one channel per direction, for each kind:

  Queue            multiprocessing.Queue put/get
  SimpleQueue      multiprocessing.SimpleQueue put/get
  Pipe send/recv   Pipe(duplex=False) send/recv of the pickled tuple
  Pipe send_bytes  Pipe(duplex=False) send_bytes/recv_bytes of the 32-byte
                   struct.pack-ed descriptor

After a warm-up, every round trip is timed with time.perf_counter_ns (message
encoding included); one-way latency is taken as round trip / 2. The script
prints median, p10 and p90 in microseconds per kind.

Run:  python bench/control_latency.py [--iterations N] [--warmup N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import statistics
import struct
import time
from multiprocessing.context import SpawnContext
from typing import Any

TIMEOUT_S = 5.0  # a receive waiting longer than this means the peer is dead
DESCRIPTOR = struct.Struct("<4Q")  # seq, op, offset, nbytes: 32 bytes
OP_SEND = 1
KINDS = ("Queue", "SimpleQueue", "Pipe send/recv", "Pipe send_bytes")

Message = tuple[int, int, int, int] | bytes


def make_channel(ctx: SpawnContext, kind: str) -> tuple[Any, Any]:
    """Return the (receive end, send end) of a one-way channel of `kind`."""
    if kind == "Queue":
        fifo = ctx.Queue()
        return fifo, fifo
    if kind == "SimpleQueue":
        simple = ctx.SimpleQueue()
        return simple, simple
    return ctx.Pipe(duplex=False)


def send(kind: str, tx: Any, msg: Message) -> None:
    if kind in ("Queue", "SimpleQueue"):
        tx.put(msg)
    elif kind == "Pipe send/recv":
        tx.send(msg)
    else:
        tx.send_bytes(msg)


def peer_timeout(kind: str) -> TimeoutError:
    return TimeoutError(f"{kind}: no message within {TIMEOUT_S} s")


def recv(kind: str, rx: Any) -> Message:
    """Receive one message; raise rather than block past TIMEOUT_S."""
    if kind == "Queue":
        try:
            return rx.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise peer_timeout(kind) from None
    # SimpleQueue.get() takes no timeout, so poll the pipe underneath it.
    ready = rx._poll(TIMEOUT_S) if kind == "SimpleQueue" else rx.poll(TIMEOUT_S)
    if not ready:
        raise peer_timeout(kind)
    if kind == "SimpleQueue":
        return rx.get()
    return rx.recv() if kind == "Pipe send/recv" else rx.recv_bytes()


def encode(kind: str, seq: int) -> Message:
    fields = (seq, OP_SEND, 0, 4096)
    return DESCRIPTOR.pack(*fields) if kind == "Pipe send_bytes" else fields


def decode_seq(kind: str, msg: Message) -> int:
    return DESCRIPTOR.unpack(msg)[0] if isinstance(msg, bytes) else msg[0]


def echo(kind: str, rx: Any, tx: Any, count: int) -> None:
    """Child side: send every received message straight back."""
    for _ in range(count):
        send(kind, tx, recv(kind, rx))


def measure(ctx: SpawnContext, kind: str, warmup: int, iterations: int) -> list[float]:
    """Return one-way latencies in microseconds for the timed round trips."""
    to_child, to_parent = make_channel(ctx, kind), make_channel(ctx, kind)
    total = warmup + iterations
    child = ctx.Process(target=echo, args=(kind, to_child[0], to_parent[1], total))
    child.start()
    try:
        samples: list[float] = []
        for seq in range(total):
            start = time.perf_counter_ns()
            send(kind, to_child[1], encode(kind, seq))
            reply = recv(kind, to_parent[0])
            elapsed = time.perf_counter_ns() - start
            if decode_seq(kind, reply) != seq:
                raise RuntimeError(f"{kind}: reply out of order at seq {seq}")
            if seq >= warmup:
                samples.append(elapsed / 2 / 1000)
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.terminate()
            child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"{kind}: child exited with code {child.exitcode}")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="timed round trips")
    parser.add_argument("--warmup", type=int, default=2_000, help="untimed round trips")
    args = parser.parse_args()
    if args.iterations < 2 or args.warmup < 0:
        parser.error("need --iterations >= 2 and --warmup >= 0")

    ctx = mp.get_context("spawn")
    print(f"Python {platform.python_version()}, os.cpu_count()={os.cpu_count()}, "
          f"spawn, {args.warmup} warm-up + {args.iterations} timed round trips; "
          "one-way latency in us")
    print(f"{'channel':<16} {'median':>8} {'p10':>8} {'p90':>8}")
    for kind in KINDS:
        samples = measure(ctx, kind, args.warmup, args.iterations)
        deciles = statistics.quantiles(samples, n=10)
        median = statistics.median(samples)
        print(f"{kind:<16} {median:>8.1f} {deciles[0]:>8.1f} {deciles[-1]:>8.1f}")


if __name__ == "__main__":
    main()
