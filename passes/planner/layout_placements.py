"""Manual layouts' placements: where each placeholder of a model lives under a named layout
(``layout_placements``), each mesh axis's role (``axis_roles``), and the layouts' names,
pipelined ones included (``layout_parts``: ``"pp4+fsdp+tp"`` is ``fsdp+tp`` on the intra-op
mesh of a 4-stage pipeline, ``"3d"`` is ``pp+tp+dp``).

Apart from ``autopar.passes.planner.layouts`` (which describes each layout and builds the
planner's Hints from these placements) so the pins (``autopar.passes.planner.constraints``,
``pin_restrictions``: ``layout=`` pins a layout's placements) read them without the planner.
"""

from __future__ import annotations

import re
from typing import Sequence

from torch import fx
from torch.distributed.tensor import Replicate, Shard

from autopar.passes.placements import Spec, fits
from autopar.passes.planner.linears import Linear
from autopar.passes.planner.megatron import expert_weights, megatron_dims
from autopar.passes.roles import AxisRole
from autopar.passes.rules.registry import expert_weights_of
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
    # the capture alone decides these: worked out once for every layout on every mesh
    tp_dims = graph.once(("megatron dims",), lambda: megatron_dims(graph, found)) if AxisRole.TP in roles else {}
    by_expert = expert_axes(name, len(mesh))
    experts = graph.once(("expert weights",), lambda: {
        w for node in captured.nodes("call_function") for arg in _expert_args(node)
        for w in expert_weights(node, captured.params, arg)})
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


PIPELINE_PREFIX = "pp"
# names of pipelined layouts besides "pp+<layout>": Megatron's and torchtitan's "3D" parallelism
PIPELINED_ALIASES = {"3d": "pp+tp+dp"}
_PIPELINED = re.compile(r"pp(\d*)(?:\+(.+))?$")


def layout_parts(name: str) -> tuple[bool, int | None, str]:
    """(whether layout ``name`` is pipelined, the depth it names or None, its intra-op layout):
    ``"fsdp+tp"`` -> (False, None, "fsdp+tp"); ``"pp+fsdp+tp"`` -> (True, None, "fsdp+tp");
    ``"pp4+tp+sp"`` -> (True, 4, "tp+sp"); ``"3d"`` -> (True, None, "tp+dp"); ``"pp"`` -> (True,
    None, "replicated"). A ValueError (``autopar:``) for a name that is none of them."""
    if name in LAYOUTS:
        return False, None, name
    match = _PIPELINED.match(PIPELINED_ALIASES.get(name, name))
    intra = (match.group(2) or "replicated") if match else None
    if match is None or intra not in LAYOUTS or intra == "replicated" and match.group(2) or match.group(1) in ("0", "1"):
        raise ValueError(f"autopar: no layout named {name!r}; expected one of {LAYOUTS}, one of them pipelined as "
                         f"pp+LAYOUT (pp4+LAYOUT for 4 stages; pp alone: stages of the whole model), or "
                         f"{', '.join(PIPELINED_ALIASES)}")
    return True, int(match.group(1)) if match.group(1) else None, intra
