"""A rank's transport under a launcher (torchrun, mpiexec, srun, or anything that sets torchrun's
variables: :mod:`lab.hosts.launchers`).

:func:`connect_from_env` reads and checks the variables, agrees with every rank on the host of
each rank through the launcher's store, proves the job's secret and opens the transport:
``"tcp"`` (sockets to every rank) or ``"auto"`` (shared memory inside a host, handed out by its
local rank 0, and sockets between hosts). :meth:`lab.Mesh.from_env` wraps it in a mesh.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

from lab.hosts.job_secret import check_secret_source, job_secret
from lab.hosts.launchers import LaunchEnv, launch_env
from lab.hosts.rendezvous import agree_hosts, env_store, host_block, learn_host_index, place_by_host_name
from lab.transport.base import Transport
from lab.transport.tcp import TcpTransport

#: The prefix of every key the lab writes into the launcher's store.
STORE_PREFIX = "lab/tcp"


def connect_from_env(transport: str) -> tuple[Transport, tuple[int, int, int], list[int]]:
    """(the transport, this rank's (host, local rank, local world size), every rank's host)."""
    env = launch_env()
    check_transport(transport)
    check_secret_source(env)  # before waiting for anyone
    return connect(env_store(), env, transport)


def connect_with_store(store: dist.Store, rank: int, world_size: int,
                       transport: str) -> tuple[Transport, tuple[int, int, int], list[int]]:
    """:func:`connect_from_env` through a store someone else made (torch's, in the backend): where
    a launcher's variables describe this very world they say where each rank runs; otherwise the
    ranks agree on it by host name through the store."""
    check_transport(transport)
    env = _launched_as(rank, world_size) or place_by_host_name(store, rank, world_size, STORE_PREFIX)
    check_secret_source(env)
    return connect(store, env, transport)


def _launched_as(rank: int, world_size: int) -> LaunchEnv | None:
    """The launcher's description of this rank, if there is one and it is of this world."""
    try:
        env = launch_env()
    except ValueError:
        return None
    return env if (env.rank, env.world_size) == (rank, world_size) else None


def check_transport(transport: str) -> None:
    if transport not in LAUNCHER_TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, LAUNCHER_TRANSPORTS))} under a "
                         f"launcher; got {transport!r}")


def connect(store: dist.Store, env: LaunchEnv,
            transport: str) -> tuple[Transport, tuple[int, int, int], list[int]]:
    """Agree on every rank's host, prove the job's secret and open ``transport`` through ``store``."""
    if env.group_rank is None:  # mpiexec on several hosts: learn the host index from the host names
        env = learn_host_index(store, env, STORE_PREFIX)
    hosts = agree_hosts(store, env, STORE_PREFIX)  # every rank's host, the same on every rank
    secret, secret_file = job_secret(store, env, STORE_PREFIX)
    address = os.environ.get("LAB_TCP_HOST", "127.0.0.1")
    try:
        wire = LAUNCHER_TRANSPORTS[transport](env, store, secret, address, hosts)
    finally:
        if secret_file is not None:  # rank 0 accepted every peer: each has read it, or failed
            secret_file.remove()
    return wire, (env.group_rank, env.local_rank, env.local_world_size), hosts


def _tcp(env, store, secret: bytes, address: str, hosts: list[int]) -> Transport:
    """Sockets to every rank."""
    return TcpTransport(env.rank, env.world_size, store, secret, host=address)


def _mixed(env, store, secret: bytes, address: str, hosts: list[int]) -> Transport:
    """Shared memory with this host's ranks (handed out by local rank 0), TCP to the others. On
    one host that is the shm transport itself, mailboxes included: small collectives then take the
    compiled plane (:mod:`lab.compiled.plane`) as they do under ``lab.launch``."""
    from lab.transport.hand_out import share_host_endpoints
    from lab.transport.mixed import MixedTransport

    first_local = host_block(hosts, env)
    local = share_host_endpoints(store, STORE_PREFIX, env.group_rank, env.local_rank, env.local_world_size,
                                 secret)
    if env.world_size == env.local_world_size:
        return local
    try:
        remote = TcpTransport(env.rank, env.world_size, store, secret, host=address)
    except BaseException:
        local.close()
        raise
    return MixedTransport(env.rank, env.world_size, first_local, local, remote)


#: What a rank under a launcher can open, by name: ``opener(env, store, secret, address, hosts)``.
LAUNCHER_TRANSPORTS: dict[str, Callable[..., Transport]] = {"tcp": _tcp, "auto": _mixed}
