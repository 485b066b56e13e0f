"""Workloads: a training job's communication, recorded once and replayed at any scale.

    lab.spawn(train, 4, workload="step.jsonl")              # lab.workload.record: every rank records
    lab.workload.mark_step()                                # in train, after each optimizer.step()
    w = lab.workload.load("step.jsonl")                     # lab.workload.format: the file
    r = lab.workload.replay(w, world_size=1024, network=lab.sim.Network(alpha_us=5, gbit=100))
    r.step_us; r.compute_us; r.exposed_comm_us              # per recorded step
    r.breakdown                                             # one row per operation
    r.stages                                                # a pipeline's: compute, exposed, bubble per stage
    r.timeline("sim.json")                                  # the simulated step, for Perfetto
    lab.workload.record_gradients(ddp_model)                # while recording: then replay(w, bucket_mb=4)

Re-targeting (:mod:`lab.workload.retarget`) keeps an allreduce's or broadcast's per-rank bytes and
a sharded group's model total; the replay (:mod:`lab.workload.replay`) runs each rank's compute
and operations in order, each collective timed by the simulator running the lab's own algorithm.
"""

from lab.workload.calls import network_named, replay
from lab.workload.format import Event, Gradients, Workload, load
from lab.workload.record import mark_step, record_gradients
from lab.workload.replay import ReplayResult

__all__ = [
    "Event", "Gradients", "ReplayResult", "Workload", "load", "mark_step", "network_named",
    "record_gradients", "replay"]
