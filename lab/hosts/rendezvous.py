"""Where ranks find each other: a ``torch.distributed.TCPStore``, never a home-made one.

Inside ``lab.spawn``/``lab.launch`` the parent hosts the store on loopback and passes its address
to every rank as ``LAB_STORE``. Under a launcher (torchrun, mpiexec, srun: :mod:`lab.hosts.launchers`),
torchrun's agent store is used, or rank 0 hosts one on ``MASTER_ADDR:MASTER_PORT`` (as set, or
the launcher's defaults) when there is no agent. A store holds only addresses and names: it has
no authentication, so nothing secret is ever put in it (the job's secret reaches the ranks another
way: :mod:`lab.hosts.job_secret`). Under a launcher the ranks also agree here on which host each rank
is on (:func:`agree_hosts`, :func:`learn_host_index`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import ipaddress
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from lab.errors import DeadlineError, LabError
from lab.hosts.launchers import LaunchEnv, launch_env

STORE_TIMEOUT = timedelta(seconds=120)


def serve_store(host: str = "127.0.0.1", port: int = 0, world_size: int | None = None,
                timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """Host a store that listens on ``host`` only (TCPStore alone binds every interface)."""
    listener = socket.create_server((host, port))
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


@functools.cache
def pool_store() -> dist.TCPStore:
    """This rank's client of its pool's store (one per process: ranks on emulated hosts keep
    the connection they made before entering their namespace)."""
    host, port = os.environ["LAB_STORE"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)


@functools.cache
def env_store() -> dist.TCPStore:
    """The store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store, or hosted by rank 0 on
    ``MASTER_ADDR`` only)."""
    env = launch_env()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if env.rank == 0 and not agent:
        try:
            return serve_store(env.master_addr, env.master_port, env.world_size)
        except OSError as exc:
            raise LabError(
                f"rank 0 cannot host the store on {env.master_addr}:{env.master_port} "
                f"({exc.strerror or exc}): set MASTER_PORT to a free port of rank 0's host, the same on "
                f"every rank (launcher: {env.launcher})") from exc
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                         timeout=STORE_TIMEOUT)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def agree_hosts(store: dist.TCPStore, env: LaunchEnv, prefix: str) -> list[int]:
    """Every rank's host (its ``GROUP_RANK``), the same list on every rank: each rank publishes
    its (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and reads everyone's.

    Nodes may legitimately hold different numbers of ranks (torchrun with another
    ``--nproc-per-node`` per node), so no rank can derive the map from its own
    ``LOCAL_WORLD_SIZE``. Reports that contradict each other are a ``LabError`` naming the ranks,
    here at start-up, instead of a collective that waits for a peer that is not there.
    """
    values = _exchange(store, env, f"{prefix}/place",
                       f"{env.group_rank},{env.local_rank},{env.local_world_size}")
    places = []
    for rank, value in enumerate(values):
        try:
            group, local, size = (int(part) for part in value.decode().split(","))
        except ValueError:
            raise LabError(f"the store holds a malformed report for rank {rank}: {value[:40]!r}") from None
        places.append((group, local, size))
    problems = placement_problems(places)
    if problems:
        _read_by_all(store, env, f"{prefix}/place-read")
        raise LabError(f"rank {env.rank}: the ranks disagree about where they run (GROUP_RANK, LOCAL_RANK, "
                       f"LOCAL_WORLD_SIZE, as their launchers set them): {'; '.join(problems)}")
    return [group for group, _, _ in places]


def place_by_host_name(store: dist.Store, rank: int, world_size: int, prefix: str) -> LaunchEnv:
    """This rank of a world no launcher described (the torch backend's, from ``tcp://``,
    ``file://`` or ``store=``): ranks with the same host name share a host, numbered in the order
    of their first rank, and each host's ranks number themselves in rank order.

        env = place_by_host_name(store, 2, 4, "lab/tcp")   # 4 ranks on one host: local rank 2 of 4
    """
    unplaced = LaunchEnv(rank, world_size, "", 0, 0, world_size, None, launcher="store")
    names = [
        value.decode() for value in _exchange(store, unplaced, f"{prefix}/hostname", socket.gethostname())]
    same = [r for r, name in enumerate(names) if name == names[rank]]
    return dataclasses.replace(unplaced, local_rank=same.index(rank), local_world_size=len(same),
                               group_rank=list(dict.fromkeys(names)).index(names[rank]))


def learn_host_index(store: dist.TCPStore, env: LaunchEnv, prefix: str) -> LaunchEnv:
    """``env`` with ``group_rank`` set, for launchers that do not number hosts (``mpiexec`` on
    several hosts): every rank publishes its host name, and hosts are numbered in the order of
    their first rank, so block placement gives ranks numbered node by node, as torchrun does.

        env = launch_env()                       # mpiexec -hosts a,b -n 8: group_rank is None
        env = learn_host_index(store, env, "lab/tcp")    # group_rank 0 on a, 1 on b
    """
    names = [value.decode() for value in _exchange(store, env, f"{prefix}/hostname", socket.gethostname())]
    order = list(dict.fromkeys(names))
    return dataclasses.replace(env, group_rank=order.index(names[env.rank]))


def _read_by_all(store: dist.TCPStore, env: LaunchEnv, key: str, limit_s: float = 10.0) -> None:
    """Before every rank fails on what it read from the store: rank 0, which may host the store
    (it ends with rank 0's process), waits until each rank has read (``limit_s`` at most), so each
    fails naming the problem, not with the store's broken pipe."""
    key = f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    done, deadline = store.add(key, 1), time.monotonic() + limit_s
    while env.rank == 0 and done < env.world_size and time.monotonic() < deadline:
        time.sleep(0.01)
        done = store.add(key, 0)


def _exchange(store: dist.TCPStore, env: LaunchEnv, key: str, value: str) -> list[bytes]:
    """Publish this rank's ``value`` under ``key`` and read every rank's, in rank order
    (``DeadlineError`` naming the ranks that never published within the store's timeout)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job must not read old reports
    keys = [f"{key}/{attempt}/{r}" for r in range(env.world_size)]
    store.set(keys[env.rank], value)
    try:
        return store.multi_get(keys)
    except RuntimeError:  # the store's timeout (DistStoreError): name who never reported
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise DeadlineError(
            f"rank {env.rank}: ranks {missing} did not report where they run within "
            f"{store.timeout.total_seconds():g} s", peers=missing) from None


def placement_problems(places: list[tuple[int, int, int]]) -> list[str]:
    """What is inconsistent in every rank's (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``):
    a host's ranks must number themselves ``0..L-1`` and all say ``L``, the number they are."""
    hosts: dict[int, list[int]] = collections.defaultdict(list)
    for rank, (group, _, _) in enumerate(places):
        hosts[group].append(rank)
    problems = []
    for group, ranks in sorted(hosts.items()):
        sizes = collections.defaultdict(list)
        for rank in ranks:
            sizes[places[rank][2]].append(rank)
        for size, claimants in sorted(sizes.items()):
            if size != len(ranks):
                says = "says" if len(claimants) == 1 else "say"
                problems.append(
                    f"{_ranks(claimants)} on host {group} (GROUP_RANK={group}) {says} LOCAL_WORLD_SIZE="
                    f"{size}, but host {group} has {len(ranks)} ({_ranks(ranks)})")
        locals_ = collections.defaultdict(list)
        for rank in ranks:
            locals_[places[rank][1]].append(rank)
        for local, claimants in sorted(locals_.items()):
            if len(claimants) > 1:
                problems.append(f"{_ranks(claimants)} on host {group} all say LOCAL_RANK={local}")
    return problems


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def host_block(hosts: list[int], env: LaunchEnv) -> int:
    """The first rank of this rank's host, for ``transport="auto"``, which needs each host's
    ranks numbered one after the other (torchrun does: ``ValueError`` otherwise)."""
    first = hosts.index(env.group_rank)
    size = hosts.count(env.group_rank)
    if hosts[first:first + size] != [env.group_rank] * size or env.rank != first + env.local_rank:
        raise ValueError(
            f"transport='auto' needs ranks numbered node by node (each node's ranks consecutive, "
            f"RANK = first rank of the node + LOCAL_RANK, as torchrun does); got RANK={env.rank}, "
            f"GROUP_RANK={env.group_rank}, LOCAL_RANK={env.local_rank}, and node {env.group_rank} "
            f"holds ranks {[r for r, h in enumerate(hosts) if h == env.group_rank]}")
    return first
