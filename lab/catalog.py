"""One record per collective, as nccl-tests' ``testColl``: the facts every part of the lab reads
(perf's tables, the log readers, the simulator, workloads, the reports) written once.

    from lab.catalog import COLLECTIVES
    COLLECTIVES["allgather"].program                 # "all_gather_perf"
    COLLECTIVES["allgather"].bus_factor(8)           # 0.875: busbw / algbw at 8 ranks
    COLLECTIVES["allgather"].input_bytes(1 << 20, 16)   # 65536: nccl-tests' size is the output

nccl-tests' size (its ``size`` column, what algbw divides) is the buffer it allocates: the
output where the collective gathers (allgather, gather: each rank gives size / N), else the
input. Its count column is each rank's share where the collective splits the buffer in N
(size = count × item bytes × N), else the whole buffer. busbw = algbw × the bus factor, which
makes a collective's busbw comparable with the link's bandwidth whatever N is (nccl-tests'
doc/PERFORMANCE.md). This module imports nothing of the lab's: every floor may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    """One collective, as the lab names it and nccl-tests runs it."""

    name: str
    program: str | None  # nccl-tests' program (all_reduce_perf); None where it has none (barrier)
    root: str | None  # the root's keyword in the lab's call (broadcast's "src"); None: no root
    reduces: bool  # takes a reduction op (nccl-tests' redop column names it; else "none")
    returns: bool  # returns a new tensor (the others work in place)
    sized_by_output: bool  # nccl-tests' size is the output: each rank's input is size / N
    splits: bool  # nccl-tests' count is each rank's share: size = count × item bytes × N
    bus_scale: float  # busbw / algbw is bus_scale × (N-1)/N, or bus_scale alone where not per_rank
    per_rank: bool = True

    @property
    def rooted(self) -> bool:
        return self.root is not None

    @property
    def moves_bytes(self) -> bool:
        """Whether it has a size and bandwidths (a barrier moves no bytes)."""
        return self.bus_scale > 0

    def bus_factor(self, world_size: int) -> float:
        """nccl-tests' busbw / algbw at ``world_size`` ranks: 2(N-1)/N for allreduce, (N-1)/N where
        each rank moves all but its own share, 1 for broadcast and reduce, 0 for a barrier."""
        return self.bus_scale * ((world_size - 1) / world_size if self.per_rank else 1.0)

    def input_bytes(self, size: int, world_size: int, itemsize: int = 4) -> int:
        """Each rank's input, in whole ``itemsize``-byte elements, for nccl-tests' ``size`` at
        ``world_size`` ranks (size / N where the size is the output; may be 0 for a tiny size)."""
        return size // itemsize // (world_size if self.sized_by_output else 1) * itemsize


#: Every collective, in the lab's order (its registry's).
COLLECTIVES: dict[str, Collective] = {
    record.name: record
    for record in (Collective("allreduce", "all_reduce_perf", None, reduces=True, returns=False,
                              sized_by_output=False, splits=False, bus_scale=2.0),
                   Collective("broadcast", "broadcast_perf", "src", reduces=False, returns=False,
                              sized_by_output=False, splits=False, bus_scale=1.0, per_rank=False),
                   Collective("allgather", "all_gather_perf", None, reduces=False, returns=True,
                              sized_by_output=True, splits=True, bus_scale=1.0),
                   Collective("reduce_scatter", "reduce_scatter_perf", None, reduces=True, returns=True,
                              sized_by_output=False, splits=True, bus_scale=1.0),
                   Collective("reduce", "reduce_perf", "dst", reduces=True, returns=False,
                              sized_by_output=False, splits=False, bus_scale=1.0, per_rank=False),
                   Collective("all_to_all", "alltoall_perf", None, reduces=False, returns=True,
                              sized_by_output=False, splits=True, bus_scale=1.0),
                   Collective("barrier", None, None, reduces=False, returns=False, sized_by_output=False,
                              splits=False, bus_scale=0.0, per_rank=False),
                   Collective("gather", "gather_perf", "dst", reduces=False, returns=True,
                              sized_by_output=True, splits=True, bus_scale=1.0),
                   Collective("scatter", "scatter_perf", "src", reduces=False, returns=True,
                              sized_by_output=False, splits=True, bus_scale=1.0))}
#: The collectives nccl-tests has a program for (all but the barrier), by the lab's name.
MEASURED: tuple[str, ...] = tuple(name for name, record in COLLECTIVES.items() if record.program)
