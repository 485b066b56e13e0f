"""lab.backend.work.LabWork on its own (no ranks): what torch reads of it once wait() returned."""

from __future__ import annotations

import threading

from lab.backend.work import LabWork


class LateCallbackWork:
    """A receive's Work that is complete at once but runs its completion callbacks on another
    thread only once told to (the communication thread noting the sender late)."""
    def __init__(self, source: int) -> None:
        self.source, self.callbacks, self.go = source, [], threading.Event()

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)
        threading.Thread(target=lambda: (self.go.wait(5), callback(self))).start()

    def wait(self, seconds=None) -> None:
        self.go.set()  # the callback may now run, after this wait has returned

    def is_completed(self) -> bool:
        return True

    def outcome(self) -> int:
        return self.source


class Group:
    def issue(self, run, now, p2p, what):
        return LateCallbackWork(3)


def test_source_rank_waits_for_the_callback_that_notes_the_sender():
    for _ in range(20):  # the callback's thread races wait()'s return: every time, the sender
        assert LabWork.issued(Group(), lambda: None, [], p2p="recv").source_rank() == 3
