"""An attacker in the middle of a lab tcp connection: listens, relays to the real rank, and
after the handshake alters or injects data. Prints its port, then relays until killed.

    python tcp_attacker.py flip|inject REAL_HOST REAL_PORT
"""

import selectors
import socket
import struct
import sys

HANDSHAKE = 44 + 32  # hello + proof, each way
HEADER = 48

mode, real_host, real_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
victim, _ = listener.accept()
upstream = socket.create_connection((real_host, real_port))
selector = selectors.DefaultSelector()
selector.register(victim, selectors.EVENT_READ, upstream)
selector.register(upstream, selectors.EVENT_READ, victim)
forwarded = 0  # bytes from the victim (the sender) to the real rank
while True:
    for key, _ in selector.select():
        data = key.fileobj.recv(1 << 16)
        if not data:
            sys.exit(0)
        if key.fileobj is victim:
            data = bytearray(data)
            start = forwarded
            forwarded += len(data)
            if mode == "flip" and start <= HANDSHAKE + HEADER + 5 < forwarded:
                data[HANDSHAKE + HEADER + 5 - start] ^= 0x01  # one bit of the first payload
            if mode == "inject" and start <= HANDSHAKE < forwarded:
                cut = HANDSHAKE - start  # after the handshake: a frame of our own, then the real one
                tag = b"fingerprint".ljust(32, b"\0")
                forged = struct.pack("<4sBBxx", b"LABT", 2, 1) + tag + struct.pack("<Q", 4096)
                data[cut:cut] = forged + b"\0" * 4096 + b"\0" * 32
            data = bytes(data)
        key.data.sendall(data)
