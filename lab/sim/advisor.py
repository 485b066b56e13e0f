"""The simulator as ``auto``'s advisor: where no fitted model decides (a world size never measured),
every candidate is replayed on the transport's calibrated network and the least time wins.

:mod:`lab.tuning` asks whatever advisor is registered (:data:`lab.tuning.ADVISORS`) and imports
nothing of the simulator; the lab's package registers this one as ``"simulator"``,
loading it when first asked (a rank that never needs advice never imports the simulator).

    advise("allreduce", 1 << 20, 8, {"alpha_us": 20.0, "gbit": 10.0})
    # -> ({"ring": AlgorithmTime(...), "tree": ...}, {"naive": "records more than 200,000 steps"})
"""

from __future__ import annotations

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.sim.core import simulate
from lab.sim.limits import SimulationTooLarge, SimulationUnsupported
from lab.sim.network import Network
from lab.tuning import AlgorithmTime

#: ``auto``'s simulations stop at this many recorded steps (a 64-rank ring allreduce is 8,064):
#: a candidate past it is left out of the comparison, a decision made on step counts only, so
#: every rank of a job leaves out the same ones (a time limit could differ between ranks).
SIMULATION_MAX_STEPS = 200_000


def simulated_input(collective: str, nbytes: int, world_size: int) -> int:
    """Each rank's input for the simulator (float32 elements, so a multiple of 4) for a call
    whose size is ``nbytes`` as ``auto`` counts it (allgather's and gather's: the result)."""
    return CATALOG[collective].input_bytes(nbytes, world_size)


def advise(collective: str, nbytes: int, world_size: int,
           network: dict) -> tuple[dict[str, AlgorithmTime], dict[str, str]] | None:
    """Each ``auto`` candidate simulated on ``Network(**network)``, and those left out with why
    (the recorder cannot run it, or it records more than :data:`SIMULATION_MAX_STEPS` steps);
    None where ``Network`` does not take ``network`` (written by another version of the lab)."""
    try:
        net = Network(**network)
    except (TypeError, ValueError):
        return None
    sim_bytes = simulated_input(collective, nbytes, world_size)
    out, left_out = {}, {}
    for algorithm in registry.auto_candidates(collective):
        try:
            result = simulate(collective, algorithm, world_size, sim_bytes, net,
                              max_steps=SIMULATION_MAX_STEPS, max_seconds=None)
        except SimulationTooLarge:
            left_out[algorithm] = f"records more than {SIMULATION_MAX_STEPS:,} steps"
            continue
        except SimulationUnsupported as exc:
            left_out[algorithm] = f"not simulated: {exc}"
            continue
        steps = len(result.critical_path)
        path_bytes = sum(m.nbytes for m in result.critical_path)
        out[algorithm] = AlgorithmTime(algorithm, result.time_us, "simulator", steps, path_bytes,
                                       steps * net.alpha_us, path_bytes * net.beta_us_per_byte)
    return out, left_out
