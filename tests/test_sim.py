"""lab.sim: the closed forms of DESIGN.md, byte counts equal to real runs, determinism, scale, errors.

The byte-count test runs every collective and algorithm that ``lab.collectives`` has (read from its
tables at collection time, so new algorithms are covered without editing this file) in one shm
pool per world size, and compares each rank's ``mesh.stats()`` with the simulated counters.
"""

from __future__ import annotations

import array
import inspect
import itertools
import math
import os
import time
import tracemalloc

import numpy as np
import pytest
import torch
from helpers import pool, slow_from_five

import lab
from lab import sim
from lab.algorithms import double_tree_schedule
from lab.collectives import calls
from lab.sim.cluster import predict_table
from lab.sim.event_loop import replay
from lab.sim.schedule import ROOTED, Schedule

ALGORITHMS = sim.algorithms()
CASES = [(c, a) for c, names in ALGORITHMS.items() for a in names]
NET = sim.Network(alpha_us=20.0, gbit=10.0)


def counts(world_size: int) -> list[int]:
    """Zero, one, fewer than ranks, not divisible by ranks, and a larger odd count."""
    return sorted({0, 1, max(world_size - 1, 0), 2 * world_size + 1, 2053})


def roots(collective: str, world_size: int) -> list[int]:
    return sorted({0, world_size - 1}) if collective in ROOTED else [0]


# -- the closed forms -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "net", [NET, sim.Network(alpha_us=3.5, gbit=400.0),
            sim.Network(alpha_us=0.0, gbit=1.0)], ids=["20us-10G", "3.5us-400G", "0us-1G"])
@pytest.mark.parametrize("world_size", [2, 4, 8, 16, 64])
def test_ring_and_tree_allreduce_match_the_closed_forms(world_size, net):
    nbytes = world_size * 1000 * 4  # N divides the element count
    beta = 8 / (net.gbit * 1e3)
    ring = sim.simulate("allreduce", "ring", world_size, nbytes, net)
    tree = sim.simulate("allreduce", "tree", world_size, nbytes, net)
    assert ring.time_us == pytest.approx(2 * (world_size - 1) * (net.alpha_us + nbytes / world_size * beta),
                                         rel=1e-12)
    assert tree.time_us == pytest.approx(2 * math.log2(world_size) * (net.alpha_us + nbytes * beta),
                                         rel=1e-12)
    # Ring: every rank sends and receives 2T(N-1)/N in 2(N-1) messages, and that is the critical path.
    assert (ring.bytes_sent == 2 * nbytes * (world_size - 1) // world_size).all()
    assert (ring.bytes_received == ring.bytes_sent).all()
    assert (ring.messages_sent == 2 * (world_size - 1)).all()
    assert len(ring.critical_path) == 2 * (world_size - 1)
    assert len(tree.critical_path) == 2 * int(math.log2(world_size))


def test_critical_path_is_a_chain_that_ends_at_the_finish():
    r = sim.simulate("allreduce", "naive", 6, 4000, NET)
    path = r.critical_path
    assert path[0].start_us == 0.0 and path[-1].end_us == r.time_us
    assert all(a.end_us == b.start_us for a, b in itertools.pairwise(path))
    # Naive: rank 0's receive port, then its send port, serialise all 2(N-1) whole-tensor messages.
    assert [m.dst for m in path[:5]] == [0] * 5 and [m.src for m in path[5:]] == [0] * 5
    assert r.time_us == pytest.approx(10 * NET.message_us(4000), rel=1e-12)


def test_world_size_one_and_zero_bytes():
    assert sim.simulate("allreduce", "ring", 1, 4096, NET).time_us == 0.0
    empty = sim.simulate("allreduce", "ring", 4, 0, NET)  # zero-byte chunks still cost α each
    assert empty.time_us == pytest.approx(6 * NET.alpha_us) and empty.bytes_sent.sum() == 0


# -- the host model ---------------------------------------------------------------------------------


def test_ranks_on_one_host_use_the_intra_host_link():
    net = sim.Network(alpha_us=20.0, gbit=10.0, ranks_per_host=8, intra_alpha_us=2.0, intra_gbit=400.0)
    r = sim.simulate("allreduce", "ring", 8, 8 * 4000, net)
    assert r.time_us == pytest.approx(14 * net.message_us(4000, intra=True), rel=1e-12)


def test_a_host_link_carries_one_message_at_a_time():
    """Recursive doubling on 2 hosts of 2: round 1 stays inside each host; in round 2 both ranks
    of a host cross to the other host at once and queue for its one uplink."""
    nbytes = 4000
    net = sim.Network(alpha_us=20.0, gbit=10.0, ranks_per_host=2, intra_alpha_us=1.0, intra_gbit=100.0)
    r = sim.simulate("allreduce", "recursive_doubling", 4, nbytes, net)
    assert r.time_us == pytest.approx(
        net.message_us(nbytes, intra=True) + 2 * net.message_us(nbytes), rel=1e-12)
    flat = sim.simulate("allreduce", "recursive_doubling", 4, nbytes, NET)
    assert flat.time_us == pytest.approx(2 * NET.message_us(nbytes), rel=1e-12)


def test_gamma_adds_the_reduction_of_each_received_byte_on_the_path():
    gamma = sim.Network(alpha_us=20.0, gbit=10.0, gamma_us_per_byte=0.001)
    plain = sim.simulate("allreduce", "ring", 4, 4000, NET).time_us
    # 3 reduce-scatter steps each fold in a 1000-byte chunk; the allgather steps only copy.
    assert sim.simulate("allreduce", "ring", 4, 4000,
                        gamma).time_us == pytest.approx(plain + 3 * 1000 * 0.001)


# -- bytes equal to the real run --------------------------------------------------------------------


def _real_stats(mesh: lab.Mesh, cases: list[tuple[str, str, int, int]]) -> list[dict[str, int]]:
    """In every rank: run each case once on the real mesh, return its counters per case."""
    out = []
    for collective, algorithm, count, root in cases:
        x = torch.arange(count, dtype=torch.float32) * 3 + mesh.rank
        fn = getattr(calls, collective)
        kwargs = {"algorithm": algorithm} if "algorithm" in inspect.signature(fn).parameters else {}
        if collective in ROOTED:
            kwargs[ROOTED[collective]] = root
        mesh.reset_stats()
        fn(mesh, **kwargs) if collective == "barrier" else fn(mesh, x, **kwargs)
        stats = mesh.stats()
        out.append({
            k: stats[k]
            for k in ("bytes_sent", "bytes_received", "messages_sent", "messages_received")})
    return out


@pytest.mark.parametrize("world_size", slow_from_five(range(1, 9)))
def test_simulated_counters_equal_mesh_stats_of_a_real_run(world_size):
    cases = [(c, a, n, root) for c, a in CASES for n in counts(world_size) for root in roots(c, world_size)]
    with pool(world_size, "shm", segment_bytes=4096) as cluster:
        real = cluster.run(_real_stats, cases)
    wrong = []
    for i, (collective, algorithm, count, root) in enumerate(cases):
        # The shm pool's ranks share one host (what hierarchical allreduce groups by).
        net = sim.Network(alpha_us=20.0, gbit=10.0, ranks_per_host=world_size)
        r = sim.simulate(collective, algorithm, world_size, count * 4, net, root=root)
        for rank in range(world_size):
            if r.stats(rank) != real[rank][i]:
                wrong.append(f"{collective} {algorithm} count={count} root={root} rank {rank}: "
                             f"sim {r.stats(rank)} real {real[rank][i]}")
    assert not wrong, f"{len(wrong)} of {len(cases) * world_size} differ:\n" + "\n".join(wrong[:20])


# -- determinism and scale --------------------------------------------------------------------------


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_a_simulation_is_deterministic(collective, algorithm):
    net = sim.Network(alpha_us=5.0, gbit=25.0, ranks_per_host=3, intra_alpha_us=1.0, intra_gbit=200.0)
    first = sim.simulate(collective, algorithm, 7, 4 * 1001, net, root=6 if collective in ROOTED else 0)
    sim.core._cache.clear()  # record it again
    again = sim.simulate(collective, algorithm, 7, 4 * 1001, net, root=6 if collective in ROOTED else 0)
    assert again.time_us == first.time_us and again.critical_path == first.critical_path
    assert np.array_equal(again.finish_us, first.finish_us) and np.array_equal(
        again.bytes_sent, first.bytes_sent)


def test_1024_ranks():
    """Tree at 1024 ranks (its 2·log2 N steps of the whole tensor); ring, whose 2N(N-1) messages
    cost seconds to record at 1024 ranks, at 256 (the closed form and the counts are the same
    formula in N; tests above check ring at 2-64 ranks too), and the choice between them."""
    nbytes = 1024 * 64 * 4
    tree = sim.simulate("allreduce", "tree", 1024, nbytes, NET)
    assert tree.time_us == pytest.approx(20 * NET.message_us(nbytes), rel=1e-12)
    assert tree.messages == 2 * 1023 and len(tree.critical_path) == 20
    n, nbytes = 256, 256 * 64 * 4
    ring = sim.simulate("allreduce", "ring", n, nbytes, NET)
    assert ring.messages == n * 2 * (n - 1)
    assert ring.time_us == pytest.approx(2 * (n - 1) * NET.message_us(nbytes // n), rel=1e-12)
    assert sim.best_algorithm("allreduce", n, nbytes, NET, candidates=["ring", "tree"]) == "tree"


def test_best_algorithm_follows_the_alpha_beta_tradeoff():
    # 1 KB on 64 ranks: tree's 12 α beat ring's 126 α. 64 MB: ring's 2T(N-1)/N beats tree's 12 T.
    assert sim.best_algorithm("allreduce", 64, 1 << 10, NET, candidates=["ring", "tree"]) == "tree"
    assert sim.best_algorithm("allreduce", 64, 64 << 20, NET, candidates=["ring", "tree"]) == "ring"
    times = sim.compare("allreduce", 64, 64 << 20, NET)
    assert set(times) == set(ALGORITHMS["allreduce"]) and min(times, key=times.get) == sim.best_algorithm(
        "allreduce", 64, 64 << 20, NET)


# -- bad arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda: sim.simulate("allreduce", "bogus", 4, 1024), "algorithm for allreduce must be one of"),
    (lambda: sim.simulate("allreduce", "auto", 4, 1024), "best_algorithm"),
    (lambda: sim.simulate("alltoall", "ring", 4, 1024), "collective must be one of"),
    (lambda: sim.simulate("allreduce", "ring", 0, 1024), "world_size must be an integer from 1 to"),
    (lambda: sim.simulate("allreduce", "ring", -3, 1024), "world_size"),
    (lambda: sim.simulate("allreduce", "ring", 2.0, 1024), "world_size"),
    (lambda: sim.simulate("allreduce", "ring", 4, -4), "nbytes must be an integer from 0 to"),
    (lambda: sim.simulate("allreduce", "ring", 4, 1022), "multiple of 4"),
    (lambda: sim.simulate("broadcast", "binomial", 4, 1024, root=4), "src must be an integer from 0 to 3"),
    (lambda: sim.best_algorithm("allreduce", 0, 1024), "world_size"),
    (lambda: sim.best_algorithm("allreduce", 4, -1), "nbytes"),
    (lambda: sim.Network(alpha_us=-1.0), r"alpha_us must be a number from 0 to 1e\+09 µs"),
    (lambda: sim.Network(alpha_us=1e308), r"alpha_us must be a number from 0 to 1e\+09 µs; got 1e\+308"),
    (lambda: sim.Network(gbit=0), r"gbit must be a number from 1e-06 to 1e\+09 Gbit/s; got 0"),
    (lambda: sim.Network(gbit=1e-320), r"gbit must be a number from 1e-06 to 1e\+09 Gbit/s; got 1e-320"),
    (lambda: sim.Network(gbit=float("inf")), "gbit must be a number from"),
    (lambda: sim.Network(gbit=float("nan")), "gbit must be a number from"),
    (lambda: sim.Network(gbit=1e300), "gbit must be a number from"),
    (lambda: sim.Network(ranks_per_host=0), "ranks_per_host"),
    (lambda: sim.Network(ranks_per_host=10**30), r"ranks_per_host must be an integer from 1 to 16,777,216"),
    (lambda: sim.Network(intra_gbit=-5.0), "intra_gbit must be a number from"),
    (lambda: sim.Network(intra_alpha_us=float("inf")), "intra_alpha_us must be a number from"),
    (lambda: sim.Network(gamma_us_per_byte=1e300), r"gamma_us_per_byte must be a number from 0 to 1e\+06"),
    (lambda: sim.simulate("allreduce", "ring", 2**40, 1024),
     r"world_size must be an integer from 1 to 16,777,216"),
    (lambda: sim.simulate("allreduce", "ring", 4, 2**41), r"nbytes must be .* from 0 to 1,099,511,627,776"),
    (lambda: sim.simulate("allgather", "ring", 2**24, 2**40), r"world_size × nbytes"),
    (lambda: sim.simulate("allreduce", "ring", 4, 1024, max_steps=0),
     "max_steps must be an integer >= 1 or None"),
    (lambda: sim.simulate("allreduce", "ring", 4, 1024, max_steps=1.5), "max_steps must be"),
    (lambda: sim.simulate("allreduce", "ring", 4, 1024, max_seconds=-1),
     "max_seconds must be a number > 0 or None"),
    (lambda: sim.compare("allreduce", 4, 1024, max_steps="many"), "max_steps must be"),
    (lambda: sim.best_algorithm("allreduce", 4, 1024, max_seconds=float("nan")), "max_seconds must be")])
def test_bad_arguments_are_value_errors_that_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


RACKS = sim.Network(ranks_per_host=8)


@pytest.mark.parametrize("call, error, match", [
    (lambda: sim.predict(RACKS, "allreduce", hosts=10**9, nbytes=1024), ValueError,
     r"hosts must be an integer >= 1, at most 2,097,152 \(16,777,216 ranks at 8 a host\); got 1000000000"),
    (lambda: sim.predict(RACKS, "allreduce", hosts=2, nbytes=True), ValueError,
     "nbytes must be .*; got True"),
    (lambda: sim.predict(RACKS, "allreduce", hosts=2, nbytes=np.bool_(True)), ValueError, "nbytes must be"),
    (lambda: sim.predict(RACKS, "allreduce", hosts=2, nbytes=-5), ValueError, "nbytes must be .*; got -5"),
    (lambda: sim.predict(RACKS, "allgather", hosts=2, nbytes=2**45), ValueError,
     r"from 0 to 17,592,186,044,416 \(allgather's size is its output"),
    (lambda: sim.predict(RACKS, "allreduce", hosts=2, nbytes=1024, ranks_per_host=True), ValueError,
     "ranks_per_host must be"),
    (lambda: sim.predict(RACKS, "allreduce", hosts=2, nbytes=1024, candidates="ring"), TypeError,
     "candidates must be a list"),
    (lambda: sim.compare("allreduce", 4, True), ValueError, "nbytes must be .*; got True"),
    (lambda: sim.predict("allreduce", 4, 1024), TypeError,
     r"cluster must be a lab.sim.Network .*got str \(every algorithm's time at N ranks: lab.sim.compare"),
    (lambda: sim.simulate("allreduce", "ring", 4, True), ValueError, "nbytes must be .*; got True"),
    (lambda: sim.estimate("allreduce", "ring", 4, True), ValueError, "nbytes must be .*; got True"),
    (lambda: sim.estimate("allreduce", "ring", 4, 1024, ranks_per_host=0), ValueError,
     "ranks_per_host must be"),
    (lambda: sim.estimate("allreduce", "ring", 4, 1024, ranks_per_host=True), ValueError,
     "ranks_per_host must be"),
    (lambda: sim.best_algorithm("allreduce", 4, True), ValueError, "nbytes must be .*; got True"),
    (lambda: predict_table(RACKS, "allreduce", 2, [True]), ValueError,
     "sizes must hold integers .*; got True"),
    (lambda: predict_table(RACKS, "allreduce", 2, [1.5]), ValueError, "sizes must hold integers"),
    (lambda: predict_table(RACKS, "allreduce", 2, 1024), TypeError, "sizes must be a list")])
def test_hosts_sizes_and_bools_for_numbers_are_refused_naming_the_parameter(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_table_predicted_at_one_rank_has_no_rates_rather_than_infinite_ones():
    (row,) = predict_table(sim.Network(), "allreduce", 1, [1024]).to_dict(orient="records")
    assert row["time_us"] == 0 and math.isnan(row["algbw"]) and math.isnan(row["busbw"])


def test_a_network_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="network must be a lab.sim.Network"):
        sim.simulate("allreduce", "ring", 4, 1024, network={"alpha_us": 1.0})


def test_unmatched_sends_are_a_schedule_error():
    one = np.array
    # Rank 0 sends to rank 1 twice; rank 1 receives once.
    s = Schedule("allreduce", "broken", 2, 8, one([0, 2, 3]), one([1, 1, -1]), one([8, 8, 0]),
                 one([-1, -1, 0]), one([0, 0, 8]), one([False, False, False]), 0.0)
    with pytest.raises(sim.ScheduleError, match="rank 0 sends rank 1 \\+1 more messages"):
        replay(s, NET)


# -- calibration and the command line ----------------------------------------------------------------


def _measured_from_model(directory, network: sim.Network) -> None:
    """A results directory whose 'measurements' are the simulator's own times on ``network``."""
    rows = [{
        "collective": "allreduce", "impl": "lab", "algorithm": a, "transport": "shm", "world": n, "bytes": b,
        "median_us": sim.simulate("allreduce", a, n, b, network).time_us} for a in ("ring", "tree", "naive")
            for n in (2, 4) for b in (1 << 10, 64 << 10, 1 << 20, 4 << 20)]
    rows.append({**rows[0], "impl": "gloo", "algorithm": "gloo"})  # not ours: left out
    directory.mkdir(exist_ok=True)
    import pandas as pd

    pd.DataFrame(rows).to_csv(directory / "allreduce.csv", index=False)


@pytest.mark.slow
def test_simulate_command_writes_results_and_the_report_section(tmp_path):
    from lab.__main__ import main

    _measured_from_model(tmp_path, sim.Network(alpha_us=30.0, gbit=5.0))
    (tmp_path / "REPORT.md").write_text("# Report\n")
    out = tmp_path / "sim"
    assert main([
        "simulate", "--world-sizes", "2", "8", "16", "--sizes", "1KB..1MB", "--gbit", "100", "--alpha-us",
        "5", "--out",
        str(out), "--measured",
        str(tmp_path)]) == 0
    import pandas as pd

    frame = pd.read_csv(out / "sim.csv")
    assert len(frame) == 3 * 6 * len(ALGORITHMS["allreduce"]) and frame["time_us"].notna().all()
    cross = pd.read_csv(out / "crossover.csv").set_index("world")
    # 16 ranks, 5 µs, 100 Gbit/s: the closed form puts the crossover at 5·(15-4)/(8e-5·(4-15/16)) bytes.
    assert cross.loc[16, "closed_form_bytes"] == pytest.approx(5 * 11 / (8e-5 * (4 - 15 / 16)))
    assert cross.loc[16, "crossover_bytes"] == pytest.approx(cross.loc[16, "closed_form_bytes"], rel=1e-6)
    for name in ("best.csv", "best_allreduce.png", "crossover.png", "calibration.csv", "validation.csv"):
        assert (out / name).exists(), name
    report = (tmp_path / "REPORT.md").read_text()
    assert "## At scale" in report and "## Simulator vs measurement" in report and report.startswith(
        "# Report")
    main(["simulate", "--world-sizes", "2", "--sizes", "4KB", "--out", str(out), "--measured", ""])
    assert (tmp_path / "REPORT.md").read_text().count("<!-- simulation:begin -->") == 1  # replaced, not added


@pytest.mark.parametrize("gap", [[], ["--gap-us", "0.5"]])
def test_the_command_and_the_api_describe_one_cluster_alike(tmp_path, gap):
    """One default gap: ``simulate --alpha-us 5`` is ``Network(alpha_us=5)``, ``--gap-us`` is ``gap_us``
    (a 1 KB double tree is where the port's hold shows: at 16 ranks 2.11x the tree at all of α, 1.43x at 0.5 µs)."""
    import pandas as pd

    from lab.__main__ import main

    main([
        "simulate", "--world-sizes", "16", "--sizes", "1KB", "--gbit", "100", "--alpha-us", "5", *gap,
        "--out",
        str(tmp_path), "--measured", ""])
    frame = pd.read_csv(tmp_path / "sim.csv").set_index("algorithm")
    net = sim.Network(alpha_us=5.0, gbit=100.0, gap_us=float(gap[1]) if gap else None)
    for algorithm in ("double_tree", "tree"):
        api = sim.simulate("allreduce", algorithm, 16, 1 << 10, net).time_us
        assert frame.at[algorithm, "time_us"] == pytest.approx(api, rel=1e-5)


def test_max_steps_skips_a_case_instead_of_recording_it():
    with pytest.raises(sim.SimulationTooLarge, match="max_steps=100"):
        sim.simulate("allreduce", "ring", 64, 4096, NET, max_steps=100)


# -- limits: refused up front, clearly, in little memory ---------------------------------------------


def traced_peak(call) -> tuple[object, int]:
    """``call()``'s result (or the exception it raised) and the peak of Python/numpy allocations."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - returned for the caller to check
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_20000_rank_ring_is_refused_up_front_in_little_memory():
    """800 million steps: the default max_steps (10 million) refuses it from a sampled rank's
    first steps, instead of growing to gigabytes. It names the limit and how to raise it."""
    error, peak = traced_peak(lambda: sim.simulate("allreduce", "ring", 20_000, 4096, NET))
    assert isinstance(error, sim.SimulationTooLarge), error
    message = str(error)
    assert "allreduce (ring) on 20,000 ranks" in message and "past max_steps=10,000,000" in message, message
    assert "max_steps=None" in message and "GB" in message, message
    assert peak < 16 << 20, f"refusing took {peak / 2**20:.0f} MiB"
    assert sim.limits.DEFAULT_MAX_STEPS == 10_000_000


def test_a_world_larger_than_max_steps_is_refused_before_anything_is_allocated():
    """Every rank sends or receives at least once: N - 1 > max_steps needs no recording at all."""
    error, peak = traced_peak(lambda: sim.simulate("barrier", "dissemination", 2**24, 0, NET))
    assert isinstance(error, sim.SimulationTooLarge) and "max_steps=10,000,000" in str(error), error
    assert peak < 1 << 20


def test_the_limit_is_max_steps_and_it_can_be_raised():
    with pytest.raises(sim.SimulationTooLarge, match="past max_steps=1,000"):
        sim.simulate("allreduce", "ring", 64, 4096, NET, max_steps=1_000)
    assert sim.simulate("allreduce", "ring", 64, 4096, NET, max_steps=64 * 126).messages == 64 * 126
    assert sim.simulate("allreduce", "ring", 64, 4096, NET, max_steps=None).messages == 64 * 126


def test_the_estimate_counts_the_steps_from_sampled_ranks():
    """Ring and naive are exact (every rank alike; naive's root sampled on its own); tree within 2x."""
    ring = sim.estimate("allreduce", "ring", 2_000, 4096)
    assert ring.steps == 2_000 * 2 * 1_999 and ring.sampled < 2_000
    assert ring.memory_bytes >= ring.steps * 100 and ring.seconds > 0
    assert sim.estimate("allreduce", "naive", 2_000, 4096).steps == 2 * 1_999 + 1_999 * 2
    actual = sim.schedule.record("allreduce", "tree", 2_000, 4096).steps
    assert actual / 2 <= sim.estimate("allreduce", "tree", 2_000, 4096).steps <= 2 * actual
    small = sim.estimate("broadcast", "binomial", 8, 4096, root=3)  # few ranks: recorded, exact
    assert small.exact and small.steps == 14


def test_a_python_heavy_recording_is_refused_by_its_estimated_time():
    """Bruck's all-to-all has few steps (N·log2 N) but O(N) Python per rank: at 20,000 ranks the
    steps pass but the recording would take far longer than max_seconds."""
    started = time.monotonic()
    with pytest.raises(sim.SimulationTooLarge, match=r"past max_seconds=300\b.*max_seconds=None"):
        sim.simulate("all_to_all", "bruck", 20_000, 20_000 * 4, NET)
    assert time.monotonic() - started < 120  # the estimate, not the recording (hours)


def test_a_double_tree_past_max_steps_is_refused_before_its_timetable_is_built():
    """A million ranks of 1 MiB: 12 segments, 52 million messages at least. Counted from the
    schedule's shape in microseconds, where the sample once built the timetable of every rank
    first (a minute)."""
    built = double_tree_schedule.timetable.cache_info().misses
    with pytest.raises(
            sim.SimulationTooLarge, match=r"allreduce \(double_tree\) on 1,000,000 ranks of "
            r"1,048,576 bytes needs at least 51,999,948 steps"):
        sim.simulate("allreduce", "double_tree", 10**6, 1 << 20, NET)
    assert double_tree_schedule.timetable.cache_info().misses == built


@pytest.mark.parametrize("world_size", [2, 3, 5, 8, 13, 20, 33])
@pytest.mark.parametrize("segment_bytes", [None, 64, 100])
def test_the_double_trees_fewest_steps_are_its_messages(monkeypatch, world_size, segment_bytes):
    """A step sends one message at most, and the recording sends 4·(N-1)·S: every link of both
    trees carries each segment up and down."""
    if segment_bytes is not None:
        monkeypatch.setenv("LAB_SEGMENT_BYTES", str(segment_bytes))
    entry = lab.algorithms.registry.ALGORITHMS["allreduce"]["double_tree"]
    mesh = sim.schedule.RecordingMesh(world_size)
    fewest = entry.fewest_steps(world_size, 256, 4, **entry.options(mesh))
    schedule = sim.schedule.record("allreduce", "double_tree", world_size, 1024)  # (not simulate's cache)
    assert int((schedule.send_peer >= 0).sum()) == fewest <= schedule.steps


def test_what_the_first_sampled_rank_builds_once_is_counted_once(monkeypatch):
    """The first rank's time before its first step (the double tree's timetable: built once for
    every rank, then kept) is counted once, not for the ranks it stands for: a 100 s build and
    1 ms a rank on 10,000 ranks is 110 s, not 62 days."""
    clock = [0.0]
    monkeypatch.setattr(sim.limits.time, "perf_counter", lambda: clock[0])

    class Recorder:
        world_size, check_at = 10_000, 0
        steps = array.array("q")

    mesh = Recorder()
    sample = sim.limits.sample_ranks(mesh.world_size, 0)
    meter = sim.limits.Meter(mesh, "a case", sample, None, None)
    for index, (_, special) in enumerate(sample):
        meter.begin(special)
        clock[0] += 100.0 if index == 0 else 0.0  # the build, before the first step
        for _ in range(4):
            mesh.steps.extend([0] * sim.limits.STEP_FIELDS)
            clock[0] += 0.25e-3
            if len(mesh.steps) >= mesh.check_at:
                mesh.check()
        meter.end()
    estimate = meter.finish()
    assert estimate.steps == 40_000 and estimate.record_s == pytest.approx(100.0 + 10_000 * 1e-3, rel=0.01)


def test_predict_and_best_algorithm_take_the_limit_and_leave_nothing_out_silently():
    """An algorithm past the limit is an error naming it, not a silently missing entry (which
    would make best_algorithm answer among the others)."""
    with pytest.raises(sim.SimulationTooLarge,
                       match=r"allreduce \(ring\).*past max_steps=2,000.*candidates="):
        sim.compare("allreduce", 64, 4096, NET, max_steps=2_000)
    with pytest.raises(sim.SimulationTooLarge, match="max_steps=2,000"):
        sim.best_algorithm("allreduce", 64, 4096, NET, max_steps=2_000)
    assert sim.best_algorithm("allreduce", 64, 4096, NET, max_steps=2_000, candidates=["tree",
                                                                                       "naive"]) == "tree"
    times = sim.compare("allreduce", 64, 4096, NET, max_steps=10_000, max_seconds=600)
    assert set(times) == set(ALGORITHMS["allreduce"])


ONE_GIB = 1 << 30


def peak_rss_growth(call) -> int:
    """How far the process's peak resident memory rose during ``call()`` (VmHWM, reset first)."""
    def hwm() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak to the current resident size
    before = hwm()
    call()
    return hwm() - before


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_recording_touches_no_data(collective, algorithm):
    """A 1 GiB input per rank on 4 ranks: nothing of it, of its copies, of the outputs or of any
    scratch buffer becomes resident while recording."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("cannot reset the peak resident size here")
    root = 3 if collective in ROOTED else 0
    sim.core._cache.clear()
    try:
        grew = peak_rss_growth(lambda: sim.simulate(collective, algorithm, 4, ONE_GIB, NET, root=root))
    except sim.SimulationUnsupported as why:
        pytest.skip(str(why))
    assert grew < 128 << 20, f"{collective} ({algorithm}): resident memory grew by {grew / 2**20:,.0f} MiB"


@pytest.mark.parametrize("collective", ["reduce_scatter", "reduce", "allgather"])
def test_recording_copies_and_allocates_no_data(collective):
    """reduce_scatter copies its input and reduce's inner ranks copy theirs; allgather allocates
    N·T: all virtual while recording (before: 2.3 GB traced for a 1 GiB reduce_scatter)."""
    for algorithm in ALGORITHMS[collective]:
        sim.core._cache.clear()
        result, peak = traced_peak(lambda a=algorithm: sim.simulate(collective, a, 4, ONE_GIB, NET, root=1))
        assert isinstance(result, sim.SimResult), result
        assert peak < 32 << 20, f"{collective} ({algorithm}) allocated {peak / 2**20:,.0f} MiB while recording"


def test_times_stay_finite_at_the_ends_of_every_range():
    """The slowest network the ranges allow, the largest input and the longest path: finite."""
    net = sim.Network(alpha_us=1e9, gbit=1e-6, intra_alpha_us=1e9, intra_gbit=1e-6, gamma_us_per_byte=1e6,
                      ranks_per_host=2)
    r = sim.simulate("allreduce", "naive", 8, sim.limits.MAX_NBYTES, net)
    assert math.isfinite(r.time_us) and r.time_us > 1e9
    fast = sim.Network(alpha_us=0.0, gbit=1e9)
    assert 0 < sim.simulate("allreduce", "ring", 4, 4096, fast).time_us < 1e-3


def test_the_recording_cache_is_bounded_by_steps(monkeypatch):
    """Recordings are kept for replays on other networks, up to a total number of steps."""
    monkeypatch.setattr(sim.core, "_CACHE_TOTAL_STEPS", 20_000)
    sim.core._cache.clear()
    for n in range(2, 60):
        sim.simulate("allreduce", "ring", n, 4096, NET)  # 2n(n-1) steps each, 200,000 in all
    kept = [s.world_size for s in sim.core._cache.values()]
    assert sum(s.steps for s in sim.core._cache.values()) <= 20_000 and 59 in kept


# -- recording changes nothing global: threads, and real collectives beside it ---------------------


def simulate_while_reducing(mesh: lab.Mesh, rounds: int) -> list[str]:
    """One thread simulates over and over (recording with kernels that do nothing) while this
    thread runs real allreduces: every real result must be exact."""
    import threading

    stop, wrong = threading.Event(), []

    def simulate() -> None:
        while not stop.is_set():
            sim.simulate("allreduce", "recursive_doubling", 6, 1 << 16, NET)
            sim.simulate("allgather", "ring", 5, 1 << 12, NET)

    thread = threading.Thread(target=simulate)
    thread.start()
    try:
        for i in range(rounds):
            x = torch.arange(3000, dtype=torch.float32) * 3 + mesh.rank + i
            lab.allreduce(mesh, x, algorithm="recursive_doubling")
            got = lab.allgather(mesh, torch.tensor([float(mesh.rank)]))
            want = torch.arange(3000, dtype=torch.float32) * 3 * mesh.world_size + sum(range(mesh.world_size)) \
                + i * mesh.world_size
            if not torch.equal(x, want) or not torch.equal(got, torch.arange(float(mesh.world_size))):
                wrong.append(f"rank {mesh.rank} round {i}")
    finally:
        stop.set()
        thread.join()
    return wrong


def test_recording_in_a_thread_leaves_real_collectives_alone():
    assert lab.spawn(simulate_while_reducing, 3, args=(60,)) == [[]] * 3


def test_recordings_in_threads_at_once_agree_with_one_at_a_time():
    from concurrent.futures import ThreadPoolExecutor

    cases = [("allreduce", a, n, b) for a in ALGORITHMS["allreduce"] for n in (3, 6) for b in (4096, 1 << 20)]
    alone = [sim.simulate(c, a, n, b, NET) for c, a, n, b in cases]
    with ThreadPoolExecutor(4) as pool_of_threads:
        together = list(pool_of_threads.map(lambda case: sim.simulate(*case, NET), cases))
    for case, one, other in zip(cases, alone, together):
        assert one.time_us == other.time_us and np.array_equal(one.bytes_sent, other.bytes_sent), case
