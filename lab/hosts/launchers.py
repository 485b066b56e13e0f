"""Which launcher started this process, and what it says about this rank: torchrun, MPICH's or Open
MPI's ``mpiexec``, or Slurm's ``srun``.

:func:`launch_env` reads the first launcher it finds, in this order (a process under ``mpiexec``
inside a Slurm job sees both sets; the launcher nearest to the process wins):

========== ================================================================================
launcher   variables read
========== ================================================================================
torchrun   ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and where set ``LOCAL_RANK``,
           ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (``"env"`` when something else set them: no
           ``TORCHELASTIC_RUN_ID``)
openmpi    ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
           ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI's documented four; ``..._NODE_RANK`` counts
           across all jobs of a node, so it is not read), ``PMIX_NAMESPACE`` for the port
mpich      ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS`` (what MPICH's and
           Intel MPI's Hydra set; srun's PMI plugins set ``PMI_RANK`` too, but not the last two)
slurm      ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID`` (the host index),
           ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``), ``SLURM_STEP_NODELIST``,
           ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` for the port
========== ================================================================================

``MASTER_ADDR``/``MASTER_PORT`` (where rank 0 hosts the store) are taken from the environment
when set. Otherwise, on one host: ``127.0.0.1``; Slurm on several nodes: the first host of
``SLURM_STEP_NODELIST`` (rank 0 runs there); mpiexec on several hosts: ``MASTER_ADDR`` is
required. The port is derived from something every rank of the job sees identically
(:func:`derived_port`): Slurm's job and step ids, Open MPI's PMIx namespace, or on one host the
pid of MPICH's ``hydra_pmi_proxy`` (every rank's parent); where there is none, ``MASTER_PORT`` is
required. Neither MPI launcher numbers hosts: on several hosts the ranks learn their host index
from each other's host names through the store (:func:`lab.hosts.rendezvous.learn_host_index`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

#: Where a port derived from the job lies: below Linux's ephemeral range (32768-60999), so no
#: outgoing connection of this host holds it.
DERIVED_PORTS = range(20000, 32000)
#: At most this many nodes in a tasks-per-node list (the lab's largest world size).
_MAX_NODES = 1 << 24

_TORCH = "torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
#: What each launcher sets, for the messages.
LAUNCHER_SETS = {
    "torchrun": _TORCH, "env": _TORCH,
    "openmpi": "Open MPI's mpirun sets OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK "
    "and OMPI_COMM_WORLD_LOCAL_SIZE",
    "mpich": "MPICH's mpiexec sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and MPI_LOCALNRANKS",
    "slurm": "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE and "
    "SLURM_STEP_NODELIST"}


@dataclass(frozen=True)
class LaunchEnv:
    """This rank, as its launcher describes it (checked by :func:`launch_env`).

    ``group_rank`` is the index of this rank's host; ``None`` where the launcher does not say
    (mpiexec on several hosts: :func:`lab.hosts.rendezvous.learn_host_index` fills it in).
    ``launcher`` names whose variables were read: ``"torchrun"``, ``"env"`` (torchrun's names set
    by something else), ``"openmpi"``, ``"mpich"`` or ``"slurm"``.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int
    group_rank: int | None
    launcher: str = "env"


@dataclass(frozen=True)
class _Reader:
    """Reads one launcher's variables; every error names the variable and the launcher."""

    launcher: str

    def error(self, message: str) -> ValueError:
        return ValueError(f"{message} (launcher: {self.launcher}; {LAUNCHER_SETS[self.launcher]})")

    def int(self, name: str, low: int, high: int | None = None, default: int | None = None) -> int:
        text = os.environ.get(name)
        if text is None:
            if default is not None:
                return default
            raise self.error(f"environment variable {name} is not set")
        try:
            value = int(text)
        except ValueError:
            raise self.error(f"environment variable {name} must be an integer; got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise self.error(f"environment variable {name} must be {bound}; got {value}")
        return value

    def required(self, name: str) -> str:
        text = os.environ.get(name)
        if not text:
            raise self.error(f"environment variable {name} is not set")
        return text

    def master(self, default_addr: Callable[[], str], port_seed: Callable[[], str]) -> tuple[str, int]:
        """``MASTER_ADDR``/``MASTER_PORT`` where set, else the launcher's defaults (each of which
        raises, naming what is missing, when there is none)."""
        addr = os.environ.get("MASTER_ADDR") or default_addr()
        if os.environ.get("MASTER_PORT"):
            return addr, self.int("MASTER_PORT", 1, 65535)
        return addr, derived_port(port_seed())


def derived_port(seed: str) -> int:
    """A port in :data:`DERIVED_PORTS` that every rank computes alike from the same ``seed``.

        >>> derived_port("slurm:4242.0") == derived_port("slurm:4242.0")
        True
    """
    digest = hashlib.sha256(seed.encode()).digest()
    return DERIVED_PORTS.start + int.from_bytes(digest[:8], "big") % len(DERIVED_PORTS)


def detect_launcher() -> str | None:
    """The launcher whose variables this process has, by precedence (module docstring), or None.

        # srun -n 4 python job.py
        detect_launcher()    # 'slurm'
    """
    environ = os.environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return "torchrun" if environ.get("TORCHELASTIC_RUN_ID") else "env"
    if any(name.startswith("OMPI_COMM_WORLD_") for name in environ):
        return "openmpi"
    hydra = "MPI_LOCALRANKID" in environ or "MPI_LOCALNRANKS" in environ
    if hydra or (("PMI_RANK" in environ or "PMI_SIZE" in environ) and "SLURM_PROCID" not in environ):
        return "mpich"
    if "SLURM_PROCID" in environ:
        return "slurm"
    return None


def launch_env() -> LaunchEnv:
    """Read and check this rank's launcher variables (``ValueError`` naming the variable and the
    launcher; a half-set environment, e.g. ``RANK`` without ``WORLD_SIZE``, names what is missing).

        # mpiexec -n 4 python job.py
        env = launch_env()   # LaunchEnv(rank=1, world_size=4, master_addr='127.0.0.1', ..., launcher='mpich')
    """
    launcher = detect_launcher()
    if launcher is None:
        raise ValueError(
            "environment variable WORLD_SIZE is not set, nor any other launcher's variables: run under "
            "torchrun, mpiexec (MPICH or Open MPI) or srun, or set RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT")
    return _READERS[launcher](_Reader(launcher))


def launcher_env() -> dict[str, str]:
    """torch's launcher variables for this rank, from whatever launcher started it: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and,
    where the launcher says, ``GROUP_RANK`` (not under mpiexec on several hosts). torch's
    ``env://`` reads only torchrun's names; under ``mpiexec`` or ``srun``::

        os.environ.update(lab.launcher_env())
        torch.distributed.init_process_group("gloo")     # env://

    Note that torch's own store (rank 0's, on ``MASTER_PORT``) listens on every interface.
    """
    env = launch_env()
    variables = {
        "RANK": env.rank, "WORLD_SIZE": env.world_size, "LOCAL_RANK": env.local_rank,
        "LOCAL_WORLD_SIZE": env.local_world_size, "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port}
    if env.group_rank is not None:
        variables["GROUP_RANK"] = env.group_rank
    return {name: str(value) for name, value in variables.items()}


def _torch(read: _Reader) -> LaunchEnv:
    world_size = read.int("WORLD_SIZE", 1)
    rank = read.int("RANK", 0, world_size - 1)
    port = read.int("MASTER_PORT", 1, 65535)
    addr = read.required("MASTER_ADDR")
    local_world_size = read.int("LOCAL_WORLD_SIZE", 1, world_size, default=world_size)
    local_rank = read.int("LOCAL_RANK", 0, local_world_size - 1, default=rank % local_world_size)
    group_rank = read.int("GROUP_RANK", 0, None, default=rank // local_world_size)
    return LaunchEnv(rank, world_size, addr, port, local_rank, local_world_size, group_rank, read.launcher)


def _mpi(read: _Reader, names: tuple[str, str, str, str], port_seed: Callable[[bool], str]) -> LaunchEnv:
    """An MPI launcher's (size, rank, local size, local rank) variables; ``port_seed(one_host)``."""
    size_name, rank_name, local_size_name, local_rank_name = names
    world_size = read.int(size_name, 1)
    rank = read.int(rank_name, 0, world_size - 1)
    local_world_size = read.int(local_size_name, 1, world_size)
    local_rank = read.int(local_rank_name, 0, local_world_size - 1)
    one_host = local_world_size == world_size

    def default_addr() -> str:
        if one_host:
            return "127.0.0.1"
        raise read.error(
            f"environment variable MASTER_ADDR is not set: ranks on several hosts ({local_size_name}="
            f"{local_world_size} < {size_name}={world_size}) need rank 0's host address in MASTER_ADDR")

    addr, port = read.master(default_addr, lambda: port_seed(one_host))
    return LaunchEnv(rank, world_size, addr, port, local_rank, local_world_size, 0 if one_host else None,
                     read.launcher)


def _openmpi(read: _Reader) -> LaunchEnv:
    def seed(one_host: bool) -> str:
        namespace = os.environ.get("PMIX_NAMESPACE")
        if not namespace:
            raise read.error(
                "environment variable MASTER_PORT is not set, and there is no PMIX_NAMESPACE to derive "
                "one from: set MASTER_PORT to the same free port on every rank")
        return f"openmpi:{namespace}"

    return _mpi(read, ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK"), seed)


def _mpich(read: _Reader) -> LaunchEnv:
    def seed(one_host: bool) -> str:
        proxy = hydra_proxy() if one_host else None
        if proxy is None:
            where = "no hydra_pmi_proxy is an ancestor of this process" if one_host else "ranks span several hosts"
            raise read.error(
                f"environment variable MASTER_PORT is not set, and {where} to derive one from: set "
                "MASTER_PORT to the same free port on every rank (mpiexec -env MASTER_PORT 29500 ...)")
        return f"mpich:{proxy}"

    return _mpi(read, ("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"), seed)


def hydra_proxy() -> str | None:
    """``"<pid>:<start time>"`` of the nearest ``hydra_pmi_proxy`` among this process's ancestors
    (Hydra runs one per host and every rank of the host is its child), or None."""
    pid = os.getppid()
    for _ in range(64):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/stat") as file:
                stat = file.read()
        except OSError:
            return None
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()  # from field 3 (state) on
        if name == "hydra_pmi_proxy":
            return f"{pid}:{fields[19]}"  # field 22: start time, in clock ticks since boot
        pid = int(fields[1])
    return None


def _slurm(read: _Reader) -> LaunchEnv:
    world_size = read.int("SLURM_NTASKS", 1)
    rank = read.int("SLURM_PROCID", 0, world_size - 1)
    counts_name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in os.environ else "SLURM_TASKS_PER_NODE"
    text = read.required(counts_name)
    try:
        counts = parse_tasks_per_node(text)
    except ValueError as exc:
        raise read.error(f"environment variable {counts_name}: {exc}") from None
    if sum(counts) != world_size:
        raise read.error(f"environment variable {counts_name}={text!r} counts {sum(counts)} tasks, but "
                         f"SLURM_NTASKS={world_size}")
    group_rank = read.int("SLURM_NODEID", 0, len(counts) - 1)
    local_world_size = counts[group_rank]
    local_rank = read.int("SLURM_LOCALID", 0, local_world_size - 1)

    def default_addr() -> str:
        if len(counts) == 1:
            return "127.0.0.1"
        nodes = read.required("SLURM_STEP_NODELIST")
        try:
            return first_host(nodes)
        except ValueError as exc:
            raise read.error(f"environment variable SLURM_STEP_NODELIST: {exc}") from None

    def seed() -> str:
        return f"slurm:{read.required('SLURM_JOB_ID')}.{read.required('SLURM_STEP_ID')}"

    addr, port = read.master(default_addr, seed)
    return LaunchEnv(rank, world_size, addr, port, local_rank, local_world_size, group_rank, read.launcher)


_READERS: dict[str, Callable[[_Reader], LaunchEnv]] = {
    "torchrun": _torch, "env": _torch, "openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm}

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_RANGES = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks per node, one count per node in node order.

        >>> parse_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    runs = []
    for item in text.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise ValueError(f"{item!r} in {text!r} is not a task count N >= 1 or N(xK)")
        runs.append((int(match[1]), int(match[2] or 1)))
    if sum(repeat for _, repeat in runs) > _MAX_NODES:
        raise ValueError(f"{text!r} lists more than {_MAX_NODES} nodes")
    return [count for count, repeat in runs for _ in range(repeat)]


def first_host(nodelist: str) -> str:
    """The first host of Slurm's compressed host list (what ``scontrol show hostnames`` prints
    first), without calling ``scontrol``: the first comma-separated item outside brackets, each
    bracket replaced by its first number as written (zero padding kept).

        >>> first_host("node[01-04,07],gpu-a1")
        'node01'
        >>> first_host("rack[2-3]-n[008-010]")
        'rack2-n008'
    """
    host, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        char = nodelist[i]
        if char == "[":
            end = nodelist.find("]", i)
            ranges = nodelist[i + 1:end] if end > 0 else ""
            if end < 0 or not _RANGES.fullmatch(ranges):
                raise ValueError(f"{nodelist!r} has a bracket that is not [N], [N-M] or a comma list of them")
            host.append(re.match(r"\d+", ranges)[0])
            i = end + 1
        elif char == "]" or char.isspace():
            raise ValueError(f"{nodelist!r} has {char!r} at {i} outside a bracket")
        else:
            host.append(char)
            i += 1
    if not host:
        raise ValueError(f"{nodelist!r} has no host first")
    return "".join(host)
