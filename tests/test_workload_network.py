"""The network a replay runs on, by name (issue 35, item 3): ``lab.sim.calibrated`` returns the
network the lab fitted for a setting (a transport, or emulated hosts at a link speed), and
``lab.workload.replay(..., network="tcp")`` and ``--network tcp`` take the same one. Quick: no ranks."""

from __future__ import annotations

import dataclasses

import pytest

import lab
from lab import tuning, workload
from lab.sim import fitted
from lab.sim.network import MAX_RANKS_PER_HOST

COLUMNS = ("setting,alpha_us,gbit,send_overhead_us,recv_overhead_us,copy_us_per_byte,gamma_us_per_byte,"
           "wake_us,memory_us_per_byte,cores,ranks_per_host,fit_error\n")


@pytest.fixture
def hosts_csv(tmp_path, monkeypatch):
    """A calibration.csv with a transport's row and three hosts settings, in place of results/'s."""
    path = tmp_path / "calibration.csv"
    path.write_text(COLUMNS + "tcp,1,1000,40,40,1e-4,1e-9,1,1e-5,2,1,0.2\n"
                    '"4 hosts, 1 Gbit/s",30,0.9,20,80,5e-4,1e-9,2,6e-4,2,1,0.1\n'
                    '"8 hosts, 10 Gbit/s",20,9,30,40,1e-6,1e-9,3,1e-6,2,1,0.1\n'
                    '"2 hosts × 2 ranks, 1 Gbit/s",40,1.1,42,6,4e-4,1e-9,70,5e-5,2,2,0.1\n')
    monkeypatch.setattr(fitted, "CALIBRATION_CSV", path)
    return path


def test_a_transport_s_network_is_tuning_json_s():
    net = lab.sim.calibrated("tcp")
    assert net == lab.sim.Network(**tuning.calibrated_networks()["tcp"])
    assert workload.network_named("tcp") == net  # what --network tcp and replay(network="tcp") take


def test_emulated_hosts_take_their_setting_s_fit(hosts_csv):
    net = lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0)
    assert (net.alpha_us, net.send_overhead_us, net.recv_overhead_us) == (30, 20, 80)
    assert net.gbit == 1.0  # the link's, which the lab sets (the fit's 0.9 trades off against α)
    assert net.ranks_per_host == 1 and net.cores == 2
    assert net.ranks_per_cpu == MAX_RANKS_PER_HOST  # every rank on one machine's cores
    assert net.cache_bytes == tuning.calibrated_networks()["tcp"]["cache_bytes"]
    assert lab.sim.calibrated("tcp", hosts=8, link_gbit=10).wake_us == 3


def test_a_host_count_never_measured_takes_the_nearest_at_that_link(hosts_csv):
    four = lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0)
    assert lab.sim.calibrated("tcp", hosts=2, link_gbit=1.0) == four
    assert lab.sim.calibrated("tcp", hosts=64, link_gbit=10.0).alpha_us == 20  # (8 hosts': the nearest)


def test_several_ranks_a_host_talk_over_shm_inside_it(hosts_csv):
    net = lab.sim.calibrated("tcp", hosts=2, link_gbit=1.0, ranks_per_host=2)
    shm = tuning.calibrated_networks()["shm"]
    assert net.ranks_per_host == 2 and net.wake_us == 70
    assert (net.intra_alpha_us, net.intra_gbit) == (shm["alpha_us"], shm["gbit"])
    own_cores = dataclasses.replace(net, ranks_per_cpu=2)  # real hosts: each its own cores
    assert own_cores.ranks_per_cpu == 2 and own_cores.gbit == net.gbit


@pytest.mark.parametrize("kwargs, says", [
    ({"transport": "ib"}, "transport must be one of queue, shm, tcp"),
    ({"transport": "tcp", "hosts": 4, "link_gbit": 25.0}, "no emulated hosts of 1 rank(s) at 25 Gbit/s"),
    ({"transport": "tcp", "hosts": 4, "link_gbit": 1.0, "ranks_per_host": 4}, "4 rank(s) at 1 Gbit/s"),
    ({"transport": "shm", "hosts": 4, "link_gbit": 1.0}, "fitted over tcp"),
    ({"transport": "tcp", "hosts": 4}, "link_gbit must be"),
    ({"transport": "tcp", "hosts": 0, "link_gbit": 1.0}, "hosts must be an integer >= 1"),
    ({"transport": "tcp", "ranks_per_host": 2}, "needs hosts= and link_gbit=")])
def test_a_setting_never_fitted_is_a_clear_error(hosts_csv, kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")) as raised:
        lab.sim.calibrated(**kwargs)
    if "no emulated hosts" in says:
        assert "4 hosts × 1 ranks, 1 Gbit/s" in str(raised.value)  # the fitted settings, listed


def test_without_the_hosts_fits_every_hosts_setting_is_unfitted(tmp_path, monkeypatch):
    monkeypatch.setattr(fitted, "CALIBRATION_CSV", tmp_path / "missing.csv")
    assert fitted.hosts_fits() == {}
    with pytest.raises(ValueError, match="fitted: none"):
        lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0)


def test_a_network_name_never_fitted_names_the_argument():
    with pytest.raises(ValueError, match="network 'ib': transport must be one of"):
        workload.network_named("ib")
    with pytest.raises(ValueError, match="network must be a lab.sim.Network"):
        workload.network_named(3)
