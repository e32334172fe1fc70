"""The simulator: the real scheduler and KV manager against a cost model of named GPUs and models.

* :mod:`workbench.sim.hardware` — the device catalogue (datasheet figures, sources) and a CPU profile;
* :mod:`workbench.sim.cost` — the per-step cost model (FLOPs, bytes, roofline, all-reduce);
* :mod:`workbench.sim.engine` — :class:`SimEngine` and :class:`SimulatedExecutor`;
* :mod:`workbench.sim.trace` — Poisson / constant arrivals, ShareGPT- / Alpaca-like lengths, trace files;
* :mod:`workbench.sim.calibrate` — fitting the cost model to real runs, and its error on held-out runs;
* :mod:`workbench.sim.run` — ``workbench simulate``: a run folder like ``workbench run``'s.
"""

from workbench.sim.cost import CostModel, Efficiency, StepCost, StepShape
from workbench.sim.engine import SimEngine, SimSpec, SimulatedExecutor
from workbench.sim.hardware import HARDWARE, HardwareSpec, cpu_profile, find_hardware
from workbench.sim.trace import TraceRequest, make_trace

__all__ = [
    "HARDWARE",
    "CostModel",
    "Efficiency",
    "HardwareSpec",
    "SimEngine",
    "SimSpec",
    "SimulatedExecutor",
    "StepCost",
    "StepShape",
    "TraceRequest",
    "cpu_profile",
    "find_hardware",
    "make_trace",
]
