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

Pipeline layouts (``pp+dp`` with 1F1B, and 3-D ``pp+tp+dp``) are these intra-op
layouts inside the pipeline search (``autopar.passes.planner.pipeline``). The public name
is ``autopar.layouts``, which adds ``build`` (a layout's Plan for a model).
"""

from __future__ import annotations

from typing import Sequence

from torch import fx
from torch.distributed.tensor import Replicate, Shard

from autopar.passes.placements import Spec, fits
from autopar.passes.planner.intra_op import Hint
from autopar.passes.planner.linears import Linear, linears
from autopar.passes.planner.megatron import expert_weights, megatron_dims, router_linears
from autopar.passes.roles import AxisRole
from autopar.passes.rules.registry import expert_weights_of
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import StrategyGraph

LAYOUTS = ("replicated", "dp", "zero1", "zero2", "fsdp", "tp", "tp+dp", "tp+zero1", "tp+sp", "fsdp+tp", "ep",
           "tp+ep")


def axis_roles(name: str, ndim: int) -> tuple[AxisRole, ...]:
    """The role of every mesh axis under layout ``name`` (FSDP's axes split the batch: ``DP``)."""
    if name == "replicated":
        return (AxisRole.REPLICA,) * ndim
    if name in ("dp", "zero1", "zero2", "fsdp"):
        return (AxisRole.DP,) * ndim
    if name == "tp":
        return (AxisRole.TP,) * ndim
    if name in ("tp+dp", "tp+zero1", "tp+sp", "fsdp+tp", "tp+ep"):
        return (AxisRole.DP,) * (ndim - 1) + (AxisRole.TP,)
    if name == "ep":
        return (AxisRole.DP,) * (ndim - 1) + (AxisRole.EP,)
    raise ValueError(f"autopar: no layout named {name!r}; expected one of {LAYOUTS}")


def expert_axes(name: str, ndim: int) -> tuple[int, ...]:
    """The mesh axes over which layout ``name`` splits experts by expert (the last, for ``ep`` and ``tp+ep``)."""
    return (ndim - 1,) if name in ("ep", "tp+ep") else ()


def _expert_args(node: fx.Node) -> tuple[int, ...]:
    """The arguments of ``node`` that are expert weights [E, K, N] (its rule's ``expert_weights``)."""
    return tuple(weight.arg for weight in expert_weights_of(node.target))


def layout_placements(name: str, graph: StrategyGraph, found: dict[fx.Node, Linear] | None = None
                      ) -> tuple[dict[fx.Node, Spec], dict[fx.Node, int]]:
    """(placement per placeholder, ZeRO level 0..2 per parameter) of layout ``name``;
    ``found``: ``linears(graph)``, where the caller has it."""
    mesh = graph.mesh_shape
    roles = axis_roles(name, len(mesh))
    captured = graph.captured
    tp_dims = megatron_dims(graph, found) if AxisRole.TP in roles else {}
    by_expert = expert_axes(name, len(mesh))
    experts = {w for node in captured.nodes("call_function") for arg in _expert_args(node)
               for w in expert_weights(node, captured.params, arg)}
    fixed: dict[fx.Node, Spec] = {}
    zero: dict[fx.Node, int] = {}
    for node in captured.nodes("placeholder"):
        if node not in graph.nodes:
            continue
        shape = tuple(node.meta["val"].shape)
        spec: list = [Replicate()] * len(mesh)
        if node.name in captured.user_inputs:
            for a, role in enumerate(roles):
                if role in (AxisRole.DP, AxisRole.EP) and shape:
                    spec[a] = Shard(0)
                elif role is AxisRole.TP and name == "tp+sp" and len(shape) > 1:
                    spec[a] = Shard(1)
        elif node.name in captured.params:
            for a, role in enumerate(roles):
                if a in by_expert and node in experts:
                    spec[a] = Shard(0)
                elif role is AxisRole.TP and node in tp_dims:
                    spec[a] = Shard(tp_dims[node])
            if name in ("fsdp", "fsdp+tp"):
                dp_axes = [a for a, r in enumerate(roles) if r is AxisRole.DP]
                spec = _fsdp(shape, spec, dp_axes, mesh)
            zero[node] = {"zero1": 1, "zero2": 2, "tp+zero1": 1}.get(name, 0)
        fixed[node] = _fitting(shape, tuple(spec), mesh)
    return fixed, zero


def _fsdp(shape: Sequence[int], spec: list, axes: list[int], mesh: Sequence[int]) -> list:
    """Split over ``axes`` along the largest dim that divides (a dim the tp axis leaves whole first)."""
    taken = {p.dim for p in spec if isinstance(p, Shard)}
    for d in sorted(range(len(shape)), key=lambda d: (d in taken, -shape[d])):
        trial = list(spec)
        for a in axes:
            trial[a] = Shard(d)
        if fits(shape, tuple(trial), mesh):
            return trial
    return spec


def _fitting(shape: Sequence[int], spec: Spec, mesh: Sequence[int]) -> Spec:
    """``spec``, with every axis whose split does not divide evenly replicated instead."""
    spec = list(spec)
    for a in range(len(spec)):
        if not fits(shape, tuple(spec), mesh) and isinstance(spec[a], Shard):
            spec[a] = Replicate()
    return tuple(spec) if fits(shape, tuple(spec), mesh) else (Replicate(),) * len(mesh)


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

