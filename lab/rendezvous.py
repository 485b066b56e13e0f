"""Where ranks find each other: a ``torch.distributed.TCPStore``, never a home-made one.

Inside ``lab.spawn``/``lab.launch`` the parent hosts the store on loopback and passes its address
to every rank as ``LAB_STORE``; under ``torchrun`` (or any launcher that sets ``MASTER_ADDR`` and
``MASTER_PORT``) the launcher's store is used, or rank 0 hosts one on ``MASTER_ADDR`` when there
is no agent. A store holds only addresses and names: it has no authentication, so nothing secret
is ever put in it. The job's secret (what the tcp handshake proves) reaches the ranks another way:
from their launcher (``lab.spawn`` hands it over its private pipe), from ``LAB_TCP_SECRET``, or, on
one host, through a file only this user can read (:func:`job_secret`).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import secrets
import socket
import stat
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lab.errors import LabError

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


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher's variables, checked: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    and where torchrun sets them, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int
    group_rank: int


def _env_int(name: str, low: int, high: int | None, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None:
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set (torchrun sets RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT)")
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"environment variable {name} must be {bound}; got {value}")
    return value


def launch_env() -> LaunchEnv:
    """Read and check the launcher's variables (``ValueError`` naming the variable)."""
    world_size = _env_int("WORLD_SIZE", 1, None)
    rank = _env_int("RANK", 0, world_size - 1)
    port = _env_int("MASTER_PORT", 1, 65535)
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        raise ValueError("environment variable MASTER_ADDR is not set (torchrun sets RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT)")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1, world_size, default=world_size)
    local_rank = _env_int("LOCAL_RANK", 0, local_world_size - 1, default=rank % local_world_size)
    group_rank = _env_int("GROUP_RANK", 0, None, default=rank // local_world_size)
    return LaunchEnv(rank, world_size, addr, port, local_rank, local_world_size, group_rank)


@functools.cache
def env_store() -> dist.TCPStore:
    """The store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store, or hosted by rank 0 on
    ``MASTER_ADDR`` only)."""
    env = launch_env()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if env.rank == 0 and not agent:
        return serve_store(env.master_addr, env.master_port, env.world_size)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=STORE_TIMEOUT)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _private_directory() -> Path:
    """A directory only this user can enter, for the one-host secret file."""
    directory = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"lab-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LabError(f"{directory} is not a private directory of this user; set LAB_TCP_SECRET instead")
    return directory


def job_secret(store: dist.TCPStore, env: LaunchEnv, prefix: str) -> tuple[bytes, Path | None]:
    """The job's secret under a launcher: ``LAB_TCP_SECRET``, or on one host a random secret that
    rank 0 writes to a file only this user can read (the store carries only the file's name).

    Returns the secret and, on rank 0, the file to delete once every peer has proven it.
    Ranks on several hosts without ``LAB_TCP_SECRET`` are a ``LabError``: no secret may travel
    through an unauthenticated store.
    """
    given = os.environ.get("LAB_TCP_SECRET")
    if given:
        return given.encode(), None
    host = os.environ.get("LAB_TCP_HOST", "127.0.0.1")
    if env.local_world_size != env.world_size or not is_loopback(host):
        raise LabError("ranks on several hosts need a shared secret: set LAB_TCP_SECRET to the same random "
                       "string on every host (e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    directory = _private_directory()
    if env.rank == 0:
        secret, name = secrets.token_bytes(32), secrets.token_hex(16)
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(secret)
        store.set(f"{prefix}/secret-file", name)
        return secret, path
    name = store.get(f"{prefix}/secret-file").decode()
    if not re.fullmatch(r"[0-9a-f]{32}", name):
        raise LabError(f"the store holds no valid secret-file name under {prefix}/secret-file")
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise LabError(f"rank 0's secret file {directory / name} is not on this host: ranks on several hosts "
                       "need LAB_TCP_SECRET") from None
    with os.fdopen(fd, "rb") as file:
        if os.fstat(file.fileno()).st_uid != os.getuid():
            raise LabError(f"{directory / name} is not owned by this user")
        return file.read(), None
