"""What a plan asks of each mesh axis and of each repeated layer, read from the Plan alone.

A Plan stores placements, not roles (``autopar.passes.roles``): an axis's role is read off
what the plan splits over it. A **batch axis** splits the batch (the model's input, or its
output where the plan splits the batch after the input), a **tensor axis** splits weights
that the ops use split (Megatron), and a batch axis that also stores weights split is a
**sharded** one (FSDP, ZeRO). The pipeline axis is ``Plan.pipeline.axis``; every other axis
is an intra-op axis, the axes the strategies' specs list, in mesh order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import fx
from torch.distributed.tensor import Placement, Shard

from autopar.passes.capture import Captured
from autopar.passes.node_keys import node_keys
from autopar.passes.placements import Spec, parse_spec

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Axes:
    """The plan's mesh, axis by axis (indices into the whole mesh)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    pipeline: int | None
    intra: tuple[int, ...]  # the axes a strategy's spec lists, in order
    batch: tuple[int, ...]
    tensor: tuple[int, ...]
    sharded: tuple[int, ...]  # batch axes on which some weight is stored split
    notes: tuple[str, ...] = ()

    def on(self, spec: Spec, axis: int) -> Placement:
        """The placement ``spec`` (a strategy's, on the intra-op axes) has on mesh axis ``axis``."""
        return spec[self.intra.index(axis)]

    def role(self, axis: int) -> str:
        """What the axis does, in the glossary's words (``autopar.passes.roles.AxisRole``)."""
        if axis == self.pipeline:
            return "pp"
        if axis in self.tensor:
            return "tp"
        if axis in self.sharded:
            return "fsdp"
        return "dp" if axis in self.batch else "replica"


@dataclass
class Reading:
    """The plan's axes, its parameters' placements and its repeated layers."""

    axes: Axes
    params: dict[str, Spec]  # qualified name -> placement on the intra-op axes
    zero: dict[str, int]
    layers: dict[int, str]  # repeated-layer number -> its module path ("model.layers.3")
    inputs: dict[str, Spec] = field(default_factory=dict)  # user input name -> its placement


def read_plan(plan, output_specs: list[Spec], param_names=()) -> Reading:
    """The plan read axis by axis. ``output_specs``: the plan's placements of the model's
    outputs (found through a capture), where an axis may split the batch after the input;
    ``param_names``: the model's, for its repeated layers where the plan records none."""
    names, shape = tuple(plan.axis_names), tuple(plan.mesh_shape)
    pipeline = plan.pipeline.axis if plan.pipeline is not None else None
    intra = tuple(a for a in range(len(shape)) if a != pipeline)
    params = {fqn: parse_spec(text) for fqn, text in plan.params.items()}
    inputs = user_inputs(plan)
    if not inputs:
        raise ValueError("autopar: export expected a plan that names its user inputs (plan.node_keys, written "
                         "by autopar.plan since plan format 2); found none. Re-plan with this autopar")
    first = next(iter(inputs.values()))
    notes = []
    batch, tensor, sharded = [], [], []
    for k, axis in enumerate(intra):
        split = [fqn for fqn, spec in params.items() if isinstance(spec[k], Shard)]
        in_input = isinstance(first[k], Shard) and first[k].dim == 0
        in_output = any(isinstance(spec[k], Shard) and spec[k].dim == 0 for spec in output_specs)
        if in_input or (in_output and not split):
            batch.append(axis)
            if not in_input:
                notes.append(f"the plan runs the model's first ops on the whole batch on every rank of "
                             f"{names[axis]} and splits the batch later; here each rank takes its rows from the start")
            if split:
                sharded.append(axis)
        elif split:
            tensor.append(axis)
        if isinstance(first[k], Shard) and first[k].dim != 0 and axis not in batch:
            notes.append(f"the plan feeds the input split along dim {first[k].dim} over {names[axis]} (sequence); "
                         "here every rank of that axis reads whole inputs: the model's own Python reads their shapes")
    axes = Axes(names, shape, pipeline, intra, tuple(batch), tuple(tensor), tuple(sharded), tuple(notes))
    layers = layer_modules(plan.param_layers) if plan.param_layers else numbered_layers(param_names)
    return Reading(axes, params, dict(plan.zero), layers, inputs)


def user_inputs(plan) -> dict[str, Spec]:
    """The plan's user inputs (by their names) and their placements."""
    found = {}
    for name, key in plan.node_keys.items():
        if key.startswith("input:") and name in plan.strategies:
            found[key.removeprefix("input:")] = parse_spec(outputs(plan.strategies[name])[0])
    return found


def outputs(strategy: str) -> list[str]:
    """The output specs of a printed strategy, ``(S(0)R, RS(1)) -> S(0)S(1) [kernel]``."""
    text = strategy.split(" -> ", 1)[1].split(" [", 1)[0]
    return text[1:-1].split(", ") if text.startswith("(") else [text]


def inputs_of(strategy: str) -> list[Spec | None]:
    """The input specs of a printed strategy (None for an input whose value is not read, ``_``)."""
    text = strategy.split(" -> ", 1)[0][1:-1]
    return [None if s in ("", "_") else parse_spec(s) for s in text.split(", ")] if text else []


def kernel_of(strategy: str) -> str | None:
    """The local kernel a printed strategy names (``[vocab_parallel_embedding]``), or None."""
    return strategy[strategy.rindex("[") + 1:-1] if strategy.endswith("]") else None


def numbered_layers(names) -> dict[int, str]:
    """Repeated-layer number -> module path, numbered in order, for a plan that records no
    layers (``Plan.param_layers``, empty in a plan written by hand): the numbered modules of
    the parameters' qualified names ``names``."""
    found: dict[str, None] = {}
    for fqn in names:
        match = _NUMBERED.match(fqn)
        if match:
            found.setdefault(f"{match.group(1)}.{match.group(2)}")
    return dict(enumerate(found))


def layer_modules(param_layers: dict[str, int]) -> dict[int, str]:
    """Repeated-layer number -> the module path of that layer: ``<container>.<i>``, the first
    numbered component its parameters' qualified names share."""
    found: dict[int, str] = {}
    for fqn, layer in sorted(param_layers.items()):
        match = _NUMBERED.match(fqn)
        if match:
            found.setdefault(int(layer), f"{match.group(1)}.{match.group(2)}")
    return found


def container_of(layers: dict[int, str]) -> str | None:
    """The module that holds the repeated layers (``model.layers``), when one container holds them all."""
    containers = {path.rsplit(".", 1)[0] for path in layers.values()}
    return containers.pop() if len(containers) == 1 else None


def planned_strategies(plan, captured: Captured) -> tuple[dict[fx.Node, str | None], dict[fx.Node, str]]:
    """(each node of ``captured`` -> the plan's printed strategy for the node of its identity,
    or None; each op node -> the module path that called it)."""
    keys = node_keys(captured)
    by_key = {key: name for name, key in plan.node_keys.items()}
    nodes = list(captured.gm.graph.nodes)
    strategy = {n: plan.strategies.get(by_key.get(keys[n.name], ""), None) for n in nodes}
    module = {n: keys[n.name].split(":", 1)[0] for n in nodes if n.op == "call_function"}
    return strategy, module


def output_specs(plan, captured: Captured) -> list[Spec]:
    """The plan's placements of the model's outputs."""
    strategy, _ = planned_strategies(plan, captured)
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    return [parse_spec(outputs(strategy[a])[0]) for a in out.all_input_nodes if strategy.get(a)]
