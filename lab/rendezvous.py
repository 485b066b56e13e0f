"""Where ranks find each other: a ``torch.distributed.TCPStore``, never a home-made one.

Inside ``lab.spawn``/``lab.launch`` the parent hosts the store and passes its address to every
rank as ``LAB_STORE``; under ``torchrun`` (or any launcher that sets ``MASTER_ADDR`` and
``MASTER_PORT``) the launcher's store is used, or rank 0 hosts one when there is no agent.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch.distributed as dist

STORE_TIMEOUT = timedelta(seconds=120)


@functools.cache
def pool_store() -> dist.TCPStore:
    """This rank's client of its pool's store (one per process)."""
    host, port = os.environ["LAB_STORE"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)


@functools.cache
def env_store() -> dist.TCPStore:
    """The store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store, or hosted by rank 0)."""
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as missing:
        raise ValueError(f"environment variable {missing} is not set (torchrun sets RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT)") from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent, timeout=STORE_TIMEOUT)
