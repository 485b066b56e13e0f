"""Persistent collectives, as MPI-4's ``MPI_Allreduce_init``: check, fingerprint, lay out and choose
once; run many times.

``lab.allreduce_init(mesh, tensor, ...)`` does everything the plain call does before its first
message (argument checks, the dtype's kernels, the buffer's layout, ``auto``'s choice) and has
every rank agree on the result: ranks whose plans differ get :class:`lab.CollectiveMismatchError`
from ``_init`` itself, naming both plans. ``plan()`` then runs the collective on the tensor's
*current* contents and returns what the plain call returns; ``plan.start()`` returns a
:class:`lab.Work`; ``plan.free()`` or leaving ``with plan:`` releases it. Every rank must run its
plans in the same order, as it would the plain calls (a plan is one collective, numbered and
fingerprinted at each run like any other).

Per rank, N=2::

    grads = torch.zeros(1000)
    with lab.allreduce_init(mesh, grads, op="avg") as plan:
        for batch in batches:
            grads.copy_(compute(batch))      # the plan reads grads' memory at each run
            plan()                           # grads now holds the average over both ranks

A plan holds the tensor's memory: write into it (``copy_``, slices, in-place ops); a tensor
rebound or resized after ``_init`` is not what the plan reads. A plan works on every transport
and on sub-meshes; it belongs to the mesh and process that made it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from lab import fingerprint
from lab.collectives.calls import (
    Prepared,
    prepare_all_to_all,
    prepare_allgather,
    prepare_allreduce,
    prepare_barrier,
    prepare_broadcast,
    prepare_gather,
    prepare_reduce,
    prepare_reduce_scatter,
    prepare_scatter,
)
from lab.comm.issue import Work, this_process
from lab.errors import CollectiveMismatchError, LabError

if TYPE_CHECKING:
    from lab.comm.protocols import CallMesh


class Plan:
    """One persistent collective of one mesh (made by ``lab.allreduce_init`` and its siblings)."""
    def __init__(self, mesh: CallMesh, prepared: Prepared) -> None:
        self._mesh, self._prepared = mesh, prepared
        self._queue = mesh.issue_queue
        self._pid = this_process()
        self._freed = False
        _agree(mesh, prepared)
        # Where the collective runs compiled on the caller's memory: its call made once, here.
        compiled = prepared.planned and prepared.planned()
        self._run_now = compiled or prepared.run
        self._issue = self._queue.run_alone if compiled else self._queue.run_collective
        self._refused = mesh.refused  # (numbers a run refused for an earlier failure: lab.comm.issue)
        # the call as a recording notes it, with its algorithm (None: the rank records nothing)
        self._what = prepared.what and prepared.what._replace(algorithm=prepared.signature.algorithm)

    @property
    def collective(self) -> str:
        return self._prepared.signature.collective

    @property
    def algorithm(self) -> str:
        """The algorithm chosen at ``_init`` (``auto`` resolved once, for every run)."""
        return self._prepared.signature.algorithm

    def __call__(self) -> Any:
        """Run the collective now on the tensor's current contents; return what the plain call does."""
        return self._issue(self._run(), refused=self._refused, what=self._what)

    def start(self) -> Work:
        """Run it asynchronously (in issue order with this mesh's other calls); return a :class:`lab.Work`."""
        return self._queue.issue(self._run(), async_op=True, what=self._what)

    def free(self) -> None:
        """Release the plan (idempotent); using it afterwards is a :class:`lab.LabError`."""
        self._freed, self._run_now = True, None  # (its compiled call goes: lab.flight.FlightRecorder.release)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else "ready"
        return f"<lab plan: {self.collective} ({self.algorithm}) on rank {self._mesh.rank}, {state}>"

    def _run(self):
        if self._freed:
            raise LabError(
                f"this {self.collective} plan was freed; make a new one with lab.{self.collective}_init")
        if this_process() != self._pid:
            raise LabError(f"this {self.collective} plan was made in process {self._pid}; a plan belongs to "
                           f"the process (and mesh) that made it")
        if self._mesh.closed:
            raise LabError(f"this {self.collective} plan's mesh is closed")
        return self._run_now


def _agree(mesh: CallMesh, prepared: Prepared) -> None:
    """Every rank's plan, compared on every rank (their fingerprints exchanged in the lab's own
    "agree" collective, which no user call can be taken for: :meth:`lab.Mesh.agree`)."""
    everyone = mesh.issue(lambda: mesh.agree(prepared.signature), async_op=False)
    mine = everyone[mesh.rank]
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            raise CollectiveMismatchError(f"plans differ: rank {mesh.rank}'s is {_shown(mine)}; "
                                          f"rank {rank}'s is {_shown(theirs)}")


def _shown(tag: bytes) -> str:
    return fingerprint.describe(tag, numbered=False)


def allreduce_init(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.allreduce` of ``tensor`` (see the module docstring); ``plan()``
    reduces ``tensor`` in place and returns it."""
    return Plan(mesh, prepare_allreduce(mesh, tensor, op, algorithm))


def broadcast_init(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.broadcast` of ``tensor`` from ``src``."""
    return Plan(mesh, prepare_broadcast(mesh, tensor, src, algorithm))


def reduce_init(mesh: CallMesh, tensor: Any, dst: int = 0, op: Any = "sum") -> Plan:
    """A persistent :func:`lab.reduce` of ``tensor`` into rank ``dst``."""
    return Plan(mesh, prepare_reduce(mesh, tensor, dst, op))


def allgather_init(mesh: CallMesh, tensor: Any, algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.allgather` of ``tensor``; each ``plan()`` returns a new tensor."""
    return Plan(mesh, prepare_allgather(mesh, tensor, algorithm))


def reduce_scatter_init(mesh: CallMesh, tensor: Any, op: Any = "sum", algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.reduce_scatter` of ``tensor``; each ``plan()`` returns a new tensor."""
    return Plan(mesh, prepare_reduce_scatter(mesh, tensor, op, algorithm))


def all_to_all_init(mesh: CallMesh, tensor: Any, output_split_sizes: Any = None,
                    input_split_sizes: Any = None, algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.all_to_all` of ``tensor`` (split sizes frozen too); each ``plan()``
    returns a new tensor."""
    return Plan(mesh, prepare_all_to_all(mesh, tensor, output_split_sizes, input_split_sizes, algorithm))


def gather_init(mesh: CallMesh, tensor: Any, dst: int = 0, algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.gather` of ``tensor`` to ``dst``; each ``plan()`` returns a new
    tensor on ``dst``, None elsewhere."""
    return Plan(mesh, prepare_gather(mesh, tensor, dst, algorithm))


def scatter_init(mesh: CallMesh, tensor: Any, src: int = 0, algorithm: str = "auto") -> Plan:
    """A persistent :func:`lab.scatter` of ``src``'s ``tensor``; each ``plan()`` returns a new tensor."""
    return Plan(mesh, prepare_scatter(mesh, tensor, src, algorithm))


def barrier_init(mesh: CallMesh) -> Plan:
    """A persistent :func:`lab.barrier`."""
    return Plan(mesh, prepare_barrier(mesh))
