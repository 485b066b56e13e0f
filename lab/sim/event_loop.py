"""Time a recorded schedule on a :class:`~lab.sim.network.Network`: a discrete-event loop in Numba.

The model (DESIGN.md, "Simulation"): each rank runs its steps in order; a step starts when the
previous one has completed. A step first takes its rank's CPU for its local passes (``p·copy``
for the p bytes the rank copied or wrote since its last step) and, if it sends, ``o_send + n·copy``;
then the message leaves when the sender's port, the receiver's port (and, between hosts, the
sender's NIC uplink and the receiver's NIC downlink; inside a host on a bus, the host's bus) are
free, first come first served, holds them for ``g + n·β`` (``g``, the gap: α unless ``gap_us``
is set; β · oversubscription between leaf switches) and arrives after ``α + n·β``; the sender
goes on once it has left. It leaves at once (eager) up to ``eager_bytes``, larger ones only once
the receiver has posted their receive (rendezvous, as MPI's large messages and NCCL's credits:
a sender running ahead cannot fill a receiver's port with a message it does not need yet). A
step with a held send posts its receive meanwhile. Once it
has arrived and the receiver has posted the receive (its own send's CPU work done), the receiver
works ``o_recv + n·copy`` (plus ``n·γ`` if it reduces), ``wake_us`` after the message arrived
if it was already waiting for it. A step completes when its send has
finished and its receive is done. CPU work waits for a free core of its rank's group when
``cores`` is set (first come first served); work of zero µs needs no core. Ties go to the lower
rank, so a replay is deterministic.

Events are taken in time order, and every port or core is claimed when its event is taken, so
first come first served is exact. Every message remembers what it waited for (the sender's
previous step, or the message holding a port or core it needed), so the critical path is read
backwards from the rank that finishes last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from lab.sim.network import Network
from lab.sim.schedule import Schedule


class Message(NamedTuple):
    """One message on the critical path."""

    src: int
    dst: int
    nbytes: int
    start_us: float
    end_us: float
    step: int  # the recorded send it is: an index into the schedule's step arrays


@dataclass(frozen=True)
class Timing:
    finish_us: np.ndarray  # float64 per rank: when its last step completed
    critical_path: list[Message]
    replay_s: float


class ScheduleError(ValueError):
    """The recorded sends and receives do not pair up (an algorithm bug the real run would hang on)."""


def match_messages(s: Schedule) -> np.ndarray:
    """For each step that sends, the step of the receiver that takes the message (-1 elsewhere).

    The k-th send from a to b goes to the k-th receive from a on b, as the real channels order them.
    """
    n = s.world_size
    rank_of_step = np.repeat(np.arange(n, dtype=np.int64), np.diff(s.step_ptr))
    sends = np.flatnonzero(s.send_peer >= 0)
    recvs = np.flatnonzero(s.recv_peer >= 0)
    send_key = rank_of_step[sends] * n + s.send_peer[sends]  # (src, dst)
    recv_key = s.recv_peer[recvs].astype(np.int64) * n + rank_of_step[recvs]
    send_order = np.argsort(send_key, kind="stable")  # stable: program order within a pair
    recv_order = np.argsort(recv_key, kind="stable")
    if len(sends) != len(recvs) or np.any(send_key[send_order] != recv_key[recv_order]):
        keys, sent = np.unique(send_key, return_counts=True)
        rkeys, received = np.unique(recv_key, return_counts=True)
        count = dict(zip(keys.tolist(), sent.tolist()))
        for key, got in zip(rkeys.tolist(), received.tolist()):
            count[key] = count.get(key, 0) - got
        key = next(k for k, c in sorted(count.items()) if c)
        raise ScheduleError(
            f"{s.collective} ({s.algorithm}) on {n} ranks: rank {key // n} sends rank {key % n} "
            f"{count[key]:+d} more messages than it receives")
    match = np.full(s.steps, -1, dtype=np.int64)
    match[sends[send_order]] = recvs[recv_order]
    wrong = s.send_bytes[sends] != s.recv_bytes[match[sends]]
    if wrong.any():
        k = sends[np.argmax(wrong)]
        raise ScheduleError(
            f"{s.collective} ({s.algorithm}): rank {rank_of_step[k]} sends {s.send_bytes[k]} bytes "
            f"to rank {s.send_peer[k]}, which receives {s.recv_bytes[match[k]]}")
    return match


@numba.njit(cache=True)
def _push(heap_t, heap_r, size, t, r):
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if heap_t[parent] < t or (heap_t[parent] == t and heap_r[parent] < r):
            break
        heap_t[i], heap_r[i] = heap_t[parent], heap_r[parent]
        i = parent
    heap_t[i], heap_r[i] = t, r
    return size + 1


@numba.njit(cache=True)
def _pop(heap_t, heap_r, size):
    t, r = heap_t[0], heap_r[0]
    size -= 1
    last_t, last_r = heap_t[size], heap_r[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        other = child + 1
        if other < size and (heap_t[other] < heap_t[child] or
                             (heap_t[other] == heap_t[child] and heap_r[other] < heap_r[child])):
            child = other
        if last_t < heap_t[child] or (last_t == heap_t[child] and last_r < heap_r[child]):
            break
        heap_t[i], heap_r[i] = heap_t[child], heap_r[child]
        i = child
    heap_t[i], heap_r[i] = last_t, last_r
    return t, r, size


@numba.njit(cache=True)
def _cpu(t, work, group, message, core_free, core_holder):
    """CPU work of ``work`` µs asked for at ``t`` by a rank of ``group``, for ``message``: (end, the
    message whose work it waited for, or -1). Unlimited cores (no table) or no work: no wait."""
    if work == 0.0 or core_free.shape[1] == 0:
        return t + work, -1
    core = np.argmin(core_free[group])
    start, cause = t, -1
    if core_free[group, core] > t:
        start, cause = core_free[group, core], core_holder[group, core]
    core_free[group, core], core_holder[group, core] = start + work, message
    return start + work, cause


@numba.njit(cache=True)
def _replay(step_ptr, send_peer, send_bytes, recv_peer, recv_bytes, reduces, passes, match, alpha, beta,
            intra_alpha, intra_beta, gamma, ranks_per_host, send_overhead, recv_overhead, copy, cores,
            ranks_per_cpu, eager_bytes, gap, intra_gap, wake, nic_of, nics, bus, tier_beta, hosts_per_leaf):
    n = len(step_ptr) - 1
    steps = len(send_peer)
    hosts = (n + ranks_per_host - 1) // ranks_per_host
    msg_start = np.zeros(steps)
    msg_end = np.zeros(steps)
    msg_cause = np.full(steps, -1, np.int64)  # the message whose end this one's start waited for
    arrived = np.full(steps, -1, np.int64)  # per receiving step: the message it takes, once it has arrived
    posted = np.zeros(n, np.bool_)  # the rank has posted its current step's receive and waits for it
    sent_t = np.zeros(n)  # when the current step's send finished (or its start, without a send)
    sent_cause = np.full(n, -1, np.int64)
    start_cause = np.full(n, -1, np.int64)
    finish = np.zeros(n)
    completed = np.zeros(steps)  # per step: when it completed
    finish_cause = np.full(n, -1, np.int64)
    cur = step_ptr[:-1].copy()
    # Rendezvous (a message over eager_bytes leaves once its receive is posted): the sending step of
    # each receiving step, each step's rank, the step whose receive each rank has posted, the send
    # each rank holds back, and a step whose receive is done while its held send is not.
    sender_step = np.full(steps, -1, np.int64)
    rank_of = np.zeros(steps, np.int64)
    for r in range(n):
        rank_of[step_ptr[r]:step_ptr[r + 1]] = r
    for k in range(steps):
        if match[k] >= 0:
            sender_step[match[k]] = k
    posted_step = np.full(n, -1, np.int64)
    held = np.full(n, -1, np.int64)
    posted_cause = np.full(n, -1, np.int64)  # what completed the rank's previous step (not a core's holder)
    received_t, received_cause = np.full(n, -1.0), np.full(n, -1, np.int64)
    # Ports: free-from time and the message holding it, per rank each way, per NIC link each way
    # (nic_of: each rank's NIC, numbered host by host) and per host bus.
    send_free, send_holder = np.zeros(n), np.full(n, -1, np.int64)
    recv_free, recv_holder = np.zeros(n), np.full(n, -1, np.int64)
    up_free, up_holder = np.zeros(hosts * nics), np.full(hosts * nics, -1, np.int64)
    down_free, down_holder = np.zeros(hosts * nics), np.full(hosts * nics, -1, np.int64)
    bus_free, bus_holder = np.zeros(hosts), np.full(hosts, -1, np.int64)
    links = (nic_of, up_free, up_holder, down_free, down_holder, bus, bus_free, bus_holder, tier_beta,
             hosts_per_leaf)
    # Cores: free-from time and the message whose work holds it, per group of ranks_per_cpu ranks.
    groups = (n + ranks_per_cpu - 1) // ranks_per_cpu
    core_free, core_holder = np.zeros((groups, cores)), np.full((groups, cores), -1, np.int64)
    # Events, in time order: a message arrives (code: its step, below every other code), a rank's
    # send leaves its CPU for the wire (steps + rank), a rank starts its next step (steps + n + rank).
    # Each rank has at most one of the last two pending, and messages in flight: one per rank when
    # a message holds its port until it arrives (gap = α), any number of a rank's otherwise.
    heap_t, heap_c = np.zeros(2 * n + steps), np.zeros(2 * n + steps, np.int64)
    size = 0
    for r in range(n):
        if step_ptr[r] < step_ptr[r + 1]:
            size = _push(heap_t, heap_c, size, 0.0, steps + n + r)
    while size:
        t, code, size = _pop(heap_t, heap_c, size)
        if code < steps:
            # A message arrives: if its receiver has posted the receive (and sleeps), the receive's
            # CPU work starts once the receiver is awake.
            k = code
            j, dst = match[k], send_peer[k]
            arrived[j] = k
            if posted[dst] and cur[dst] == j:
                posted[dst] = False
                size = _receive(dst, j, t + wake, k, k, recv_bytes, reduces, recv_overhead, copy, gamma,
                                ranks_per_cpu, core_free, core_holder, sent_t, sent_cause, held, received_t,
                                received_cause, step_ptr, cur, start_cause, finish, finish_cause, completed,
                                heap_t, heap_c, size, steps, n)
            # A held send's step whose receive was done completes with its send.
            r = rank_of[k]
            if cur[r] == k and received_t[r] >= 0:
                done, cause = (t, k) if t >= received_t[r] else (received_t[r], received_cause[r])
                received_t[r] = -1.0
                size = _complete(r, k, done, cause, step_ptr, cur, start_cause, finish, finish_cause,
                                 completed, heap_t, heap_c, size, steps, n)
            continue
        if code < steps + n:
            # A step's CPU work is done: its message (if any) takes the ports and goes on the wire.
            r = code - steps
            k = cur[r]
        else:
            # A rank starts its next step: first its CPU work (local passes, the copy into the transport).
            r = code - steps - n
            k = cur[r]
            posted_cause[r] = start_cause[r]
            work = copy * passes[k]  # the local passes before the step (a rotation, a work copy)
            if send_peer[k] >= 0:
                work += send_overhead + copy * send_bytes[k]
            # (the core is held in the name of the message before: this one may wait for its
            # receive and leave later, and a cause must precede what it delays)
            ready, cause = _cpu(t, work, r // ranks_per_cpu, start_cause[r], core_free, core_holder)
            if cause >= 0:
                start_cause[r] = cause
            if ready > t:
                size = _push(heap_t, heap_c, size, ready, steps + r)
                continue
        if send_peer[k] < 0:
            sent_t[r], sent_cause[r] = t, start_cause[r]
        else:
            if send_bytes[k] <= eager_bytes or posted_step[send_peer[k]] == match[k]:
                size = _wire(r, k, t, start_cause[r], send_peer, send_bytes, alpha, beta, intra_alpha,
                             intra_beta, gap, intra_gap, ranks_per_host, send_free, send_holder, recv_free,
                             recv_holder, links, msg_start, msg_end, msg_cause, sent_t, sent_cause, heap_t,
                             heap_c, size)
            else:
                held[r] = k  # its receiver has not posted the receive yet
        # The rank posts its receive (or, without one, its step completes when its send has).
        if recv_peer[k] < 0:
            if held[r] == k:
                received_t[r], received_cause[r] = t, start_cause[r]
            else:
                size = _complete(r, k, sent_t[r], sent_cause[r], step_ptr, cur, start_cause, finish,
                                 finish_cause, completed, heap_t, heap_c, size, steps, n)
            continue
        posted_step[r] = k
        m = sender_step[k]
        src = rank_of[m]
        if held[src] == m:  # the sender waited for this receive: its message leaves now
            held[src] = -1
            size = _wire(src, m, t, posted_cause[r], send_peer, send_bytes, alpha, beta, intra_alpha,
                         intra_beta, gap, intra_gap, ranks_per_host, send_free, send_holder, recv_free,
                         recv_holder, links, msg_start, msg_end, msg_cause, sent_t, sent_cause, heap_t,
                         heap_c, size)
        if arrived[k] >= 0:
            size = _receive(r, k, t, start_cause[r], arrived[k], recv_bytes, reduces, recv_overhead, copy,
                            gamma, ranks_per_cpu, core_free, core_holder, sent_t, sent_cause, held,
                            received_t, received_cause, step_ptr, cur, start_cause, finish, finish_cause,
                            completed, heap_t, heap_c, size, steps, n)
        else:
            posted[r] = True
    return finish, finish_cause, msg_start, msg_end, msg_cause, cur, completed


@numba.njit(cache=True)
def _wire(r, k, t, cause, send_peer, send_bytes, alpha, beta, intra_alpha, intra_beta, gap, intra_gap,
          ranks_per_host, send_free, send_holder, recv_free, recv_holder, links, msg_start, msg_end,
          msg_cause, sent_t, sent_cause, heap_t, heap_c, size):
    """Rank r's message of step k takes the ports at t (first come first served) and goes on the wire.
    ``links``: each rank's NIC, the NICs' up- and downlinks, whether a host's ranks share a bus, the
    buses, β between leaf switches and the hosts per leaf."""
    nic_of, up_free, up_holder, down_free, down_holder, bus, bus_free, bus_holder, tier_beta, leaf = links
    dst = send_peer[k]
    # The send leaves when this rank's send port and the receiver's receive port are free
    # (and, between hosts, the sender's NIC uplink and the receiver's NIC downlink; on a bus, the bus).
    start = t
    if send_free[r] > start:
        start, cause = send_free[r], send_holder[r]
    if recv_free[dst] > start:
        start, cause = recv_free[dst], recv_holder[dst]
    host, peer_host = r // ranks_per_host, dst // ranks_per_host
    if host != peer_host:
        up, down = nic_of[r], nic_of[dst]
        if up_free[up] > start:
            start, cause = up_free[up], up_holder[up]
        if down_free[down] > start:
            start, cause = down_free[down], down_holder[down]
        # It holds the ports and links for the gap and its bytes, and arrives after α and its bytes.
        per_byte = beta if host // leaf == peer_host // leaf else tier_beta
        free = start + gap + per_byte * send_bytes[k]
        end = start + alpha + per_byte * send_bytes[k]
        up_free[up], up_holder[up] = free, k
        down_free[down], down_holder[down] = free, k
    else:
        if bus and bus_free[host] > start:
            start, cause = bus_free[host], bus_holder[host]
        free = start + intra_gap + intra_beta * send_bytes[k]
        end = start + intra_alpha + intra_beta * send_bytes[k]
        if bus:
            bus_free[host], bus_holder[host] = free, k
    send_free[r], send_holder[r] = free, k
    recv_free[dst], recv_holder[dst] = free, k
    msg_start[k], msg_end[k], msg_cause[k] = start, end, cause
    sent_t[r], sent_cause[r] = free, k  # the sender goes on once it has left
    # It arrives at its end: an event, taken before any rank's step at the same time.
    return _push(heap_t, heap_c, size, end, k)


@numba.njit(cache=True)
def _receive(r, k, t, t_cause, m, recv_bytes, reduces, recv_overhead, copy, gamma, ranks_per_cpu, core_free,
             core_holder, sent_t, sent_cause, held, received_t, received_cause, step_ptr, cur, start_cause,
             finish, finish_cause, completed, heap_t, heap_c, size, steps, n):
    """Rank r's receive of step k (message m, arrived) starts its CPU work at t, which ``t_cause``
    set (the message's arrival, or what started the step); the step then completes, or, while
    its own send waits for its receiver (rendezvous), completes when that send arrives."""
    work = recv_overhead + (copy + (gamma if reduces[k] else 0.0)) * recv_bytes[k]
    done, cause = _cpu(t, work, r // ranks_per_cpu, m, core_free, core_holder)
    if cause < 0:
        cause = t_cause
    if held[r] == k:
        received_t[r], received_cause[r] = done, cause
        return size
    if sent_t[r] > done:
        done, cause = sent_t[r], sent_cause[r]
    return _complete(r, k, done, cause, step_ptr, cur, start_cause, finish, finish_cause, completed, heap_t,
                     heap_c, size, steps, n)


@numba.njit(cache=True)
def _complete(r, k, t, cause, step_ptr, cur, start_cause, finish, finish_cause, completed, heap_t, heap_c,
              size, steps, n):
    """Step k of rank r completed at t: start the next one then, or record the finish."""
    cur[r] = k + 1
    completed[k] = t
    if k + 1 < step_ptr[r + 1]:
        start_cause[r] = cause
        return _push(heap_t, heap_c, size, t, steps + n + r)
    finish[r], finish_cause[r] = t, cause
    return size


def nic_of_rank(network: Network, world_size: int) -> np.ndarray:
    """Per rank, the NIC its messages between hosts use, numbered host by host (host · NICs + the
    NIC its local rank maps to: ``nic_map``, else consecutive blocks of local ranks).

        nic_of_rank(Network(ranks_per_host=4, nics_per_host=2), 8)    # array([0, 0, 1, 1, 2, 2, 3, 3])
    """
    host, local = np.divmod(np.arange(world_size, dtype=np.int64), network.ranks_per_host)
    nics = network.nics_per_host
    nic = (np.asarray(network.nic_map, dtype=np.int64)[local] if network.nic_map is not None else local *
           nics // network.ranks_per_host)
    return host * nics + nic


def finish_times(s: Schedule, match: np.ndarray, network: Network) -> tuple[np.ndarray, ...]:
    """The event loop on ``s`` (with ``match`` from :func:`match_messages`): per rank the finish time and
    the message it waited for last, per message its start, end and cause, per rank the step it
    stopped at, and per step when it completed. A calibration calls this many times on one
    schedule, pairing its messages once. A byte copied costs what the case's working set makes it
    (:meth:`Network.copy_cost`)."""
    return _replay(s.step_ptr, s.send_peer, s.send_bytes, s.recv_peer, s.recv_bytes, s.reduces, s.pass_bytes,
                   match, float(network.alpha_us), network.beta_us_per_byte, network.intra_alpha,
                   network.intra_beta_us_per_byte, float(network.gamma_us_per_byte), network.ranks_per_host,
                   float(network.send_overhead_us), float(network.recv_overhead_us),
                   float(network.copy_cost(s.working_set_bytes)), network.cores or 0,
                   min(network.cpu_group, max(s.world_size,
                                              1)), network.eager_limit, network.gap, network.intra_gap,
                   float(network.wake_us), nic_of_rank(network, s.world_size), network.nics_per_host,
                   network.intra_fabric == "bus", network.tier_beta_us_per_byte, network.hosts_per_leaf)


def loop_times(s: Schedule, match: np.ndarray, network: Network, calls: int) -> np.ndarray:
    """Each call's time in a back-to-back loop of ``calls``, as :mod:`lab.benchmark` times it: every
    rank times its own call, from the end of its last one to the end of this one, and a call takes
    its slowest rank's time. ``s`` is one call's schedule :meth:`~lab.sim.schedule.Schedule.repeated`
    ``calls`` times (``match`` its pairing). The ranks of a rooted collective that only send run
    ahead into the next call while the root takes their messages, as they do in the real loop.
    """
    completed = finish_times(s, match, network)[6]
    per_call = np.diff(s.step_ptr) // calls
    last = s.step_ptr[:-1,
                      None] + per_call[:, None] * np.arange(1, calls + 1) - 1  # [rank, call]: its last step
    ends = np.where(per_call[:, None] > 0, completed[np.maximum(last, 0)] if s.steps else 0.0, 0.0)
    return np.diff(ends, axis=1, prepend=0.0).max(axis=0, initial=0.0)


def replay(s: Schedule, network: Network) -> Timing:
    """Time ``s`` on ``network``: each rank's finish time and the critical path."""
    started = time.perf_counter()
    match = match_messages(s)
    finish, finish_cause, msg_start, msg_end, msg_cause, cur, _ = finish_times(s, match, network)
    stuck = np.flatnonzero(cur < s.step_ptr[1:])
    if len(stuck):
        r = int(stuck[0])
        k = cur[r]
        raise ScheduleError(
            f"{s.collective} ({s.algorithm}) on {s.world_size} ranks deadlocks: rank {r} waits at its "
            f"step {k - s.step_ptr[r]} for a message from rank {s.recv_peer[k]}")
    path: list[Message] = []
    if s.world_size:
        rank = int(np.argmax(finish))  # the first of the ranks that finish last
        m = int(finish_cause[rank])
        while m >= 0:
            if len(path) > s.steps:
                raise RuntimeError(f"{s.collective} ({s.algorithm}): the critical path loops at message {m}")
            sender = int(np.searchsorted(s.step_ptr, m, side="right")) - 1
            path.append(
                Message(sender, int(s.send_peer[m]), int(s.send_bytes[m]), float(msg_start[m]),
                        float(msg_end[m]), m))
            m = int(msg_cause[m])
        path.reverse()
    return Timing(finish, path, time.perf_counter() - started)
