"""The cluster the simulator times messages on: α per message, β per byte, a host's ranks on a
switch or a bus inside it, its NICs (each a link each way) and the switch tier above the hosts,
and the CPU work around each message (LogGP's overhead o, per-byte copies and reductions) on the
cores a host's ranks share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import checks
from lab.command_line import checked, number

#: The accepted ranges, wide enough for any real network and narrow enough that every simulated
#: time is finite: a message of 2**40 bytes at the slowest rate is 8.8e15 µs, and no path of
#: fewer than 2**63 of them reaches float64's 1.8e308. (Before: gbit=1e-320 made β infinite.)
ALPHA_US = (0.0, 1e9)  # up to 1,000 s per message
GBIT = (1e-6, 1e9)  # 1 kbit/s to 1 Ebit/s
GAMMA_US_PER_BYTE = (0.0, 1e6)
#: The most ranks per host (as many as the simulator takes ranks at all), the most cores, the largest cache.
MAX_RANKS_PER_HOST = 1 << 24
MAX_CORES = 1 << 24
MAX_CACHE_BYTES = 1 << 50
#: How a host's ranks reach each other: every pair at once (NVSwitch-like), or one message at a time.
INTRA_FABRICS = ("switch", "bus")
#: The switch tier's oversubscription: 1 (full bisection) to a tier a million times thinner.
OVERSUBSCRIPTION = (1.0, 1e6)
#: Where Linux describes the first CPU's caches (index0..N: level, size).
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes() -> int | None:
    """This machine's last-level cache (the highest level sysfs lists), in bytes; None if unknown.

        last_level_cache_bytes()      # 33554432 on a machine with a 32 MiB L3
    """
    sizes = {}
    for index in sorted(_CACHES.glob("index*")):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        digits, unit = size.rstrip("KMG"), size[len(size.rstrip("KMG")):]
        if digits.isdigit():
            sizes[level] = int(digits) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(unit, 1)
    return sizes[max(sizes)] if sizes else None


def _check_number(name: str, value: object, span: tuple[float, float], unit: str) -> float:
    """``value`` as a float, or a ValueError naming ``name`` and its range.

        _check_number("gbit", 1e-320, GBIT, "Gbit/s")
        # ValueError: gbit must be a number from 1e-06 to 1e+09 Gbit/s; got 1e-320
    """
    low, high = span
    if not checks.is_real(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a number from {low:g} to {high:g} {unit}; got {value!r}")
    return float(value)


def _check_count(name: str, value: object, high: int, unless_none: str) -> int | None:
    """``value`` as an int from 1 to ``high`` (None stays None), or a ValueError naming ``name``."""
    if value is None:
        return None
    if not checks.is_int(value) or not 1 <= value <= high:
        raise ValueError(
            f"{name} must be an integer from 1 to {high:,} or None ({unless_none}); got {value!r}")
    return int(value)


def _check_nic_map(nic_map: object, ranks_per_host: int, nics: int) -> tuple[int, ...] | None:
    """``nic_map`` as a tuple of ``ranks_per_host`` NIC indices, each below ``nics`` (None stays None).

        _check_nic_map([0, 0, 1, 1], 4, 2)    # (0, 0, 1, 1)
        _check_nic_map([0, 2], 2, 2)          # ValueError: nic_map must list ranks_per_host=2 NICs ...
    """
    if nic_map is None:
        return None
    values = tuple(nic_map) if isinstance(nic_map, (list, tuple)) else ()
    if len(values) != ranks_per_host or not all(checks.is_int(v) and 0 <= v < nics for v in values):
        raise ValueError(f"nic_map must list ranks_per_host={ranks_per_host} NICs, one per local rank, each "
                         f"from 0 to nics_per_host-1={nics - 1}; got {nic_map!r}")
    return tuple(int(v) for v in values)


def _check_int(name: str, value: object, high: int = MAX_RANKS_PER_HOST) -> int:
    """``value`` as an int from 1 to ``high``, or a ValueError naming ``name``."""
    if not checks.is_int(value) or not 1 <= value <= high:
        raise ValueError(f"{name} must be an integer from 1 to {high:,}; got {value!r}")
    return int(value)


def _check_topology(network: Network) -> dict:
    """The host terms of ``network`` checked (a ValueError naming the first one out of range), as
    the values to store: ``ranks_per_host``, ``nics_per_host``, ``nic_map``, ``oversubscription``,
    ``hosts_per_leaf``."""
    if network.intra_fabric not in INTRA_FABRICS:
        raise ValueError(f"intra_fabric must be one of {INTRA_FABRICS}; got {network.intra_fabric!r}")
    per_host = _check_int("ranks_per_host", network.ranks_per_host)
    nics = _check_int("nics_per_host", network.nics_per_host)
    return {
        "ranks_per_host": per_host, "nics_per_host": nics,
        "hosts_per_leaf": _check_int("hosts_per_leaf", network.hosts_per_leaf),
        "nic_map": _check_nic_map(network.nic_map, per_host, nics),
        "oversubscription": _check_number("oversubscription", network.oversubscription, OVERSUBSCRIPTION,
                                          "(1: full bisection)")}


@dataclass(frozen=True)
class Network:
    """A cluster as the simulator sees it: links, and the CPU work around each message.

    **Links.** A message of n bytes costs ``alpha_us + n * 8 / (gbit * 1e3)`` µs on the wire. Each
    rank sends one message at a time and receives one at a time, both directions at once (full
    duplex). With ``ranks_per_host`` > 1, ranks ``[h*L, (h+1)*L)`` share host h: a message between
    two hosts also holds the sender's host uplink and the receiver's host downlink for its whole
    duration, and a message inside a host costs ``intra_alpha_us + n * 8 / (intra_gbit * 1e3)``
    (both default to the inter-host values).

    **Hosts** (the defaults are the model above: one link each way per host, a switch inside).
    ``intra_fabric`` is how a host's ranks reach each other: ``"switch"`` (NVSwitch-like: every pair
    at the intra-host α/β at once, each rank one message each way at a time) or ``"bus"`` (one
    message at a time on the host's bus, first come first served). A host has ``nics_per_host``
    NICs, each a link each way at ``gbit``: local rank l's messages between hosts leave and enter
    through NIC ``nic_map[l]`` (default: consecutive blocks, ``l * nics_per_host // ranks_per_host``;
    ``nics_per_host = ranks_per_host`` is rails, one NIC per GPU). Hosts sit ``hosts_per_leaf`` to
    a leaf switch (default 1: every message between hosts crosses the tier above); a message
    between leaves costs ``oversubscription`` × β per byte: a tier that carries 1/oversubscription
    of what its hosts can send, all of them sending across at once (as a collective's steps do).

    **Latency and gap** (LogP's L and g). ``gap_us`` (default None: all of α) is the part of α
    during which a message holds the ports and links it uses; the rest of α is flight time that
    holds nothing. A message then frees its ports after ``gap_us + n·β`` and arrives after ``α +
    n·β``, and its sender goes on once it has left: a rank sending to several peers (a node of
    two trees at once) overlaps their latencies, as a NIC with several messages in flight does.
    Inside a host the gap is ``min(gap_us, intra α)``. With the default, a port is held for the
    whole of α, and the closed forms hold.

    **Eager and rendezvous.** A message of at most ``eager_bytes`` (default 64 KiB, MPI's usual
    eager limit; None: every message) leaves as soon as its sender is ready; a larger one waits
    until its receiver has posted the receive (rendezvous), so a sender that runs ahead cannot
    take a receiver's port with a message it does not need yet.

    **CPU** (LogGP's o, and the per-byte work a transport really does; all default to 0). Before
    a message of n bytes goes on the wire its sender works ``send_overhead_us + n *
    copy_us_per_byte`` µs (the call, the copy into shared memory or the socket, a frame's MAC);
    once it has arrived and the receiver has posted the receive, the receiver works
    ``recv_overhead_us + n * copy_us_per_byte`` µs, plus ``n * gamma_us_per_byte`` when it folds
    the message into its buffer (the reduction kernel). ``cores`` (default None: as many as there
    are ranks) is how many cores each group of ``ranks_per_cpu`` ranks shares (default: a host's
    ranks share its cores; ``ranks_per_cpu=world_size`` puts emulated hosts on one machine): CPU
    work that finds every core of its group busy waits for the first one free, first come first
    served. With every CPU term at 0 the model is the links alone, and the closed forms hold.

    **Memory** (default: none). A case whose working set W (every rank's input plus the bytes it
    receives, in one call) outgrows the ``cache_bytes`` its ranks share streams from memory: each
    byte it copies costs ``memory_us_per_byte · (1 - cache_bytes / W)`` more, the share of W the
    cache cannot hold paying memory's extra. Without ``cache_bytes``, or with W within the cache,
    a copy costs ``copy_us_per_byte``.

    **Waking** (default 0). A receiver that has posted its receive and waits, asleep, for the
    message starts the receive's work ``wake_us`` after the message arrives: the kernel wakes it
    and, on shared cores, it waits for its turn. One that finds its message already there pays
    none of it (a root taking N-1 messages that came while it worked wakes once, not N-1 times).

    Ranges (a ``ValueError`` naming the parameter otherwise): ``alpha_us``, ``intra_alpha_us``,
    ``send_overhead_us``, ``recv_overhead_us`` and ``wake_us`` 0 to 1e9 µs, ``gap_us`` 0 to ``alpha_us``, ``gbit`` and ``intra_gbit`` 1e-6 to
    1e9 Gbit/s, ``copy_us_per_byte`` and ``gamma_us_per_byte`` 0 to 1e6, ``ranks_per_host``,
    ``cores`` and ``ranks_per_cpu`` 1 to 2**24, ``cache_bytes`` 1 to 2**50, ``memory_us_per_byte``
    0 to 1e6, ``nics_per_host`` and ``hosts_per_leaf`` 1 to 2**24, ``oversubscription`` 1 to 1e6:
    every simulated time is then finite.

        lab.sim.Network(alpha_us=20.0, gbit=10.0)     # 1 MB: 20 + 838.9 µs per message
        lab.sim.Network(alpha_us=5.0, gbit=100.0, gap_us=0.5)  # a NIC taking a message every 0.5 µs
        lab.sim.Network(alpha_us=5.0, gbit=10.0, send_overhead_us=30.0, recv_overhead_us=30.0,
                        copy_us_per_byte=1e-4, cores=2, ranks_per_cpu=8)   # 8 ranks on 2 cores
        lab.sim.Network(copy_us_per_byte=1e-4, cache_bytes=32 << 20, memory_us_per_byte=1e-4)  # 2x per byte at W = ∞
        lab.sim.Network(alpha_us=5.0, gbit=400.0, ranks_per_host=8, nics_per_host=8,  # rails, 2:1 above
                        intra_alpha_us=1.0, intra_gbit=3600.0, oversubscription=2.0)
        lab.sim.Network(gbit=1e-320)                  # ValueError: gbit must be a number from 1e-06 to 1e+09 Gbit/s
    """

    alpha_us: float = 20.0
    gbit: float = 10.0
    ranks_per_host: int = 1
    intra_alpha_us: float | None = None
    intra_gbit: float | None = None
    gamma_us_per_byte: float = 0.0
    send_overhead_us: float = 0.0
    recv_overhead_us: float = 0.0
    copy_us_per_byte: float = 0.0
    cores: int | None = None
    ranks_per_cpu: int | None = None
    eager_bytes: int | None = 64 * 1024
    gap_us: float | None = None
    wake_us: float = 0.0
    cache_bytes: int | None = None
    memory_us_per_byte: float = 0.0
    nics_per_host: int = 1
    nic_map: tuple[int, ...] | None = None
    intra_fabric: str = "switch"
    oversubscription: float = 1.0
    hosts_per_leaf: int = 1

    def __post_init__(self) -> None:
        # Frozen: store the checked floats with object.__setattr__ (a numpy scalar becomes a float).
        for name, span, unit in [("alpha_us", ALPHA_US, "µs"), ("gbit", GBIT, "Gbit/s"),
                                 ("intra_alpha_us", ALPHA_US, "µs"), ("intra_gbit", GBIT, "Gbit/s"),
                                 ("gamma_us_per_byte", GAMMA_US_PER_BYTE, "µs per byte"),
                                 ("send_overhead_us", ALPHA_US, "µs"), ("recv_overhead_us", ALPHA_US, "µs"),
                                 ("copy_us_per_byte", GAMMA_US_PER_BYTE, "µs per byte"),
                                 ("wake_us", ALPHA_US, "µs"),
                                 ("memory_us_per_byte", GAMMA_US_PER_BYTE, "µs per byte"),
                                 ("gap_us", (0.0, self.alpha_us), "µs (at most alpha_us)")]:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_number(name, value, span, unit))
        for name, value in _check_topology(self).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "cores", _check_count("cores", self.cores, MAX_CORES, "a core per rank"))
        object.__setattr__(
            self, "ranks_per_cpu",
            _check_count("ranks_per_cpu", self.ranks_per_cpu, MAX_RANKS_PER_HOST, "ranks_per_host"))
        object.__setattr__(self, "cache_bytes",
                           _check_count("cache_bytes", self.cache_bytes, MAX_CACHE_BYTES, "no cache limit"))
        if self.eager_bytes is not None and (not checks.is_int(self.eager_bytes) or self.eager_bytes < 0):
            raise ValueError(f"eager_bytes must be a non-negative integer, or None (every message eager); "
                             f"got {self.eager_bytes!r}")

    @property
    def eager_limit(self) -> int:
        """The largest message that leaves before its receive is posted (``eager_bytes``; None: any)."""
        return 2**62 if self.eager_bytes is None else int(self.eager_bytes)

    @property
    def beta_us_per_byte(self) -> float:
        """µs per byte between hosts: 8 / (gbit · 1e3)."""
        return 8.0 / (self.gbit * 1e3)

    @property
    def intra_alpha(self) -> float:
        return self.alpha_us if self.intra_alpha_us is None else float(self.intra_alpha_us)

    @property
    def gap(self) -> float:
        """µs of α a message holds its ports and links for between hosts (``gap_us``; None: α)."""
        return self.alpha_us if self.gap_us is None else float(self.gap_us)

    @property
    def intra_gap(self) -> float:
        """The same inside a host: ``min(gap_us, intra α)``."""
        return min(self.gap, self.intra_alpha)

    @property
    def intra_beta_us_per_byte(self) -> float:
        return 8.0 / ((self.gbit if self.intra_gbit is None else self.intra_gbit) * 1e3)

    @property
    def tier_beta_us_per_byte(self) -> float:
        """µs per byte between hosts under different leaf switches: β · ``oversubscription``."""
        return self.beta_us_per_byte * self.oversubscription

    @property
    def cpu_group(self) -> int:
        """How many ranks share one group of ``cores``: ``ranks_per_cpu``, else ``ranks_per_host``."""
        return self.ranks_per_host if self.ranks_per_cpu is None else self.ranks_per_cpu

    def copy_cost(self, working_set_bytes: float) -> float:
        """µs per byte copied in a case of this working set: ``copy_us_per_byte``, plus memory's
        extra on the share of the working set beyond the cache."""
        if self.cache_bytes is None or working_set_bytes <= self.cache_bytes:
            return self.copy_us_per_byte
        return self.copy_us_per_byte + self.memory_us_per_byte * (1.0 - self.cache_bytes / working_set_bytes)

    def message_us(self, nbytes: int, *, intra: bool = False) -> float:
        """The time of one message of ``nbytes`` bytes on an idle link (the wire alone, no CPU)."""
        if intra:
            return self.intra_alpha + nbytes * self.intra_beta_us_per_byte
        return self.alpha_us + nbytes * self.beta_us_per_byte

    def describe(self) -> str:
        """``α 20 µs, 10 Gbit/s`` (and the host structure and CPU terms when there are some; 3 digits each)."""
        text = f"α {self.alpha_us:.3g} µs, {self.gbit:.3g} Gbit/s"
        if self.gap_us is not None:
            text += f" (a message holds its port {self.gap_us:.3g} µs of α)"
        if self.ranks_per_host > 1:
            intra_gbit = self.gbit if self.intra_gbit is None else self.intra_gbit
            bus = " on a bus" if self.intra_fabric == "bus" else ""
            text += (f", {self.ranks_per_host} ranks/host{bus} (inside: α {self.intra_alpha:.3g} µs, "
                     f"{intra_gbit:.3g} Gbit/s)")
        if self.nics_per_host > 1:
            text += f", {self.nics_per_host} NICs/host"
        if self.oversubscription > 1:
            leaf = f" above leaves of {self.hosts_per_leaf} hosts" if self.hosts_per_leaf > 1 else ""
            text += f", {self.oversubscription:.3g}:1 oversubscribed{leaf}"
        if self.send_overhead_us or self.recv_overhead_us:
            text += f", o {self.send_overhead_us:.3g}/{self.recv_overhead_us:.3g} µs (send/receive)"
        if self.wake_us:
            text += f", wake {self.wake_us:.3g} µs"
        if self.copy_us_per_byte:
            text += f", copy {self.copy_us_per_byte:.3g} µs/B"
        if self.gamma_us_per_byte:
            text += f", γ {self.gamma_us_per_byte:.3g} µs/B"
        if self.cache_bytes is not None and self.memory_us_per_byte:
            text += f", memory {self.memory_us_per_byte:.3g} µs/B beyond a {self.cache_bytes / 2**20:g} MiB cache"
        if self.cores is not None:
            if self.cpu_group == 1:
                text += f", {self.cores} cores for each rank"
            else:
                shared = "all ranks" if self.cpu_group == MAX_RANKS_PER_HOST else f"{self.cpu_group} ranks"
                text += f", {self.cores} cores shared by {shared}"
        return text


def network_term(name: str, convert: Callable[[str], Any] = number) -> Callable[[str], Any]:
    """An argparse type for :class:`Network`'s term ``name``, checked as the Network checks it."""
    return checked(convert, lambda value: Network(**{name: value}))
