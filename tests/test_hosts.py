"""Emulated hosts: namespaces, switch and capped links made and removed, the cap real, the
collective and gloo matrices across 2, 3 and 4 hosts, faults within the deadline, and nothing
left after close, an exception, Ctrl-C or SIGKILL of the owner.

Everything that needs namespaces is skipped, saying why, where they cannot be made (not Linux,
no root and no unprivileged user namespaces); argument checks run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    DEADLINE_MS,
    DEATH_DEADLINE_MS,
    EXIT_GUARD_S,
    assert_death_reported_without_a_deadline,
    assert_matches_and_identical,
    assert_no_failures,
    assert_stall_ended_by_the_pool,
    check_allgather,
    check_allreduce,
    check_broadcast,
    check_other_inputs,
    check_reduce_scatter,
    compare_with_gloo,
    faulty_job,
    large_allreduce,
    require_hosts,
    sigint_as_ctrl_c,
)

import lab
from lab.hosts.emulated import Hosts

# Slow, the whole module: emulated hosts (namespaces, capped links).
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"


def run(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout


#: What tests/test_tcp.py's ``two_hosts`` makes in the root namespace (netns labA<n>, labB<n>; veth
#: va<n>, vb<n>): another pytest-xdist worker may be running it side by side.
SIDE_BY_SIDE = re.compile(r"lab[AB]\d+|v[ab]\d+")


def root_network() -> tuple[list[str], list[str]]:
    """What the root namespace shows: ``ip netns`` and the names of ``ip link``, less what another
    worker's test makes meanwhile."""
    links = (line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link").splitlines())
    namespaces = (line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip())
    return ([name for name in namespaces if not SIDE_BY_SIDE.fullmatch(name)],
            sorted(name for name in links if not SIDE_BY_SIDE.fullmatch(name)))


def live_network_namespaces() -> set[int]:
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            inodes.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            pass  # gone meanwhile, or not ours to see
    return inodes


def all_gone(pids: list[int], inodes: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
        held = set(inodes) & live_network_namespaces()
        if not alive and not held:
            return
        assert time.monotonic(
        ) < deadline, f"left behind: processes {alive}, network namespaces {sorted(held)}"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"


# -- arguments: checked before anything is made, everywhere -----------------------------------


def noop(mesh: lab.Mesh) -> None:
    return None


@pytest.mark.parametrize("options, match", [
    (dict(hosts=2, transport="shm"), "transport must be 'tcp' or 'auto' with hosts > 1"),
    (dict(hosts=2, transport="queue"), "transport must be 'tcp' or 'auto' with hosts > 1"),
    (dict(hosts=3, transport="tcp"), r"hosts must be an int that divides world_size \(4\)"),
    (dict(hosts=0, transport="tcp"), "hosts must be"), (dict(hosts=True, transport="tcp"), "hosts must be"),
    (dict(hosts=2, transport="tcp", link_gbit=0), "link_gbit must be a number from 1e-05 to 1000 Gbit/s"),
    (dict(hosts=2, transport="tcp", link_gbit="1"), "link_gbit must be a number from 1e-05 to 1000 Gbit/s"),
    (dict(link_gbit=1.0, transport="tcp"), "give hosts= too"),
    (dict(hosts=2, transport="gloo"), "transport must be one of")])
def test_bad_host_options_are_value_errors(options, match):
    with pytest.raises(ValueError, match=match):
        lab.spawn(noop, 4, **options)


def test_unavailable_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(lab.EmulationUnavailable, match="need Linux network namespaces; this is darwin"):
        Hosts(2)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(lab.EmulationUnavailable, match=r"ip and tc not found: install iproute2"):
        Hosts(2)


def placement(mesh: lab.Mesh) -> tuple[int, int, int]:
    return mesh.host, mesh.local_rank, mesh.local_world_size


def test_without_hosts_every_rank_is_on_host_0():
    assert lab.spawn(placement, 3) == [(0, 0, 3), (0, 1, 3), (0, 2, 3)]


@pytest.mark.parametrize("gbit", [float("inf"), 1e-12, 1e12, float("nan"), 5e-6, 1001.0])
def test_link_gbit_outside_what_tbf_can_do_is_a_value_error_before_anything_is_made(gbit, monkeypatch):
    """Before: inf, 1e-12 and 1e12 reached tc and came back as EmulationUnavailable with tc's
    internals. The range is where tbf keeps the cap as asked (see the next test)."""
    def no_keeper(*args, **kwargs):
        raise AssertionError("a keeper was started for a link_gbit that cannot be made")

    monkeypatch.setattr(subprocess, "Popen", no_keeper)
    with pytest.raises(
            ValueError, match=r"link_gbit must be a number from 1e-05 to 1000 Gbit/s \(10 kbit/s to 1 "
            r"Tbit/s.*\) or None \(uncapped\); got"):
        Hosts(2, link_gbit=gbit)
    with pytest.raises(ValueError, match="link_gbit must be a number from 1e-05 to 1000"):
        lab.spawn(noop, 2, hosts=2, link_gbit=gbit, transport="tcp")


@pytest.mark.parametrize("gbit, rate", [(1e-5, "10Kbit"), (1000.0, "1Tbit")])
def test_the_ends_of_the_link_gbit_range_are_capped_as_asked(gbit, rate):
    """At both ends tc keeps the rate, the 1 ms bucket and the 20 ms queue it is given (past them
    it clips the bucket below a packet, or wraps the queue limit: 'lat 825s', 'limit 167532704b')."""
    require_hosts()
    with Hosts(1, link_gbit=gbit) as hosts:
        up = run("nsenter", f"--net={hosts[0].netns}", "tc", "qdisc", "show", "dev", "eth0")
        down = run("nsenter", f"--net={hosts.switch_netns}", "tc", "qdisc", "show", "dev", "h0")
    for shown in (up, down):
        assert re.search(rf"qdisc tbf \S+ root .*rate {rate} burst \S+ lat 20ms", shown), shown


# -- namespaces and links: made, capped, removed --------------------------------------------------


def test_namespaces_links_and_caps_are_made_and_removed():
    require_hosts()
    before, namespaces_before = root_network(), live_network_namespaces()
    with Hosts(3, link_gbit=0.5) as hosts:
        made = [hosts.switch_netns] + [h.netns for h in hosts.hosts]
        inodes = [os.stat(p).st_ino for p in made]
        pids = hosts.pids
        assert len(set(inodes)) == 4 and not set(inodes) & namespaces_before
        for host in hosts.hosts:
            inside = run("nsenter", f"--net={host.netns}", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
            assert f"inet {host.address}/24" in inside
            qdisc = run("nsenter", f"--net={host.netns}", "tc", "qdisc", "show", "dev", "eth0")
            assert "tbf" in qdisc and "rate 500Mbit" in qdisc, qdisc  # the host's upload
        switch = run("nsenter", f"--net={hosts.switch_netns}", "tc", "qdisc", "show")
        assert all(f"dev h{i} root" in switch
                   for i in range(3)) and switch.count("rate 500Mbit") == 3  # downloads
        bridge = run("nsenter", f"--net={hosts.switch_netns}", "ip", "-o", "link", "show", "master", "br0")
        assert sorted(line.split(":")[1].strip().split("@")[0]
                      for line in bridge.splitlines()) == ["h0", "h1", "h2"]
        assert root_network() == before  # nothing in the root namespace, even while they exist
    all_gone(pids, inodes, within_s=0.5)
    assert root_network() == before


def test_an_exception_inside_the_pool_removes_everything():
    require_hosts()
    before = root_network()
    with pytest.raises(RuntimeError, match="user code failed"), lab.launch(2, hosts=2,
                                                                           transport="tcp") as cluster:
        pids = cluster.hosts.pids + cluster.pids
        inodes = [os.stat(h.netns).st_ino for h in cluster.hosts.hosts]
        raise RuntimeError("user code failed")
    all_gone(pids, inodes)
    assert root_network() == before


def owner(*extra: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "hosts_owner.py")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_ctrl_c)
    line = process.stdout.readline()
    assert line, process.stderr.read()
    return process, json.loads(line)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_nothing_outlives_an_owner_killed_or_interrupted(how):
    require_hosts()
    before = root_network()
    process, made = owner()
    assert all(os.path.exists(f"/proc/{p}") for p in made["pids"])
    os.kill(process.pid, how)
    process.wait(EXIT_GUARD_S)  # a hang guard: the owner's teardown, stretched on a loaded machine
    process.stdout.close()
    if how == signal.SIGINT:
        assert "KeyboardInterrupt" in process.stderr.read()
    process.stderr.close()
    all_gone(made["pids"], made["inodes"])
    assert root_network() == before


def link_transfer(nbytes: int, gbit: float, userns: str, python: str = sys.executable,
                  user: list[str] = ()) -> dict:
    done = subprocess.run(
        [*user, python, str(SCRIPTS / "host_link.py"),
         str(nbytes), str(gbit), userns], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def tbf_burst(gbit: float) -> int:
    return max(128 << 10, int(gbit * 1e9) // 8 // 1000)


def test_a_user_namespace_works_as_root_does():
    """The path taken without root (forced here): the keeper in a user namespace of its own,
    processes joining it before the host's network namespace; the cap holds the same way."""
    require_hosts()
    nbytes, gbit = 2 << 20, 0.2
    result = link_transfer(nbytes, gbit, "1")
    assert result["userns"] and result["userns"].endswith("/ns/user")
    assert result["seconds"] >= (nbytes - tbf_burst(gbit)) * 8 / (gbit * 1e9)
    all_gone(result["pids"], [])


def test_an_unprivileged_user_gets_hosts_where_the_kernel_allows():
    """As ``nobody``, with the system's Python (the venv may not be readable to it)."""
    require_hosts()
    python, setpriv = shutil.which("python3", path="/usr/bin:/bin"), shutil.which("setpriv")
    if os.geteuid() != 0 or not python or not setpriv:
        pytest.skip("needs root (to become nobody), setpriv and a system python3")
    nobody = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    if subprocess.run([*nobody, python, "-c", f"open({str(SCRIPTS / 'host_link.py')!r})"],
                      capture_output=True).returncode:
        pytest.skip("user nobody cannot read the checkout")
    if subprocess.run([*nobody, "unshare", "--user", "--net", "true"], capture_output=True).returncode:
        pytest.skip("this kernel does not allow unprivileged user namespaces")
    result = link_transfer(1 << 20, 1.0, "auto", python, nobody)
    assert result["userns"], result  # auto without root: a user namespace


# -- the cap is real: a lower bound on time, not a speed assertion ---------------------------------

NBYTES = 4 << 20
GBIT = 0.1


def timed_transfers(mesh: lab.Mesh) -> dict[str, float]:
    """Host 0 -> host 1: one 4 MB send (answered), one lab ring allreduce and one gloo allreduce."""
    from lab.reference import gloo_collective

    x = torch.zeros(NBYTES // 4)
    ack = torch.zeros(1)
    gloo_collective(mesh, "allreduce", torch.zeros(1))  # join gloo before timing
    lab.allreduce(mesh, ack, algorithm="ring")
    times = {}
    started = time.perf_counter()
    if mesh.rank == 0:
        mesh.send(1, x)
        mesh.recv(1)
    else:
        mesh.recv(0)
        mesh.send(0, ack)
    times["send"] = time.perf_counter() - started
    for name, call in [("lab ring allreduce", lambda: lab.allreduce(mesh, x, algorithm="ring")),
                       ("gloo allreduce", lambda: gloo_collective(mesh, "allreduce", x))]:
        lab.allreduce(mesh, ack, algorithm="ring")
        started = time.perf_counter()
        call()
        times[name] = time.perf_counter() - started
    return times


def test_the_cap_is_real_for_the_lab_and_for_gloo():
    """Through a 100 Mbit/s link no transfer of B bytes beats (B - bucket) / rate; a 2-rank
    allreduce of T bytes sends T (lab's ring: 2 chunks of T/2; gloo: the same) across it."""
    require_hosts()
    floor = (NBYTES - tbf_burst(GBIT)) * 8 / (GBIT * 1e9)
    times = lab.spawn(timed_transfers, 2, hosts=2, link_gbit=GBIT, transport="tcp", recv_timeout_ms=60_000)
    for rank, by_call in enumerate(times):
        for call, seconds in by_call.items():
            assert seconds >= floor, f"rank {rank} {call}: {seconds:.3f} s < {floor:.3f} s: the cap did not hold"


# -- the matrices across hosts (pools once per module) --------------------------------------------

LAYOUTS = [(2, 4), (3, 3), (4, 8)]  # (hosts, world_size): 2, 1 and 2 ranks per host


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"H{p[0]}-N{p[1]}")
def cluster(request):
    require_hosts()
    hosts, world_size = request.param
    with lab.launch(world_size, hosts=hosts, link_gbit=1.0, transport="tcp", recv_timeout_ms=60_000) as c:
        yield c


def test_ranks_know_their_host(cluster):
    n, h = cluster.world_size, len(cluster.hosts)
    per_host = n // h
    assert cluster.run(placement) == [(r // per_host, r % per_host, per_host) for r in range(n)]


def test_collective_matrix_across_hosts(cluster):
    """The wire set of tests/test_collectives.py (every collective, algorithm, count, root and
    shape; each element width): links and namespaces carry bytes and never see the op or dtype,
    whose full matrix runs on shm there."""
    for check in (check_allreduce, check_broadcast, check_allgather, check_reduce_scatter):
        assert_no_failures(cluster.run(check, False))
    assert_no_failures(cluster.run(check_other_inputs))


def test_gloo_matrix_across_hosts(cluster):
    """Against gloo across the same links: the wire set (tests/test_gloo.py)."""
    n = cluster.world_size
    assert_matches_and_identical(cluster.run(compare_with_gloo, [1, n + 1, 1000], 2026, False))
    assert_matches_and_identical(cluster.run(large_allreduce, (1 << 18) + 3))


# -- faults across hosts: ended within the deadline + 2 s -----------------------------------------


@pytest.mark.parametrize("fault, victim, which", [
    ("sigkill", 2, "allreduce-ring"),
    ("sigkill", 0, "allgather"),
    ("stall", 1, "allreduce-tree"),
    ("stall", 3, "broadcast"),])
def test_a_killed_or_stalled_rank_ends_the_run_in_time(fault, victim, which, tmp_path):
    """Timed from the fault, as test_faults does: a death is reported before any deadline fires
    (30 s here), a stall before the stalled rank would wake."""
    require_hosts()
    deadline_ms = DEADLINE_MS if fault == "stall" else DEATH_DEADLINE_MS
    stamp = tmp_path / "fault"
    with lab.launch(4, hosts=2, link_gbit=1.0, transport="tcp", recv_timeout_ms=deadline_ms) as cluster:
        pids = cluster.hosts.pids + cluster.pids
        with pytest.raises(lab.RankError) as info:
            cluster.run(faulty_job, which, 300_001, victim, 3, fault, str(stamp))
        since_fault = time.time() - float(stamp.read_text())
    error = info.value
    case = (fault, victim, which)
    if fault == "sigkill":
        assert (error.rank, error.exc_type) == (victim, "ProcessDied"), str(error)
        assert_death_reported_without_a_deadline(error, since_fault, case)
    else:
        assert (error.rank, error.exc_type) == (victim, "Unresponsive"), str(error)
        assert_stall_ended_by_the_pool(error, since_fault, case)
    all_gone(pids, [])


# -- the keeper dies: named, not a rank --------------------------------------------------------------


def test_hosts_say_when_their_keeper_died():
    """lab.hosts.emulated alone: the keeper's sentinel becomes readable and lost() names it."""
    require_hosts()
    with Hosts(2) as hosts:
        keeper = hosts.pids[0]
        assert hosts.lost() is None
        os.kill(keeper, signal.SIGKILL)
        with selectors.DefaultSelector() as selector:
            selector.register(hosts.sentinel, selectors.EVENT_READ)
            assert selector.select(30.0), "the sentinel did not report the keeper's death"
        assert hosts.lost() == (f"the emulated-hosts keeper (pid {keeper}) died (killed by signal SIGKILL): "
                                "the links between the hosts went with it")


def gone_before_the_run(pid: int) -> None:
    """Wait until ``pid`` has exited (a zombie or reaped): SIGKILL is delivered asynchronously,
    and "between runs" means the next run starts after the death."""
    for _ in range(1000):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} outlived SIGKILL by 10 s")


def sleep_then_allreduce(mesh: lab.Mesh, seconds: float) -> float:
    time.sleep(seconds)
    x = torch.ones(1024)
    lab.allreduce(mesh, x, algorithm="ring")
    return float(x[0])


@pytest.mark.parametrize("when", ["between runs", "during a run"])
@pytest.mark.parametrize("victim", ["keeper", "switch holder"])
def test_a_dead_keeper_is_named_instead_of_a_rank(victim, when):
    """Before: the ranks' messages across hosts went nowhere, and the run ended at the deadline
    with a DeadlineError blaming a rank. Now the pool notices at once (the keeper's sentinel),
    closes, and says what died; nothing is left behind."""
    require_hosts()
    deadline_s = 120
    with lab.launch(4, hosts=2, transport="tcp", recv_timeout_ms=deadline_s * 1000) as cluster:
        assert cluster.run(sleep_then_allreduce, 0.0) == [4.0] * 4
        keeper, switch_holder = cluster.hosts.pids[:2]
        pids = cluster.hosts.pids + cluster.pids
        inodes = [os.stat(h.netns).st_ino for h in cluster.hosts.hosts]
        victim_pid = keeper if victim == "keeper" else switch_holder
        if when == "between runs":
            os.kill(victim_pid, signal.SIGKILL)
            gone_before_the_run(victim_pid)
            sleep = 0.0
        else:
            threading.Timer(1.0, os.kill, (victim_pid, signal.SIGKILL)).start()
            sleep = 5.0  # the ranks are inside the run when it happens
        started = time.monotonic()
        with pytest.raises(lab.LabError) as info:
            cluster.run(sleep_then_allreduce, sleep)
        elapsed = time.monotonic() - started
        with pytest.raises(lab.LabError, match="closed"):
            cluster.run(sleep_then_allreduce, 0.0)
    message = str(info.value)
    assert not isinstance(info.value, lab.RankError) and "DeadlineError" not in message, message
    assert f"the emulated-hosts keeper (pid {keeper})" in message, message
    if victim == "switch holder":
        assert f"the switch's network namespace (pid {switch_holder}) died" in message, message
    assert elapsed < deadline_s / 2, f"noticed after {elapsed:.0f} s: at the deadline, not at the death"
    all_gone(pids, inodes)


# -- the report's verdicts, on made-up sweeps (no namespaces needed) --------------------------------


def made_up_sweep(hosts: int, slowdown: dict[str, float]) -> tuple:
    """Medians that follow the link model at 1 Gbit/s plus 100 µs per call, times ``slowdown``."""
    import pandas as pd

    from lab.results.hosts import link_model_us

    rows = []
    for algorithm in ["ring", "tree", "naive"]:
        for nbytes in [1 << 10, 1 << 20, 64 << 20]:
            model = link_model_us(algorithm, hosts, nbytes, 1.0)
            median = (100 * (1 if algorithm == "tree" else hosts) + model) * slowdown.get(algorithm, 1.0)
            rows.append({
                "hosts": hosts, "link_gbit": 1.0, "algorithm": algorithm, "bytes": nbytes,
                "median_us": median, "link_model_us": model, "cpu_busy": 0.5, "link_use": model / median})
    counted = pd.DataFrame([{
        "hosts": hosts, "rank": 0, "algorithm": "ring", "bytes": 1 << 20,
        "bytes_sent": 2 * (1 << 20) * (hosts - 1) // hosts}])
    return pd.DataFrame(rows), counted


def test_claims_are_confirmed_or_refuted_by_the_figures():
    import pandas as pd

    from lab.results.hosts import claims, models

    frames, counted = zip(*[made_up_sweep(4, {}), made_up_sweep(8, {"naive": 3.0})])
    frame, counted = pd.concat(frames), pd.concat(counted)
    verdicts = claims(frame, models(frame), counted).set_index(["hosts", "claim"])["verdict"]
    by_claim = {(h, c.rsplit(" (", 1)[0]): v for (h, c), v in verdicts.items()}
    assert by_claim[(4, "ring sends 2T(N-1)/N per rank")] == "confirmed"
    assert by_claim[(4, "ring's time is 2T(N-1)/N·β: the link bound")] == "confirmed"
    assert by_claim[(4, "naive's root link carries (N-1)·T each way: 2(N-1)·T·β")] == "confirmed"
    assert by_claim[(8, "naive's root link carries (N-1)·T each way: 2(N-1)·T·β")] == "refuted"  # 3x slow
    assert by_claim[(4, "tree's depth is log2 N: 2·⌈log2 N⌉·T·β")] == "confirmed"
    assert by_claim[("4->8", "ring's time stays flat from 4 to 8 hosts")] == "confirmed"
    assert by_claim[("4->8", "naive's time grows with N from 4 to 8 hosts")] == "refuted"  # grew 7x, not 7/3
