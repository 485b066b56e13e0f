"""Issue 17, found from outside: jobs under torchrun, or started by hand with the variables torchrun
sets (``tests/scripts/launcher_rank.py``: one process per rank, each with its own output), meeting
through ``Mesh.from_env``. A rank started by hand is forked from the forkserver that already
imported torch and the lab (``tests/torch_ranks.py``'s ``ForkedScript``: the script as ``python``
would run it, with only the environment it is given), not a new interpreter that imports them
again (3 CPU s a rank); two torchrun launches stay real.

7. the shm descriptor hand-out of ``transport="auto"`` against strangers (a second process that
   becomes ``nobody``), silent connections of this user, and a full listen queue;
8. the one-host secret file when rank 0 is stopped by SIGTERM or SIGKILL while it waits;
10. a local rank with another ``LAB_TCP_SECRET``, or none when rank 0 has one;
11. nodes with different numbers of ranks, and launchers whose variables contradict each other;
13. a symbolic link, planted or dangling, where the private secret directory belongs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import child_env, free_port
from torch_ranks import ForkedScript

from lab.errors import DeadlineError, LabError
from lab.hosts.job_secret import SecretFile, job_secret, sweep_stale_secret_files
from lab.hosts.rendezvous import LaunchEnv, agree_hosts, host_block, placement_problems
from lab.transport.hand_out import HELLO_TIMEOUT_S, connect_hand_out

# Slow, the whole module: jobs launched as torchrun does, one process per rank.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
RANK = SCRIPTS / "launcher_rank.py"
STRANGER = SCRIPTS / "launcher_shm_stranger.py"
NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0,
                             reason="needs root, to run a second process as another user (nobody)")


def start_rank(rank: int, world_size: int, port: int, xdg: Path, *, group: int | None = 0,
               local: int | None = None, local_world: int | None = None,
               **variables: str | None) -> ForkedScript:
    """One rank with torchrun's variables (``None`` leaves one unset). Every job of these tests
    keeps its secret files under ``xdg`` (``XDG_RUNTIME_DIR``), apart from other jobs', and its
    ranks' output beside them."""
    env = child_env(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), XDG_RUNTIME_DIR=str(xdg))
    env.pop("LAB_TCP_SECRET", None)
    given = {
        "GROUP_RANK": group, "LOCAL_RANK": rank if local is None and group == 0 else local,
        "LOCAL_WORLD_SIZE": world_size if local_world is None and group == 0 else local_world, **variables}
    env.update({name: str(value) for name, value in given.items() if value is not None})
    return ForkedScript(RANK, env, xdg / f"rank{rank}-{secrets.token_hex(4)}.log")


def finish(procs: list[subprocess.Popen | ForkedScript], timeout: float = 150) -> list[str]:
    """Every rank's output once it exits; a rank still running at ``timeout`` is a hang: killed."""
    outputs, hung = [], []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            hung.append(rank)
        outputs.append(out + err[-3000:])
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(outputs)
    return outputs


def kill_all(procs: list[ForkedScript]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def line(output: str, prefix: str) -> str:
    return next((text for text in output.splitlines() if text.startswith(prefix)), "")


def store_get(port: int, key: str) -> str:
    """What a job's store holds under ``key`` (as any local process could read it)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    return store.get(key).decode()


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


# -- 7. the shm hand-out: strangers, silent connections, a full queue --------------------------------


def stranger(name: str, count: int, uid: int) -> subprocess.Popen:
    """Silent connections to a hand-out socket from a second process running as ``uid``."""
    return subprocess.Popen(
        [sys.executable, str(STRANGER), name,
         str(count), str(uid),
         str(4 * HELLO_TIMEOUT_S)], stdout=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen, prefix: str) -> dict:
    text = proc.stdout.readline()
    assert text.startswith(prefix), text
    return json.loads(text[len(prefix):])


def three_ranks_at_the_door(tmp_path: Path) -> tuple[list[ForkedScript], Path, str]:
    """A one-host job of 3 ranks (``auto``) whose local ranks 1 and 2 stop right before they
    connect to local rank 0's hand-out; returns the ranks, the file that lets them go on, and the
    hand-out socket's name (read from the store, as anyone on this host can)."""
    port, go = free_port(), tmp_path / "go"
    ranks = [start_rank(r, 3, port, tmp_path, LAB_TEST_GO=str(go), LAB_TEST_WORK="none") for r in range(3)]
    for proc in ranks[1:]:
        assert proc.stdout.readline().startswith("READY"), finish(ranks)
    return ranks, go, store_get(port, "lab/tcp/shm/0")


@as_root
def test_another_users_connections_are_dropped_at_accept(tmp_path):
    """24 silent connections from nobody (the report's 3 delayed a rank 13 s, 24 failed it with
    EAGAIN): each is accepted and dropped before the hello timeout could have dropped it, none is
    refused for a full queue, and the real ranks then join."""
    ranks, go, name = three_ranks_at_the_door(tmp_path)
    try:
        attacker = stranger(name, 24, NOBODY)
        connected, dropped = report(attacker, "CONNECTED "), report(attacker, "DROPPED ")
        assert attacker.wait(60) == 0
        assert (connected["connected"], connected["errors"]) == (24, []), connected
        assert dropped["open"] == 0, dropped
        assert max(dropped["after_s"]) < HELLO_TIMEOUT_S, dropped  # at accept, not by the hello timeout
        go.touch()
        outputs = finish(ranks)
    finally:
        kill_all(ranks)
    assert all(line(out, "OK rank") for out in outputs), outputs


def test_a_silent_connection_of_this_user_holds_up_no_rank(tmp_path):
    """3 silent connections of this very user, made before the real ranks connect: the ranks are
    served while those wait for their hello timeout, so the hand-out ends (and drops them) before
    that timeout could; served one at a time, the ranks would wait 3 x 5 s behind them."""
    ranks, go, name = three_ranks_at_the_door(tmp_path)
    try:
        attacker = stranger(name, 3, os.getuid())
        connected = report(attacker, "CONNECTED ")
        assert connected["connected"] == 3, connected
        go.touch()
        outputs = finish(ranks)
        dropped = report(attacker, "DROPPED ")
        assert attacker.wait(60) == 0
    finally:
        kill_all(ranks)
    assert all(line(out, "OK rank") for out in outputs), outputs
    assert dropped["open"] == 0, dropped  # nothing of theirs is held after the hand-out
    assert max(dropped["after_s"]) < HELLO_TIMEOUT_S, (dropped, outputs)
    assert all(line(out, "JOINED").endswith("sigterm same") for out in outputs), outputs  # handler put back


def test_a_rank_waits_out_a_full_listen_queue_instead_of_failing():
    """A rank whose connect finds the hand-out's queue full (EAGAIN) retries until there is room."""
    name = b"\0lab-test-" + secrets.token_hex(8).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(name)
        listener.listen(0)
        fillers = []
        while True:  # fill the queue, as a burst of other connections would
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            if filler.connect_ex(name):
                filler.close()
                break
            fillers.append(filler)
        got: dict = {}

        def connect() -> None:
            try:
                got["socket"] = connect_hand_out(name, time.monotonic() + 120, 1)
            except (OSError, LabError) as exc:  # the old client: BlockingIOError at once
                got["error"] = exc

        thread = threading.Thread(target=connect)
        thread.start()
        thread.join(0.3)
        assert "error" not in got, got
        accepted = [listener.accept()[0] for _ in fillers]  # room in the queue
        thread.join(120)
        assert "socket" in got, got
        mine, _ = listener.accept()
        assert struct.unpack("3i", mine.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   12))[0] == os.getpid()
        for sock in (*fillers, *accepted, mine, got["socket"]):
            sock.close()


def test_a_queue_that_stays_full_is_a_deadline_error_naming_the_hand_out():
    name = b"\0lab-test-" + secrets.token_hex(8).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(name)
        listener.listen(0)
        fillers = []
        while True:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            if filler.connect_ex(name):
                filler.close()
                break
            fillers.append(filler)
        with pytest.raises(DeadlineError,
                           match="local rank 2: local rank 0's shm hand-out queue stayed full"):
            connect_hand_out(name, time.monotonic() + 0.2, 2)
        for filler in fillers:
            filler.close()


def test_a_hand_out_nobody_listens_on_is_a_clear_error():
    with pytest.raises(LabError, match="local rank 1: nothing listens at local rank 0's shm hand-out socket"):
        connect_hand_out(b"\0lab-test-" + secrets.token_hex(8).encode(), time.monotonic() + 60, 1)


# -- 8. the secret file: SIGTERM, SIGKILL, the sweep -------------------------------------------------


def rank_zero_holding_its_secret_file(tmp_path: Path, transport: str, **variables) -> tuple[list, int]:
    """A one-host job of 2 ranks without LAB_TCP_SECRET, rank 1 held back right before it joins:
    rank 0 has written its secret file and waits for rank 1. Returns both ranks and the port."""
    port, go = free_port(), tmp_path / f"go-{secrets.token_hex(4)}"
    ranks = [
        start_rank(r, 2, port, tmp_path, LAB_TEST_TRANSPORT=transport, LAB_TEST_GO=str(go),
                   **(variables if r == 0 else {})) for r in range(2)]
    assert ranks[1].stdout.readline().startswith("READY"), finish(ranks)  # it has read rank 0's file
    return ranks, port


def private(tmp_path: Path) -> Path:
    return tmp_path / f"lab-{os.getuid()}"


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_sigterm_while_waiting_for_a_peer_removes_the_secret_file(tmp_path, transport):
    """torchrun stops the other workers with SIGTERM when one fails: the file goes, and the rank
    still dies of the signal (as it would without the lab)."""
    ranks, _ = rank_zero_holding_its_secret_file(tmp_path, transport)
    try:
        assert len(list(private(tmp_path).iterdir())) == 1
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(60) == -signal.SIGTERM
        assert list(private(tmp_path).iterdir()) == []
    finally:
        kill_all(ranks)


def test_sigterm_removes_the_file_and_still_runs_the_programs_own_handler(tmp_path):
    hook = tmp_path / "hook"
    ranks, _ = rank_zero_holding_its_secret_file(tmp_path, "tcp", LAB_TEST_TERM_HOOK=str(hook))
    try:
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(60) == 3  # the program's handler ran (and exited with its own code)
        assert hook.read_text() == "called"
        assert list(private(tmp_path).iterdir()) == []
    finally:
        kill_all(ranks)


def test_a_sigkilled_ranks_file_is_swept_by_the_next_job_but_a_live_jobs_never(tmp_path):
    """SIGKILL runs no code: the file stays until the next job's rank 0 starts, which removes it
    and leaves the file of a job still running (its rank 0 holds the file's lock)."""
    killed, killed_port = rank_zero_holding_its_secret_file(tmp_path, "tcp")
    alive, alive_port = rank_zero_holding_its_secret_file(tmp_path, "auto")
    later: list = []
    try:
        killed_file, alive_file = (private(tmp_path) / store_get(port, "lab/tcp/secret-file")
                                   for port in (killed_port, alive_port))
        killed[0].kill()
        killed[0].wait(60)
        assert killed_file.exists()  # nothing could remove it
        later, later_port = rank_zero_holding_its_secret_file(tmp_path, "tcp")
        later_file = private(tmp_path) / store_get(later_port, "lab/tcp/secret-file")
        assert sorted(private(tmp_path).iterdir()) == sorted([alive_file, later_file])
        for job in (alive, later):
            job[0].send_signal(signal.SIGTERM)
            job[0].wait(60)
        assert list(private(tmp_path).iterdir()) == []
    finally:
        kill_all([*killed, *alive, *later])


def test_the_sweep_keeps_a_file_being_made_and_removes_an_abandoned_one(tmp_path, monkeypatch):
    """Unlocked and shorter than a secret: being made now (kept), or abandoned long ago (removed)."""
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    young, old, finished = (directory / secrets.token_hex(16) for _ in range(3))
    young.write_bytes(b"")
    old.write_bytes(b"")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    finished.write_bytes(secrets.token_bytes(32))
    (directory / "notes.txt").write_bytes(b"")  # not a secret file's name: never touched
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(sweep_stale_secret_files(fd)) == sorted([old.name, finished.name])
    finally:
        os.close(fd)
    assert sorted(p.name for p in directory.iterdir()) == sorted([young.name, "notes.txt"])


def test_a_secret_file_is_removed_once_and_its_sigterm_handler_put_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    file = SecretFile(secrets.token_bytes(32))
    assert file.path.read_bytes() and signal.getsignal(signal.SIGTERM) != before
    file.remove()
    file.remove()
    assert not file.path.exists() and signal.getsignal(signal.SIGTERM) == before


# -- 10. a rank with another secret ------------------------------------------------------------------


def test_a_local_rank_with_another_secret_is_told_so_and_no_rank_waits_for_it(tmp_path):
    """Rank 1's LAB_TCP_SECRET differs (auto, one host): today a JSONDecodeError there and a 60 s
    deadline on rank 0. Rank 1 and rank 0 name the mismatch and LAB_TCP_SECRET; rank 2 is told
    too (or, if it was served first, loses rank 0 at its first collective), and nobody waits out
    a deadline."""
    port, right = free_port(), secrets.token_hex(32)
    ranks = [
        start_rank(r, 3, port, tmp_path, LAB_TCP_SECRET=right if r != 1 else secrets.token_hex(32))
        for r in range(3)]
    outputs = finish(ranks)
    failures = [line(out, "FAILED") for out in outputs]
    assert failures[1].startswith("FAILED LabError: local rank 1: local rank 0"), outputs
    assert failures[0].startswith("FAILED LabError: local rank 0: local rank 1"), outputs
    for failure in failures[:2]:
        assert "secret does not match" in failure and "LAB_TCP_SECRET" in failure, failure
    assert failures[2].startswith(("FAILED LabError", "FAILED PeerLostError")), outputs
    assert not any("DeadlineError" in failure or "JSONDecodeError" in failure
                   for failure in failures), outputs


def test_a_rank_without_the_secret_rank_0_has_says_so_at_once(tmp_path):
    """On one host a rank without LAB_TCP_SECRET looks for rank 0's secret file; when rank 0 has
    the variable instead, it used to wait out the store's 120 s timeout for a file never made."""
    port = free_port()
    ranks = [
        start_rank(r, 2, port, tmp_path, LAB_TEST_TRANSPORT="tcp",
                   LAB_TCP_SECRET=secrets.token_hex(32) if r == 0 else None) for r in range(2)]
    try:
        out, err = ranks[1].communicate(timeout=150)
    finally:
        kill_all(ranks)  # rank 0 waits for rank 1's connection; torchrun would stop it at once
    assert line(
        out,
        "FAILED") == ("FAILED LabError: rank 1: rank 0 takes the job's secret from LAB_TCP_SECRET, but "
                      "this rank has none: set LAB_TCP_SECRET to the same value on every rank (or, on one "
                      "host, on none)"), out + err[-3000:]


# -- 11. where the ranks are: uneven nodes, contradicting launchers ------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_torchrun_nodes_with_different_numbers_of_ranks(transport):
    """Two torchruns, 2 ranks and 1 (torchrun allows that): every rank has the same host map, and
    hierarchical allreduce is right (each rank built the map from its own LOCAL_WORLD_SIZE: the
    allreduce waited out its deadline over tcp; auto refused a layout torchrun made)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    port = free_port()
    env = child_env(LAB_TCP_SECRET=secrets.token_hex(32), LAB_TEST_TRANSPORT=transport)
    jobs = [
        subprocess.Popen([
            torchrun, "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node",
            str(per_node), "--master-addr", "127.0.0.1", "--master-port",
            str(port),
            str(RANK)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for node, per_node in ((0, 2), (1, 1))]
    outputs = finish(jobs, timeout=180)
    lines = sorted(text for out in outputs for text in out.splitlines() if text.startswith("OK"))
    assert lines == [
        "OK rank 0 host 0 local 0 of 2 hosts 2: allreduce ok",
        "OK rank 1 host 0 local 1 of 2 hosts 2: allreduce ok",
        "OK rank 2 host 1 local 0 of 1 hosts 2: allreduce ok"], outputs


def test_ranks_whose_variables_contradict_each_other_fail_at_start_naming_them(tmp_path):
    """A launcher that says LOCAL_WORLD_SIZE=2 to all 3 ranks and no GROUP_RANK: rank 2 is then
    alone on host 1 but claims a partner. Every rank refuses at start-up, naming rank 2, instead
    of a hierarchical allreduce that waits for a rank that is not there."""
    port, secret = free_port(), secrets.token_hex(32)
    ranks = [
        start_rank(r, 3, port, tmp_path, group=None, local_world=2, LAB_TCP_SECRET=secret,
                   LAB_TEST_TRANSPORT="tcp") for r in range(3)]
    outputs = finish(ranks)
    for rank, out in enumerate(outputs):
        assert line(out, "FAILED") == (
            f"FAILED LabError: rank {rank}: the ranks disagree about where they run (GROUP_RANK, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, as their launchers set them): rank 2 on host 1 (GROUP_RANK=1) says LOCAL_WORLD_SIZE=2, "
            "but host 1 has 1 (rank 2)"), outputs
        assert not line(out, "JOINED"), out


@pytest.mark.parametrize(
    "places, problems",
    [
        ([(0, 0, 2), (0, 1, 2), (1, 0, 1)], []),  # uneven and consistent: torchrun with 2 + 1
        ([(1, 0, 1), (0, 0, 2), (0, 1, 2)], []),  # hosts in any order
        ([(0, 0, 2), (0, 1, 2),
          (1, 0, 2)], [("rank 2 on host 1 (GROUP_RANK=1) says LOCAL_WORLD_SIZE=2, but host 1 has 1 "
                        "(rank 2)")]),
        ([(0, 0, 2), (0, 0, 2)], ["ranks 0, 1 on host 0 all say LOCAL_RANK=0"]),
        ([(0, 0, 3), (0, 1, 2),
          (0, 2, 3)], [("rank 1 on host 0 (GROUP_RANK=0) says LOCAL_WORLD_SIZE=2, but host 0 has 3 "
                        "(ranks 0, 1, 2)")]),
        ([(0, 0, 1), (0, 1, 1),
          (1, 0, 1)], [("ranks 0, 1 on host 0 (GROUP_RANK=0) say LOCAL_WORLD_SIZE=1, but host 0 has 2 "
                        "(ranks 0, 1)")])])
def test_placement_problems_name_the_ranks(places, problems):
    assert placement_problems(places) == problems


def test_a_rank_that_never_reports_is_named_when_the_store_gives_up():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=1))
    env = LaunchEnv(rank=0, world_size=3, master_addr="127.0.0.1", master_port=store.port, local_rank=0,
                    local_world_size=3, group_rank=0)
    store.set("lab/tcp/place/0/1", "0,1,3")
    with pytest.raises(DeadlineError,
                       match=r"rank 0: ranks \[2\] did not report where they run within 1 s") as caught:
        agree_hosts(store, env, "lab/tcp")
    assert caught.value.peers == (2,)


def test_auto_refuses_a_node_whose_ranks_are_not_consecutive():
    env = LaunchEnv(rank=2, world_size=4, master_addr="127.0.0.1", master_port=1, local_rank=1,
                    local_world_size=2, group_rank=0)
    assert host_block([0, 0, 1, 1], LaunchEnv(3, 4, "127.0.0.1", 1, 1, 2, 1)) == 2
    with pytest.raises(ValueError, match=r"node 0 holds ranks \[0, 2\]"):
        host_block([0, 1, 0, 1], env)


# -- 13. the private directory: a planted or dangling symbolic link -----------------------------------


def rank_zero_env(port: int) -> LaunchEnv:
    return LaunchEnv(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, local_rank=0,
                     local_world_size=2, group_rank=0)


def test_a_dangling_symlink_for_the_private_directory_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LAB_TCP_SECRET", raising=False)
    link = private(tmp_path)
    link.symlink_to(tmp_path / "nowhere")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(
            LabError, match=f"{link} is a symbolic link .* lab does not follow it: remove it, or set "
            "LAB_TCP_SECRET"):
        job_secret(store, rank_zero_env(store.port), "lab/tcp")
    assert not (tmp_path / "nowhere").exists() and not store.check(["lab/tcp/secret-file"])
    assert signal.getsignal(signal.SIGTERM) == before


@as_root
def test_a_symlink_planted_by_another_user_is_never_followed(monkeypatch):
    """In a shared sticky directory (like /tmp), nobody plants lab-<uid> as a link to a directory
    of its own, open to all: rank 0 refuses it, naming the link, and writes nothing there."""
    shared = Path(tempfile.mkdtemp(prefix="lab-shared-", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        link, target = shared / f"lab-{os.getuid()}", shared / "theirs"
        plant = (
            f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); os.mkdir({str(target)!r}); "
            f"os.chmod({str(target)!r}, 0o777); os.symlink({str(target)!r}, {str(link)!r})")
        planted = subprocess.run([sys.executable, "-c", plant], capture_output=True, text=True, timeout=60,
                                 check=False)
        assert planted.returncode == 0, planted.stderr
        assert link.lstat().st_uid == NOBODY
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
        monkeypatch.delenv("LAB_TCP_SECRET", raising=False)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with pytest.raises(LabError, match=f"{link} is a symbolic link"):
            job_secret(store, rank_zero_env(store.port), "lab/tcp")
        assert list(target.iterdir()) == []
    finally:
        shutil.rmtree(shared)
