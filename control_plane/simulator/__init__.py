"""Seeded deterministic simulation of the edge, the admission processor, its timer and the workers.

The package is pure (the command line, ``__main__``, is the one module that prints and times). Its
modules, each importing only those listed before it::

    config      sizes, fault rates, the policy it runs under, the run's counters
    world       the seeded clock, the pending deliveries, the lossy network, the logs as they land
    processor   the admission processor (the real ``handle`` and ``route``) and its deadline timer
    edge        the HTTP edge and its clients
    workers     the workers: accept, decode, renew, report
    checks      the end-state checks and the summary of a run
    simulation  ``Simulation`` (the world wired to its actors: run, drain, check) and ``simulate``

``simulation``'s docstring describes the whole: the data flow, the faults and the checks.
"""

from control_plane.simulator.config import T0_MS, SimConfig
from control_plane.simulator.processor import Processor
from control_plane.simulator.simulation import Simulation, simulate
from control_plane.simulator.world import SimulationFailed

__all__ = ["T0_MS", "Processor", "SimConfig", "Simulation", "SimulationFailed", "simulate"]
