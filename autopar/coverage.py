"""``autopar coverage``: the ops of a model that have no sharding rule (they run replicated),
and the manual layouts that apply to it on a mesh (each costed as ``autopar.plan(...,
layout=name)`` costs it, from one capture)."""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from autopar import costmodels
from autopar.passes import rules
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.explain import duration
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.planner.request import PlanningError
from autopar.passes.strategy_graph import NoRuleWarning, build_strategy_graph


@dataclass
class Coverage:
    """What ``coverage`` found for one model on one mesh."""

    mesh_shape: tuple[int, ...]
    ops: Counter  # ATen op -> calls in the captured graph
    without_rule: list[str]  # ops of ``ops`` without a sharding rule, sorted
    layouts: dict[str, float | str]  # layout -> predicted step seconds where it applies, else why not
    reasons: dict[str, list[str]]  # layout -> what its plan gave up to apply (tied layers split)

    def applies(self) -> list[str]:
        return [name for name, got in self.layouts.items() if not isinstance(got, str)]

    def table(self) -> str:
        lines = [f"{sum(self.ops.values())} op calls, {len(self.ops)} distinct ops; "
                 f"{len(self.without_rule)} without a sharding rule (run replicated)"]
        lines += [f"  no rule: {op} ({self.ops[op]} calls)" for op in self.without_rule]
        shape = "x".join(map(str, self.mesh_shape))
        lines.append(f"layouts on mesh {shape}: {len(self.applies())} of {len(self.layouts)} apply")
        for name, got in self.layouts.items():
            verdict = f"applies, predicted step {duration(got)}" if not isinstance(got, str) else \
                f"does not apply: {got}"
            lines.append(f"  {name:<10} {verdict}")
            lines += [f"             {r}" for r in self.reasons.get(name, [])]
        return "\n".join(lines)


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
    costs = build_costs(graph, costmodels.preset(hardware, tuple(mesh_shape)))
    names = tuple(f"axis{a}" for a in range(len(mesh_shape)))
    found: dict[str, float | str] = {}
    reasons: dict[str, list[str]] = {}
    for name in layouts.LAYOUTS:
        if len(mesh_shape) < 2 and name != "tp" and "tp" in layouts.axis_roles(name, 2):
            found[name] = "it needs a mesh of two or more axes (on one axis it is tp)"
            continue
        try:
            plan, _ = plan_layout(costs, {name: layouts.hint(name, graph)}, name, None, names)
        except PlanningError as e:
            found[name] = str(e).removeprefix("autopar: ")
            continue
        found[name] = plan.predicted.step_time
        reasons[name] = list(plan.reasons)
    return Coverage(tuple(mesh_shape), ops, without, found, reasons)
