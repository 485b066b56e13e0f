"""The lab's allreduce inside torch's DistributedDataParallel, as a communication hook.

DDP still needs a process group of its own (gloo here) to broadcast the initial parameters and
find unused ones; the gradients, the traffic that matters, go through the lab instead:

    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    ddp_model.register_comm_hook(mesh, lab.ddp.allreduce_hook)

Per rank, with N ranks: each ``GradBucket`` (DDP packs gradients into ~25 MB buckets) is averaged
in place across ranks, as DDP's default gloo allreduce would, and handed back as a completed future.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist

from lab.collectives.calls import allreduce
from lab.comm.mesh import Mesh


def allreduce_hook(mesh: Mesh, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s flat gradient buffer across ranks with ``lab.allreduce``."""
    buffer = bucket.buffer()
    allreduce(mesh, buffer, op="avg")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
