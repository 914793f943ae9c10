"""autopar: automatic parallelization of PyTorch training.

The layers, bottom up: ``costmodels`` (hardware profiles, cost functions), ``passes``
(capture, sharding strategies, simulation, and later solve and codegen) and this
package, the public API on top.
"""

from passes.capture import Captured, capture
from passes.strategies import StrategyGraph, build_strategy_graph

__all__ = ["Captured", "capture", "StrategyGraph", "build_strategy_graph"]
