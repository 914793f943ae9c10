"""Stage boundaries by module name: the ``stage_starts`` pin read on a capture and on a plan.

A pipeline cuts a model between its repeated layers (``autopar.passes.layers``: the nodes
under module ``model.layers.16`` are one layer; layers are numbered in graph order, as the
stage search numbers them). ``start_layers`` turns the pinned module names into those
numbers (the stage search then cuts before them only: ``pipeline.search``'s ``starts``), with
one ``autopar:`` error for a name that names no module, a module that is no repeated layer,
the first layer (the first stage starts there always), or names out of order.
``plan_stage_starts`` reads the layers a plan's stages start at back from its nodes' stages.
"""

from __future__ import annotations

from typing import Mapping

from torch import fx

from autopar.passes.layers import layer_path
from autopar.passes.plan import Plan
from autopar.passes.planner.constraints import Constraints
from autopar.passes.planner.request import PlanningError


def layer_names(layer_of: Mapping[fx.Node, int], params: dict[str, str]) -> dict[str, int]:
    """Module name -> number of each repeated layer (``layer_of``: node -> its layer's number)."""
    out: dict[str, int] = {}
    for node, number in layer_of.items():
        if (where := layer_path(node, params)) is not None:
            out.setdefault(f"{where[0]}.{where[1]}", number)
    return out


def layer_modules(captured) -> list[str]:
    """The repeated layers' module names, numbered as the planner numbers them: in graph order
    of their first op (``layers.find_layers``)."""
    order: dict[str, None] = {}
    for node in captured.nodes():
        if node.op != "placeholder" and (where := layer_path(node, captured.params)) is not None:
            order.setdefault(f"{where[0]}.{where[1]}", None)
    return list(order)


def start_layers(pins: Constraints, captured) -> tuple[int, ...]:
    """The layer numbers where ``pins.stage_starts`` start stages 2, 3, ... (``layer_modules``
    numbering); an ``autopar:`` error naming the pin where one cannot be read so."""
    modules = layer_modules(captured)
    pin = pins.pin("stage_starts")
    shown = (f"{modules[0]} ... {modules[-1]}" if len(modules) > 2 else ", ".join(modules)) or "none"
    out = []
    for name in pins.stage_starts:
        found = [k for k, module in enumerate(modules) if module == name or module.endswith("." + name)]
        if len(found) > 1:
            raise PlanningError(f"autopar: pin {pin}: {name} names {len(found)} repeated layers ("
                                f"{', '.join(modules[k] for k in found)}); expected one: write its full name")
        if not found:
            what = ("a module that is not a repeated layer" if _is_module(name, captured)
                    else "no module of this model")
            raise PlanningError(f"autopar: pin {pin}: {name} names {what}; expected the module names of repeated "
                                f"layers where stages start (this model's: {shown})")
        if found[0] == 0:
            raise PlanningError(f"autopar: pin {pin}: {name} is the first repeated layer, where the first stage "
                                "starts always; expected where stages 2, 3, ... start")
        out.append(found[0])
    if out != sorted(out):
        raise PlanningError(f"autopar: pin {pin} names layers out of order (layers {out}); expected the stages' "
                            "first layers in the model's order")
    return tuple(out)


def _is_module(name: str, captured) -> bool:
    """Whether ``name`` names a module the capture ran (its ``nn_module_stack``) or one holding a parameter."""
    paths = {path for node in captured.nodes() for path, _ in (node.meta.get("nn_module_stack") or {}).values()}
    paths |= {fqn.rpartition(".")[0] for fqn in captured.params.values()}
    return any(path == name or path.endswith("." + name) for path in paths)


def plan_stage_starts(plan: Plan, captured) -> list[int]:
    """The layer numbers (``layer_modules``) where ``plan``'s stages 2, 3, ... start: each one's
    first repeated layer; [] without a pipeline."""
    if plan.pipeline is None:
        return []
    number = {name: k for k, name in enumerate(layer_modules(captured))}
    first: dict[int, int] = {}
    for node in captured.nodes():
        stage = plan.pipeline.stage_of.get(node.name)
        if node.op == "placeholder" or stage is None or (where := layer_path(node, captured.params)) is None:
            continue
        k = number[f"{where[0]}.{where[1]}"]
        first[stage] = min(first.get(stage, k), k)
    return [first[s] for s in sorted(first) if s > 0]
