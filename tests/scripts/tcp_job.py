"""A small real job under a launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
``Mesh.from_env()`` over tcp, every result checked against values computed here. With
``TCP_JOB_HOLD=KEY``, ranks other than 0 wait for KEY in the store before they connect to a peer
(a test's hook: an attacker sets it once its storm is on, so the real ranks arrive in the middle). Rank 0 also
checks, once the mesh is up, that of the connections to its listener only the real peers' remain
(no stranger's, no listening socket). Prints one ``OK rank R`` line per rank.
"""

import os
import sys

import psutil
import torch

import lab
from lab.hosts.rendezvous import env_store
from lab.transport import handshake

if os.environ.get("TCP_JOB_HOLD") and os.environ["RANK"] != "0":
    connect_to = handshake._connect_to

    def held(*args):
        env_store().wait([os.environ["TCP_JOB_HOLD"]])
        return connect_to(*args)

    handshake._connect_to = held

mesh = lab.Mesh.from_env(recv_timeout_ms=60_000)
n, rank = mesh.world_size, mesh.rank
if rank == 0:  # at once: the peers wait in the first collective, so their sockets are still up
    port = int(env_store().get("lab/tcp/addr/0").decode().rsplit(":", 1)[1])
    mine = [c for c in psutil.Process().net_connections(kind="tcp") if c.laddr.port == port]
    states = sorted(c.status for c in mine)
    if states != ["ESTABLISHED"] * (n - 1):
        sys.exit(f"rank 0: its listener's port {port} still has {states} (want {n - 1} real peers only)")
base = torch.arange(1000, dtype=torch.float64)
x = base + 1000 * rank
checks = {
    "allreduce ring": (lab.allreduce(mesh, x.clone(), algorithm="ring"), n * base + 1000 * n * (n - 1) // 2),
    "allreduce tree": (lab.allreduce(mesh, x.clone(), algorithm="tree"), n * base + 1000 * n * (n - 1) // 2),
    "broadcast": (lab.broadcast(mesh, x.clone(), src=n - 1), base + 1000 * (n - 1)),
    "allgather": (lab.allgather(mesh, x), torch.cat([base + 1000 * r for r in range(n)]))}
wrong = [name for name, (got, want) in checks.items() if not torch.equal(got, want)]
if wrong:
    sys.exit(f"rank {rank}: wrong results: {wrong}")
os.write(1, f"OK rank {rank}\n".encode())  # one write: the ranks share stdout
mesh.close()
