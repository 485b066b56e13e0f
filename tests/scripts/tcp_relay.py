"""An attacker in the middle of a lab tcp connection, in a process of its own: it listens, relays
a real handshake to the real rank unchanged (it cannot forge one), then tampers with the frames
the connecting rank sends. Prints its port, then relays until killed or done.

    python tcp_relay.py MODE REAL_HOST REAL_PORT [LENGTH [CAP]]

MODE, all after the handshake:

- ``flip``: flip one bit of the first frame's payload.
- ``inject``: insert a frame of its own (the receiver's tag, 4096 bytes) before the first one.
- ``forge-tag``: insert a frame claiming the receiver's context but another collective.
- ``forge-other``: send a header claiming another context and LENGTH payload bytes, then stream
  junk (up to CAP bytes, 64 MiB by default) for as long as the receiver takes it; prints
  ``{"accepted": N}`` (the bytes the receiver's socket took) when the receiver closes or CAP is sent.
- ``replay``: forward the first frame twice.
- ``reorder``: forward the second frame before the first.

It knows the wire layout (the attacker can read it: frames are not encrypted), not the keys.
"""

import json
import selectors
import socket
import struct
import sys

HANDSHAKE = 44 + 32  # hello + proof, each way
HEAD = 48 + 32  # header, then its MAC
TRAILER = 32  # the frame's MAC
TAG = b"fingerprint".ljust(32, b"\0")  # the tests' tag: context b"fing"

mode, real_host, real_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
length = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
cap = int(sys.argv[5]) if len(sys.argv) > 5 else 64 << 20


def header(tag: bytes, nbytes: int) -> bytes:
    """A header in the lab's layout (magic, version, kind, tag, length) with a junk MAC."""
    return struct.pack("<4sBBxx", b"LABT", 3, 1) + tag + struct.pack("<Q", nbytes) + b"\0" * 32


def frames(buffer: bytearray) -> list[bytes]:
    """Cut the whole frames off the front of ``buffer``."""
    whole = []
    while len(buffer) >= HEAD:
        size = HEAD + struct.unpack_from("<Q", buffer, 40)[0] + TRAILER
        if len(buffer) < size:
            break
        whole.append(bytes(buffer[:size]))
        del buffer[:size]
    return whole


def flood(upstream: socket.socket) -> None:
    """The forged header, then junk as fast as the receiver takes it."""
    upstream.sendall(header(b"othr" + TAG[4:], length))
    junk, accepted = b"\0" * (1 << 20), 0
    upstream.settimeout(10)
    try:
        while accepted < cap:
            accepted += upstream.send(junk[:cap - accepted])
    except OSError:
        pass
    print(json.dumps({"accepted": accepted}), flush=True)
    sys.exit(0)


listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
victim, _ = listener.accept()
upstream = socket.create_connection((real_host, real_port))
selector = selectors.DefaultSelector()
selector.register(victim, selectors.EVENT_READ, upstream)
selector.register(upstream, selectors.EVENT_READ, victim)
handshake, answered, pending, seen, held = 0, 0, bytearray(), 0, None
while True:
    for key, _ in selector.select():
        data = key.fileobj.recv(1 << 16)
        if not data:
            sys.exit(0)
        if key.fileobj is upstream:
            victim.sendall(data)
            answered += len(data)
            if mode == "forge-other" and answered >= HANDSHAKE and handshake == HANDSHAKE:
                flood(upstream)  # both sides hold their proofs: the connection is up
            continue
        take = min(HANDSHAKE - handshake, len(data))  # the handshake passes untouched
        if take:
            upstream.sendall(data[:take])
            handshake += take
            data = data[take:]
            if handshake == HANDSHAKE:
                if mode == "forge-other" and answered >= HANDSHAKE:
                    flood(upstream)
                if mode == "inject":
                    upstream.sendall(header(TAG, 4096) + b"\0" * (4096 + TRAILER))
                if mode == "forge-tag":
                    upstream.sendall(
                        header(TAG[:4] + b"other collective".ljust(28, b"\0"), 4096) + b"\0" *
                        (4096 + TRAILER))
        pending += data
        for frame in frames(pending):
            seen += 1
            if mode == "flip" and seen == 1:
                frame = bytearray(frame)
                frame[HEAD + 5] ^= 0x01
                frame = bytes(frame)
            if mode == "replay" and seen == 1:
                upstream.sendall(frame)
            if mode == "reorder" and seen == 1:
                held = frame
                continue
            upstream.sendall(frame)
            if held is not None and seen == 2:
                upstream.sendall(held)
