"""The job's secret under a launcher: what the tcp handshake proves, never put in the store.

It reaches the ranks from their launcher (``lab.spawn`` hands it over its private pipe), from
``LAB_TCP_SECRET`` (the same value on every host), or, on one host, through a file only this
user can read: rank 0 makes it in this user's private directory (:class:`SecretFile`: locked
while in use, removed once every peer has proven the secret, on an error or on SIGTERM) and puts
only its name in the store; the next job sweeps the files of dead ones
(:func:`sweep_stale_secret_files`).

    secret, file = job_secret(store, env, prefix)   # file: rank 0's SecretFile, None elsewhere
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from lab.errors import LabError
from lab.hosts.launchers import LaunchEnv
from lab.hosts.rendezvous import is_loopback

#: An unlocked secret file shorter than a secret is one being made, unless it is this old (its
#: creator died in the microseconds between creating and locking it): see sweep_stale_secret_files.
STALE_UNFINISHED_S = 60.0
_SECRET_BYTES = 32
_SECRET_NAME = re.compile(r"[0-9a-f]{32}")
_FROM_ENVIRONMENT = "LAB_TCP_SECRET"  # the store's secret-file entry when rank 0 has LAB_TCP_SECRET


def _private_directory() -> tuple[int, Path]:
    """This user's private directory for the one-host secret file: an open descriptor (every
    later name is resolved against it, so nothing can be swapped in under a checked path) and
    its path, for messages.

    It is opened without following a symbolic link: in a shared ``/tmp`` anyone can plant
    ``lab-<uid>`` first, as a link to a directory of theirs or to nowhere, and either is refused.
    """
    path = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"lab-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(path):
            raise LabError(
                f"{path} is a symbolic link (to {os.readlink(path)!r}), not this user's private "
                "directory; lab does not follow it: remove it, or set LAB_TCP_SECRET instead") from None
        raise LabError(f"{path} cannot be this user's private directory ({exc.strerror}); remove it, or set "
                       "LAB_TCP_SECRET instead") from None
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise LabError(f"{path} is not a private directory of this user (owner uid {info.st_uid}, mode "
                       f"{stat.S_IMODE(info.st_mode):o}); set LAB_TCP_SECRET instead")
    return fd, path


def sweep_stale_secret_files(directory_fd: int) -> list[str]:
    """Remove the secret files of dead jobs from this user's private directory; returns their names.

    A file's creator holds an exclusive ``flock`` on it for as long as the file exists, and the
    kernel drops the lock when the process dies, however it dies (SIGKILL too): a file whose lock
    can be taken has no living owner. Unlike a recorded pid, a lock cannot be fooled by pid reuse
    or by a job in another pid namespace that shares the directory. The creator locks the file
    right after creating it and only then writes its 32 bytes, so an unlocked file shorter than
    that is one being made at this moment, unless it is older than ``STALE_UNFINISHED_S``.
    """
    removed = []
    for name in os.listdir(directory_fd):
        if not _SECRET_NAME.fullmatch(name):
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory_fd)
        except OSError:
            continue  # removed meanwhile, or not a plain file
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator is alive
            info = os.fstat(fd)
            finished = info.st_size >= _SECRET_BYTES or time.time() - info.st_mtime > STALE_UNFINISHED_S
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and finished:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=directory_fd)
                removed.append(name)
        finally:
            os.close(fd)
    return removed


class SecretFile:
    """Rank 0's file holding a one-host job's secret (``name`` in this user's private directory),
    removed on every exit path that runs code: :meth:`remove` (``Mesh.from_env``'s ``finally``,
    once every peer has proven the secret, or on an error), a SIGTERM handler (torchrun stops the
    other workers with SIGTERM when one fails), and ``atexit``. SIGKILL runs nothing: the file
    stays, but its lock dies with the process and the next job's sweep removes it.
    """
    def __init__(self, secret: bytes) -> None:
        self.name = secrets.token_hex(16)
        self._fd = self._directory_fd = -1
        self._previous: object = None
        self._handling = False
        self._handle_sigterm()  # first: no moment where a SIGTERM would leave the file behind
        try:
            self._directory_fd, self.directory = _private_directory()
            sweep_stale_secret_files(self._directory_fd)
            self._fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                               dir_fd=self._directory_fd)
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # held while the file exists: the sweep's sign of life
            view = memoryview(secret)
            while view:
                view = view[os.write(self._fd, view):]
        except BaseException:
            self.remove()
            raise
        atexit.register(self.remove)

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def remove(self) -> None:
        """Delete the file, close its descriptors, put the SIGTERM handler back. Safe to call again,
        and from the SIGTERM handler in the middle of a call of its own: each step is idempotent,
        and a descriptor is marked closed before it is closed."""
        self._unlink()
        self._restore_sigterm()
        atexit.unregister(self.remove)
        for attribute in ("_fd", "_directory_fd"):
            fd = getattr(self, attribute)
            setattr(self, attribute, -1)
            if fd >= 0:
                os.close(fd)

    def _unlink(self) -> None:
        # By name alone: a random 128-bit name that O_EXCL made is ours if it exists at all, so a
        # SIGTERM between the file's creation and the assignment of its descriptor removes it too.
        if self._directory_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name, dir_fd=self._directory_fd)

    def _handle_sigterm(self) -> None:
        # Python runs signal handlers in the main thread only; from another thread, or where the
        # current handler was set outside Python (it could not be put back), the sweep has to do.
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None:
            return
        self._previous, self._handling = previous, True
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._handling:
            self._handling = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:  # nobody replaced it since
                signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame) -> None:
        """Remove the file, then do what SIGTERM did before: call the previous handler, ignore it,
        or end the process by the signal itself (so the exit status stays "killed by SIGTERM")."""
        self._unlink()
        previous = self._previous
        self._restore_sigterm()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def check_secret_source(env: LaunchEnv) -> None:
    """Ranks on several hosts need ``LAB_TCP_SECRET``: no secret may travel through an
    unauthenticated store (``LabError`` saying so, before anything waits for a peer)."""
    host = os.environ.get("LAB_TCP_HOST", "127.0.0.1")
    if not os.environ.get("LAB_TCP_SECRET") and (env.local_world_size != env.world_size or
                                                 not is_loopback(host)):
        raise LabError(
            "ranks on several hosts need a shared secret: set LAB_TCP_SECRET to the same random "
            "string on every host (e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`; "
            f"launcher: {env.launcher})")


def job_secret(store: dist.TCPStore, env: LaunchEnv, prefix: str) -> tuple[bytes, SecretFile | None]:
    """The job's secret under a launcher: ``LAB_TCP_SECRET``, or on one host a random secret that
    rank 0 writes to a file only this user can read (the store carries only the file's name).

    Returns the secret and, on rank 0, the :class:`SecretFile` to remove once every peer has
    proven it. Ranks on several hosts without ``LAB_TCP_SECRET`` are a ``LabError``
    (:func:`check_secret_source`), and so is a rank without it when rank 0 has it.
    """
    check_secret_source(env)
    key = f"{prefix}/secret-file"
    given = os.environ.get("LAB_TCP_SECRET")
    if given:
        if env.rank == 0:  # a rank without it learns that at once instead of waiting for a file
            store.set(key, _FROM_ENVIRONMENT)
        return given.encode(), None
    if env.rank == 0:
        secret = secrets.token_bytes(_SECRET_BYTES)
        file = SecretFile(secret)
        try:
            store.set(key, file.name)
        except BaseException:
            file.remove()
            raise
        return secret, file
    name = store.get(key).decode()
    if name == _FROM_ENVIRONMENT:
        raise LabError(
            f"rank {env.rank}: rank 0 takes the job's secret from LAB_TCP_SECRET, but this rank has "
            "none: set LAB_TCP_SECRET to the same value on every rank (or, on one host, on none)")
    if not _SECRET_NAME.fullmatch(name):
        raise LabError(f"the store holds no valid secret-file name under {key}")
    return _read_secret_file(name), None


def _read_secret_file(name: str) -> bytes:
    directory_fd, directory = _private_directory()
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory_fd)
        except FileNotFoundError:
            raise LabError(
                f"rank 0's secret file {directory / name} is not on this host: ranks on several hosts "
                "need LAB_TCP_SECRET") from None
        with os.fdopen(fd, "rb") as file:
            if os.fstat(file.fileno()).st_uid != os.getuid():
                raise LabError(f"{directory / name} is not owned by this user")
            secret = file.read()
    finally:
        os.close(directory_fd)
    if len(secret) != _SECRET_BYTES:
        raise LabError(f"{directory / name} holds {len(secret)} bytes, not a {_SECRET_BYTES}-byte secret")
    return secret
