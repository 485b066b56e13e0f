"""The cluster fitted to its own nccl-tests logs (lab.sim.fit_cluster) and predicted at more hosts
(lab.sim.predict), and the Network's host terms (NICs, rails, a bus inside, the switch tier).

Synthetic logs are nccl-tests text written from a known network's simulated times, read back
with lab.sim.read_nccl_tests, and fitted: the fit must find the known network again.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from lab import __main__ as cli
from lab import sim

pytestmark = pytest.mark.no_ranks

KNOWN = sim.Network(alpha_us=6.0, gbit=200.0, ranks_per_host=4, intra_alpha_us=1.5, intra_gbit=1500.0)
SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB to 64 MiB, factor 4
HEADER = [("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   "
           "algbw   busbw #wrong"),
          ("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  "
           "(GB/s)  (GB/s)")]


def nccl_tests_text(network: sim.Network, hosts: int, per_host: int, devices: bool = True) -> str:
    """all_reduce_perf's output as the known network's best simulated time would print it."""
    world = hosts * per_host
    lines = [
        f"# nThread 1 nGpus 1 minBytes {SIZES[0]} maxBytes {SIZES[-1]} step: 4(factor) warmup iters: 5", "#"]
    if devices:
        lines.append("# Using devices")
        lines += [
            f"#  Rank {r:2d} Group  0 Pid {100 + r:6d} on      host{r // per_host} "
            f"device {r % per_host:2d} [0x{r:02x}] SIM GPU" for r in range(world)]
    lines += ["#", *HEADER]
    for size in SIZES:
        t = sim.predict(network, "allreduce", hosts=hosts, nbytes=size, ranks_per_host=per_host).time_us
        algbw = size / t / 1e3
        busbw = algbw * 2 * (world - 1) / world
        cells = f"{t:9.2f}  {algbw:7.3f}  {busbw:7.3f}      0"
        lines.append(f"{size:12d}  {size // 4:12d}     float     sum      -1  {cells}  {cells}")
    return "\n".join([*lines, "# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 1.0", "#"]) + "\n"


@pytest.fixture(scope="module")
def log_paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("logs")
    paths = []
    for hosts in (1, 2):
        path = folder / f"all_reduce_{hosts}hosts.log"
        path.write_text(nccl_tests_text(KNOWN, hosts, 4))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def report(log_paths: list[Path]) -> sim.FitReport:
    return sim.fit_cluster_report([sim.read_nccl_tests(path) for path in log_paths])


def test_synthetic_logs_fit_back_to_the_known_network(report: sim.FitReport):
    for term in ("intra_alpha_us", "intra_gbit", "alpha_us", "gbit"):
        got, want = getattr(report.network, term), getattr(KNOWN, term)
        assert got == pytest.approx(want, rel=0.01), term
    assert report.network.ranks_per_host == 4
    assert report.error < 0.005
    assert (report.bands["max_error"] < 0.01).all()
    bands = {"up to 64 KiB", "64 KiB-1 MiB", "1-32 MiB", "from 64 MiB"}
    assert set(report.bands["band"].astype(str)) == bands


@pytest.mark.parametrize("hosts", [4, 8, 16])
def test_predictions_at_more_hosts_match_the_known_network(report: sim.FitReport, hosts: int):
    for size in (4096, 1 << 20, 64 << 20):
        want = sim.predict(KNOWN, "allreduce", hosts=hosts, nbytes=size)
        got = sim.predict(report.network, "allreduce", hosts=hosts, nbytes=size)
        assert got.time_us == pytest.approx(want.time_us, rel=0.01), (hosts, size)
        assert got.times[want.algorithm] == pytest.approx(got.time_us, rel=0.01)  # the known best, or a tie
        assert got.time_us == min(got.times.values())


def test_each_log_determines_the_terms_it_sees(report: sim.FitReport, log_paths: list[Path]):
    one, two = map(str, log_paths)
    terms = report.terms.set_index("term")
    assert one in terms.loc["intra_gbit", "determined_by"]
    for term in ("alpha_us", "gbit"):
        assert terms.loc[term, "determined_by"] == [two]
        assert terms.loc[term, "rise"][one] == 0.0  # one host never crosses a NIC


def test_a_one_host_log_leaves_the_terms_between_hosts_as_given(log_paths: list[Path]):
    built = sim.Network(alpha_us=3.0, gbit=50.0, nics_per_host=2)
    result = sim.fit_cluster_report([sim.read_nccl_tests(log_paths[0])], built)
    terms = result.terms.set_index("term")
    assert not terms.loc["alpha_us", "fitted"] and not terms.loc["gbit", "fitted"]
    assert (result.network.alpha_us, result.network.gbit, result.network.nics_per_host) == (3.0, 50.0, 2)
    assert result.network.intra_gbit == pytest.approx(KNOWN.intra_gbit, rel=0.01)


def test_predict_keeps_its_per_algorithm_form():
    times = sim.compare("allreduce", 4, 1 << 20, KNOWN)
    assert set(times) >= {"ring", "tree"}
    best = sim.predict(KNOWN, "allreduce", hosts=1, nbytes=1 << 20)
    assert best.time_us == min(times.values()) and best.algorithm == min(times, key=times.get)


def test_closed_forms_are_unchanged_at_the_defaults():
    n, size, alpha, gbit = 8, 1 << 24, 5.0, 100.0
    beta = 8 / (gbit * 1e3)
    defaults = sim.Network(alpha_us=alpha, gbit=gbit)
    spelled = sim.Network(alpha_us=alpha, gbit=gbit, nics_per_host=1, intra_fabric="switch",
                          oversubscription=1.0, hosts_per_leaf=1)
    for network in (defaults, spelled):
        ring = sim.simulate("allreduce", "ring", n, size, network).time_us
        tree = sim.simulate("allreduce", "tree", n, size, network).time_us
        assert ring == pytest.approx(2 * (n - 1) * (alpha + size / n * beta), rel=1e-12)
        assert tree == pytest.approx(2 * math.log2(n) * (alpha + size * beta), rel=1e-12)


def _time(algorithm: str, world: int, **terms: object) -> float:
    """64 MiB allreduce, α 0 between hosts and next to nothing inside: the bytes between hosts alone."""
    network = sim.Network(alpha_us=0.0, gbit=100.0, intra_alpha_us=0.0, intra_gbit=1e9, **terms)
    return sim.simulate("allreduce", algorithm, world, 64 << 20, network).time_us


def test_two_nics_halve_the_rails_of_a_bandwidth_bound_allreduce():
    # Hierarchical on 2 hosts of 2: each local rank's ring crosses hosts at once; one NIC carries both.
    one = _time("hierarchical", 4, ranks_per_host=2)
    assert _time("hierarchical", 4, ranks_per_host=2, nics_per_host=2) == pytest.approx(one / 2, rel=0.01)
    assert _time("hierarchical", 4, ranks_per_host=2, nics_per_host=2, nic_map=(0, 0)) == pytest.approx(one)


def test_oversubscription_doubles_the_time_between_leaves():
    # A ring over 2 hosts of 1 rank: all its bytes cross the tier (default: every host its own leaf).
    full = _time("ring", 2)
    assert _time("ring", 2, oversubscription=2.0) == pytest.approx(2 * full, rel=1e-9)
    assert _time("ring", 2, oversubscription=2.0, hosts_per_leaf=2) == pytest.approx(full, rel=1e-9)


def test_a_bus_takes_one_message_at_a_time():
    # Ring on one host of 2: each step's two messages share the bus, one after the other.
    size, alpha, gbit = 1 << 20, 2.0, 100.0
    step = alpha + size / 2 * 8 / (gbit * 1e3)
    network = sim.Network(alpha_us=alpha, gbit=gbit, ranks_per_host=2)
    assert sim.simulate("allreduce", "ring", 2, size, network).time_us == pytest.approx(2 * step)
    bus = sim.Network(alpha_us=alpha, gbit=gbit, ranks_per_host=2, intra_fabric="bus")
    assert sim.simulate("allreduce", "ring", 2, size, bus).time_us == pytest.approx(4 * step)


@pytest.mark.parametrize("terms, message", [
    ({"nics_per_host": 0}, "nics_per_host must be an integer from 1"),
    ({"ranks_per_host": 2, "nic_map": (0, 1)}, "nic_map must list ranks_per_host=2 NICs"),
    ({"ranks_per_host": 2, "nic_map": (0,)}, "nic_map must list ranks_per_host=2 NICs"),
    ({"intra_fabric": "ring"}, "intra_fabric must be one of"),
    ({"oversubscription": 0.5}, "oversubscription must be a number from 1"),
    ({"hosts_per_leaf": 1.5}, "hosts_per_leaf must be an integer from 1")])
def test_bad_host_terms_are_named(terms: dict, message: str):
    with pytest.raises(ValueError, match=message):
        sim.Network(**terms)


def test_bad_logs_are_clear_errors(tmp_path: Path, log_paths: list[Path]):
    with pytest.raises(ValueError, match="non-empty list of nccl-tests logs"):
        sim.fit_cluster([])
    path = tmp_path / "all_reduce_no_devices.log"
    path.write_text(nccl_tests_text(KNOWN, 1, 4, devices=False))
    with pytest.raises(ValueError, match=rf"{path}: df.attrs\['hosts'\] must be a count"):
        sim.fit_cluster([sim.read_nccl_tests(path)])
    with pytest.raises(TypeError, match="log 1 must be a DataFrame"):
        sim.fit_cluster([sim.read_nccl_tests(log_paths[0]), str(log_paths[1])])
    odd = sim.read_nccl_tests(log_paths[1])
    odd.attrs["hosts"] = 3
    with pytest.raises(ValueError, match="8 ranks do not split evenly over 3 hosts"):
        sim.fit_cluster([odd])
    with pytest.raises(ValueError, match="hosts must be an integer >= 1"):
        sim.predict(KNOWN, "allreduce", hosts=0, nbytes=1024)


def test_the_command_prints_one_json_object(log_paths: list[Path]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["cluster", "fit", *map(str, log_paths), "--predict-hosts", "4", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["network"]["gbit"] == pytest.approx(KNOWN.gbit, rel=0.01)
    (predicted,) = result["predictions"]
    assert (predicted["collective"], predicted["hosts"], predicted["ranks"]) == ("allreduce", 4, 16)
    assert [row["bytes"] for row in predicted["table"]] == SIZES
    assert isinstance(predicted["table"][0]["bytes"], int)  # numpy's int64 written as an integer
    assert {"time_us", "algbw", "busbw", "algorithm"} <= set(predicted["table"][0])


def test_the_command_names_a_log_it_cannot_fit(tmp_path: Path, capsys: pytest.CaptureFixture):
    path = tmp_path / "all_reduce_no_devices.log"
    path.write_text(nccl_tests_text(KNOWN, 1, 4, devices=False))
    with pytest.raises(SystemExit):
        cli.main(["cluster", "fit", str(path)])
    assert "df.attrs['hosts'] must be a count" in capsys.readouterr().err
