"""autopar: automatic parallelization of PyTorch training and serving.

The floors, bottom up (``docs/design.md`` has the map and what may import what):
``autopar.costmodels`` (hardware profiles, cost functions), ``autopar.passes`` (capture,
sharding strategies, costing, the planner, lowering to per-rank programs),
``autopar.runtime`` (what runs during a training step) and this package's public API on
top (``compile``, ``plan``, ``dry_run``, ``layouts``, the CLI).
"""

from autopar.compiler import compile  # noqa: A004  (autopar.compile is the public entry point)
from autopar.passes.capture import Captured, capture
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph
from autopar.passes.generation import Inference
from autopar.passes.plan import Plan
from autopar import layouts
from autopar.planning import plan
from autopar.passes.planner.constraints import Constraints
from autopar.dryrun import DryRunResult, dry_run
from autopar import checkpoint, faults
from autopar.checkpoint import Checkpointer

__all__ = ["compile", "Captured", "capture", "StrategyGraph", "build_strategy_graph", "Plan", "Inference", "Constraints", "layouts",
           "plan",
           "dry_run", "DryRunResult", "checkpoint", "faults", "Checkpointer"]
