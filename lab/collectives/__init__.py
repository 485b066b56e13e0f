"""The public collectives: the calls and their checks (:mod:`lab.collectives.calls`,
:mod:`lab.collectives.prepared`), gather and scatter's blocks, persistent plans
(:mod:`lab.collectives.plans`) and which algorithm runs (:mod:`lab.collectives.choice`).

The algorithms they run live a floor below, in :mod:`lab.algorithms`. Empty on purpose: importing
one call's module runs nothing else.
"""
