"""Time a recorded schedule on a :class:`~lab.sim.network.Network`: a discrete-event loop in Numba.

The model (DESIGN.md, "Simulation"): each rank runs its steps in order; a step starts when the
previous one has completed. A step's send leaves at once (eager) when the sender's port, the
receiver's port (and, between hosts, both hosts' links) are free, first come first served, and
holds them for ``α + n·β``. A step completes when its send has finished and its receive (the
message the peer sent, matched first-in first-out per pair of ranks) has arrived, plus ``n·γ``
if it is reduced. Ties go to the lower rank, so a replay is deterministic.

Every message remembers what it waited for (the sender's previous step, or the message holding
a port it needed), so the critical path is read backwards from the rank that finishes last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from lab.sim.network import Network
from lab.sim.record import Schedule


class Message(NamedTuple):
    """One message on the critical path."""

    src: int
    dst: int
    nbytes: int
    start_us: float
    end_us: float


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
        raise ScheduleError(f"{s.collective} ({s.algorithm}) on {n} ranks: rank {key // n} sends rank {key % n} "
                            f"{count[key]:+d} more messages than it receives")
    match = np.full(s.steps, -1, dtype=np.int64)
    match[sends[send_order]] = recvs[recv_order]
    wrong = s.send_bytes[sends] != s.recv_bytes[match[sends]]
    if wrong.any():
        k = sends[np.argmax(wrong)]
        raise ScheduleError(f"{s.collective} ({s.algorithm}): rank {rank_of_step[k]} sends {s.send_bytes[k]} bytes "
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
        if other < size and (heap_t[other] < heap_t[child] or (heap_t[other] == heap_t[child] and heap_r[other] < heap_r[child])):
            child = other
        if last_t < heap_t[child] or (last_t == heap_t[child] and last_r < heap_r[child]):
            break
        heap_t[i], heap_r[i] = heap_t[child], heap_r[child]
        i = child
    heap_t[i], heap_r[i] = last_t, last_r
    return t, r, size


@numba.njit(cache=True)
def _complete(r, k, t, cause, step_ptr, cur, start_cause, finish, finish_cause, heap_t, heap_r, size):
    """Step k of rank r completed at t: start the next one then, or record the finish."""
    cur[r] = k + 1
    if k + 1 < step_ptr[r + 1]:
        start_cause[r] = cause
        return _push(heap_t, heap_r, size, t, r)
    finish[r], finish_cause[r] = t, cause
    return size


@numba.njit(cache=True)
def _replay(step_ptr, send_peer, send_bytes, recv_peer, recv_bytes, reduces, match,
            alpha, beta, intra_alpha, intra_beta, gamma, ranks_per_host):
    n = len(step_ptr) - 1
    steps = len(send_peer)
    hosts = (n + ranks_per_host - 1) // ranks_per_host
    msg_start = np.zeros(steps)
    msg_end = np.zeros(steps)
    msg_cause = np.full(steps, -1, np.int64)  # the message whose end this one's start waited for
    arrived = np.full(steps, -1, np.int64)  # per receiving step: the message it takes, once sent
    waiting = np.full(n, -1, np.int64)  # the step a rank is blocked in, waiting for its message
    wait_t = np.zeros(n)
    wait_cause = np.full(n, -1, np.int64)
    start_cause = np.full(n, -1, np.int64)
    finish = np.zeros(n)
    finish_cause = np.full(n, -1, np.int64)
    cur = step_ptr[:-1].copy()
    # Ports: free-from time and the message holding it, per rank each way and per host link each way.
    send_free, send_holder = np.zeros(n), np.full(n, -1, np.int64)
    recv_free, recv_holder = np.zeros(n), np.full(n, -1, np.int64)
    up_free, up_holder = np.zeros(hosts), np.full(hosts, -1, np.int64)
    down_free, down_holder = np.zeros(hosts), np.full(hosts, -1, np.int64)
    heap_t, heap_r = np.zeros(n), np.zeros(n, np.int64)
    size = 0
    for r in range(n):
        if step_ptr[r] < step_ptr[r + 1]:
            size = _push(heap_t, heap_r, size, 0.0, r)
    while size:
        t, r, size = _pop(heap_t, heap_r, size)
        k = cur[r]
        base, base_cause = t, start_cause[r]
        dst = send_peer[k]
        if dst >= 0:
            # The send leaves when this rank's send port and the receiver's receive port are free
            # (and, between hosts, the two host links), first come first served.
            start, cause = t, base_cause
            if send_free[r] > start:
                start, cause = send_free[r], send_holder[r]
            if recv_free[dst] > start:
                start, cause = recv_free[dst], recv_holder[dst]
            up, down = r // ranks_per_host, dst // ranks_per_host
            if up != down:
                if up_free[up] > start:
                    start, cause = up_free[up], up_holder[up]
                if down_free[down] > start:
                    start, cause = down_free[down], down_holder[down]
                end = start + alpha + beta * send_bytes[k]
                up_free[up], up_holder[up] = end, k
                down_free[down], down_holder[down] = end, k
            else:
                end = start + intra_alpha + intra_beta * send_bytes[k]
            send_free[r], send_holder[r] = end, k
            recv_free[dst], recv_holder[dst] = end, k
            msg_start[k], msg_end[k], msg_cause[k] = start, end, cause
            base, base_cause = end, k
            # Deliver: if the receiver is already blocked on this message, its step completes.
            j = match[k]
            arrived[j] = k
            if waiting[dst] == j:
                waiting[dst] = -1
                done_t = end + gamma * recv_bytes[j] if reduces[j] else end
                done_cause = k
                if wait_t[dst] > done_t:
                    done_t, done_cause = wait_t[dst], wait_cause[dst]
                size = _complete(dst, j, done_t, done_cause, step_ptr, cur, start_cause, finish, finish_cause,
                                 heap_t, heap_r, size)
        if recv_peer[k] >= 0:
            m = arrived[k]
            if m < 0:
                waiting[r], wait_t[r], wait_cause[r] = k, base, base_cause
                continue
            done_t = msg_end[m] + gamma * recv_bytes[k] if reduces[k] else msg_end[m]
            if done_t >= base:
                base, base_cause = done_t, m
        size = _complete(r, k, base, base_cause, step_ptr, cur, start_cause, finish, finish_cause,
                         heap_t, heap_r, size)
    return finish, finish_cause, msg_start, msg_end, msg_cause, cur


def replay(s: Schedule, network: Network) -> Timing:
    """Time ``s`` on ``network``: each rank's finish time and the critical path."""
    started = time.perf_counter()
    match = match_messages(s)
    finish, finish_cause, msg_start, msg_end, msg_cause, cur = _replay(
        s.step_ptr, s.send_peer, s.send_bytes, s.recv_peer, s.recv_bytes, s.reduces, match,
        float(network.alpha_us), network.beta_us_per_byte, network.intra_alpha, network.intra_beta_us_per_byte,
        float(network.gamma_us_per_byte), network.ranks_per_host)
    stuck = np.flatnonzero(cur < s.step_ptr[1:])
    if len(stuck):
        r = int(stuck[0])
        k = cur[r]
        raise ScheduleError(f"{s.collective} ({s.algorithm}) on {s.world_size} ranks deadlocks: rank {r} waits at its "
                            f"step {k - s.step_ptr[r]} for a message from rank {s.recv_peer[k]}")
    path: list[Message] = []
    if s.world_size:
        rank = int(np.argmax(finish))  # the first of the ranks that finish last
        m = int(finish_cause[rank])
        while m >= 0:
            sender = int(np.searchsorted(s.step_ptr, m, side="right")) - 1
            path.append(Message(sender, int(s.send_peer[m]), int(s.send_bytes[m]),
                                float(msg_start[m]), float(msg_end[m])))
            m = int(msg_cause[m])
        path.reverse()
    return Timing(finish, path, time.perf_counter() - started)
