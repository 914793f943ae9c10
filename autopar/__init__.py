"""autopar: automatic parallelization of PyTorch training.

The layers, bottom up: ``costmodels`` (hardware profiles, cost functions), ``passes``
(capture, sharding strategies, simulation, and later solve and codegen) and this
package, the public API on top.
"""

from autopar.compiler import compile  # noqa: A004  (autopar.compile is the public entry point)
from passes.capture import Captured, capture
from passes.strategies import StrategyGraph, build_strategy_graph
from passes.plan import Plan
from autopar import layouts
from autopar.planning import plan
from autopar.dryrun import DryRunResult, dry_run
from autopar import checkpoint, faults
from autopar.checkpoint import Checkpointer

__all__ = ["compile", "Captured", "capture", "StrategyGraph", "build_strategy_graph", "Plan", "layouts", "plan",
           "dry_run", "DryRunResult", "checkpoint", "faults", "Checkpointer"]
