"""``auto`` asks the simulator where nothing was measured; ``python -m lab explain`` and its pictures."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys

import pytest

from lab import sim, tuning
from lab.__main__ import main
from lab.algorithms import registry
from lab.collectives import choice as collectives
from lab.sim.plot import arrows
from lab.sim.schedule import record

NETWORK = {"alpha_us": 20.0, "gbit": 10.0}


@pytest.fixture
def simulator_only(monkeypatch):
    """A tuning table with no fits and one calibrated network, shm's: auto can only simulate."""
    monkeypatch.setattr(tuning, "fitted_models", dict)
    monkeypatch.setattr(tuning, "measured_models", lambda world_size: {})
    monkeypatch.setattr(tuning, "calibrated_networks", lambda: {"shm": NETWORK})
    monkeypatch.delenv("LAB_ALGO", raising=False)
    monkeypatch.setattr(tuning, "_SIMULATED", {})


def simulated(nbytes: int, world_size: int) -> dict[str, float]:
    return sim.compare("allreduce", world_size, nbytes, sim.Network(**NETWORK),
                       candidates=registry.auto_candidates("allreduce"))


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 16 << 20])
def test_with_no_fits_auto_picks_the_simulators_best_and_explain_says_so(simulator_only, capsys, nbytes):
    times = simulated(nbytes, 8)
    best = min(times, key=times.get)
    assert tuning.choose(nbytes, 8, "shm") == best
    assert collectives.choose("allreduce", nbytes, 8, "shm") == best  # what the public call resolves
    assert main(["explain", "allreduce", "--ranks", "8", "--bytes", str(nbytes)]) == 0
    out = capsys.readouterr().out
    assert f"auto picks {best} -- simulator: shm has fits for 0 of allreduce's algorithms" in out
    assert f"Why {best}:" in out


def test_explain_prints_the_simulators_own_times_and_terms(simulator_only, capsys):
    main(["explain", "allreduce", "ring", "--ranks", "5", "--bytes", "1M"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if "simulator " in line}
    net = sim.Network(**NETWORK)
    assert set(rows) == set(registry.auto_candidates("allreduce"))
    for algorithm, line in rows.items():
        result = sim.simulate("allreduce", algorithm, 5, 1 << 20, net)
        steps = len(result.critical_path)
        assert f"{result.time_us:,.0f} µs" in line and f" {steps} " in line
        assert f"{steps * net.alpha_us:,.0f} µs" in line  # the α terms: messages on the path times α
    assert rows["ring"].endswith(("<- asked", "<- auto"))


def test_a_size_bucket_is_simulated_once(simulator_only, monkeypatch):
    first = tuning.choose(3 << 19, 8, "shm")  # 1.5 MB: simulated at its bucket's 1 MB
    assert first == min(simulated(1 << 20, 8), key=simulated(1 << 20, 8).get)

    def no_more(*args):
        raise AssertionError("simulated again")

    monkeypatch.setitem(tuning.ADVISORS, "simulator", no_more)
    assert tuning.choose(1 << 20, 8, "shm") == tuning.choose((2 << 20) - 4, 8, "shm") == first


def test_fits_at_the_world_size_they_were_measured_at_still_decide(monkeypatch):
    fits = {
        "shm": {
            "allreduce": {
                "ring": {"alpha_step_us": 1.0, "beta_byte_us": 1e-6},
                "tree": {"alpha_step_us": 1e4, "beta_byte_us": 1e-6}}}}
    choice = tuning.decide(1 << 10, 4, "shm", models=fits, networks={"shm": NETWORK}, worlds=(4,))
    assert (choice.algorithm, choice.source) == ("ring", "fitted model")
    choice = tuning.decide(1 << 10, 8, "shm", models=fits, networks={"shm": NETWORK}, worlds=(4,))
    assert choice.source == "simulator" and choice.algorithm != "ring"  # 14 steps of 20 µs lose at 1 KB
    # a network that this Network does not accept is not used: the fits, extrapolated
    choice = tuning.decide(1 << 10, 8, "shm", models=fits, networks={"shm": {"alpha_us": -1.0}}, worlds=(4,))
    assert (choice.algorithm, choice.source) == ("ring", "fitted model")


def test_the_shipped_networks_are_network_keyword_arguments():
    networks = tuning.calibrated_networks()
    assert set(tuning.TRANSPORTS) <= set(networks)
    fields = {f.name for f in dataclasses.fields(sim.Network)}
    # How a cluster is built (NICs, fabric, switch tier) is given, not fitted: a calibration of one
    # machine's runs leaves it at the defaults, and a file may carry it or not.
    topology = {"nics_per_host", "nic_map", "intra_fabric", "oversubscription", "hosts_per_leaf"}
    for kwargs in networks.values():
        assert fields - topology <= set(kwargs) <= fields  # every fitted field travels
        sim.Network(**kwargs)


def test_two_ranks_ring_has_four_arrows_two_reduced_two_copied_two_critical():
    schedule = record("allreduce", "ring", 2, 1024)
    timing = sim.simulate("allreduce", "ring", 2, 1024, sim.Network(**NETWORK))
    drawn = arrows(schedule, timing.critical_path)
    assert [(a.src, a.dst, a.nbytes, a.sent_at, a.received_at, a.reduces) for a in drawn] == [
        (0, 1, 512, 0, 0, True), (0, 1, 512, 1, 1, False), (1, 0, 512, 0, 0, True), (1, 0, 512, 1, 1, False)]
    assert sum(a.critical for a in drawn) == len(timing.critical_path) == 2


@pytest.mark.parametrize("algorithm",
                         ["ring", "tree", "recursive_doubling", "halving_doubling", "double_tree"])
@pytest.mark.parametrize("world_size", [3, 8])
def test_every_message_is_an_arrow_and_the_critical_path_is_placed(algorithm, world_size):
    schedule = record("allreduce", algorithm, world_size, 256 << 10)
    result = sim.simulate("allreduce", algorithm, world_size, 256 << 10, sim.Network(**NETWORK))
    drawn = arrows(schedule, result.critical_path)
    assert len(drawn) == result.messages
    assert sum(a.critical for a in drawn) == len(result.critical_path)
    assert all(a.received_at >= a.sent_at for a in drawn)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "double_tree"])
def test_the_critical_path_is_placed_with_cpu_terms_too(algorithm):
    # With CPU terms the critical path can pass from rank to rank through a shared core, not only
    # through messages: the replay names each critical message's recorded send, nothing is guessed.
    network = sim.Network(alpha_us=0.001, gbit=32.0, send_overhead_us=22.0, recv_overhead_us=42.0,
                          copy_us_per_byte=5.4e-5, cores=2,
                          ranks_per_cpu=8)  # 8 ranks on 2 cores, as fitted here
    schedule = record("allreduce", algorithm, 8, 256 << 10)
    result = sim.simulate("allreduce", algorithm, 8, 256 << 10, network)
    drawn = arrows(schedule, result.critical_path)
    assert sum(a.critical for a in drawn) == len(result.critical_path) > 0


def test_plot_writes_a_png_of_the_expected_size(tmp_path, capsys):
    path = tmp_path / "ring.png"
    assert main(["explain", "allreduce", "ring", "--ranks", "4", "--bytes", "1M", "--plot", str(path)]) == 0
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    # 6 steps: max(6, 0.85·6 + 2) = 7.1 in wide, max(3, 0.65·4 + 1.6) = 4.2 in high, at 110 dpi
    assert (width, height) == (pytest.approx(781, abs=1), pytest.approx(462, abs=1))
    assert f"24 messages -> {path}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, option", [
    (["explain", "allreduce", "--ranks", "8", "--bytes", "1X"], "--bytes"),
    (["explain", "allreduce", "--ranks", "0", "--bytes", "1M"], "--ranks"),
    (["explain", "allreduce", "--ranks", "eight", "--bytes", "1M"], "--ranks"),
    (["explain", "allreduce", "butterfly", "--ranks", "8", "--bytes", "1M"], "argument algorithm"),
    (["explain", "allreduce", "--ranks", "8", "--bytes", "1M", "--transport", "pigeon"], "--transport"),
    (["explain", "allsum", "--ranks", "8", "--bytes", "1M"], "collective"),
    (["explain", "allreduce", "--bytes", "1M"], "--ranks")])
def test_bad_arguments_name_the_option(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_lab_sim_works_after_a_plain_import_lab():
    code = ("import lab; r = lab.sim.simulate('allreduce', 'ring', 4, 1 << 20, lab.sim.Network(20.0, 10.0)); "
            "print(round(r.time_us, 1))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) == pytest.approx(6 * (20 + (1 << 18) * 8 / 10e3), abs=0.1)
