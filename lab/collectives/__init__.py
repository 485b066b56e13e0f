"""The collectives: the public calls (:mod:`lab.collectives.calls`), one file per algorithm, their
registry (:mod:`lab.collectives.registry`) and how ``auto`` chooses (:mod:`lab.collectives.choice`).

Empty on purpose: importing an algorithm or the registry runs nothing else (``lab.tuning`` reads
the registry, and the calls sit above ``lab.tuning``).
"""
