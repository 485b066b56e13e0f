"""Where ranks run: emulated hosts (:mod:`lab.hosts.emulated`, their keeper :mod:`lab.hosts.keeper`),
launchers' variables (:mod:`lab.hosts.launchers`), the rendezvous (:mod:`lab.hosts.rendezvous`) and
the job's secret (:mod:`lab.hosts.job_secret`).

``lab.hosts.Hosts`` and ``lab.hosts.Host`` are the emulated hosts' classes, as documented.
"""

from lab.hosts.emulated import Host, Hosts

__all__ = ["Host", "Hosts"]
