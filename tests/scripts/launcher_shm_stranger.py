"""A stranger at a rank's shm hand-out socket (the abstract Unix socket local rank 0 of a
``transport="auto"`` job listens on): opens silent connections and reports when each is dropped.

    python launcher_shm_stranger.py NAME COUNT UID WAIT_S

NAME: the socket's abstract name without the leading NUL (as the store holds it); UID: the user
to become first (as root: another user, e.g. 65534 for nobody; or this user's own uid). Prints
``CONNECTED <json>`` once every connection was attempted (how many were accepted, the errors,
the monotonic time), then, after every connection was dropped or WAIT_S passed, ``DROPPED
<json>`` (seconds from each connection to its end-of-file, and how many are still open).
Standard library only: the user it becomes need not read the checkout's virtual environment.
"""

import errno
import json
import os
import selectors
import socket
import sys
import time

name, count, uid, wait_s = sys.argv[1].encode(), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if uid != os.getuid():
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
connected, errors, opened = [], [], {}
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)  # a full backlog answers EAGAIN at once instead of blocking here
    code = sock.connect_ex(b"\0" + name)
    if code:
        errors.append(errno.errorcode.get(code, str(code)))
        sock.close()
        continue
    connected.append(sock)
    opened[sock] = time.monotonic()
print("CONNECTED " + json.dumps({"connected": len(connected), "errors": errors, "at": time.monotonic()}),
      flush=True)

selector = selectors.DefaultSelector()
for sock in connected:
    selector.register(sock, selectors.EVENT_READ)
dropped, deadline = [], time.monotonic() + wait_s
while len(dropped) < len(connected) and time.monotonic() < deadline:
    for key, _ in selector.select(max(deadline - time.monotonic(), 0.001)):
        try:
            data = key.fileobj.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # dropped by the listener (anything it sent before closing is ignored)
            dropped.append(time.monotonic() - opened[key.fileobj])
            selector.unregister(key.fileobj)
print(
    "DROPPED " +
    json.dumps({"after_s": dropped, "open": len(connected) - len(dropped), "at": time.monotonic()}),
    flush=True)
