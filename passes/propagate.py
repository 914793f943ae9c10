"""Choose every node's strategy by forward propagation from fixed placeholder layouts.

This is how a manual layout becomes a full choice: the user (or ``autopar.layouts``)
fixes where parameters and inputs live — DP replicates parameters and splits the batch,
Megatron TP splits column/row weights — and each op, in graph order, takes the strategy
that moves the fewest bytes from its producers' layouts (ties: the first listed, so a
value stays as it is unless splitting it is free). The planner's solver replaces this
with a global optimum; this greedy pass is exact for layouts whose ops need no
resharding.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import fx
from torch.distributed.tensor import Partial, Replicate

from autopar.passes.placements import Spec, local_shape, spec_str
from autopar.passes.rules import overlapped
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs
from autopar.passes.op_strategies import TensorMeta


def reshard_bytes(meta: TensorMeta, src: Spec, dst: Spec | None, mesh_shape: Sequence[int]) -> float:
    """A rough count of bytes a device sends to move ``src`` to ``dst`` (0 when local)."""
    if dst is None or src == dst:
        return 0.0
    local = math.prod(local_shape(meta.shape, src, mesh_shape)) * meta.dtype.itemsize
    moved = 0.0
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b or isinstance(a, Replicate):
            continue  # slicing a replica, or zeroing others' parts: no data moves
        n = mesh_shape[axis]
        factor = 2.0 if isinstance(a, Partial) and isinstance(b, Replicate) else 1.0
        moved += factor * local * (n - 1)
    return moved


def choose_by_propagation(graph: StrategyGraph, fixed: dict[fx.Node, Spec]) -> dict[fx.Node, int]:
    """A strategy index per node: placeholders as ``fixed`` (replicated if absent), ops greedy."""
    mesh = graph.mesh_shape
    choice: dict[fx.Node, int] = {}
    have: dict[fx.Node, tuple[Spec, ...]] = {}
    metas: dict[fx.Node, tuple[TensorMeta, ...]] = {}
    for node, ns in graph.nodes.items():
        if node.op == "placeholder":
            want = fixed.get(node, (Replicate(),) * len(mesh))
            options = [s.output for s in ns.strategies]
            if want not in options:
                shape = tuple(node.meta["val"].shape)
                raise ValueError(
                    f"autopar: cannot lay out {node.name} (shape {shape}) as {spec_str(want)} on mesh "
                    f"{mesh}: a split dim must divide by the devices it is split over (uneven shards are "
                    f"not supported). Valid here: {', '.join(spec_str(o) for o in options)}; or change "
                    "the size (e.g. a batch that is a multiple of the data-parallel size)"
                )
            choice[node] = options.index(want)
            have[node] = (want,)
            metas[node] = (TensorMeta.of(node.meta["val"]),)
        elif ns.follows is not None:
            producer, index = ns.follows
            choice[node] = choice[producer]
            have[node] = (have[producer][index],)
            metas[node] = (metas[producer][index],)
        else:
            sources = tensor_inputs(node)

            def cost(strategy):
                return sum(
                    reshard_bytes(metas[src][0], have[src][0], need, mesh)
                    for src, need in zip(sources, strategy.inputs)
                )

            # a linear running its collective inside (async TP) is the solver's to choose where it
            # pays: laid out as written, an op moves its values on the edges
            allowed = [i for i, s in enumerate(ns.strategies) if s.kernel not in overlapped.KERNELS]
            best = min(allowed or range(len(ns.strategies)), key=lambda i: cost(ns.strategies[i]))
            choice[node] = best
            have[node] = ns.strategies[best].outputs
            metas[node] = ns.info.outputs
    return choice
