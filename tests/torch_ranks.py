"""The ranks of a torch job as torchrun would start them, forked from the lab's forkserver instead.

A torchrun launch costs an agent process and one process per rank that each import torch and the
lab (3-4 CPU seconds apiece on a slow machine). Where a test is about the job, not the launcher,
:func:`run_like_torchrun` starts the same ranks from the forkserver that already imported them
(:func:`lab.launch.forkserver.start_context`), with torchrun's environment: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` naming an agent store this process hosts (as torchrun's agent does,
``TORCHELASTIC_USE_AGENT_STORE=True``) and ``OMP_NUM_THREADS=1``. Each module that claims
torchrun keeps at least one real torchrun launch.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from lab.launch.forkserver import die_with_parent, start_context

#: How long the agent store waits for a rank (a loaded machine's slowest start), as torchrun's does.
STORE_TIMEOUT = timedelta(seconds=300)


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun ``--standalone --nproc-per-node=world_size`` sets in rank ``rank``."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "lab-tests",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1"}


def _rank(target: Callable[..., object], args: tuple, env: dict[str, str], log: str) -> None:
    """In a forked rank: the job's environment alone (not the forkserver's), its output to ``log``."""
    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    with open(log, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    target(*args)
    sys.stdout.flush()
    sys.stderr.flush()


def run_script(path: str, argv: list[str]) -> None:
    """In a rank: the script at ``path`` as ``python path *argv`` runs it (as ``__main__``, its folder
    first on ``sys.path``)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def start_forked(target: Callable[..., object], args: tuple, env: dict[str, str], log: Path,
                 name: str) -> BaseProcess:
    """A process running ``target(*args)`` with the environment ``env`` (and no other), forked from
    the forkserver that imported torch and the lab; its stdout and stderr go to the file ``log``."""
    process = start_context().Process(target=_rank, args=(target, args, env, str(log)), name=name)
    process.start()
    return process


def end(processes: list[BaseProcess], timeout_s: float) -> None:
    """Wait for ``processes`` to end, each within ``timeout_s`` (a hang guard); kill those that did
    not, and raise TimeoutError naming them."""
    try:
        for process in processes:
            process.join(timeout_s)
        hung = [process.name for process in processes if process.is_alive()]
        if hung:
            raise TimeoutError(f"{', '.join(hung)} still running after {timeout_s:.0f} s")
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join()


def run_like_torchrun(target: Callable[..., object], world_size: int, args: tuple, logs: Path,
                      env: dict[str, str], timeout_s: float = 300.0) -> tuple[list[int | None], list[str]]:
    """``target(*args)`` in each of ``world_size`` ranks with torchrun's environment over ``env``;
    once every rank has ended, each rank's exit code and what it wrote (stdout and stderr)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)
    paths = [logs / f"rank{rank}.log" for rank in range(world_size)]
    processes = [
        start_forked(target, args, {**env, **torchrun_env(rank, world_size, store.port)}, paths[rank],
                     f"torch-rank{rank}") for rank in range(world_size)]
    try:
        end(processes, timeout_s)
    finally:
        del store
    return [process.exitcode
            for process in processes], [path.read_text() if path.exists() else "" for path in paths]


def launch(script: str, main: Callable[..., object], n: int, out: Path, env: dict[str, str], torchrun: bool,
           timeout_s: float = 900.0) -> tuple[list[int | None], list[str]]:
    """The job ``python script OUT`` (its ``main(OUT)``) in ``n`` ranks: under a real torchrun launch
    (``torchrun``: each rank's exit is torchrun's, its output torchrun's stderr) or forked as
    :func:`run_like_torchrun` forks them; each rank's exit code and the end of its output."""
    if not torchrun:
        exits, logs = run_like_torchrun(main, n, (str(out),), out, env, timeout_s)
        return exits, [log[-4000:] for log in logs]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script,
        str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
    return [done.returncode] * n, [done.stderr[-4000:]] * n


def result_lines(processes: list[BaseProcess], paths: list[Path], tail: int) -> list[str]:
    """Each rank's first ``RESULT`` line (the words after it), or, where it wrote none, its exit code
    and the last ``tail`` characters of its output."""
    outputs = []
    for process, path in zip(processes, paths, strict=True):
        text = path.read_text() if path.exists() else ""
        lines = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
        outputs.append(lines[0] if lines else f"exit {process.exitcode}: {text[-tail:]}")
    return outputs


class ForkedScript:
    """``python script`` in one process forked from the forkserver (:func:`start_forked`) with the
    environment ``env``, behind the part of :class:`subprocess.Popen`'s interface that tests which
    start ranks one by one use (``stdout.readline``, ``communicate``, ``wait``, ``poll``,
    ``send_signal``, ``kill``). Its stdout and stderr go to one file, ``log``: ``communicate``
    returns them together as stdout (less the lines ``stdout.readline`` took) and ``""`` as stderr.
    """
    def __init__(self, script: Path, env: dict[str, str], log: Path):
        self.log, self.taken = log, 0
        self.process = start_forked(run_script, (str(script), []), env, log, log.stem)
        self.stdout = self

    def readline(self, timeout_s: float = 150.0) -> str:
        """The next whole line it wrote; what is left once it ended, or after ``timeout_s`` (a hang
        guard): ``""`` where it wrote nothing more."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended = not self.process.is_alive()  # before the read: all it wrote is then in the file
            text = self.log.read_text()[self.taken:] if self.log.exists() else ""
            if "\n" in text or ended or time.monotonic() > deadline:
                line = text[:text.index("\n") + 1] if "\n" in text else text
                self.taken += len(line)
                return line
            time.sleep(0.01)

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (``-signal`` for a signal's death), as Popen's; TimeoutExpired while it runs."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.log), timeout)
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.log.read_text()[self.taken:] if self.log.exists() else "", ""

    def send_signal(self, signum: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
