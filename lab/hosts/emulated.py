"""Emulated hosts: one network namespace per host, a virtual switch, a capped link for each.

Mininet's method, on one machine. A *keeper* process (:mod:`lab.hosts.keeper` run as a script,
stdlib only) makes a switch namespace holding a Linux bridge, and one namespace per host holding
``eth0``, one end of a veth pair whose other end is a port of the bridge::

    host 0 [eth0 10.99.0.1] ==veth== [h0 ┐
    host 1 [eth0 10.99.0.2] ==veth== [h1 ├ br0]  switch
    host 2 [eth0 10.99.0.3] ==veth== [h2 ┘

Each host's link is capped at ``link_gbit`` in each direction by a token bucket (``tbf``) on
both ends of its veth: egress of ``eth0`` is the host's upload, egress of ``hN`` its download.
``link_gbit`` goes from 1e-5 to 1,000 Gbit/s (:data:`LINK_GBIT`), where tbf keeps what it is
given; outside, a ``ValueError`` before anything is made.

Lifetime. The namespaces are anonymous: each is held by one sleeping child of the keeper, and
the kernel frees a namespace (and its veth ends, and the bridge) as soon as no process is left
in it. The keeper ends its children when its stdin (a pipe from the owner) closes, which happens
on :meth:`Hosts.close`, and also when the owner dies by any signal, SIGKILL included; the
children also carry ``PR_SET_PDEATHSIG``. So nothing is ever added to the root namespace (no
``ip netns`` entry, no ``ip link``) and nothing is left to sweep.

The other way round: should the keeper die (or one of its namespace holders, which takes the
bridge or a host's link with it), the links are gone while the ranks still need them. The keeper
reports a holder's death on its stdout and exits, and its stdout reads end-of-file once it is
gone, so :attr:`Hosts.sentinel` becomes readable: ``lab.launch`` waits on it with the ranks, and
:meth:`Hosts.lost` says what died instead of a rank timing out.

Privileges. As root (CAP_SYS_ADMIN and CAP_NET_ADMIN) the namespaces are made directly. Without
them the keeper first enters a new *user* namespace, where it is root, which unprivileged users
may do where the kernel allows it; rank processes join that user namespace before the host's
network namespace. Where neither works, :class:`lab.EmulationUnavailable` says what is missing.

Rank processes join their host with :meth:`Host.enter`, first thing in their life: Python 3.11
has no ``os.setns``, so it calls ``setns(2)`` through ctypes (:func:`lab.hosts.keeper.setns`).

This module is the owner's side, in the user's process: :class:`Hosts` starts the keeper and
watches it, :class:`Host` is what a rank needs. Like the keeper it needs no torch and nothing
else of the lab (but :class:`lab.EmulationUnavailable`, when raised): loaded by path outside the
package (``tests/scripts/host_link.py``, any Python, any user), it loads the keeper beside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Self

if __package__:  # lab.hosts.emulated
    from lab.hosts import keeper as hosts_keeper
else:  # this file loaded by path, outside the lab package: the keeper's file beside it
    _spec = importlib.util.spec_from_file_location(
        "hosts_keeper", os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py"))
    hosts_keeper = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(hosts_keeper)

# The keeper's constants, as lab.hosts.emulated has always had them.
CLONE_NEWUSER, CLONE_NEWNET = hosts_keeper.CLONE_NEWUSER, hosts_keeper.CLONE_NEWNET
SUBNET, INTERFACE = hosts_keeper.SUBNET, hosts_keeper.INTERFACE
#: How long the keeper may take to build the namespaces and links.
START_TIMEOUT_S = 30.0
#: The link caps tbf keeps as given (Gbit/s), found by trying: from 10 kbit/s (below, tc clips
#: the 128 KiB bucket, to 230 bytes at 8 bit/s, under one packet) to 1 Tbit/s (past ~1.6 Tbit/s
#: the queue limit, rate x 21 ms, wraps its 32 bits; past 34 Tbit/s tc refuses the burst).
LINK_GBIT = (1e-5, 1000.0)


def check_link_gbit(link_gbit: object) -> float | None:
    """``link_gbit`` if tbf can cap a link at it, None for uncapped; a ValueError otherwise.

        check_link_gbit(1.0)            # 1.0
        check_link_gbit(float("inf"))   # ValueError: link_gbit must be a number from 1e-05 to 1000 Gbit/s ...
    """
    low, high = LINK_GBIT
    if link_gbit is None:
        return None
    # (not lab.checks: this file runs alone too, as another user's script)
    if isinstance(link_gbit, bool) or not isinstance(link_gbit, (int, float)) or not low <= link_gbit <= high:
        raise ValueError(
            f"link_gbit must be a number from {low:g} to {high:g} Gbit/s (10 kbit/s to 1 Tbit/s: "
            f"what tc's token bucket caps faithfully) or None (uncapped); got {link_gbit!r}")
    return float(link_gbit)


@dataclass(frozen=True)
class Host:
    """One emulated host, as a rank process needs it: where to go and what to bind."""

    index: int
    address: str  # eth0's IPv4 address
    interface: str  # the name of the host's link inside its namespace (for GLOO_SOCKET_IFNAME)
    netns: str  # /proc/<holder pid>/ns/net
    userns: str | None  # /proc/<keeper pid>/ns/user when made without root, else None

    def enter(self, before_network: Callable[[], object] | None = None) -> None:
        """Move the calling process into this host: its user namespace (if any), then its
        network namespace. Call it before the process opens any socket it means to use there
        (and while it has one thread: joining a user namespace requires that).

        ``before_network`` runs between the two steps, still in the caller's network
        namespace: the place to connect to a service on the root namespace's loopback.
        """
        if self.userns is not None:
            hosts_keeper.setns(self.userns, CLONE_NEWUSER)
        if before_network is not None:
            before_network()
        hosts_keeper.setns(self.netns, CLONE_NEWNET)


class Hosts:
    """``count`` emulated hosts on one switch, each link capped at ``link_gbit`` Gbit/s each way.

        with Hosts(4, link_gbit=1.0) as hosts:
            hosts[2].address        # '10.99.0.3'
            hosts[2].netns          # '/proc/<pid>/ns/net' (nsenter --net=... to look inside)

    ``link_gbit=None``: uncapped links (veth speed). ``user_namespace``: ``None`` picks (root:
    no; otherwise: yes), ``True``/``False`` forces. Raises :class:`lab.EmulationUnavailable`
    where namespaces cannot be made. :meth:`close` (or leaving the ``with``) removes everything.
    """
    def __init__(self, count: int, link_gbit: float | None = None, *,
                 user_namespace: bool | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
            raise ValueError(f"hosts must be an int in [1, 250]; got {count!r}")
        link_gbit = check_link_gbit(link_gbit)  # before the keeper: nothing is made for a cap tc cannot keep
        self.count, self.link_gbit = count, link_gbit
        self.hosts: list[Host] = []
        self._keeper: subprocess.Popen | None = None
        _check_platform()
        if user_namespace is None:
            user_namespace = os.geteuid() != 0
        self.user_namespace = user_namespace
        # The keeper: lab/hosts/keeper.py as a script (no torch to import), told what to build on
        # its command line, ended by closing its stdin.
        self._keeper = subprocess.Popen([
            sys.executable, "-I",
            os.path.abspath(hosts_keeper.__file__),
            str(count),
            str(link_gbit or 0), "1" if user_namespace else "0"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = _read_line(self._keeper, START_TIMEOUT_S)
            made = json.loads(line) if line else {"error": "the keeper exited: " + self._keeper.stderr.read()}
            if "error" in made:
                raise _unavailable(made["error"], user_namespace)
        except BaseException:
            self.close()
            raise
        userns = f"/proc/{self._keeper.pid}/ns/user" if user_namespace else None
        self.switch_netns = f"/proc/{made['switch']}/ns/net"
        self.hosts = [
            Host(i, f"{SUBNET}.{i + 1}", INTERFACE, f"/proc/{pid}/ns/net", userns)
            for i, pid in enumerate(made["hosts"])]

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def sentinel(self) -> IO[str] | None:
        """Readable once the keeper has exited or reported a lost namespace holder (its stdout):
        wait on it with the ranks' sentinels (``lab.launch`` does), then ask :meth:`lost`."""
        return None if self._keeper is None else self._keeper.stdout

    def lost(self) -> str | None:
        """What took the hosts down while they are still needed, or None while they stand.

            hosts.lost()   # 'the emulated-hosts keeper (pid 4242) died (killed by signal SIGKILL): ...'
        """
        keeper = self._keeper
        if keeper is None or not _readable(keeper.stdout):
            return None
        report = keeper.stdout.readline()  # the keeper's last words, or "" if it died without any
        try:
            keeper.wait(5.0)  # it exits right after reporting
        except subprocess.TimeoutExpired:
            pass
        what = json.loads(report).get("lost") if report.startswith("{") else None
        if what:
            return (f"the emulated-hosts keeper (pid {keeper.pid}) ended the hosts: {what}, and the links "
                    "between the hosts went with it")
        return f"the emulated-hosts keeper (pid {keeper.pid}) died ({hosts_keeper.how_ended(keeper.returncode)}): " \
               "the links between the hosts went with it"

    @property
    def pids(self) -> list[int]:
        """The keeper and the processes holding the namespaces (switch first, then hosts)."""
        if self._keeper is None:
            return []
        return [self._keeper.pid] + [
            int(p.split("/")[2]) for p in [self.switch_netns] + [h.netns for h in self.hosts]]

    def close(self) -> None:
        """Remove the hosts: the keeper ends its namespace holders and exits. Idempotent."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        keeper.stdin.close()  # the keeper's signal to end everything
        try:
            keeper.wait(5.0)
        except subprocess.TimeoutExpired:
            keeper.kill()  # its children die with it (PR_SET_PDEATHSIG)
            keeper.wait()
        keeper.stdout.close()
        keeper.stderr.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_keeper", None) is not None:
            self.close()


# -- the owner's side: checks and messages --------------------------------------------------------


def _check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise _unavailable(f"emulated hosts need Linux network namespaces; this is {sys.platform}", False)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise _unavailable(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)",
                           False)


def _unavailable(reason: str, user_namespace: bool) -> Exception:
    from lab.errors import EmulationUnavailable

    hint = ""
    if "user namespace" in reason:
        hint = (
            " Run as root (or with CAP_SYS_ADMIN and CAP_NET_ADMIN), or allow unprivileged user namespaces: "
            "sysctl -w user.max_user_namespaces=15000; on Debian/Ubuntu also "
            "kernel.unprivileged_userns_clone=1, and on Ubuntu 24.04 kernel.apparmor_restrict_unprivileged_userns=0."
        )
    elif "network namespace" in reason and not user_namespace:
        hint = " Run as root (CAP_SYS_ADMIN), or without root where unprivileged user namespaces are allowed."
    elif "type veth" in reason or "type bridge" in reason:
        hint = " The kernel lacks veth or bridge support: modprobe veth bridge (CONFIG_VETH, CONFIG_BRIDGE)."
    elif "tbf" in reason:
        hint = " The kernel lacks the token-bucket qdisc: modprobe sch_tbf (CONFIG_NET_SCH_TBF)."
    return EmulationUnavailable(f"cannot emulate hosts: {reason.strip()}.{hint}")


def _readable(stream: IO[str]) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        return bool(selector.select(0))


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise TimeoutError(f"the namespace keeper did not finish in {timeout_s} s")
    return process.stdout.readline()
