"""Which ranks a mesh spans: its numbering, its context id, the host of each rank.

The root mesh spans every rank in global order under context 0. A sub-mesh
(:meth:`lab.Mesh.split`, :meth:`lab.Mesh.sub_mesh`) lists its members as global ranks in its own
rank order, under a context id its members agreed; its transfers travel on the root's channels
between global ranks, so every rank it names is translated here.

    world = Membership(global_rank=3, hosts=[0, 0, 1, 1])       # rank 3 of 4, two hosts
    pair = world.sub([1, 3], context=7)                          # pair.rank == 1
    pair.to_global(0), pair.who()                                # 1, 'rank 1 of sub-mesh 00000007 (global rank 3)'
"""

from __future__ import annotations

from typing import Any

from lab import checks
from lab.errors import LabError
from lab.fingerprint import MAX_CONTEXT


class Membership:
    """This rank's place in a mesh: ``rank`` of ``world_size``, the global rank of each of the
    mesh's ranks (``members``; None: the root mesh, where they are the same) and every global
    rank's host (``hosts``)."""
    def __init__(self, global_rank: int, hosts: list[int], members: list[int] | None = None,
                 context: int = 0) -> None:
        self.global_rank, self.hosts, self.members, self.context = global_rank, hosts, members, context
        self.rank = global_rank if members is None else members.index(global_rank)
        self.world_size = len(hosts) if members is None else len(members)
        self.host_count = len({hosts[g] for g in self.members or range(len(hosts))})

    def to_global(self, rank: int) -> int:
        """The global rank of this mesh's rank ``rank``."""
        return rank if self.members is None else self.members[rank]

    def from_global(self, global_rank: int) -> int:
        """This mesh's rank of global rank ``global_rank`` (one of its members)."""
        return global_rank if self.members is None else self.members.index(global_rank)

    def host_of(self, rank: int) -> int:
        return self.hosts[self.to_global(rank)]

    def who(self, global_rank: int | None = None) -> str:
        """``rank 3`` on the root mesh; ``rank 1 of sub-mesh 1a2b3c4d (global rank 3)`` on a
        sub-mesh (this rank when ``global_rank`` is None)."""
        if global_rank is None:
            global_rank = self.global_rank
        if self.members is None:
            return f"rank {global_rank}"
        if global_rank in self.members:
            return f"rank {self.members.index(global_rank)} of sub-mesh {self.context:08x} (global rank {global_rank})"
        return f"global rank {global_rank}"

    def name(self) -> str:
        """``""`` for the root mesh, ``sub-mesh 1a2b3c4d`` for a sub-mesh."""
        return "" if self.members is None else f"sub-mesh {self.context:08x}"

    def describe(self) -> str:
        """What error messages say of a sub-mesh: ``sub-mesh 00000007 (global ranks 1, 3; this
        is its rank 1)``; ``""`` for the root mesh."""
        if self.members is None:
            return ""
        shown = ", ".join(map(str, self.members[:8])) + (", ..." if len(self.members) > 8 else "")
        return f"{self.name()} (global ranks {shown}; this is its rank {self.rank})"

    def trace_fields(self) -> dict[str, Any]:
        """What a sub-mesh's trace rows add: which sub-mesh, and the global rank."""
        return {} if self.members is None else {
            "sub_mesh": f"{self.context:08x}", "global_rank": self.global_rank}

    def local_placement(self, host: int) -> tuple[int, int]:
        """(this rank's index among the mesh's ranks on ``host``, its host; how many those are)."""
        same_host = [g for g in self.members or range(len(self.hosts)) if self.hosts[g] == host]
        return same_host.index(self.global_rank), len(same_host)

    def sub(self, ranks: Any, context: Any) -> Membership:
        """The membership of the sub-mesh of ``ranks`` (this mesh's ranks, in the sub-mesh's rank
        order, this rank among them) under ``context``; ``ValueError`` naming the argument."""
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"members must be a list of this mesh's ranks; got {ranks!r}")
        ranks = list(ranks)
        if not all(checks.is_int(r) and 0 <= r < self.world_size
                   for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"members must be distinct ranks in [0, {self.world_size}); got {ranks}")
        if self.rank not in ranks:
            raise ValueError(f"members must include this rank ({self.rank}); got {ranks}")
        if not checks.is_int(context) or not 0 < context <= MAX_CONTEXT:
            raise ValueError(f"context must be an int in [1, {MAX_CONTEXT}]; got {context!r}")
        return Membership(self.global_rank, self.hosts, [self.to_global(int(r)) for r in ranks], int(context))


def agree_split(everyone: list[list[int]], color: int | None) -> tuple[list[int] | None, int, int]:
    """What :meth:`lab.Mesh.split` decides from every rank's ``(color, key, next context id)``
    (colour -1: opted out): (this rank's colour's members in (key, rank) order, or None when
    ``color`` is None; their context id; this rank's next context id).

    Colour i (in sorted order) gets the context id base + i, where base is past every id any
    participant has used. Two sub-meshes that share a rank were both made by splits that rank
    took part in, one after the other, so the later one's base is past the earlier one's ids:
    live sub-meshes on common channels never share an id.

        agree_split([[0, 0, 1], [1, 0, 1], [0, 0, 1]], color=0)    # ([0, 2], 1, 3)
    """
    colors = sorted({c for c, _, _ in everyone if c >= 0})
    base = max(used for _, _, used in everyone)
    if base + len(colors) > MAX_CONTEXT:
        raise LabError(f"this job has made {base - 1:,} sub-meshes; context ids (4 bytes) are spent")
    if color is None:
        return None, 0, base + len(colors)
    members = [r for _, r in sorted((k, r) for r, (c, k, _) in enumerate(everyone) if c == color)]
    return members, base + colors.index(color), base + len(colors)
