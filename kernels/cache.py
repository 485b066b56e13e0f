"""A guard on Numba's disk cache: compiled code is never older than any source it was built from.

``cache=True`` checks only the compiled function's own file: an entry point compiled into one
file keeps running the old code of a helper in another (a mailbox function, an algorithm, a
constant) after that helper changed. :func:`guard` keeps a digest of a group of sources next to
their cache; where the sources differ from it, it removes the group's cached code (so it compiles
again) and writes the new digest, under a lock, so that ranks importing at once agree.

    guard("kernels", sorted(Path(kernels.__file__).parent.glob("*.py")))   # at import
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numba


def cache_dir(source: Path) -> Path:
    """Where Numba caches the functions of ``source``: ``NUMBA_CACHE_DIR``'s subfolder for its
    folder (named as Numba names it: the folder's name and the SHA-1 of its path), else the
    ``__pycache__`` next to it."""
    folder = source.resolve().parent
    if numba.config.CACHE_DIR:
        hashed = hashlib.sha1(str(folder).encode()).hexdigest()
        return Path(numba.config.CACHE_DIR) / f"{folder.name}_{hashed}"
    return folder / "__pycache__"


def digest(sources: Sequence[Path]) -> str:
    """SHA-256 over the sources' names and bytes, in the order given."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return h.hexdigest()


def guard(group: str, sources: Sequence[Path]) -> bool:
    """Remove the cached code of ``sources`` where any of them changed since the digest of
    ``group`` was written; returns whether it removed any. Where the cache cannot be written
    (a read-only install), Numba does not cache either, and there is nothing to guard."""
    sources = [Path(s) for s in sources]
    stamp = cache_dir(sources[0]) / f"{group}.sources.sha256"
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        with open(stamp, "a+") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released on close: one process checks and clears at a time
            held.seek(0)
            wanted = digest(sources)
            if held.read() == wanted:
                return False
            for source in sources:
                for cached in cache_dir(source).glob(f"{source.stem}.*.nb[ic]"):
                    cached.unlink(missing_ok=True)
            held.seek(0)
            held.truncate()
            held.write(wanted)
            held.flush()
            os.fsync(held.fileno())
            return True
    except OSError:
        return False
