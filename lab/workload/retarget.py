"""Re-targeting a recorded operation to another world size, by what the operation means.

A recording of N ranks laid out as a DeviceMesh (``dims``, row-major as torch's DeviceMesh; one
dimension of N without one) replays on M ranks laid out as ``dims`` of the same names. Target rank
m mirrors the recorded rank at its coordinates modulo the recorded sizes; an operation's group is
the slice of the target mesh along the dimensions the recorded group spanned, through m.

Bytes follow the operation's meaning (per rank, as the simulator takes them):

=================================  =====================================  =======================
operation                          ``shard="strong"`` (default)           ``shard="weak"``
=================================  =====================================  =======================
allreduce, broadcast, reduce       the input kept (DDP's buckets)         the same
allgather, gather                  the model's total kept: input x n/m    the input kept
reduce_scatter, scatter            the input (the total) kept             the output kept
all_to_all                         the total kept: input x n/m            the input kept
=================================  =====================================  =======================

(n and m: the recorded and the target group sizes.) A send or receive keeps its bytes and its
peer's offset in mesh coordinates.

    layout = Layout.of(workload, dims={"dp": 128, "tp": 8})
    layout.group_of(rank, event)      # the target group's key and its size
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.checks import is_int
from lab.sim.limits import MAX_WORLD_SIZE
from lab.workload.format import DTYPE_BYTES, Event, Workload

SHARDING = ("strong", "weak")
_GROWS_WITH_THE_GROUP = ("allgather", "gather", "all_to_all")  # input is a shard of a fixed total


@dataclass(frozen=True)
class Layout:
    """The recorded and the target mesh: dimension names and sizes (row-major)."""

    names: tuple[str, ...]
    recorded: tuple[int, ...]
    target: tuple[int, ...]
    shard: str = "strong"

    @classmethod
    def of(cls, workload: Workload, world_size: int | None = None, dims: dict[str, int] | None = None,
           shard: str = "strong") -> Layout:
        """The layout for replaying ``workload`` on ``world_size`` ranks or on the mesh ``dims``
        (``ValueError`` naming the argument where neither fits the recording)."""
        if shard not in SHARDING:
            raise ValueError(f"shard must be one of {', '.join(SHARDING)}; got {shard!r}")
        if world_size is not None and not (is_int(world_size) and 1 <= world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"world_size must be an int in [1, {MAX_WORLD_SIZE:,}] (the simulator's "
                             f"largest) or None (as recorded); got {world_size!r}")
        recorded = workload.dims or {"world": workload.world_size}
        if dims is None:
            if world_size is None or world_size == workload.world_size:
                dims = dict(recorded)
            elif len(recorded) == 1:
                dims = {next(iter(recorded)): world_size}
            else:
                raise ValueError(
                    f"the recording is a {len(recorded)}-D mesh {recorded}: give dims= with a size for "
                    f"each of {', '.join(recorded)}, not world_size")
        if (not isinstance(dims, dict) or list(dims) != list(recorded) or
                not all(is_int(v) and v >= 1 for v in dims.values())):
            raise ValueError(
                f"dims must give a size >= 1 to each of the recording's dimensions {list(recorded)}, "
                f"in that order; got {dims!r}")
        if math.prod(dims.values()) > MAX_WORLD_SIZE:
            raise ValueError(f"dims={dims} make {math.prod(dims.values()):,} ranks, more than the "
                             f"simulator's {MAX_WORLD_SIZE:,}")
        if world_size is not None and math.prod(dims.values()) != world_size:
            raise ValueError(f"world_size={world_size} is not the product of dims={dims}")
        return cls(tuple(recorded), tuple(recorded.values()), tuple(dims.values()), shard)

    @property
    def world_size(self) -> int:
        return math.prod(self.target)

    def coordinates(self, rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        out = []
        for size in reversed(sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coords: tuple[int, ...], sizes: tuple[int, ...]) -> int:
        rank = 0
        for c, size in zip(coords, sizes):
            rank = rank * size + c
        return rank

    def template(self, rank: int) -> int:
        """The recorded rank whose events target rank ``rank`` replays."""
        coords = self.coordinates(rank, self.target)
        return self.rank_at(tuple(c % r for c, r in zip(coords, self.recorded)), self.recorded)

    def spanned(self, event: Event) -> tuple[bool, ...] | None:
        """Which dimensions the recorded group spans (the ranks it holds vary along them); None for
        a group that is no slice of the mesh, which only a replay at the recorded size can keep."""
        coords = [self.coordinates(g, self.recorded) for g in event.group]
        spans = tuple(len({c[i] for c in coords}) > 1 for i in range(len(self.names)))
        if len(event.group) != math.prod(r for r, s in zip(self.recorded, spans) if s):
            if self.recorded == self.target:
                return None
            raise ValueError(
                f"rank {event.rank}'s {event.op} (operation {event.index}) ran on {list(event.group)}, "
                f"which is no slice of the mesh {dict(zip(self.names, self.recorded))}: it cannot "
                "be re-targeted")
        return spans

    def group_of(self, rank: int, event: Event, spans: tuple[bool, ...] | None) -> tuple[tuple, int]:
        """The target group of ``rank``'s ``event``: its key (the spanned dimensions and this rank's
        coordinates in the others; the recorded ranks where ``spans`` is None) and its size."""
        if spans is None:
            return event.group, len(event.group)
        coords = self.coordinates(rank, self.target)
        key = tuple(None if s else c for s, c in zip(spans, coords))
        return key, math.prod(t for t, s in zip(self.target, spans) if s)

    def position(self, rank: int, spans: tuple[bool, ...]) -> int:
        """``rank``'s rank within its group along ``spans`` (row-major over the spanned dimensions)."""
        coords = self.coordinates(rank, self.target)
        sizes = tuple(t for t, s in zip(self.target, spans) if s)
        return self.rank_at(tuple(c for c, s in zip(coords, spans) if s), sizes)

    def peer_of(self, rank: int, event: Event) -> int:
        """A send's or receive's target peer: the recorded peer's offset in coordinates, kept."""
        mine, theirs = (self.coordinates(event.rank,
                                         self.recorded), self.coordinates(event.peer, self.recorded))
        here = self.coordinates(rank, self.target)
        return self.rank_at(
            tuple((h + t - m) % size for h, t, m, size in zip(here, theirs, mine, self.target)), self.target)

    def nbytes(self, event: Event, group_size: int) -> int:
        """Each rank's input bytes of ``event`` on a target group of ``group_size`` (module docstring):
        whole elements, a shard rounded up (FSDP pads its shards alike), and whole 4-byte words (the
        simulator's elements).

            layout.nbytes(allgather_of_1000_floats_on_4, 16)    # 1000 bytes: 250 floats a shard
        """
        n, m = len(event.group), group_size
        count = event.count
        if event.op in _GROWS_WITH_THE_GROUP and self.shard == "strong":
            count = -(-count * n // m)
        elif event.op in ("reduce_scatter", "scatter") and self.shard == "weak":
            count = -(-count * m // n)
        return -(-count * DTYPE_BYTES[event.dtype] // 4) * 4
