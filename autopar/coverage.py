"""``autopar coverage``: the ops of a model that have no sharding rule (they run replicated),
and the manual layouts that apply to it on a mesh (each costed as ``autopar.plan(...,
layout=name)`` costs it, from one capture)."""

from __future__ import annotations

import math
import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar import costmodels
from autopar.costmodels.units import gib_text
from autopar.passes import rules
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.explain import duration
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.planner.request import PlanningError
from autopar.passes.roles import AxisRole
from autopar.passes.strategy_graph import NoRuleWarning, build_strategy_graph


@dataclass
class Coverage:
    """What ``coverage`` found for one model on one mesh."""

    mesh_shape: tuple[int, ...]
    ops: Counter  # ATen op -> calls in the captured graph
    without_rule: list[str]  # ops of ``ops`` without a sharding rule, sorted
    layouts: dict[str, float | str]  # layout -> predicted step seconds where it applies, else why not
    reasons: dict[str, list[str]]  # layout -> what its plan gave up to apply (tied layers split)
    memory: dict[str, float] = field(default_factory=dict)  # layout that applies -> predicted bytes per device
    capacity: float = math.inf  # the device's memory, bytes
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # layout with a tp axis -> (split, all) linears

    def applies(self) -> list[str]:
        return [name for name, got in self.layouts.items() if not isinstance(got, str)]

    def fits(self) -> list[str]:
        """The layouts that apply and whose predicted memory per device fits the device."""
        return [name for name in self.applies() if self.memory.get(name, 0.0) <= self.capacity]

    def table(self) -> str:
        lines = [f"{sum(self.ops.values())} op calls, {len(self.ops)} distinct ops; "
                 f"{len(self.without_rule)} without a sharding rule (run replicated)"]
        lines += [f"  no rule: {op} ({self.ops[op]} calls)" for op in self.without_rule]
        shape = "x".join(map(str, self.mesh_shape))
        lines.append(f"layouts on mesh {shape}: {len(self.applies())} of {len(self.layouts)} apply, "
                     f"{len(self.fits())} of them fit in the device's {gib_text(self.capacity)}")
        for name, got in self.layouts.items():
            verdict = f"applies, predicted step {duration(got)}, {self._fit(name)}" if not isinstance(got, str) else \
                f"does not apply: {got}"
            if name in self.linears and not isinstance(got, str):
                verdict += ", {} of {} linears split on its tp axis".format(*self.linears[name])
            lines.append(f"  {name:<10} {verdict}")
            lines += [f"             {r}" for r in self.reasons.get(name, [])]
        return "\n".join(lines)

    def _fit(self, name: str) -> str:
        need = self.memory.get(name, 0.0)
        return (f"{gib_text(need)} per device" if need <= self.capacity else
                f"{gib_text(need)} per device: DOES NOT FIT in {gib_text(self.capacity)} (more devices, a smaller "
                "batch, or another layout)")


def coverage(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict[str, Any] | None = None, *,
             mesh_shape: tuple[int, ...] = (2, 2), hardware: str = "h100") -> Coverage:
    """The rule coverage of ``model``'s captured graph and every manual layout of
    ``layouts.LAYOUTS`` on ``mesh_shape`` (priced by the preset ``hardware``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)  # reported here, as the list of ops
        captured = capture(model, example_inputs, example_kwargs)
        graph = build_strategy_graph(captured, tuple(mesh_shape))
    ops = Counter(str(n.target) for n in captured.nodes("call_function") if n.target is not operator.getitem)
    without = sorted(op for op in ops if rules.rule_for(op) is None)
    profile = costmodels.preset(hardware, tuple(mesh_shape))
    costs = build_costs(graph, profile)
    found: dict[str, float | str] = {}
    reasons: dict[str, list[str]] = {}
    memory: dict[str, float] = {}
    linears: dict[str, tuple[int, int]] = {}
    for name in layouts.LAYOUTS:
        if len(mesh_shape) < 2 and name != "tp" and "tp" in layouts.axis_roles(name, 2):
            found[name] = "it needs a mesh of two or more axes (on one axis it is tp)"
            continue
        hint = layouts.hint(name, graph)
        if AxisRole.TP in layouts.axis_roles(name, len(mesh_shape)):
            split, whole = layouts.split_linears(name, graph, hint.fixed)
            linears[name] = (len(split), len(split) + len(whole))
            if not split:
                found[name] = _no_linear_split(len(whole), mesh_shape)
                continue
        try:
            plan, _ = plan_layout(costs, {name: hint}, name, None, profile.axis_names)
        except PlanningError as e:
            found[name] = str(e).removeprefix("autopar: ")
            continue
        found[name] = plan.predicted.step_time
        reasons[name] = list(plan.reasons)
        memory[name] = sum(plan.predicted.memory.values())
    return Coverage(tuple(mesh_shape), ops, without, found, reasons, memory, float(profile.device.memory_bytes),
                    linears=linears)


def _no_linear_split(linears: int, mesh_shape: tuple[int, ...]) -> str:
    """Why a layout with a tp axis that splits no linear does not apply (it would be a data-parallel
    layout with a replicated axis)."""
    if not linears:
        return ("it splits no linear on its tp axis: the model has none (no contraction with a parameter, "
                "e.g. only convolutions); use dp or fsdp")
    return (f"it splits none of the model's {linears} linears on its tp axis: no weight's split dim divides "
            f"evenly over it on mesh {'x'.join(map(str, mesh_shape))}; use a smaller tp axis, or dp or fsdp")
