"""What the layers above ask of a mesh, declared: :class:`CallMesh` for the public collectives,
:class:`BackendMesh` for the torch backend besides (what algorithms ask is
:class:`lab.algorithms.peers.Peers`).

:class:`lab.Mesh` implements all three, by delegating to its parts (an
:class:`lab.comm.exchange.Exchange` and a :class:`lab.comm.point_to_point.PointToPoint`); the
simulator's :class:`lab.sim.schedule.RecordingMesh` implements :class:`CallMesh` and ``Peers``
with no transport. ``tests/test_mesh_protocols.py`` checks both, member by member, and that the
public calls and the backend use nothing of a mesh that is not declared here.

    def allreduce(mesh: CallMesh, tensor, op="sum", algorithm="auto", async_op=False): ...
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from lab.comm.issue import IssueQueue
    from lab.comm.operations import Operation
    from lab.comm.planned_run import PlannedRun
    from lab.fingerprint import Signature
    from lab.flight import FlightRecord
    from lab.ops import DType, Reduction


class CallMesh(Protocol):
    """What the public collectives (:mod:`lab.collectives`: the calls, their ``prepare_*``, their
    plans, ``auto``'s choice) use of a mesh: who this rank is, the issue order, one collective's
    numbering, its algorithm's run and the compiled path."""

    #: The transport's name ("shm", "tcp", "queue", "auto"; the recorder's "sim"): ``auto`` reads its fits.
    transport: str
    #: Hosts this mesh's ranks are on: ``auto`` weighs host-aware algorithms when more than one.
    host_count: int
    #: The plain calls' checks and choices, by their arguments (:func:`lab.collectives.prepared.remembered`).
    templates: dict

    @property
    def rank(self) -> int:
        ...

    @property
    def world_size(self) -> int:
        ...

    @property
    def closed(self) -> bool:
        """True once the mesh was closed (a plan's run is then refused)."""

    @property
    def recording(self) -> bool:
        """True while the rank records its calls into a workload (calls then describe themselves)."""

    @property
    def compiled_max_bytes(self) -> int:
        """The largest tensor a collective runs in one compiled call (0: none)."""

    @property
    def issue_queue(self) -> IssueQueue:
        """The issue order: a plan's or a lane's run goes through its ``run_alone``."""

    def issue(self, run: Callable[[], Any], async_op: bool, *, what: Operation | None = None) -> Any:
        """Run ``run`` in issue order, now or (``async_op``) on the communication thread."""

    def refused(self) -> None:
        """Number a collective refused before it ran (an earlier asynchronous call's failure)."""

    def describe(self, op: str, dtype: DType, count: int, out_count: int, **rest: Any) -> Operation:
        """A call as a recording notes it (built only where :attr:`recording`)."""

    def collective(self, name: str, algorithm: str, dtype: DType, count: int, op: str = "", root: int = -1,
                   compiled: bool = True) -> AbstractContextManager[None]:
        """Run one collective: numbered, fingerprinted, recorded, traced."""

    def run(self, algorithm: Callable[..., None], *args: Any, **options: Any) -> None:
        """Run one algorithm of the collective entered with :meth:`collective`."""

    def compiled_call(self, signature: Signature, algorithm: Any, args: tuple,
                      at: bool = False) -> PlannedRun | None:
        """The compiled call of ``signature`` made once (a plan's, a lane's), or None."""

    def agree(self, signature: Signature) -> list[bytes]:
        """Every rank's fingerprint of ``signature``, in rank order (a plan's ranks compare)."""

    @staticmethod
    def kernels(op: Any, dtype: DType) -> Reduction:
        """The reduction kernels of ``(op, dtype)``."""

    @staticmethod
    def new_flat(numel: int, dtype: DType) -> np.ndarray:
        """A new flat output buffer (allgather's, gather's, all_to_all's)."""


class BackendMesh(CallMesh, Protocol):
    """What the torch backend (:mod:`lab.backend`) uses of a mesh besides the public calls':
    point-to-point tensors, calls issued from its own threads, sub-meshes for ``new_group``, the
    flight recorder for its errors, a recording of the calls, and closing."""

    #: A receive waits this long in silence before a DeadlineError.
    recv_timeout_ms: float

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """This mesh's ranks as global ranks, in its rank order."""

    def issue(self, run: Callable[[], Any], async_op: bool, p2p: str = "", *,
              what: Operation | None = None) -> Any:
        """:meth:`CallMesh.issue`; ``p2p="send"``/``"recv"``: a send's or receive's."""

    def issue_now(self, run: Callable[[], Any], what: Operation | None = None) -> Any:
        """``issue(run, async_op=True)``, run on this thread when nothing is in flight."""

    def send(self, dst: int, tensor: Any, tag: int = 0) -> None:
        ...

    def recv(self, src: int | None, timeout_ms: float | None = None, tag: int = 0) -> Any:
        ...

    def probe(self, src: int | None, tag: int = 0, timeout_ms: float | None = None) -> int | None:
        ...

    def sub_mesh(self, members: list[int], context: int, own_order: bool = False) -> BackendMesh:
        ...

    def record_workload(self, path: str, store: Any = None, recorded: dict | None = None) -> None:
        ...

    def flight_records(self) -> list[FlightRecord]:
        ...

    def close(self) -> None:
        ...
