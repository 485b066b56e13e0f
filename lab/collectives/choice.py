"""Which algorithm a collective runs: the one named, ``LAB_ALGO``'s, or ``"auto"``'s pick.

``"auto"`` asks the fitted models (:mod:`lab.tuning`) for the fastest algorithm at this size, world
size and transport, prefers a compilable algorithm where the compiled path takes the tensor
(:mod:`lab.compiled.plane`), and weighs ``"hierarchical"``, ``"ring_channels"`` and ``"chain_tree"`` for an
allreduce across hosts.

    pick(mesh, "allreduce", "auto", 4 << 20)     # the fitted models' fastest for 4 MiB, e.g. "ring"
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lab import tuning
from lab.algorithms import registry

if TYPE_CHECKING:
    from lab.comm.protocols import CallMesh

#: Every collective's algorithms, by name (``"auto"`` picks one of them; see :func:`choose`): the
#: registry's entries (:mod:`lab.algorithms.registry`), each callable. reduce and barrier have one each.
ALGORITHMS: dict[str, dict[str, registry.Algorithm]] = registry.ALGORITHMS

#: CPython's os.environ keeps the environment in this dict of bytes (set and deleted through
#: os.environ, as LAB_ALGO is): a plain call reads it at every call, and ``os.environ.get`` costs
#: 0.5 µs where the dict's ``get`` costs 20 ns.
_ENVIRON_BYTES = getattr(os.environ, "_data", None)


def lab_algo() -> Any:
    """``LAB_ALGO`` as set now, as a key of what depends on it (not to be parsed: see
    :func:`forced_algorithm`)."""
    if type(_ENVIRON_BYTES) is dict:
        return _ENVIRON_BYTES.get(b"LAB_ALGO", b"")
    return os.environ.get("LAB_ALGO", "")


def forced_algorithm(collective: str) -> str | None:
    """The algorithm ``LAB_ALGO`` forces on ``collective``, or None (like ``NCCL_ALGO``).

    ``LAB_ALGO`` is a comma-separated list of names, each either ``algorithm`` (applies to every
    collective that has an algorithm of that name: ``ring`` forces allreduce, allgather and
    reduce_scatter and leaves broadcast alone) or ``collective=algorithm`` (that collective
    only; it wins over a bare name). A name no collective has is a ``ValueError`` naming
    ``LAB_ALGO``, raised by every collective that consults it.

        LAB_ALGO=ring                                   # ring wherever there is one
        LAB_ALGO=allreduce=tree,broadcast=scatter_allgather
    """
    targeted, bare = {}, []
    for entry in filter(None, (e.strip() for e in os.environ.get("LAB_ALGO", "").split(","))):
        target, _, name = (part.strip() for part in entry.rpartition("="))
        if target and name not in ALGORITHMS.get(target, {}):
            expected = (", ".join(f"{target}={a}" for a in ALGORITHMS[target])
                        if target in ALGORITHMS else f"a collective among {', '.join(ALGORITHMS)}")
            raise ValueError(f"LAB_ALGO entry {entry!r} is not valid; expected {expected}")
        if not target and not any(name in algorithms for algorithms in ALGORITHMS.values()):
            known = sorted({a for algorithms in ALGORITHMS.values() for a in algorithms})
            raise ValueError(f"LAB_ALGO must name algorithms among {', '.join(known)}; got {name!r}")
        if target:
            targeted[target] = name
        else:
            bare.append(name)
    if collective in targeted:
        return targeted[collective]
    return next((name for name in bare if name in ALGORITHMS[collective]), None)


#: choose()'s answers: ``auto`` is decided once per (collective, size, N, transport, LAB_ALGO, models)
#: instead of on every call (parsing LAB_ALGO and comparing every model cost ~10 µs a call).
_CHOICES: dict[tuple, str] = {}
_MAX_CHOICES = 4096


def choose(collective: str, nbytes: int, world_size: int, transport: str) -> str:
    """The algorithm ``"auto"`` runs for ``collective`` on an ``nbytes`` tensor: ``LAB_ALGO``'s
    if it names one of this collective's, else the fitted model's fastest (:mod:`lab.tuning`)."""
    key = (collective, nbytes, world_size, transport, lab_algo(), tuning.fitted_models)
    chosen = _CHOICES.get(key)
    if chosen is None:
        chosen = forced_algorithm(collective) or tuning.choose(nbytes, world_size, transport, collective)
        if len(_CHOICES) >= _MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[key] = chosen
    return chosen


def check_algorithm(algorithm: Any, collective: str = "allreduce") -> str:
    """``algorithm`` if ``collective`` has it (or it is ``"auto"``), else a ``ValueError`` listing them."""
    if isinstance(algorithm, str) and algorithm in ALGORITHMS[collective]:
        return algorithm
    choices = [*ALGORITHMS[collective], "auto"]
    if algorithm not in choices:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, choices))}; got {algorithm!r}")
    return algorithm


def pick(mesh: CallMesh, collective: str, algorithm: str, nbytes: int) -> str:
    """Check ``algorithm`` (before any communication) and resolve ``"auto"``.

    A mesh across hosts (``hosts=``, torchrun's nodes) lets allreduce's ``auto`` weigh
    ``"hierarchical"``, ``"ring_channels"`` and ``"chain_tree"`` against the flat algorithms
    (:func:`lab.tuning.choose_across_hosts`);
    ``transport="auto"`` reads the ``shm`` fits inside one host and the ``tcp`` fits across hosts.
    The answer is kept per (collective, size, mesh shape, ``LAB_ALGO``, models), as :func:`choose`'s.
    """
    if algorithm != "auto" or collective not in ALGORITHMS:
        return check_algorithm(algorithm, collective)
    compiled_max_bytes = mesh.compiled_max_bytes  # 0: no compiled path
    key = (collective, nbytes, mesh.world_size, mesh.transport, mesh.host_count, 0 < compiled_max_bytes and
           nbytes <= compiled_max_bytes, lab_algo(), tuning.fitted_models)
    chosen = _PICKS.get(key)
    if chosen is None:
        chosen = _auto(*key[:6])
        if len(_PICKS) >= _MAX_CHOICES:
            _PICKS.clear()
        _PICKS[key] = chosen
    return chosen


_PICKS: dict[tuple, str] = {}


def _auto(collective: str, nbytes: int, world_size: int, transport: str, hosts: int, compiled: bool) -> str:
    """``"auto"``'s pick (see :func:`pick`); ``compiled``: the compiled path takes the tensor."""
    # Small enough for the compiled path (lab.compiled.plane): the model's pick if it compiles, else the
    # collective's first compilable algorithm (one Numba call beats a Python exchange).
    if compiled and not forced_algorithm(collective):
        compilable = registry.compiled(collective)
        if compilable:
            chosen = choose(collective, nbytes, world_size, "shm")
            return chosen if chosen in compilable else compilable[0]
    if hosts > 1 and collective == "allreduce" and transport in ("tcp",
                                                                 "auto") and not forced_algorithm(collective):
        return tuning.choose_across_hosts(nbytes, world_size, hosts, "shm" if transport == "auto" else "tcp")
    if transport == "auto":
        transport = "tcp" if hosts > 1 else "shm"
    return choose(collective, nbytes, world_size, transport)
