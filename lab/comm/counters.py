"""A mesh's payload counters, what ``mesh.stats()`` reports.

:class:`Counters` adds what the Python path counts to what compiled calls counted themselves in
the mesh's ledger (:mod:`lab.compiled.plane`: ``BOOKED``, in the order of :data:`BOOKED_KEYS`).
"""

from __future__ import annotations

import numpy as np

KEYS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "collectives",
        "collectives_compiled", "bytes_sent_inter_host", "bytes_received_inter_host")
#: What a compiled call keeping its own books adds to the ledger, in the ledger's order (each is
#: also one compiled collective, and all of it stays on this host).
BOOKED_KEYS = KEYS[:5]


class Counters:
    """One mesh's counters: ``add`` from the Python path, ``booked`` (a view of the ledger's
    words) from compiled calls; :meth:`reset` clears both."""
    def __init__(self, booked: np.ndarray) -> None:
        self._booked = booked
        self.reset()

    def reset(self) -> None:
        self._counts = dict.fromkeys(KEYS, 0)
        self._booked[:] = 0

    def add(self, **counts: int) -> None:
        for key, value in counts.items():
            self._counts[key] += value

    def __getitem__(self, key: str) -> int:
        """What the Python path counted of ``key`` (the trace's rows: compiled calls that keep
        their own books run only without a trace)."""
        return self._counts[key]

    def snapshot(self) -> dict[str, int]:
        stats = dict(self._counts)
        booked = self._booked.tolist()
        for key, value in zip(BOOKED_KEYS, booked, strict=True):
            stats[key] += value
        stats["collectives_compiled"] += booked[-1]
        return stats
