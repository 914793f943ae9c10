"""Manual layouts as Plans: the ones people write by hand, for any model they apply to.

A layout is a set of constraints on where parameters and inputs live, plus axis roles
and ZeRO levels; the planner completes it into one strategy per node with the same
cost tables the solver uses (``autopar.passes.planner.intra_op.complete``: each op, in graph order, the
fastest strategy given its producers; ``hint(..., complete=True)`` uses
``autopar.passes.propagate`` instead). The planner
evaluates every layout with the same cost model and gives it to the solver as a
candidate solution, so the automatic plan is never predicted slower than the best
layout that fits. Layouts (axis roles: ``dp`` data parallel, ``tp`` tensor parallel):

- ``replicated``: every device runs the whole step (the baseline of no parallelism);
- ``dp``: parameters replicated, batch split over every axis;
- ``zero1`` / ``zero2``: ``dp`` with optimizer state (and gradients) sharded;
- ``fsdp`` (ZeRO-3): every parameter split over every axis along its largest
  dimension that divides, gathered before use;
- ``tp``: Megatron tensor parallelism over every axis: the first linear of a pair
  split by output features (column), the one reading a split activation by input
  features (row), embeddings split by vocabulary. A linear is recognised by its math,
  however it is written (``autopar.passes.planner.linears``: ``F.linear``, ``x @ w.T``,
  GPT-2's ``Conv1D`` ``addmm`` with a weight stored [in, out], ``einsum``); the layout's
  plan notes how many it split (``linears_line``);
- ``tp+dp``: Megatron on the last (fastest) axis, data parallel on the others;
- ``tp+zero1``: ``tp+dp`` with the optimizer state sharded over the data-parallel axes
  (Megatron-LM's distributed optimizer);
- ``tp+sp``: ``tp+dp`` plus sequence parallelism (inputs split by sequence on tp);
- ``fsdp+tp``: Megatron on the last axis, ``fsdp`` on the others;
- ``ep``: expert parallel (mixture-of-experts models): ``dp`` with every expert's weights
  on one rank of the last axis (experts split by expert there); each rank's tokens go to
  the ranks of their experts and back all-to-all (Megatron-Core's "alltoall" dispatcher:
  the axis's role ``ep`` keeps the experts op to its all-to-all strategies, what its rule's
  ``restrict`` says);
- ``tp+ep``: ``tp+dp`` with the experts split by expert over the tp axis instead of
  within each expert (tokens whole there, for Megatron's attention: the dispatch the
  cost model picks, allgather where it is cheaper).

On an MoE layer Megatron leaves the router whole (its scores pick the experts on every
rank) and splits each expert's MLP like a dense one: the grouped matmul reading the
layer's input by output features (column), the one reading its split activation by
input features (row). On a model without experts ``ep`` is ``dp`` and ``tp+ep`` is
``tp+dp`` (``hints`` drops the duplicates).

Pipelined layouts (``pp+dp``, ``pp+fsdp+tp``, 3-D ``pp+tp+dp`` alias ``3d``, ``pp4+tp+sp``
with its depth: ``layout_placements.layout_parts``) are these intra-op layouts inside the
pipeline search (``autopar.passes.planner.pipeline``). Each layout's placements live in
``autopar.passes.planner.layout_placements``; ``autopar.plan(..., layout=name)`` pins them
(``Constraints(layout=name)``: recomputation, micro-batches, schedule and depth still searched).
The public name is ``autopar.layouts``, which adds ``build`` (a layout's Plan for a model).
"""

from __future__ import annotations

from typing import Sequence

from torch import fx
from torch.distributed.tensor import Shard

from autopar.passes.placements import Spec
from autopar.passes.planner.layout_rules import Hint
from autopar.passes.planner.layout_placements import (LAYOUTS, axis_roles, expert_axes,  # noqa: F401 (their public name)
                                                      layout_parts, layout_placements)
from autopar.passes.planner.linears import Linear, linears
from autopar.passes.planner.megatron import megatron_dims, router_linears  # noqa: F401 (re-exported)
from autopar.passes.roles import AxisRole
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import StrategyGraph


def split_linears(name: str, graph: StrategyGraph, fixed: dict[fx.Node, Spec],
                  found: dict[fx.Node, Linear] | None = None) -> tuple[list[str], list[str]]:
    """(split, whole): the linears (``autopar.passes.planner.linears``; MoE routers, which
    Megatron keeps whole, aside) whose weight layout ``name`` stores split on its tp axes
    (``fixed``: its placements), and those it leaves whole there, each named by its weight."""
    tp = [a for a, role in enumerate(axis_roles(name, len(graph.mesh_shape))) if role is AxisRole.TP]
    found = linears(graph) if found is None else found
    routers = router_linears(graph, found)
    split, whole = [], []
    for node, linear in found.items():
        if node in routers:
            continue
        spec = fixed.get(linear.weight)
        on_tp = spec is not None and any(isinstance(spec[a], Shard) for a in tp)
        (split if on_tp else whole).append(graph.captured.params[linear.weight.name])
    return split, whole


def linears_line(name: str, graph: StrategyGraph, fixed: dict[fx.Node, Spec],
                 found: dict[fx.Node, Linear] | None = None) -> str | None:
    """'tp+dp splits 4 of 6 linears on its tp axis; left whole: ...', for a layout with a tp
    axis (None for others): what Megatron's column-then-row split reached."""
    if AxisRole.TP not in axis_roles(name, len(graph.mesh_shape)):
        return None
    split, whole = split_linears(name, graph, fixed, found)
    line = f"{name} splits {len(split)} of {len(split) + len(whole)} linears on its tp axis"
    if whole:
        names = list(dict.fromkeys(whole))
        line += "; left whole: " + ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return line


def hint(name: str, graph: StrategyGraph, complete: bool = False, found: dict[fx.Node, Linear] | None = None) -> Hint:
    """Layout ``name`` on ``graph``: its placeholder placements and ZeRO levels. The planner
    completes it with its cost tables (each op the fastest given its producers);
    ``complete=True`` completes it here by ``autopar.passes.propagate`` (fewest bytes moved).
    ``found``: ``linears(graph)``, where the caller has it."""
    roles = axis_roles(name, len(graph.mesh_shape))
    if found is None and AxisRole.TP in roles:
        found = linears(graph)
    fixed, zero = layout_placements(name, graph, found)
    tp = tuple(a for a, role in enumerate(roles) if role is AxisRole.TP)
    keep = tuple(a for a, role in enumerate(roles) if role in (AxisRole.TP, AxisRole.EP))
    data = tuple(a for a, role in enumerate(roles) if role is AxisRole.DP and graph.mesh_shape[a] > 1)
    linears_said = linears_line(name, graph, fixed, found)
    return Hint(name, choose_by_propagation(graph, fixed) if complete else None, zero, fixed, keep, data,
                batch_whole_axes=tp, everything_whole=name == "replicated",
                roles=roles,
                notes=[linears_said] if linears_said else [])


def hints(graph: StrategyGraph, names: Sequence[str] = LAYOUTS) -> list[Hint]:
    """Every layout in ``names`` that applies to this mesh (duplicates of another dropped)."""
    out, seen = [], set()
    found = linears(graph)
    for name in names:
        if AxisRole.TP in axis_roles(name, len(graph.mesh_shape)) and name != "tp" and len(graph.mesh_shape) < 2:
            continue  # tp+dp on one axis is tp
        h = hint(name, graph, found=found)
        key = (tuple(sorted((n.name, str(s)) for n, s in h.fixed.items())),
               tuple(sorted((n.name, z) for n, z in h.zero.items())))
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out

