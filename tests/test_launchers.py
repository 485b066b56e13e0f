"""`lab.Mesh.from_env()` under torchrun, MPICH's and Open MPI's mpiexec, and Slurm's srun.

The detection (:mod:`lab.hosts.launchers`) on faked environments, launcher by launcher: what each reads,
the defaults for MASTER_ADDR and MASTER_PORT, precedence when several launchers' variables are
present, half-set environments, and Slurm's compressed host and tasks-per-node lists. Then real
jobs: ``mpiexec -n 3`` (MPICH's, from the venv) over tcp and auto, and three processes with
Slurm's variables faked as srun sets them on two nodes. Each rank allreduces ``index * stride +
rank`` and checks its own result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import child_env

import lab
from lab.hosts import launchers
from lab.hosts.launchers import (
    LaunchEnv,
    derived_port,
    first_host,
    launch_env,
    launcher_env,
    parse_tasks_per_node,
)
from lab.hosts.rendezvous import learn_host_index, serve_store

SCRIPT = Path(__file__).parent / "scripts" / "launched_rank.py"
MPIEXEC = Path(sys.executable).with_name("mpiexec")
#: Every variable a launcher (or a user, for one) sets that launch_env may read.
LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL", "SLURM_", "TORCHELASTIC_", "PMIX_")
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT")


def is_launcher_variable(name: str) -> bool:
    return name in TORCH_NAMES or name.startswith(LAUNCHER_PREFIXES)


@pytest.fixture(autouse=True)
def bare(monkeypatch):
    """No launcher's variables, whatever started pytest; ``set(**variables)`` sets some."""
    for name in list(os.environ):
        if is_launcher_variable(name):
            monkeypatch.delenv(name)

    def set_(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_


def launched_env(**variables: str) -> dict[str, str]:
    """A child's environment: this checkout's lab, no launcher variables but ``variables``."""
    env = {name: value for name, value in child_env().items() if not is_launcher_variable(name)}
    return {**env, **variables}


# -- Slurm's compressed lists --------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node01", "node01"),
        ("node[01-04,07],gpu-a1", "node01"),
        ("node[001-003]", "node001"),
        ("node[7,9-10]", "node7"),
        ("node[010-012],node[001-002]", "node010"),
        ("gpu-a1,node[01-02]", "gpu-a1"),
        ("rack[2-3]-n[008-010]", "rack2-n008"),
        ("n[0]", "n0"),
        ("[5-6]x", "5x"),
        ("127.0.0.[1-2]", "127.0.0.1"),
        ("a.example.org,b.example.org", "a.example.org"),
        ("node[3-4,1]", "node3")  # as written: Slurm keeps the list's order
    ])
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", [
    "", ",node1", "node[01-02", "node01]", "node[]", "node[a-b]", "node[1-]", "node[1,,2]", "node[[1]]",
    "node 01", "node[1-2"])
def test_a_malformed_slurm_host_list_is_a_value_error(nodelist):
    with pytest.raises(ValueError, match="has"):
        first_host(nodelist)


@pytest.mark.parametrize("text, counts", [
    ("1", [1]),
    ("4", [4]),
    ("2(x3)", [2, 2, 2]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,2(x2),3", [1, 2, 2, 3]),
    ("8(x1)", [8]),])
def test_slurm_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text",
                         ["", "x", "2(x)", "2(3)", "0", "2(x0)", "-1", "2,", "2(x3)1", "1(x99999999999)"])
def test_malformed_slurm_tasks_per_node(text):
    with pytest.raises(ValueError):
        parse_tasks_per_node(text)


# -- each launcher, faked ------------------------------------------------------------------------


def test_torchrun_and_env(bare):
    bare(RANK="3", WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", LOCAL_RANK="1",
         LOCAL_WORLD_SIZE="2", GROUP_RANK="1")
    assert launch_env() == LaunchEnv(3, 4, "10.0.0.1", 29500, 1, 2, 1, "env")
    bare(TORCHELASTIC_RUN_ID="none")
    assert launch_env().launcher == "torchrun"


def test_openmpi_on_one_host(bare):
    bare(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="3", OMPI_COMM_WORLD_LOCAL_RANK="1",
         OMPI_COMM_WORLD_LOCAL_SIZE="3", PMIX_NAMESPACE="prterun-vm-4242@1")
    port = derived_port("openmpi:prterun-vm-4242@1")
    assert launch_env() == LaunchEnv(1, 3, "127.0.0.1", port, 1, 3, 0, "openmpi")


def test_openmpi_on_several_hosts_needs_master_addr(bare):
    bare(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
         OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_NAMESPACE="4242")
    with pytest.raises(
            ValueError, match=r"MASTER_ADDR is not set: ranks on several hosts \(OMPI_COMM_WORLD_LOCAL_SIZE"
            r"=4 < OMPI_COMM_WORLD_SIZE=8\).*launcher: openmpi"):
        launch_env()
    bare(MASTER_ADDR="10.0.0.1")
    env = launch_env()
    assert (env.master_addr, env.group_rank, env.local_rank, env.local_world_size) == ("10.0.0.1", None, 1, 4)
    assert "GROUP_RANK" not in launcher_env()  # learnt at from_env from the host names


def test_openmpi_without_a_namespace_needs_master_port(bare, monkeypatch):
    bare(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0",
         OMPI_COMM_WORLD_LOCAL_SIZE="2")
    with pytest.raises(ValueError, match="MASTER_PORT is not set, and there is no PMIX_NAMESPACE"):
        launch_env()
    bare(MASTER_PORT="29555")
    assert launch_env().master_port == 29555


def test_mpich_on_one_host(bare, monkeypatch):
    bare(PMI_RANK="2", PMI_SIZE="3", MPI_LOCALRANKID="2", MPI_LOCALNRANKS="3")
    # pytest's ancestors hold no hydra_pmi_proxy: no port to derive
    with pytest.raises(
            ValueError, match="MASTER_PORT is not set, and no hydra_pmi_proxy is an ancestor.*"
            "launcher: mpich"):
        launch_env()
    monkeypatch.setattr(launchers, "hydra_proxy", lambda: "4242:99")
    assert launch_env() == LaunchEnv(2, 3, "127.0.0.1", derived_port("mpich:4242:99"), 2, 3, 0, "mpich")
    bare(MASTER_ADDR="127.0.0.2", MASTER_PORT="29501")
    assert launch_env() == LaunchEnv(2, 3, "127.0.0.2", 29501, 2, 3, 0, "mpich")


def test_mpich_on_several_hosts_needs_master_addr_and_port(bare, monkeypatch):
    monkeypatch.setattr(launchers, "hydra_proxy", lambda: "4242:99")  # one per host: no use across hosts
    bare(PMI_RANK="2", PMI_SIZE="4", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2", MASTER_ADDR="10.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT is not set, and ranks span several hosts"):
        launch_env()
    bare(MASTER_PORT="29502")
    assert launch_env() == LaunchEnv(2, 4, "10.0.0.1", 29502, 0, 2, None, "mpich")


def test_the_hydra_proxy_is_found_among_the_ancestors(tmp_path):
    """Under a process named hydra_pmi_proxy (python, through a link of that name), its child and
    its grandchild behind a shell both find it: the same pid and start time."""
    proxy = tmp_path / "hydra_pmi_proxy"
    proxy.symlink_to(sys.executable)
    body = ("import os, subprocess, sys; print(os.getpid(), flush=True); "
            "subprocess.run([sys.argv[1], '-c', os.environ['ASK'], os.environ['LAUNCHERS']]); "
            "subprocess.run(['sh', '-c', '\"$0\" -c \"$ASK\" \"$LAUNCHERS\"', sys.argv[1]])")
    ask = "import runpy, sys; print(runpy.run_path(sys.argv[1])['hydra_proxy']())"  # the module alone: no torch, fast
    done = subprocess.run([str(proxy), "-c", body, sys.executable], capture_output=True, text=True,
                          timeout=60, check=False, env=launched_env(ASK=ask, LAUNCHERS=launchers.__file__))
    pid, child, grandchild = done.stdout.split()
    assert child == grandchild and child.split(":")[0] == pid, done.stdout + done.stderr


def test_slurm_on_two_nodes(bare):
    bare(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1",
         SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NODELIST="node[07-08]", SLURM_JOB_ID="4242",
         SLURM_STEP_ID="0")
    assert launch_env() == LaunchEnv(3, 4, "node07", derived_port("slurm:4242.0"), 1, 2, 1, "slurm")
    port = str(derived_port("slurm:4242.0"))
    assert launcher_env() == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "node07", "MASTER_PORT": port}


def test_slurm_uneven_nodes_and_the_job_wide_tasks_per_node(bare):
    bare(SLURM_PROCID="6", SLURM_NTASKS="7", SLURM_LOCALID="0", SLURM_NODEID="3",
         SLURM_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NODELIST="gpu-a1,node[01-03]", SLURM_JOB_ID="7",
         SLURM_STEP_ID="2")
    env = launch_env()
    assert (env.group_rank, env.local_rank, env.local_world_size, env.master_addr) == (3, 0, 1, "gpu-a1")


def test_slurm_on_one_node_stays_on_loopback(bare):
    bare(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_NODEID="0",
         SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="node01", SLURM_JOB_ID="4242", SLURM_STEP_ID="1")
    assert launch_env() == LaunchEnv(1, 2, "127.0.0.1", derived_port("slurm:4242.1"), 1, 2, 0, "slurm")
    bare(MASTER_ADDR="127.0.0.3", MASTER_PORT="29503")
    assert launch_env() == LaunchEnv(1, 2, "127.0.0.3", 29503, 1, 2, 0, "slurm")


@pytest.mark.parametrize("change, message", [
    ({"SLURM_STEP_ID": None}, "SLURM_STEP_ID is not set"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
    ({"SLURM_STEP_NODELIST": None}, "SLURM_STEP_NODELIST is not set"),
    ({"SLURM_STEP_NODELIST": "node[01-02"}, "SLURM_STEP_NODELIST: 'node\\[01-02' has a bracket"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"
      }, r"SLURM_STEP_TASKS_PER_NODE='2\(x3\)' counts 6 tasks, but SLURM_NTASKS=4"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(3)"
      }, r"SLURM_STEP_TASKS_PER_NODE: '2\(3\)' in '2\(3\)' is not a task count"),
    ({"SLURM_STEP_TASKS_PER_NODE": None}, "SLURM_TASKS_PER_NODE is not set"),
    ({"SLURM_NODEID": "2"}, r"SLURM_NODEID must be in \[0, 1\]; got 2"),
    ({"SLURM_LOCALID": "2"}, r"SLURM_LOCALID must be in \[0, 1\]; got 2"),
    ({"SLURM_PROCID": "4"}, r"SLURM_PROCID must be in \[0, 3\]; got 4"),
    ({"SLURM_NTASKS": None}, "SLURM_NTASKS is not set"),
    ({"SLURM_NTASKS": "four"}, "SLURM_NTASKS must be an integer; got 'four'"),])
def test_slurm_errors_name_the_variable(bare, monkeypatch, change, message):
    bare(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1",
         SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NODELIST="node[07-08]", SLURM_JOB_ID="4242",
         SLURM_STEP_ID="0")
    for name, value in change.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message + r".*\(launcher: slurm; srun sets SLURM_PROCID"):
        launch_env()


# -- precedence and half-set environments ---------------------------------------------------------

SLURM = {
    "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "node01", "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0"}
MPICH = {
    "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "29504"}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "PMIX_NAMESPACE": "x"}
TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29505",
    "TORCHELASTIC_RUN_ID": "r"}


@pytest.mark.parametrize(
    "present, launcher, rank",
    [
        ({**SLURM, **MPICH, **OPENMPI, **TORCHRUN
          }, "torchrun", 3),  # torchrun started inside an MPI or Slurm job
        ({**SLURM, **MPICH, **OPENMPI}, "openmpi", 2),
        ({**SLURM, **MPICH}, "mpich", 1),  # Hydra inside a Slurm allocation: the ranks are Hydra's
        ({**SLURM, "PMI_RANK": "0", "PMI_SIZE": "1"
          }, "slurm", 0),  # srun --mpi=pmi2 sets PMI_RANK, not Hydra's
        (SLURM, "slurm", 0)])
def test_precedence(bare, present, launcher, rank):
    bare(**present)
    env = launch_env()
    assert (env.launcher, env.rank) == (launcher, rank)


@pytest.mark.parametrize("present, message", [
    ({"RANK": "0"}, r"WORLD_SIZE is not set \(launcher: env; torchrun sets"),
    ({"WORLD_SIZE": "2"}, r"RANK is not set \(launcher: env"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, r"MASTER_PORT is not set \(launcher: env"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "r"
      }, r"MASTER_ADDR is not set \(launcher: torchrun"),
    ({"OMPI_COMM_WORLD_RANK": "0"
      }, r"OMPI_COMM_WORLD_SIZE is not set \(launcher: openmpi; Open MPI's mpirun"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_SIZE is not set"),
    ({"PMI_RANK": "0"}, r"PMI_SIZE is not set \(launcher: mpich; MPICH's mpiexec sets"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALNRANKS is not set"),
    ({"MPI_LOCALRANKID": "0"}, "PMI_SIZE is not set"),
    ({"SLURM_PROCID": "0"}, r"SLURM_NTASKS is not set \(launcher: slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "SLURM_TASKS_PER_NODE is not set"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "WORLD_SIZE is not set, nor any other launcher's"),
    ({}, "run under torchrun, mpiexec \\(MPICH or Open MPI\\) or srun")])
def test_a_half_set_environment_names_what_is_missing(bare, present, message):
    bare(**present)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        lab.Mesh.from_env()
    assert time.monotonic() - started < 1  # before any connection attempt


# -- the helpers ----------------------------------------------------------------------------------


def test_derived_ports_agree_and_stay_below_the_ephemeral_range():
    ports = {derived_port(f"slurm:{job}.0") for job in range(2000)}
    assert all(launchers.DERIVED_PORTS.start <= port < launchers.DERIVED_PORTS.stop for port in ports)
    assert len(ports) > 1800  # spread out: two jobs rarely meet
    assert derived_port("mpich:1:2") == derived_port("mpich:1:2")


TORCH_FIELDS = ("rank", "world_size", "master_addr", "master_port", "local_rank", "local_world_size",
                "group_rank")


def test_launcher_env_gives_torch_what_it_reads(bare, monkeypatch):
    """Under mpiexec, ``os.environ.update(lab.launcher_env())`` makes torch's names say the same."""
    monkeypatch.setattr(launchers, "hydra_proxy", lambda: "4242:99")
    bare(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2")
    want = {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(derived_port("mpich:4242:99"))}
    assert lab.launcher_env() == want
    before = launch_env()
    bare(**lab.launcher_env())  # what the docstring tells a torch program to do
    after = launch_env()
    assert after.launcher == "env" and after == LaunchEnv(*[getattr(before, f) for f in TORCH_FIELDS], "env")


def test_learn_host_index_numbers_hosts_by_their_first_rank(monkeypatch):
    """mpiexec across hosts: the ranks' host names, in rank order b, b, a, c, a -> hosts 0, 0, 1, 2, 1."""
    store = serve_store()
    names = ["b", "b", "a", "c", "a"]
    for rank, name in enumerate(names):
        if rank != 3:
            store.set(f"lab/tcp/hostname/0/{rank}", name)
    monkeypatch.setattr("socket.gethostname", lambda: "c")
    env = LaunchEnv(3, 5, "127.0.0.1", store.port, 0, 1, None, "mpich")
    assert learn_host_index(store, env, "lab/tcp") == LaunchEnv(3, 5, "127.0.0.1", store.port, 0, 1, 2,
                                                                "mpich")


# -- real jobs ------------------------------------------------------------------------------------


def mpiexec_unusable() -> str | None:
    if not MPIEXEC.exists():
        return f"no mpiexec beside {sys.executable} (pip install -e '.[peers]' brings MPICH's)"
    for _ in range(3):  # (on a loaded machine the probe once failed, saying nothing, and passed again)
        try:
            probe = subprocess.run([str(MPIEXEC), "-n", "1", "true"], capture_output=True, text=True,
                                   timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return f"{MPIEXEC} -n 1 true did not finish within 30 s"
        if probe.returncode == 0:
            return None
    return f"{MPIEXEC} -n 1 true failed three times (exit {probe.returncode}): {probe.stderr.strip()[-300:]}"


def outputs_ok(lines: str, world_size: int, launcher: str) -> list[str]:
    oks = sorted(line for line in lines.splitlines() if line.startswith("OK rank"))
    assert [line.split()[2] for line in oks] == [str(r) for r in range(world_size)], lines
    assert all(f"launcher {launcher}" in line for line in oks), lines
    return oks


@pytest.mark.slow  # (a launch: mpiexec's three ranks each import torch and the lab)
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_mpiexec_job(transport):
    """``mpiexec -n 3``: launch_env reads Hydra's variables, derives the port from the
    hydra_pmi_proxy every rank shares, and rank 0 hosts the store on loopback."""
    reason = mpiexec_unusable()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable,
                           str(SCRIPT), transport], capture_output=True, text=True, timeout=120, check=False,
                          env=launched_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    oks = outputs_ok(done.stdout, 3, "mpich")
    assert all(f"local {r}/3 host 0" in line for r, line in enumerate(oks)), oks
    assert len({line.split("port ")[1] for line in oks}) == 1, oks  # every rank derived the same port


@pytest.mark.slow
def test_faked_srun_job_on_two_nodes():
    """Three processes with Slurm's variables as srun sets them for ``-N 2 -n 3`` (2 tasks on the
    first node, 1 on the second): the store's host is the first host of SLURM_STEP_NODELIST, the
    port comes from the job and step ids, and transport="auto" joins the "nodes" over tcp."""
    job = str(os.getpid())
    placement = [(0, 0), (0, 1), (1, 0)]  # (SLURM_NODEID, SLURM_LOCALID) of each task
    ranks = [
        subprocess.Popen([sys.executable, str(SCRIPT), "auto"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=launched_env(SLURM_PROCID=str(rank), SLURM_NTASKS="3", SLURM_NODEID=str(node),
                                          SLURM_LOCALID=str(local), SLURM_STEP_TASKS_PER_NODE="2,1",
                                          SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_JOB_ID=job,
                                          SLURM_STEP_ID="0", LAB_TCP_SECRET="faked-srun"))
        for rank, (node, local) in enumerate(placement)]
    try:
        results = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, (out, err) in zip(ranks, results):
        assert rank.returncode == 0, out + err[-3000:]
    oks = outputs_ok("".join(out for out, _ in results), 3, "slurm")
    assert [line.split(" local ")[1].split(" port")[0]
            for line in oks] == ["0/2 host 0", "1/2 host 0", "0/1 host 1"]
    assert all(line.endswith(f"port {derived_port(f'slurm:{job}.0')}") for line in oks), oks


def test_launch_env_positional_fields_keep_their_order():
    """LaunchEnv's first seven fields are what they were (positional callers); launcher defaults to "env"."""
    env = LaunchEnv(3, 4, "127.0.0.1", 1, 1, 2, 1)
    assert (env.group_rank, env.launcher) == (1, "env")
