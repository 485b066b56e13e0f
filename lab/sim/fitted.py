"""The network the lab fitted for a setting: a transport on one machine, or emulated hosts.

:mod:`lab.sim.calibrate` fits a :class:`~lab.sim.network.Network` per measured setting. The
transports' (shm, queue, tcp: every rank on this machine) travel in ``lab/tuning.json``'s
``networks``; the emulated hosts' (``N hosts, G Gbit/s`` and ``N hosts × L ranks, G Gbit/s``:
tcp between network namespaces whose links are limited to G Gbit/s) are in
``results/sim/calibration.csv``, which ``python -m lab simulate`` writes with them.

A network's parameters describe a link and the CPU work around each message, not how many hosts
there are (the replay's world size says that): emulated hosts at a link speed take the fit of
the hosts setting with that link and that many ranks a host, of the very host count where one
was measured, else of the nearest host count, with that link's bandwidth: the lab sets it (the
namespaces' links carry ``link_gbit``), so it is known, not fitted. (The fit's own bandwidth
trades off against its other terms: 1.3 Gbit/s on 1 Gbit/s links, with α near 0, which made a
replayed DDP step on 4 hosts 20 % short of the measured one; at 1 Gbit/s it was within 1 %.)
Emulated hosts share this machine's cores (``cores``, with ``ranks_per_cpu`` every rank), as they
did when measured; for a cluster of real hosts of that kind, give each host its own:
``dataclasses.replace(net, ranks_per_cpu=L)``.

    lab.sim.calibrated("tcp")                               # tcp between ranks of one machine
    lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0)       # the "4 hosts, 1 Gbit/s" fit, at 1 Gbit/s
    lab.sim.calibrated("tcp", hosts=2, link_gbit=1.0, ranks_per_host=2)
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from lab import checks, tuning
from lab.sim.network import MAX_RANKS_PER_HOST, Network

#: The emulated hosts' fits, as :mod:`lab.sim.validation` writes them.
CALIBRATION_CSV = Path(__file__).resolve().parents[2] / "results" / "sim" / "calibration.csv"
#: The fitted parameters of a row of that file (every other field of the network is the setting's).
FITTED = ("alpha_us", "gbit", "send_overhead_us", "recv_overhead_us", "copy_us_per_byte", "gamma_us_per_byte",
          "wake_us", "memory_us_per_byte")
_HOSTS_SETTING = re.compile(r"(\d+) hosts(?: × (\d+) ranks)?, ([0-9.e+-]+) Gbit/s$")


def calibrated(transport: str, hosts: int | None = None, link_gbit: float | None = None,
               ranks_per_host: int = 1) -> Network:
    """The :class:`Network` the lab fitted for ``transport`` (``hosts=None``: its ranks on this
    machine), or for ``hosts`` emulated hosts of ``ranks_per_host`` ranks each whose links carry
    ``link_gbit`` Gbit/s (see the module's docstring). A setting never fitted is a ``ValueError``
    listing the fitted ones.

        net = lab.sim.calibrated("tcp", hosts=4, link_gbit=1.0)
        lab.workload.replay(w, world_size=1024, network=net)
    """
    fitted = tuning.calibrated_networks()
    if not isinstance(transport, str) or transport not in fitted:
        raise ValueError(f"transport must be one of {', '.join(sorted(fitted)) or 'none fitted'} "
                         f"(lab/tuning.json's networks, from python -m lab results); got {transport!r}")
    if hosts is None and link_gbit is None:
        if ranks_per_host != 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r} needs hosts= and link_gbit=: one machine's "
                             "ranks are one host")
        return Network(**fitted[transport])
    for name, value in (("hosts", hosts), ("ranks_per_host", ranks_per_host)):
        if not checks.is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    if not checks.is_real(link_gbit) or not link_gbit > 0:
        raise ValueError(f"link_gbit must be the emulated links' Gbit/s (> 0) with hosts=; got {link_gbit!r}")
    if transport != "tcp":
        raise ValueError(f"emulated hosts were fitted over tcp (the links between them); "
                         f"got transport={transport!r}")
    return _hosts_network(hosts, float(link_gbit), ranks_per_host, fitted)


def hosts_fits(path: Path | None = None) -> dict[tuple[int, int, float], dict[str, float]]:
    """``{(hosts, ranks_per_host, link_gbit): the fitted row}`` of the emulated hosts' settings in
    ``path`` (default :data:`CALIBRATION_CSV`); ``{}`` where it is missing.

        hosts_fits()[4, 1, 1.0]["gbit"]      # the "4 hosts, 1 Gbit/s" fit's bandwidth
    """
    path = CALIBRATION_CSV if path is None else path
    if not path.exists():
        return {}
    fits = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            match = _HOSTS_SETTING.match(row.get("setting", ""))
            if match:
                hosts, per_host, gbit = int(match[1]), int(match[2] or 1), float(match[3])
                fits[hosts, per_host, gbit] = {name: float(row[name]) for name in (*FITTED, "cores")}
    return fits


def _hosts_network(hosts: int, link_gbit: float, ranks_per_host: int, fitted: dict) -> Network:
    """The fit of the hosts setting at ``link_gbit`` and ``ranks_per_host`` nearest ``hosts``, with
    the link's bandwidth, this machine's cache (the tcp network's) and, inside a host, shm's link."""
    fits = hosts_fits()
    near = sorted((abs(key[0] - hosts), key) for key in fits
                  if key[1] == ranks_per_host and abs(key[2] - link_gbit) <= 1e-9 * link_gbit)
    if not near:
        settings = "; ".join(f"{h} hosts × {per_host} ranks, {gbit:g} Gbit/s"
                             for h, per_host, gbit in sorted(fits))
        raise ValueError(f"no emulated hosts of {ranks_per_host} rank(s) at {link_gbit:g} Gbit/s were fitted "
                         f"(fitted: {settings or 'none'}; {CALIBRATION_CSV} is written by python -m lab "
                         "simulate from results/hosts/)")
    row = fits[near[0][1]]
    inside = fitted.get("shm", {})
    intra = ({"intra_alpha_us": inside.get("alpha_us"), "intra_gbit": inside.get("gbit")}
             if ranks_per_host > 1 and inside else {})
    return Network(**{name: row[name]
                      for name in FITTED if name != "gbit"}, gbit=link_gbit, cores=int(row["cores"]),
                   ranks_per_host=ranks_per_host, ranks_per_cpu=MAX_RANKS_PER_HOST,
                   cache_bytes=fitted["tcp"].get("cache_bytes"), **intra)
