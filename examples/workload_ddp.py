"""Record a DDP training step on emulated hosts, then replay it on 1,024 ranks.

    sudo python examples/workload_ddp.py                     # 4 hosts, tcp, 1 Gbit/s links
    sudo python examples/workload_ddp.py --hosts 2 --ranks 4096 --out ddp.jsonl

Each rank runs on its own emulated host (a network namespace whose link carries 1 Gbit/s; making
them needs root) and trains a 2.1 MB MLP with torch's DDP on the lab's backend
(``lab.backend.init_process_group``), recording its collectives, its waits and the compute between
them (``workload=``). The recording is replayed on the hosts it ran on, next to the measured step,
and then on ``--ranks`` ranks: DDP keeps each bucket's bytes at any scale, so the allreduces grow
with the world while the compute stays. The replay runs on the network the lab fitted for these
hosts (``lab.sim.calibrated``), each host with its own cores; it prints the step time, the
communication that compute does not hide, and the operations that expose the most. The recording
knows DDP's gradients (``lab.workload.record_gradients``), so it also answers what another bucket
size would do there (``--bucket-mb``, the 1 MB buckets it trained with against fewer, larger ones).
"""

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lab
from lab.workload.cli import summary  # what `python -m lab workload replay` prints


def train(mesh: lab.Mesh, steps: int) -> list[float]:
    """DDP of a 2.1 MB MLP in 1 MB buckets, a batch of 64: each step's ms."""
    lab.backend.init_process_group(mesh)  # torch's default group over this rank's mesh
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    lab.workload.record_gradients(ddp)  # so the replay can form DDP's buckets at another size
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(mesh.rank)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        x = torch.randn(64, 256, generator=data)
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        lab.workload.mark_step()  # the end of a step in the recording
        times.append((time.perf_counter() - started) * 1e3)
    dist.destroy_process_group()  # (the mesh stays open: it is the pool's)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts, one rank each")
    parser.add_argument("--steps", type=int, default=4, help="steps recorded (the first warms up; >= 2)")
    parser.add_argument("--ranks", type=int, default=1024, help="the world to replay the step on")
    parser.add_argument("--out", help="where the recording goes (default: a temporary file)")
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="the other bucket size the replay tries")
    args = parser.parse_args()
    path = Path(args.out or Path(tempfile.mkdtemp()) / "ddp.jsonl")
    times = lab.spawn(train, args.hosts, args=(args.steps,), hosts=args.hosts, link_gbit=1.0, transport="tcp",
                      workload=str(path))
    measured = statistics.median(max(step) for step in list(zip(*times))[1:])  # after warm-up
    w = lab.workload.load(path)
    net = lab.sim.calibrated("tcp", hosts=args.hosts, link_gbit=1.0)
    here = lab.workload.replay(w, network=net, timeline=False)
    print(f"recorded {w.steps} steps of {w.world_size} ranks into {path}")
    print(f"on {args.hosts} hosts: measured {measured:,.1f} ms a step (median after the first, slowest "
          f"rank), replayed {statistics.median(here.step_us[1:]) / 1e3:,.1f} ms\n")
    started = time.perf_counter()
    own_cores = dataclasses.replace(net, ranks_per_cpu=1)  # real hosts: each its own cores
    there = lab.workload.replay(w, world_size=args.ranks, network=own_cores, timeline=False)
    print(summary(there, top=4))
    print(f"\n(replayed on {args.ranks:,} ranks in {time.perf_counter() - started:.1f} s)")
    rebucketed = lab.workload.replay(w, world_size=args.ranks, network=own_cores, timeline=False,
                                     bucket_mb=args.bucket_mb)

    def ms(values) -> str:  # the median after the warm-up step
        return f"{statistics.median(values[1:]) / 1e3:,.1f} ms"

    print(f"with {args.bucket_mb:g} MB buckets instead of 1 MB: step {ms(rebucketed.step_us)} against "
          f"{ms(there.step_us)}, exposed communication {ms(rebucketed.exposed_comm_us)} against "
          f"{ms(there.exposed_comm_us)}")


if __name__ == "__main__":
    main()
