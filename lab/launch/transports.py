"""The transports a pool can run, one entry each: what the parent builds for every rank, and how
a rank turns that into its transport.

The option checks, the pool and the ranks read everything they need from the entry, so a new
transport is its module in ``lab/transport/`` plus one entry here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lab.hosts.rendezvous import pool_store
from lab.transport import mixed as mixed_transport
from lab.transport import queue as queue_transport
from lab.transport import shm as shm_transport
from lab.transport import shm_endpoints
from lab.transport import tcp as tcp_transport
from lab.transport.base import Transport

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext


class BufferSizes(Protocol):
    """The pool options endpoints are built from (:class:`lab.launch.options.BufferSizes` has them)."""

    segment_bytes: int
    slots: int
    eager_bytes: int


@dataclass(frozen=True)
class PoolTransport:
    """One transport as the pool sees it."""

    #: The most ranks a pool of it may hold.
    max_world_size: int
    #: How many descriptors the parent holds for a mesh of N ranks, beyond the pool's own 3 per rank.
    descriptors: Callable[[int], int]
    #: In the parent: every rank's endpoints, in rank order, pickled into its process at start
    #: (``close_in_parent()`` drops the parent's copies).
    endpoints: Callable[[BaseContext, int, BufferSizes], list[Any]]
    #: In a rank: its transport, from its endpoints and the address it listens on.
    connect: Callable[[Any, str], Transport]
    #: It may span emulated hosts (any other would bypass their links).
    crosses_hosts: bool = False
    #: The most ranks on one host, and why, if it has such a limit.
    max_ranks_per_host: int | None = None
    per_host_reason: str = ""


def _shm_endpoints(context: BaseContext, world_size: int, options: BufferSizes) -> list[Any]:
    return shm_endpoints.create_endpoints(world_size, options.segment_bytes, options.slots,
                                          options.eager_bytes)


def _queue_endpoints(context: BaseContext, world_size: int, options: BufferSizes) -> list[Any]:
    return queue_transport.create_endpoints(context, world_size)


def _tcp_endpoints(context: BaseContext, world_size: int, options: BufferSizes) -> list[Any]:
    secret = secrets.token_bytes(32)  # handed to the ranks over their private pipes only
    return [tcp_transport.TcpEndpoints(rank, world_size, secret) for rank in range(world_size)]


def _mixed_endpoints(context: BaseContext, world_size: int, options: BufferSizes) -> list[Any]:
    """One shm mesh per host (its ranks by local rank), one secret for TCP."""
    per_host, secret = world_size // (options.hosts or 1), secrets.token_bytes(32)
    endpoints: list[mixed_transport.MixedEndpoints] = []
    try:
        for host in range(options.hosts or 1):
            local = shm_endpoints.create_endpoints(per_host, options.segment_bytes, options.slots,
                                                   options.eager_bytes)
            endpoints += [
                mixed_transport.MixedEndpoints(host * per_host + ep.rank, world_size, secret, ep)
                for ep in local]
    except BaseException:
        for ep in endpoints:
            ep.close_in_parent()
        raise
    return endpoints


def _tcp_connect(endpoints: Any, address: str) -> Transport:
    """Meet the other ranks through the pool's store (``LAB_STORE``) and connect to each."""
    return tcp_transport.TcpTransport(endpoints.rank, endpoints.world_size, pool_store(), endpoints.secret,
                                      host=address)


def _mixed_connect(endpoints: mixed_transport.MixedEndpoints, address: str) -> Transport:
    """Shared memory to the ranks of this host, TCP to the others (if there are other hosts)."""
    local = shm_transport.ShmTransport(endpoints.shm)
    remote = _tcp_connect(endpoints, address) if endpoints.shm.world_size < endpoints.world_size else None
    first_local = endpoints.rank - endpoints.shm.rank  # this host's ranks are consecutive
    return mixed_transport.MixedTransport(endpoints.rank, endpoints.world_size, first_local, local, remote)


def _no_descriptors(world_size: int) -> int:
    return 0


#: A rank's channel descriptors travel to it in one ``SCM_RIGHTS`` message, which Linux caps at
#: 253: shm passes 3N-1 of them (pipes, segments and the mailboxes), queue 5N-4 (queue pipes and "alive" pipes),
#: plus multiprocessing's own few.
_SHM_MAX_RANKS = 82

POOL_TRANSPORTS: dict[str, PoolTransport] = {
    "shm": PoolTransport(max_world_size=_SHM_MAX_RANKS, descriptors=lambda n: 2 * n * (n - 1),
                         endpoints=_shm_endpoints,
                         connect=lambda endpoints, address: shm_transport.ShmTransport(endpoints)),
    "queue": PoolTransport(max_world_size=50, descriptors=lambda n: 4 * n * (n - 1),
                           endpoints=_queue_endpoints,
                           connect=lambda endpoints, address: queue_transport.QueueTransport(endpoints)),
    "tcp": PoolTransport(max_world_size=1024, descriptors=_no_descriptors, endpoints=_tcp_endpoints,
                         connect=_tcp_connect, crosses_hosts=True),
    # shared memory inside a host, TCP between hosts
    "auto": PoolTransport(max_world_size=1024, descriptors=_no_descriptors, endpoints=_mixed_endpoints,
                          connect=_mixed_connect, crosses_hosts=True, max_ranks_per_host=_SHM_MAX_RANKS,
                          per_host_reason="a shm mesh per host")}
#: The transports a pool can run, by name.
TRANSPORTS = tuple(POOL_TRANSPORTS)
