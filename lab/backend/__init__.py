"""The lab as a ``torch.distributed`` backend: ``dist.init_process_group("lab")``.

``import lab`` registers the name ``"lab"`` (as out-of-tree backends do on import). A torch
program then runs on the lab's algorithms, deadlines, mismatch detection, flight recorder,
counters and trace by changing one word::

    import torch.distributed as dist                # after the lab's package is imported
    dist.init_process_group("lab")                  # torchrun, tcp://, file:// or store=
    dist.all_reduce(grads)                          # lab.allreduce on the group's mesh
    model = torch.nn.parallel.DistributedDataParallel(model)   # DDP, FSDP2, DeviceMesh: unmodified

The world is one :class:`lab.Mesh` built from the store torch hands over
(:meth:`lab.Mesh.from_store`; ``transport="auto"``: shared memory inside a host, TCP across).
``new_group`` makes a sub-mesh of it: the same channels, a context id agreed through the store,
no new socket, and an issue order of its own (its own communication thread), so that groups
progress independently, whatever order and thread each rank issues their calls in, as gloo's do.
``timeout=`` of ``init_process_group`` is the lab's silence deadline;
``pg_options=lab.backend.Options(...)`` takes the rest.

Every call returns a :class:`LabWork` at once and runs on its group's communication thread in
issue order. ``wait()`` raises ``torch.distributed.DistBackendError`` carrying the lab's message
(rank, peer, collective, step) and the group's flight recorder, with the lab's exception as its
``__cause__``. A failed collective's future is completed with a value that raises that same
error when anything reads it (torch's C++ consumers, DDP among them, crash on a future completed
with an exception): DDP's ``backward()`` then raises a ``RuntimeError`` carrying its message
(torch's C++ converts it; docs/backend.md says what a training loop catches).

Inside ``lab.spawn``/``lab.launch`` (any transport, emulated hosts included), the rank's own mesh
becomes torch's world instead (:func:`init_process_group`)::

    def train(mesh):                                 # lab.spawn(train, 4, hosts=4, transport="tcp")
        lab.backend.init_process_group(mesh)         # torch's default group over the pool's mesh
        model = torch.nn.parallel.DistributedDataParallel(model)
        ...
        dist.destroy_process_group()                 # the mesh stays open: it is the pool's

Here: the creator torch calls; the process group is :class:`lab.backend.group.LabProcessGroup`,
torch's arguments as it takes them :mod:`lab.backend.args` (``Options`` among them, re-exported
here), its handles :class:`lab.backend.work.LabWork`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

from lab import checks
from lab.backend.args import NAME, Options
from lab.backend.group import LabProcessGroup
from lab.backend.work import LabWork
from lab.comm.mesh import Mesh
from lab.errors import LabError
from lab.fingerprint import MAX_CONTEXT
from lab.hosts.rendezvous import env_store, pool_store

#: Sub-groups' context ids count down from here (``Mesh.split``'s count up from 1).
_GROUP_CONTEXT_TOP = MAX_CONTEXT

# -- creation ---------------------------------------------------------------------------------

#: The world's mesh in this process, which every group of the world shares ("mesh"), the prefix of
#: the lab's keys for this incarnation of the world ("prefix", :func:`_next_prefix`) and the store
#: under it ("store"); how many incarnations this process has made ("made"); whether the world's
#: mesh is the program's (``init_process_group``: "given" while torch makes the world, then "lent";
#: "lent_made": how many times).
_world: dict[str, Any] = {}


def _next_prefix() -> str:
    """The store prefix of a new incarnation of the world's group: after ``destroy_process_group()``
    torch hands the next ``init_process_group`` the same store under the same prefix, where the last
    incarnation's keys would pass for this one's. Every rank makes the world as many times (each
    init is collective), so the count agrees."""
    made = _world.get("made", 0)
    _world["made"] = made + 1
    return f"lab/{made}/"


def create(options: Any, pg_options: Any = None) -> LabProcessGroup:
    """torch's creator: the world's group (a new mesh through torch's store) or a ``new_group``
    (a sub-mesh of the world's, with a context id agreed through the group's store)."""
    lab_options = pg_options if isinstance(pg_options, Options) else Options()
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options must be lab.backend.Options; got {type(pg_options).__name__}")
    members = list(options.global_ranks_in_group)
    if "torch.distributed.pipelining" in sys.modules:  # (a recording then labels its stages' transfers)
        from lab.workload.pipeline import label_pipelines

        label_pipelines()
    given = _world.pop("given", None)
    if given is not None:
        return _lent_world(given, options, lab_options)
    world = _world.get("mesh")
    # (a program's mesh outlives torch's world: it is the world only while torch's default group is)
    if world is None or world.closed or _world.get("lent") and not dist.is_initialized():
        if members and members != list(range(len(members))):
            raise LabError("a lab group other than the world was created before the world's")
        timeout_ms = lab_options.recv_timeout_ms
        if timeout_ms is None:
            timeout_ms = options.timeout.total_seconds() * 1000
        prefix = _next_prefix()
        store = dist.PrefixStore(prefix, options.store)
        world = Mesh.from_store(store, options.group_rank, options.group_size,
                                transport=lab_options.transport, recv_timeout_ms=timeout_ms,
                                trace=lab_options.trace, workload=lab_options.workload)
        _world.update(mesh=world, prefix=prefix, store=store, lent=False)
        return LabProcessGroup(world, lab_options)
    # A new_group (any group after the world's, even one of every rank: its collectives may
    # interleave with the world's in any order, from any thread): a sub-mesh with a context id and
    # an issue order of its own.
    group = world.sub_mesh(members or list(range(world.world_size)), _agree_context(options), own_order=True)
    return LabProcessGroup(group, lab_options, own_order=True)


def init_process_group(mesh: Mesh, **kwargs: Any) -> None:
    """Make torch's default process group over ``mesh``, this rank's mesh of ``lab.spawn`` or
    ``lab.launch`` (any transport, emulated hosts included) or of ``Mesh.from_env``: DDP, FSDP2,
    DeviceMesh and ``new_group`` then run on it (the world's group in one issue order with the
    mesh's own calls, each ``new_group`` in an order of its own), and a recording of the mesh's
    rank (``workload=``) sees them.

    ``kwargs``: :func:`torch.distributed.init_process_group`'s (``pg_options=Options(...)``: its
    ``workload`` starts a recording if the mesh has none; ``transport``, ``recv_timeout_ms`` and
    ``trace`` are the mesh's own already), besides ``backend``, ``rank`` and ``world_size``, which
    are the mesh's. ``store``: where new groups agree on their ids (default: the pool's store, or
    the launcher's). ``dist.destroy_process_group()`` leaves the mesh open: it is the program's.

        def train(mesh):
            lab.backend.init_process_group(mesh)
            model = torch.nn.parallel.DistributedDataParallel(model)
    """
    store = kwargs.pop("store", None) or (pool_store() if "LAB_STORE" in os.environ else env_store())
    made = _world.get("lent_made", 0)  # (torch's keys of each incarnation under a prefix of their own)
    _world.update(given=mesh, lent_made=made + 1)
    try:
        dist.init_process_group(NAME, store=dist.PrefixStore(f"lab-lent/{made}/", store), rank=mesh.rank,
                                world_size=mesh.world_size, **kwargs)
    finally:
        _world.pop("given", None)


def _lent_world(mesh: Mesh, options: Any, lab_options: Options) -> LabProcessGroup:
    """The world's group over the program's ``mesh`` (:func:`init_process_group`)."""
    if (options.group_rank, options.group_size) != (mesh.rank, mesh.world_size):
        raise LabError(f"torch's world (rank {options.group_rank} of {options.group_size}) is not the mesh's "
                       f"(rank {mesh.rank} of {mesh.world_size})")
    prefix = _next_prefix()
    store = dist.PrefixStore(prefix, options.store)
    _world.update(mesh=mesh, prefix=prefix, store=store, lent=True)
    workload = checks.workload_path(lab_options.workload)  # (or LAB_WORKLOAD's)
    if workload and not mesh.recording:
        mesh.record_workload(workload, store)
    return LabProcessGroup(mesh, lab_options, owns_mesh=False)


def _agree_context(options: Any) -> int:
    """A context id for a new group, the same on its every member and unlike every other live
    group's: its rank 0 draws the next one from a counter of this incarnation of the world (in the
    world's store: the store torch hands a group is one of its own) and leaves it in the group's
    store, under this incarnation's name (torch names groups afresh after a destroy)."""
    key = f"{_world['prefix']}context"
    if options.group_rank == 0:
        drawn = _world["store"].add("groups", 1)
        if drawn >= _GROUP_CONTEXT_TOP // 2:
            raise LabError(f"this job has made {drawn - 1:,} lab groups; context ids are spent")
        options.store.set(key, str(_GROUP_CONTEXT_TOP - drawn))
    return int(options.store.get(key))


def register() -> None:
    """Register ``"lab"`` with ``torch.distributed`` (done by ``import lab``; idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


__all__ = ["NAME", "LabProcessGroup", "LabWork", "Options", "init_process_group", "register"]
