"""A pool's options, declared once and checked once, before anything starts.

``lab.spawn``, ``lab.launch`` and :class:`lab.Cluster` all take them as keywords; each bad value
is a ``ValueError``/``TypeError`` naming it. What depends on the transport (its largest pool,
its descriptors, whether it crosses hosts) comes from its entry in :mod:`lab.launch.transports`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import resource
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from lab import checks
from lab.hosts.emulated import check_link_gbit
from lab.launch.transports import POOL_TRANSPORTS, TRANSPORTS, PoolTransport
from lab.transport import shm_endpoints

#: The most shared memory a shm pool may map in all, as a fraction of the machine's memory.
MAX_SHM_FRACTION = 0.5

Function = TypeVar("Function", bound=Callable[..., Any])


@dataclass(frozen=True)
class PoolOptions:
    """How a pool's ranks talk; see :func:`lab.launch.launch` for each option."""

    transport: str = "shm"
    recv_timeout_ms: float | None = None
    trace: str | None = None
    segment_bytes: int = shm_endpoints.DEFAULT_SEGMENT_BYTES
    slots: int = shm_endpoints.DEFAULT_SLOTS
    eager_bytes: int = shm_endpoints.DEFAULT_EAGER_BYTES
    hosts: int | None = None
    link_gbit: float | None = None
    workload: str | None = None
    env: Mapping[str, str] | None = None

    @property
    def wire(self) -> PoolTransport:
        """The transport's entry (once :meth:`checked`)."""
        return POOL_TRANSPORTS[self.transport]

    def checked(self, world_size: Any) -> PoolOptions:
        """Refuse a bad ``world_size`` or option, and raise the open-file limit if the pool needs it.
        Returns these options with numpy integers made Python ints (for the ranks and lab.hosts.emulated)."""
        checks.positive_int(world_size, "world_size")
        transport = self.transport
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; "
                             f"got {transport!r}")
        if world_size > self.wire.max_world_size:
            raise ValueError(f"world_size must be at most {self.wire.max_world_size} with "
                             f"transport={transport!r} (see docs/failures.md, 'Limits'); got {world_size}")
        checks.timeout_ms(self.recv_timeout_ms, "recv_timeout_ms")
        checks.trace_path(self.trace)
        checks.trace_path(os.environ.get("LAB_TRACE"), "LAB_TRACE")
        checks.env_flag("LAB_TRACE_STEPS")
        workload = checks.workload_path(self.workload)  # (or LAB_WORKLOAD's)
        check_env(self.env)
        self._check_buffers(world_size)
        _ensure_descriptors(3 * world_size + self.wire.descriptors(world_size))
        self._check_hosts(world_size)
        hosts = None if self.hosts is None else int(self.hosts)
        return replace(self, segment_bytes=int(self.segment_bytes), slots=int(self.slots),
                       eager_bytes=int(self.eager_bytes), hosts=hosts, workload=workload and
                       os.path.abspath(workload))

    def _check_buffers(self, world_size: int) -> None:
        """The shm buffers: ``slots`` of ``segment_bytes`` per directed edge, messages of at most
        ``eager_bytes`` inline; a shm pool may not map more than half the machine's memory."""
        slots, segment_bytes, eager_bytes = self.slots, self.segment_bytes, self.eager_bytes
        checks.positive_int(slots, "slots")
        if not checks.is_int(segment_bytes) or segment_bytes < 64 or segment_bytes % 64:
            raise ValueError(f"segment_bytes must be a positive int multiple of 64; got {segment_bytes!r}")
        if not checks.is_int(eager_bytes) or not 0 <= eager_bytes <= shm_endpoints.MAX_EAGER_BYTES:
            raise ValueError(f"eager_bytes must be an int in [0, {shm_endpoints.MAX_EAGER_BYTES}]; "
                             f"got {eager_bytes!r}")
        if self.transport != "shm":
            return
        total = world_size * (world_size - 1) * slots * segment_bytes
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > MAX_SHM_FRACTION * memory:
            raise ValueError(f"slots x segment_bytes is too large: {world_size} ranks would map "
                             f"{total / 2**30:.1f} GiB of shared memory (N(N-1) x slots x segment_bytes), "
                             f"more than half of this machine's {memory / 2**30:.0f} GiB; "
                             f"got slots={slots}, segment_bytes={segment_bytes}")

    def _check_hosts(self, world_size: int) -> None:
        """``hosts`` divides the ranks evenly, ``link_gbit`` comes with it, and the transport can
        run on that many hosts with that many ranks each."""
        transport, hosts, wire = self.transport, self.hosts, self.wire
        if hosts is None:
            if self.link_gbit is not None:
                raise ValueError(f"link_gbit caps the links of emulated hosts: give hosts= too; "
                                 f"got link_gbit={self.link_gbit!r}")
            if wire.max_ranks_per_host is not None and world_size > wire.max_ranks_per_host:
                raise ValueError(f"world_size must be at most {wire.max_ranks_per_host} with "
                                 f"transport={transport!r} on one host ({wire.per_host_reason}); "
                                 f"got {world_size}")
            return
        if not checks.is_int(hosts) or not 1 <= hosts <= world_size or world_size % hosts:
            raise ValueError(f"hosts must be an int that divides world_size ({world_size}); got {hosts!r}")
        check_link_gbit(self.link_gbit)  # the range tbf can cap at (lab.hosts.emulated.LINK_GBIT)
        if hosts > 1 and not wire.crosses_hosts:
            crossing = " or ".join(
                repr(name) for name, entry in POOL_TRANSPORTS.items() if entry.crosses_hosts)
            raise ValueError(f"transport must be {crossing} with hosts > 1 "
                             f"({transport!r} would bypass the links)")
        if wire.max_ranks_per_host is not None and world_size // hosts > wire.max_ranks_per_host:
            raise ValueError(f"world_size must be at most {wire.max_ranks_per_host} per host with "
                             f"transport={transport!r} ({wire.per_host_reason}); "
                             f"got {world_size // hosts} per host")


def _ensure_descriptors(needed: int) -> None:
    """Raise the soft limit on open files to the hard one if the pool needs it, or refuse."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    if in_use + needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or in_use + needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return
    raise ValueError(f"world_size is too large for this process's open-file limit: the pool needs "
                     f"{needed} descriptors, {in_use} are open, and the hard limit is {hard} "
                     "(raise it with ulimit -n)")


def takes_pool_options(function: Function) -> Function:
    """Show :class:`PoolOptions`' fields as ``function``'s keyword-only parameters in place of its
    ``**options`` (``help()``, ``inspect.signature``), so the options are declared once, above."""
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(PoolOptions)]
    function.__signature__ = signature.replace(parameters=own + options)  # type: ignore[attr-defined]
    return function


def check_env(env: Mapping[str, str] | None) -> None:
    """``env``, a pool's environment variables: names as the shell takes them, values strings."""
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise TypeError(f"env must be a mapping of variable names to strings; got {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"env: {name!r} is not an environment variable's name")
        if not isinstance(value, str):
            raise TypeError(f"env[{name!r}] must be a str; got {type(value).__name__}")


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """This process's environment with ``variables`` set, restored after: a pool launched inside
    runs with them (rank processes take the caller's environment)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
