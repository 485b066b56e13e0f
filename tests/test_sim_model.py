"""The simulator's CPU terms (issue 21): per-message overheads, per-byte copies and reductions, and
ranks sharing a host's cores; and the calibration that fits them to measurements."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from lab import sim
from lab.sim.network import MAX_RANKS_PER_HOST

pytestmark = pytest.mark.no_ranks

#: The hand calculation's network: 4,000-byte chunks cost 20 + 3.2 µs on the wire.
CPU = {
    "alpha_us": 20.0, "gbit": 10.0, "send_overhead_us": 5.0, "recv_overhead_us": 7.0,
    "copy_us_per_byte": 0.001, "gamma_us_per_byte": 0.002}


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_closed_forms_still_exact_with_the_cpu_terms_at_zero(world_size):
    """Cores shared by every rank change nothing while no CPU work is asked for."""
    net = sim.Network(alpha_us=20.0, gbit=10.0, cores=1, ranks_per_cpu=world_size)
    nbytes = world_size * 1000 * 4
    beta = net.beta_us_per_byte
    ring = sim.simulate("allreduce", "ring", world_size, nbytes, net)
    tree = sim.simulate("allreduce", "tree", world_size, nbytes, net)
    assert ring.time_us == pytest.approx(2 * (world_size - 1) * (20.0 + nbytes / world_size * beta),
                                         rel=1e-12)
    assert tree.time_us == pytest.approx(2 * math.log2(world_size) * (20.0 + nbytes * beta), rel=1e-12)


def test_cpu_terms_on_two_ranks_match_a_hand_calculation():
    """Ring allreduce of 8,000 bytes on 2 ranks: two sendrecv steps of 4,000 bytes, the first reduced.

    A core each: send work 5 + 4 = 9 µs, wire 23.2 µs, receive work 7 + 4 (+ 8 reducing) µs:
    step 1 ends at 9 + 23.2 + 19 = 51.2, step 2 at 51.2 + 9 + 23.2 + 11 = 94.4 µs, on both ranks.

    One core for both: step 1: sends work 0-9 (rank 0), 9-18 (rank 1); wires 9-32.2 and 18-41.2;
    rank 1 reduces 32.2-51.2, rank 0 waits for the core and reduces 51.2-70.2. Step 2: rank 1 asks
    at 51.2, sends work 70.2-79.2; rank 0 asks at 70.2, works 79.2-88.2; wires 79.2-102.4 and
    88.2-111.4; rank 0 copies out 102.4-113.4, rank 1 111.4 → waits → 113.4-124.4.
    """
    own = sim.simulate("allreduce", "ring", 2, 8000, sim.Network(**CPU))
    assert own.finish_us.tolist() == pytest.approx([94.4, 94.4], rel=1e-12)
    shared = sim.simulate("allreduce", "ring", 2, 8000, sim.Network(**CPU, cores=1, ranks_per_cpu=2))
    assert shared.finish_us.tolist() == pytest.approx([113.4, 124.4], rel=1e-12)
    # Ranks of one host share its cores by default; as many cores as ranks is no sharing at all.
    assert sim.simulate("allreduce", "ring", 2, 8000, sim.Network(**CPU, cores=1, ranks_per_host=2)).time_us \
        == pytest.approx(124.4, rel=1e-12)
    assert sim.simulate("allreduce", "ring", 2, 8000, sim.Network(**CPU, cores=2, ranks_per_cpu=2)).time_us \
        == pytest.approx(94.4, rel=1e-12)


def test_each_cpu_term_moves_the_prediction_by_its_share():
    """Ring on 2 ranks with a core each: o_send and o_recv add once per step, copy both sides' bytes."""
    base = sim.Network(alpha_us=20.0, gbit=10.0)
    plain = sim.simulate("allreduce", "ring", 2, 8000, base).time_us
    for field, extra in [("send_overhead_us", 2 * 5.0), ("recv_overhead_us", 2 * 5.0),
                         ("copy_us_per_byte", 2 * 2 * 4000 * 0.001), ("gamma_us_per_byte", 4000 * 0.001)]:
        value = 5.0 if field.endswith("_us") else 0.001
        net = sim.Network(alpha_us=20.0, gbit=10.0, **{field: value})
        assert sim.simulate("allreduce", "ring", 2, 8000,
                            net).time_us == pytest.approx(plain + extra, rel=1e-12)


def test_copies_beyond_the_cache_pay_memory_s_extra_as_a_hand_calculation_says():
    """The 2-rank ring of the hand calculation above (8,000 bytes, a core each) touches W = 2 ·
    8,000 of input + 2 · 8,000 received = 32,000 bytes. With an 8,000-byte cache, 3/4 of W is
    beyond it: a byte copied costs 0.001 + 0.75 · 0.002 = 0.0025 µs. Step 1: send 5 + 10, wire
    23.2, receive 7 + 10 + 8 (γ, unchanged) = 63.2; step 2: 15 + 23.2 + 17 = 118.4 µs. A cache
    that holds W, or no cache given, leaves the 94.4 µs of the copy alone."""
    memory = {**CPU, "memory_us_per_byte": 0.002}
    net = sim.Network(**memory, cache_bytes=8000)
    assert net.copy_cost(32000) == pytest.approx(0.0025, rel=1e-12)
    assert sim.simulate("allreduce", "ring", 2, 8000, net).finish_us.tolist() == pytest.approx([118.4, 118.4])
    for roomy in (sim.Network(**memory, cache_bytes=32000), sim.Network(**memory)):
        assert sim.simulate("allreduce", "ring", 2, 8000, roomy).time_us == pytest.approx(94.4, rel=1e-12)


def test_local_passes_are_recorded_and_cost_a_copy_each_on_the_rank_s_core():
    """reduce_scatter copies its T-byte input into a work buffer and its T/N-byte block into the
    result; Bruck rotates T bytes in, packs two slots of T/4 per step (2 steps at N = 4) and rotates
    T bytes out; ring allreduce works in place. Each pass costs ``copy`` per byte and no message.

    reduce_scatter of 8,000 bytes on 2 ranks, copy 0.001 µs/B alone: the work copy 8 µs, the
    step's send copy 4, the wire 20 + 3.2, the receive's copy 4, the block's copy 4: 43.2 µs.
    """
    from lab.sim.schedule import record

    T = 1 << 20
    scatter = record("reduce_scatter", "ring", 4, T)
    assert scatter.per_rank(scatter.pass_bytes).tolist() == [T + T // 4] * 4
    bruck = record("all_to_all", "bruck", 4, T)
    assert bruck.per_rank(bruck.pass_bytes).tolist() == [T + 2 * (2 * T // 4) + T] * 4
    ring = record("allreduce", "ring", 4, T)
    assert ring.per_rank(ring.pass_bytes).tolist() == [0] * 4
    net = sim.Network(alpha_us=20.0, gbit=10.0, copy_us_per_byte=0.001)
    assert sim.simulate("reduce_scatter", "ring", 2, 8000,
                        net).finish_us.tolist() == pytest.approx([43.2, 43.2])
    assert sim.simulate("reduce_scatter", "ring", 2, 8000, sim.Network(alpha_us=20.0, gbit=10.0)).time_us \
        == pytest.approx(23.2)  # no CPU terms: the wire alone, passes or not


def test_recordings_in_two_threads_count_their_own_local_passes():
    """The pass counter is a context variable: eight recordings at once, in threads, each find
    what one alone finds (Bruck's 3T per rank, reduce_scatter's T + T/N)."""
    from concurrent.futures import ThreadPoolExecutor

    from lab.sim.schedule import record

    def passes(case):
        schedule = record(*case)
        return schedule.per_rank(schedule.pass_bytes).tolist()

    cases = [("all_to_all", "bruck", 4, 1 << 20), ("reduce_scatter", "ring", 4, 1 << 20)] * 4
    alone = [passes(case) for case in cases[:2]] * 4
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(passes, cases)) == alone
    assert alone[:2] == [[3 << 20] * 4, [(1 << 20) + (1 << 18)] * 4]


def test_a_back_to_back_loop_lets_the_senders_of_a_gather_run_ahead():
    """Linear gather on 3 ranks, o_send 5, o_recv 10, α 1 µs, bytes free. One call from a common
    start: the senders' messages arrive at 6 and 7, the root takes them 6-16 and 16-26: 26 µs. In a
    loop, as lab.benchmark times it, a sender's call ends once its message has left (6 µs) and it
    starts the next, so from the second call on the root finds its messages there: 20 µs a call."""
    from lab.sim.calibrate import benchmark_us
    from lab.sim.event_loop import loop_times, match_messages
    from lab.sim.schedule import record

    net = sim.Network(alpha_us=1.0, gbit=1e9, send_overhead_us=5.0, recv_overhead_us=10.0)
    assert sim.simulate("gather", "linear", 3, 1024, net).time_us == pytest.approx(26.0, abs=1e-3)
    loop = record("gather", "linear", 3, 1024).repeated(4)
    assert loop.steps == 4 * 4 and loop.step_ptr.tolist() == [0, 8, 12, 16]
    assert loop_times(loop, match_messages(loop), net, 4).tolist() == pytest.approx([26.0, 20.0, 20.0, 20.0],
                                                                                    abs=1e-3)
    assert benchmark_us(loop, match_messages(loop), net) == pytest.approx(20.0, abs=1e-3)


def test_eight_ranks_on_two_cores_serialise_their_cpu_work():
    """Recursive doubling on 8 ranks, no wire time: 3 steps of 8 sends and 8 receives of 10 µs each,
    2 cores: 3 · 2 · 8 · 10 / 2 = 240 µs (a core each: 3 · 20 = 60 µs)."""
    net = {"alpha_us": 0.0, "gbit": 1e9, "send_overhead_us": 10.0, "recv_overhead_us": 10.0}
    alone = sim.simulate("allreduce", "recursive_doubling", 8, 4096, sim.Network(**net)).time_us
    shared = sim.simulate("allreduce", "recursive_doubling", 8, 4096,
                          sim.Network(**net, cores=2, ranks_per_cpu=8)).time_us
    assert alone == pytest.approx(60.0, abs=1e-6) and shared == pytest.approx(240.0, abs=1e-6)


def test_a_receiver_that_waits_asleep_pays_the_wake_up_after_its_message_arrives():
    """The 2-rank ring above with a core each and a wake-up of 3 µs: in both steps both ranks have
    posted their receive before the message arrives (at 32.2 and 86.4 µs), so each receive's work
    starts 3 µs late: 94.4 + 2 · 3 = 100.4 µs."""
    woken = sim.simulate("allreduce", "ring", 2, 8000, sim.Network(**CPU, wake_us=3.0))
    assert woken.finish_us.tolist() == pytest.approx([100.4, 100.4], rel=1e-12)


def test_a_receiver_that_finds_its_message_there_pays_no_wake_up():
    """Linear gather to rank 0 of 3 ranks, 10 µs per message (one at a time into rank 0), waking
    15 µs: rank 1's message arrives at 10 while rank 0 waits, so rank 0 takes it at 25; rank 2's
    arrived at 20, before rank 0 asked for it, so it is taken at once: 25 µs, not 10 + 15 + 15."""
    net = sim.Network(alpha_us=10.0, gbit=1e9, wake_us=15.0)
    gathered = sim.simulate("gather", "linear", 3, 3 * 4, net)
    assert gathered.finish_us[0] == pytest.approx(25.0, abs=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"wake_us": -1.0}, r"wake_us must be a number from 0 to 1e\+09 µs"),
    ({"cores": 0}, r"cores must be an integer from 1 to 16,777,216 or None"),
    ({"cores": 2.5}, r"cores must be an integer"),
    ({"ranks_per_cpu": 0}, r"ranks_per_cpu must be an integer from 1"),
    ({"send_overhead_us": -1.0}, r"send_overhead_us must be a number from 0 to 1e\+09 µs"),
    ({"recv_overhead_us": math.inf}, r"recv_overhead_us must be a number"),
    ({"copy_us_per_byte": 1e300}, r"copy_us_per_byte must be a number from 0 to 1e\+06"),
    ({"memory_us_per_byte": -1e-4}, r"memory_us_per_byte must be a number from 0 to 1e\+06"),
    ({"cache_bytes": 0}, r"cache_bytes must be an integer from 1 to")])
def test_bad_cpu_terms_are_value_errors_that_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sim.Network(**kwargs)


def test_times_stay_finite_with_every_cpu_term_at_its_largest():
    net = sim.Network(alpha_us=1e9, gbit=1e-6, send_overhead_us=1e9, recv_overhead_us=1e9,
                      copy_us_per_byte=1e6, gamma_us_per_byte=1e6, cores=1, ranks_per_cpu=8)
    assert math.isfinite(sim.simulate("allreduce", "naive", 8, sim.limits.MAX_NBYTES, net).time_us)


# -- calibration --------------------------------------------------------------------------------------

TRUTH = sim.Network(alpha_us=30.0, gbit=5.0, send_overhead_us=12.0, recv_overhead_us=25.0,
                    copy_us_per_byte=2e-4, gamma_us_per_byte=5e-4, wake_us=15.0, memory_us_per_byte=3e-4,
                    cache_bytes=8 << 20, cores=2, ranks_per_cpu=MAX_RANKS_PER_HOST)


def _measured_from_model(directory, network: sim.Network) -> None:
    """A results directory whose 'measurements' are the simulator's own times on ``network``, of a
    back-to-back loop as the benchmark runs it (calibration cases at N = 2, 4, 8 and 1 KB·16^k;
    validation cases at N = 3 and 64 KB)."""
    from lab.sim.calibrate import benchmark_schedule, benchmark_us

    rows = [{
        "collective": "allreduce", "impl": "lab", "algorithm": a, "transport": "shm", "world": n, "bytes": b,
        "median_us": benchmark_us(*benchmark_schedule("allreduce", a, n, b), network)}
            for a in ("ring", "tree", "naive") for n in (2, 3, 4, 8)
            for b in (1 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20)]
    directory.mkdir(exist_ok=True)
    pd.DataFrame(rows).to_csv(directory / "allreduce.csv", index=False)
    (directory / "machine.json").write_text(
        json.dumps({"cores": str(network.cores), "last_level_cache_bytes": str(network.cache_bytes)}))


@pytest.mark.slow
def test_calibration_recovers_known_parameters_from_synthetic_measurements(tmp_path):
    from lab.sim.calibrate import PARAMETERS, calibrate
    from lab.sim.validation import best_agreement

    _measured_from_model(tmp_path, TRUTH)
    fits, table = calibrate(tmp_path)
    assert list(fits) == ["shm"] and len(table) == 60
    assert set(table.loc[table["world"] == 3, "role"]) == {"validation"}
    assert set(table.loc[table["bytes"] == 64 << 10, "role"]) == {"validation"}
    fit = fits["shm"]
    assert fit.network.cores == 2 and fit.network.cache_bytes == 8 << 20 and fit.error < 1e-9
    for name, *_ in PARAMETERS:
        assert getattr(fit.network, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
        assert fit.determined[name] > 0.005, name  # each one constrained by the synthetic cases
    assert np.allclose(table["ratio"], 1.0, rtol=1e-9)  # validation cases included
    assert best_agreement(table)["agree"].all()


def test_interpolated_reads_a_validation_case_off_its_calibrated_neighbours():
    """256 KB and 4 MB at N = 4 took 300 and 1,800 µs: 1 MB at N = 4 reads 600 µs (linear in size);
    at 1 MB, N = 2, 4 and 8 then read 100, 600 and 700 µs: N = 6 reads 650 µs (linear in N); a
    case outside the calibrated sizes or N, or of another algorithm, is left out."""
    from lab.sim.validation import interpolated

    def row(algorithm, world, nbytes, median, role):
        return {
            "setting": "shm", "collective": "allreduce", "algorithm": algorithm, "world": world,
            "bytes": nbytes, "median_us": median, "role": role, "ratio": 1.0}

    calibration = [
        row("ring", 4, 256 << 10, 300.0, "calibration"),
        row("ring", 4, 4 << 20, 1800.0, "calibration"),
        row("ring", 2, 1 << 20, 100.0, "calibration"),
        row("ring", 8, 1 << 20, 700.0, "calibration")]
    validation = [
        row("ring", 4, 1 << 20, 650.0, "validation"),
        row("ring", 6, 1 << 20, 480.0, "validation"),
        row("ring", 4, 16 << 20, 9000.0, "validation"),
        row("ring", 16, 1 << 20, 2000.0, "validation"),
        row("tree", 4, 1 << 20, 500.0, "validation")]
    table = pd.DataFrame(calibration + validation)
    read = interpolated(table)
    assert read[["world", "bytes", "read_us"]].values.tolist() == [[4, 1 << 20, 600.0], [6, 1 << 20, 650.0]]


@pytest.mark.slow
def test_repeatability_compares_the_cases_measured_again_with_their_first_measurement(tmp_path):
    """A second run under repeat/ where 1 KB cases took 3x as long and the rest 1.2x or 1.3x: from
    64 KB up those within 25 % are the 1.2x ones, and within 2x are all but the 1 KB ones."""
    from lab.sim.validation import repeatability, validation_section

    _measured_from_model(tmp_path, TRUTH)
    first = pd.read_csv(tmp_path / "allreduce.csv")
    again = first.copy()
    again["median_us"] *= np.where(first["bytes"] == 1 << 10, 3.0,
                                   np.where(first["algorithm"] == "ring", 1.2, 1.3))
    (tmp_path / "repeat" / "4").mkdir(parents=True)
    again.to_csv(tmp_path / "repeat" / "4" / "allreduce.csv", index=False)
    table = repeatability(tmp_path)
    assert table.to_dict("records") == [{
        "setting": "shm", "cases": 60, "near": pytest.approx(1 / 3), "within_2x": pytest.approx(0.8)}]
    assert "| shm | 60 | 33% | 80% |" in validation_section(tmp_path, tmp_path)


# -- eager and rendezvous -------------------------------------------------------------------------


def test_a_large_message_waits_for_its_receive_and_a_small_one_does_not():
    """Rank 1 receives a small message from rank 2, then a large one from rank 0. Eagerly the
    large one takes rank 1's port first and the small one queues behind it; with rendezvous it
    waits until rank 1 posts its receive, after the small one."""
    from lab.sim.event_loop import replay
    from lab.sim.schedule import Schedule

    large, small = 1 << 20, 1000
    one = np.array
    s = Schedule("allreduce", "by hand", 3, large, one([0, 1, 3, 4]), one([1, -1, -1, 1]),
                 one([large, 0, 0, small]), one([-1, 2, 0, -1]), one([0, small, large, 0]), one([False] * 4),
                 0.0)
    net = sim.Network(alpha_us=20.0, gbit=10.0)
    t_large, t_small = net.message_us(large), net.message_us(small)
    eager = replay(s, sim.Network(alpha_us=20.0, gbit=10.0, eager_bytes=None))
    assert eager.finish_us == pytest.approx([t_large, t_large + t_small, t_large + t_small], rel=1e-12)
    rendezvous = replay(s, net)
    assert rendezvous.finish_us == pytest.approx([t_small + t_large, t_small + t_large, t_small], rel=1e-12)
    assert [(m.src, m.dst) for m in rendezvous.critical_path] == [(2, 1), (0, 1)]
    assert replay(s, sim.Network(alpha_us=20.0, gbit=10.0, eager_bytes=large)).finish_us == \
        pytest.approx(eager.finish_us, rel=1e-12)


def test_rendezvous_lets_the_pipelined_double_tree_run_as_its_timetable_says():
    """Eagerly, double-tree segments sent ahead of their receive block the ports of the ones
    needed now; with rendezvous above 64 KiB the pipeline runs as its timetable says."""
    times = {}
    for eager in (None, 64 * 1024):
        net = sim.Network(alpha_us=5.0, gbit=100.0, eager_bytes=eager)
        times[eager] = {
            a: sim.simulate("allreduce", a, 256, 64 << 20, net).time_us
            for a in ("ring", "double_tree")}
    # (256 ranks, 64 MB: 0.64x its eager time, 1.07x the ring's; at 1,024 ranks 0.71x the ring's)
    assert times[64 * 1024]["double_tree"] < 0.7 * times[None]["double_tree"], times
    assert times[64 * 1024]["double_tree"] < 1.1 * times[64 * 1024]["ring"], times


@pytest.mark.parametrize("eager_bytes", [-1, 1.5, "64K"])
def test_a_bad_eager_limit_is_a_value_error_that_names_it(eager_bytes):
    with pytest.raises(ValueError, match="eager_bytes must be"):
        sim.Network(eager_bytes=eager_bytes)


# -- latency and gap (LogP's L and g) ---------------------------------------------------------------


def test_a_gap_lets_a_sender_overlap_its_messages_latencies():
    """Binomial broadcast of 1,000 bytes on 4 ranks, α 20 µs, 0.8 µs of bytes. The root sends two
    messages (X then Z), X's receiver one (to Y).

    The port held for all of α: X 0-20.8, then the root's Z and X's to Y both 20.8-41.6: every
    rank finishes at 41.6 (the closed form, 2·(α + nβ)). A gap of 2 µs: X holds the root's port
    0-2.8 and arrives at 20.8; Z leaves at 2.8 and arrives at 23.6; X's receiver sends at 20.8,
    is done at 23.6, and Y receives at 41.6: the root finishes at 5.6, X and Z at 23.6, Y at 41.6.
    """
    whole = sim.simulate("broadcast", "binomial", 4, 1000, sim.Network(alpha_us=20.0, gbit=10.0))
    assert whole.finish_us.tolist() == pytest.approx([41.6] * 4, rel=1e-12)
    gapped = sim.simulate("broadcast", "binomial", 4, 1000, sim.Network(alpha_us=20.0, gbit=10.0, gap_us=2.0))
    assert sorted(gapped.finish_us.tolist()) == pytest.approx([5.6, 23.6, 23.6, 41.6], rel=1e-12)
    assert gapped.time_us == whole.time_us  # the critical path is a chain: one message per step


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_gap_leaves_the_closed_forms_of_chains_exact(world_size):
    """Ring and tree send one message per rank per step and wait for it: the gap changes nothing."""
    nbytes = world_size * 1000 * 4
    for algorithm in ("ring", "tree"):
        whole = sim.simulate("allreduce", algorithm, world_size, nbytes,
                             sim.Network(alpha_us=20.0, gbit=10.0))
        gapped = sim.simulate("allreduce", algorithm, world_size, nbytes,
                              sim.Network(alpha_us=20.0, gbit=10.0, gap_us=0.5))
        assert gapped.time_us == pytest.approx(whole.time_us, rel=1e-12)


def test_the_double_tree_at_scale_costs_the_tree_s_latency_with_a_small_gap():
    """256 ranks, 1 KB: each rank works in two trees at once; with the port held for all of α its
    two trees' messages queue behind each other, with a NIC's gap they overlap (NCCL's model
    gives the double tree one tree's latency)."""
    times = {
        gap: {
            a: sim.simulate("allreduce", a, 256, 1024, sim.Network(alpha_us=5.0, gbit=100.0,
                                                                   gap_us=gap)).time_us
            for a in ("tree", "double_tree")}
        for gap in (None, 0.5)}
    assert times[None]["double_tree"] > 1.9 * times[None]["tree"]
    assert times[0.5]["double_tree"] < 1.5 * times[0.5]["tree"]
    assert times[0.5]["tree"] == pytest.approx(times[None]["tree"], rel=1e-12)


@pytest.mark.parametrize("gap_us, match", [(-1.0, "gap_us must be a number from 0 to 20"),
                                           (20.5, "at most alpha_us"), ("1", "gap_us must be a number")])
def test_a_bad_gap_is_a_value_error_that_names_it(gap_us, match):
    with pytest.raises(ValueError, match=match):
        sim.Network(alpha_us=20.0, gap_us=gap_us)
