"""The emulated hosts' keeper: the process that builds their namespaces and holds them (:mod:`lab.hosts.emulated`).

Run as a script by :class:`lab.hosts.emulated.Hosts` (``python -I lab/hosts/keeper.py COUNT GBIT USERNS``),
stdlib only, importing nothing from the lab (no torch). It makes a switch namespace holding a
bridge and one namespace per host whose ``eth0`` is a veth pair's end, the other end plugged into
the bridge, both capped by ``tbf``; prints the holders' pids as one JSON line; holds them until its
stdin closes (the owner's signal, or the owner's death); and, should a holder die, reports it on
its stdout and ends the rest.

Also here, for the owner's side too: the syscalls through ctypes (Python 3.11 has no
``os.setns``): :func:`setns`, which rank processes use to join their host, and how a process ended
(:func:`how_ended`).
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
#: The hosts' subnet (each pool has its own switch namespace, so pools never collide).
SUBNET = "10.99.0"
#: The host side of every link.
INTERFACE = "eth0"


def how_ended(returncode: int | None) -> str:
    """``killed by signal SIGKILL``, ``exited with code 1``: how a process ended (a wait status's code)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


# -- syscalls -------------------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(path: str, kind: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc().setns(fd, kind), f"setns({path})")
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# -- the keeper (this file run as a script) -------------------------------------------------------


def _hold_network_namespace() -> int:
    """Fork a child that unshares a new network namespace and sleeps in it; return its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            _die_with_parent()
            _check(_libc().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET): cannot make a network namespace")
            os.write(ready_w, b"ok")
            while True:
                signal.pause()
        except BaseException as exc:  # noqa: BLE001 - reported to the keeper
            os.write(ready_w, str(exc).encode())
        finally:
            os._exit(1)
    os.close(ready_w)
    answer = os.read(ready_r, 4096).decode()
    os.close(ready_r)
    if answer != "ok":
        raise OSError(answer)
    return pid


def _run_in(pid: int, tool: str, commands: list[str]) -> None:
    """Run ``commands`` through ``ip -batch -`` or ``tc -batch -`` inside process ``pid``'s network namespace."""
    done = subprocess.run([tool, "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True,
                          text=True, check=False,
                          preexec_fn=lambda: setns(f"/proc/{pid}/ns/net", CLONE_NEWNET))
    if done.returncode:
        raise OSError(
            f"{tool} failed: {(done.stderr or done.stdout).strip()} (commands: {'; '.join(commands)})")


def _cap(device: str, gbit: float) -> str:
    """A token bucket of ``gbit`` on ``device``'s egress. The bucket holds 1 ms of traffic (at
    least 128 KiB, so a 64 KiB GSO segment passes whole), the queue at most 20 ms more."""
    rate = int(gbit * 1e9)
    burst = max(128 << 10, rate // 8 // 1000)
    return f"qdisc add dev {device} root tbf rate {rate}bit burst {burst} latency 20ms"


def _enter_user_namespace() -> None:
    """Become root of a new user namespace (unprivileged users may, where the kernel allows)."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc().unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER): cannot make a user namespace")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _hold(holders: dict[int, str]) -> str | None:
    """Wait until stdin closes (None) or a namespace holder dies (what died: it is reaped here).

    Each holder is watched through a pidfd (Linux 5.3); where there are none, stdin only."""
    with selectors.DefaultSelector() as selector:
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
        pidfds = []
        try:
            for pid, name in holders.items():
                try:
                    pidfds.append(os.pidfd_open(pid))
                except (AttributeError, OSError):
                    continue
                selector.register(pidfds[-1], selectors.EVENT_READ, (pid, name))
            while True:
                for key, _ in selector.select():
                    if key.data is None:
                        if not os.read(key.fd, 4096):
                            return None
                        continue
                    pid, name = key.data
                    _, status = os.waitpid(pid, 0)
                    del holders[pid]  # reaped: never to be killed (its pid may be reused)
                    how = how_ended(os.waitstatus_to_exitcode(status))
                    return f"the process holding {name} (pid {pid}) died ({how})"
        finally:
            for fd in pidfds:
                os.close(fd)


def _keeper_main(count: int, gbit: float, user_namespace: bool) -> None:
    """Build the switch and the hosts, report their holders' pids, hold them until stdin closes
    (or report the holder that died, and end the rest)."""
    _die_with_parent()
    holders: dict[int, str] = {}
    try:
        # 1. Without root: a user namespace of our own, in which we may make network namespaces.
        if user_namespace:
            _enter_user_namespace()
        # 2. The switch: a namespace with a bridge.
        switch = _hold_network_namespace()
        holders[switch] = "the switch's network namespace"
        _run_in(switch, "ip", ["link add br0 type bridge", "link set br0 up"])
        # 3. Each host: a namespace whose eth0 is a veth pair's end; the other end, hN, goes to the switch.
        for i in range(count):
            host = _hold_network_namespace()
            holders[host] = f"host {i}'s network namespace"
            _run_in(host, "ip", [
                "link set lo up", f"link add {INTERFACE} type veth peer name h{i} netns {switch}",
                f"addr add {SUBNET}.{i + 1}/24 dev {INTERFACE}", f"link set {INTERFACE} up"])
            if gbit:  # the host's upload
                _run_in(host, "tc", [_cap(INTERFACE, gbit)])
        # 4. Plug every hN into the bridge; cap it (the host's download).
        _run_in(switch, "ip",
                [cmd for i in range(count) for cmd in (f"link set h{i} master br0", f"link set h{i} up")])
        if gbit:
            _run_in(switch, "tc", [_cap(f"h{i}", gbit) for i in range(count)])
        print(json.dumps({"switch": switch, "hosts": list(holders)[1:]}), flush=True)
        # 5. Hold everything until the owner closes our stdin (or dies), or a holder dies.
        lost = _hold(holders)
        if lost:  # the owner's pool is waiting on our stdout: say what went, then end the rest
            print(json.dumps({"lost": lost}), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the owner, who raises EmulationUnavailable
        print(json.dumps({"error": str(exc)}), flush=True)
    finally:
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    _keeper_main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1")
