"""Two emulated hosts, one TCP transfer from host 0 to host 1; stdlib only (no lab, no torch),
so it runs under any Python and any user: ``python host_link.py NBYTES GBIT USERNS``.

Loads ``lab/hosts/emulated.py`` by path, builds ``Hosts(2, GBIT)`` (``USERNS``: ``1``, ``0`` or ``auto``),
and prints one JSON line: the transfer's seconds, the user namespace used, the holders' pids.
"""

import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location("lab_hosts",
                                              Path(__file__).parents[2] / "lab" / "hosts" / "emulated.py")
hosts_module = importlib.util.module_from_spec(spec)
sys.modules["lab_hosts"] = hosts_module
spec.loader.exec_module(hosts_module)

nbytes, gbit = int(sys.argv[1]), float(sys.argv[2]) or None
user_namespace = {"1": True, "0": False, "auto": None}[sys.argv[3]]
PORT = 5001

with hosts_module.Hosts(2, gbit, user_namespace=user_namespace) as hosts:
    sender, receiver = hosts[0], hosts[1]
    ready_r, ready_w = os.pipe()
    result_r, result_w = os.pipe()
    server = os.fork()
    if server == 0:  # host 1: receive everything, then answer one byte
        receiver.enter()
        listener = socket.create_server((receiver.address, PORT))
        os.write(ready_w, b"x")
        conn, _ = listener.accept()
        buffer, got = bytearray(1 << 20), 0
        while got < nbytes:
            got += conn.recv_into(buffer) or nbytes
        conn.sendall(b"k")
        os._exit(0)
    os.read(ready_r, 1)
    client = os.fork()
    if client == 0:  # host 0: send, wait for the answer: the whole transfer crossed the links
        sender.enter()
        conn = socket.create_connection((receiver.address, PORT))
        started = time.perf_counter()
        conn.sendall(bytes(nbytes))
        conn.recv(1)
        os.write(result_w, repr(time.perf_counter() - started).encode())
        os._exit(0)
    os.waitpid(client, 0)
    os.waitpid(server, 0)
    print(json.dumps({"seconds": float(os.read(result_r, 100)), "userns": sender.userns, "pids": hosts.pids}))
