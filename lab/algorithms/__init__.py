"""The algorithms: one file per algorithm, each a plain function over :class:`lab.algorithms.peers.Peers`
(send, recv, sendrecv), MPICH's fold for any rank count, the double tree's timetable, and the one
registry of them all (:mod:`lab.algorithms.registry`).

A floor above the compiled plane's ``@compilable`` and below everything that runs them: the
public calls (:mod:`lab.collectives`), ``auto``'s models (:mod:`lab.tuning`), the simulator.
Empty on purpose: importing an algorithm or the registry runs nothing else.
"""
