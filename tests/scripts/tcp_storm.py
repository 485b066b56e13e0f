"""A connection storm against a lab rank's listener, from a process of its own.

    python tcp_storm.py STORE_HOST STORE_PORT KEY IDLE TRICKLE [READY_KEY]

Reads the listener's ``host:port`` under KEY in the job's store (it has no authentication: any
local user can), opens IDLE connections that never send a byte and TRICKLE ones that send a
plausible lab hello one byte every 0.25 s, and reopens each one the listener closes, for as long
as the listener accepts. Prints ``ready`` (and sets READY_KEY in the store) once all are open. When stdin closes it stops reopening,
sends one byte on every connection still open (so that one whose other end is gone gets a reset),
waits (up to 30 s) for the listener to have closed every connection, and prints one JSON line:
``opened``, ``closed_by_listener``, ``refused`` (connects refused: the listener is gone),
``still_open``.
"""

import json
import secrets
import selectors
import socket
import struct
import sys
import time
from datetime import timedelta

import torch.distributed as dist

store_host, store_port, key, idle, trickle = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(
    sys.argv[4]), int(sys.argv[5])
ready_key = sys.argv[6] if len(sys.argv) > 6 else None
store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=60))
host, port = store.get(key).decode().rsplit(":", 1)
target = (host, int(port))
# What a connecting rank 1 would send first (magic, version, rank, nonce), a byte at a time.
HELLO = struct.pack("<4sBxxxI32s", b"LABT", 3, 1, secrets.token_bytes(32))

selector = selectors.DefaultSelector()
counts = {"opened": 0, "closed_by_listener": 0, "refused": 0}
sent = {}  # trickling socket -> bytes of HELLO sent
reopening = True


def open_one(trickling: bool) -> None:
    """One more connection, unless the listener is gone (refused) or slow to accept (retried later)."""
    global reopening
    try:
        sock = socket.create_connection(target, timeout=2)
    except ConnectionRefusedError:
        counts["refused"] += 1
        reopening = False  # the listener is closed: the storm is over
        return
    except OSError:
        return  # a full accept queue: the next round tries again
    sock.setblocking(False)
    counts["opened"] += 1
    selector.register(sock, selectors.EVENT_READ, trickling)
    if trickling:
        sent[sock] = 0


def closed(sock: socket.socket) -> bool:
    """True if the listener closed ``sock`` (end of file or a reset)."""
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def forget(sock: socket.socket) -> bool:
    trickling = selector.get_key(sock).data
    selector.unregister(sock)
    sent.pop(sock, None)
    sock.close()
    counts["closed_by_listener"] += 1
    return trickling


for n in range(idle + trickle):
    open_one(trickling=n >= idle)
print("ready", flush=True)
if ready_key:
    store.set(ready_key, "on")
selector.register(sys.stdin, selectors.EVENT_READ, None)
next_byte = time.monotonic()
wanted = {False: idle, True: trickle}
give_up = None
while True:
    for event, _ in selector.select(0.05):
        if event.fileobj is sys.stdin:
            if not sys.stdin.readline():  # the test is done: stop reopening, count what is left
                selector.unregister(sys.stdin)
                reopening, give_up = False, time.monotonic() + 30
                # An idle socket learns that its other end is gone only when it sends: one that
                # connected as the listener closed may never have been told (no RST came). Each
                # sends a byte now, which a closed end answers with a reset.
                for probed in [k.fileobj for k in selector.get_map().values() if k.data is not None]:
                    try:
                        probed.send(b"\0")
                    except BlockingIOError:
                        pass
                    except OSError:
                        forget(probed)
            continue
        if closed(event.fileobj):
            forget(event.fileobj)
    if reopening:
        have = {False: 0, True: 0}
        for key in selector.get_map().values():
            if key.data is not None:
                have[key.data] += 1
        for trickling, count in wanted.items():
            for _ in range(count - have[trickling]):
                if reopening:
                    open_one(trickling)
    if time.monotonic() >= next_byte:
        next_byte += 0.25
        for sock in list(sent):
            try:
                sock.send(HELLO[sent[sock] % len(HELLO):][:1])
                sent[sock] += 1
            except BlockingIOError:
                pass
            except OSError:
                forget(sock)
    open_now = sum(1 for key in selector.get_map().values() if key.data is not None)
    if give_up is not None and (open_now == 0 or time.monotonic() > give_up):
        print(json.dumps({**counts, "still_open": open_now}), flush=True)
        break
