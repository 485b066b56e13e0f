"""torch's point-to-point calls on the ``"lab"`` process group: ``send``, ``recv`` and a receive
from any source, each a Work issued in the group's order on its communication thread (an
``irecv`` must not block its caller), as :class:`lab.backend.group.LabProcessGroup` takes them.

    group.send([t], dst=1, tag=0).wait()      # rank 0
    group.recv([t], src=0, tag=0).wait()      # rank 1: t holds rank 0's
"""

from __future__ import annotations

from typing import Any

import torch

from lab import checks
from lab.backend.args import one, receive_into
from lab.backend.work import LabWork


class SendRecv:
    """The point-to-point part of the lab's process group, whose ``mesh`` and ``_work`` (a
    Work issued in its order, as its collectives' are) it uses."""

    mesh: Any

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LabWork:
        tensor, tag = one(tensors, "send"), checks.p2p_tag(tag)
        run = lambda: self.mesh.send(dst, tensor, tag)
        return self._work(run, tensors, "send", tensors, peer=dst, tag=tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LabWork:
        return self._receive(one(tensors, "recv"), src, checks.p2p_tag(tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LabWork:
        return self._receive(one(tensors, "recv"), None, checks.p2p_tag(tag))

    def _receive(self, tensor: torch.Tensor, src: int | None, tag: int) -> LabWork:
        """Receive into ``tensor``; while the message has not arrived, run the sends issued
        after this receive (torch posts ``irecv`` and ``isend`` at once: see
        :meth:`lab.comm.issue.IssueQueue.run_sends_behind`)."""
        queue = self.mesh.issue_queue
        issued = queue.issued
        run = lambda: receive_into(self.mesh, tensor, src, tag, lambda: queue.run_sends_behind(issued))
        return self._work(run, [tensor], "recv", [tensor], peer=src, tag=tag)
