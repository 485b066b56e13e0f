"""Rank processes: ``lab.spawn`` for one call, ``lab.launch`` for a persistent pool.

The parent builds the whole mesh (pipes or queues, shared-memory segments), starts one process
per rank and talks to each over a private control pipe: it sends ``(fn, args)`` pickled, the rank
answers with its result or its exception. Processes start from a forkserver that has already
imported torch, numba and the compiled kernels, so a pool starts in well under a second and no
rank compiles anything. Whatever happens, :meth:`Cluster.close` ends every process.

The parts, one concern each:

- :mod:`~lab.launch.options`: :class:`PoolOptions`, declared once for ``spawn``, ``launch`` and
  ``Cluster``, and checked once;
- :mod:`~lab.launch.transports`: the transports a pool can run, one entry each;
- :mod:`~lab.launch.pool`: :class:`Cluster` (start, run, collect, close);
- :mod:`~lab.launch.rank`: what runs in each rank process, and the control protocol;
- :mod:`~lab.launch.diagnosis`: which rank failed, and why;
- :mod:`~lab.launch.forkserver`: how ranks are started, and die with their job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab.launch.diagnosis import FAILURE_GRACE_S
from lab.launch.options import PoolOptions, takes_pool_options
from lab.launch.pool import STARTUP_TIMEOUT_S, Cluster

__all__ = ["FAILURE_GRACE_S", "STARTUP_TIMEOUT_S", "Cluster", "PoolOptions", "launch", "spawn"]


def launch(world_size: int, **options: Any) -> Cluster:
    """Start a persistent pool of rank processes; use it as a context manager.

    Same options as :func:`spawn` (``transport``, ``recv_timeout_ms``, ``trace``, ``segment_bytes``,
    ``slots``, ``eager_bytes``, ``hosts``, ``link_gbit``, ``workload``, ``env``); ``segment_bytes`` and
    ``slots`` size the shm transport's per-peer buffers (``slots`` buffers of ``segment_bytes`` per
    directed edge); shm messages of at most ``eager_bytes`` (0 to 4,048; default 4,048) travel
    inline in the pipe.

    ``hosts=H`` places the ranks on H emulated hosts (:mod:`lab.hosts.emulated`: a network namespace each,
    one switch, each host's link capped at ``link_gbit`` Gbit/s each way, uncapped if None); host
    h holds ranks ``[h*L, (h+1)*L)``, ``L = world_size // H``. With ``H > 1`` the transport must be
    ``"tcp"`` or ``"auto"`` (shared memory inside a host, TCP between hosts). Raises
    :class:`lab.EmulationUnavailable` where namespaces cannot be made.

    ``env={"LAB_COMPILED_MAX_BYTES": "0"}`` sets environment variables for this pool alone: while it
    is built and in its ranks (which otherwise take the caller's environment as it is).

    ``workload="step.jsonl"`` (or ``LAB_WORKLOAD``) records every rank's collective and
    point-to-point calls, and the compute between them, into that file (:mod:`lab.workload`;
    the parent writes its header, each rank its lines at each ``lab.workload.mark_step()``).

        with lab.launch(4, transport="queue") as cluster:
            first = cluster.run(step, 1.0)
            second = cluster.run(step, 2.0)   # same processes, same mesh
    """
    return Cluster(world_size, **options)


@takes_pool_options
def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (), **options: Any) -> list[Any]:
    """Run ``fn(mesh, *args)`` in ``world_size`` new processes; return their results in rank order.

        def step(mesh, scale):
            x = torch.arange(4.0) * scale + mesh.rank
            return lab.allreduce(mesh, x)

        lab.spawn(step, 2, args=(10.0,))      # [tensor([1., 21., 41., 61.])] * 2

    The options are :class:`PoolOptions`' (see :func:`launch`). Everything (processes, pipes,
    queues, shared memory) is torn down before it returns or raises.
    """
    with launch(world_size, **options) as cluster:
        return cluster.run(fn, *args)
