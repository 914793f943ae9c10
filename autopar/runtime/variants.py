"""A model's programs per input shapes and mode, each laid out by one plan.

``lower_plan`` lays a capture out as the plan says (``autopar.passes.planner.relayout``: any
capture of the plan's model, any batch size, train or eval mode, ``no_grad``), with ZeRO-1
parameters held as their ops use them where they can be (``zero1_layouts``). A
``Variant`` is one such program with what running it needs; ``Variants`` keeps the
compiled one and the most recently used others.

Non-tensor inputs (CLIP's ``return_loss=True``) are settings: export bakes their values
into the graph, so a variant is captured for each value given (``settings_of``, part of
the key), and the value is passed to the program as captured.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.batch import Cut
from autopar.runtime.gradsync import GradientSync
from autopar.runtime.zero1 import slice_axes
from autopar.passes.capture import Captured, retarget_devices
from autopar.passes.lowering.codegen import RankProgram, lower
from autopar.passes.placements import Spec, local_shape, local_slice, parse_spec
from autopar.passes.plan import Plan
from autopar.passes.planner.relayout import relayout
from autopar.passes.lowering.recompute import layers_to_recompute, plan_layers, recompute_layers
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs


@dataclass
class Variant:
    """The model captured and laid out for one set of whole input shapes in one mode (train,
    or eval: dropout off). The variants of a ParallelModule run on the same parameter
    shards; each has its own cuts of the inputs and its own loss program."""

    captured: Captured
    program: RankProgram
    grads: GradientSync  # sums the data-parallel gradient shares its backward leaves
    input_shapes: dict[str, tuple[int, ...]]  # whole, per tensor input
    cuts: dict[str, Cut]  # this rank's cut of each whole tensor input
    constants: dict[str, torch.Tensor]  # this rank's shards of the tensors export lifted as constants
    target_cuts: dict[tuple[int, ...], Cut] = field(default_factory=dict)  # whole target shape -> its cut
    loss_program: RankProgram | None = None  # laid out when the first target is seen
    loss_captured: Captured | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # non-tensor inputs, as captured (``settings_of``)

    @property
    def tensor_names(self) -> list[str]:
        """The user inputs that are tensors, in the graph's order."""
        return [n for n in self.captured.user_inputs if n not in self.settings]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.input_shapes[n] for n in self.tensor_names)

    @property
    def setting_key(self) -> tuple:
        return settings_key(self.settings)

    @staticmethod
    def of(captured: Captured, program: RankProgram, grads: GradientSync, mesh_shape: tuple[int, ...],
           coord: tuple[int, ...], device: torch.device) -> Variant:
        retarget_devices(program.gm, device)  # captured on the weights' device, run on the mesh's
        settings = settings_of(captured)
        shapes = {n.name: tuple(n.meta["val"].shape) for n in captured.nodes("placeholder")
                  if n.name in captured.user_inputs and n.name not in settings}
        cuts = {name: Cut.of(shape, program.input_specs[name], mesh_shape, coord) for name, shape in shapes.items()}
        constants = {}
        for name, value in captured.constant_values.items():
            spec = program.input_specs.get(name)
            constants[name] = (value if spec is None else local_slice(value, spec, mesh_shape, coord)).to(device)
        return Variant(captured, program, grads, shapes, cuts, constants, settings=settings)


def settings_of(captured: Captured) -> dict[str, Any]:
    """The captured model's non-tensor user inputs by name (a bool keyword such as CLIP's
    ``return_loss``), with the values they were captured with: export bakes those into the
    graph, so another value needs another capture."""
    return {n.name: n.meta.get("val") for n in captured.nodes("placeholder")
            if n.name in captured.user_inputs and not isinstance(n.meta.get("val"), torch.Tensor)}


def settings_key(settings: dict[str, Any]) -> tuple:
    """The settings as part of a variant's key: plain values (bool, int, float, str) only."""
    for name, value in settings.items():
        if not isinstance(value, Hashable):
            raise ValueError(
                f"autopar: expected the non-tensor input {name!r} to be a plain value (bool, int, float, str), "
                f"captured into the program; found a {type(value).__name__}; pass it as a tensor, or bind it "
                "in a wrapper module's forward")
    return tuple((name, type(value).__name__, value) for name, value in settings.items())


def lower_plan(graph: StrategyGraph, captured: Captured, plan: Plan, mesh: DeviceMesh,
               sync_as: dict[str, tuple[int, ...]] | None = None) -> tuple[RankProgram, set[str]]:
    """This rank's program for ``plan`` (any capture of the plan's model: its nodes found by
    identity, what the plan does not lay out re-solved with the weights fixed, ``relayout``),
    and the ZeRO-1 parameters it holds as their ops use them. ``sync_as``: the compiled
    program's gradient sums, by fqn (``synced_by_fqn``), which this one's gradients follow."""
    per_use = frozenset(ph for ph, fqn in captured.params.items() if plan.zero.get(fqn, 0) == 3)
    stored = stored_layouts(captured, plan)
    choice = relayout(graph, plan).choice
    # ZeRO-1 parameters are held as their ops use them (autopar.runtime.zero1); ZeRO-2 ones
    # (and ZeRO-1 ones read in several layouts) gathered from storage once per step
    level1 = zero1_layouts(graph, choice, {ph: stored[ph] for ph, fqn in captured.params.items()
                                           if plan.zero.get(fqn, 0) == 1 and ph in stored})
    program = lower(graph, choice, mesh, per_use, storage={ph: spec for ph, spec in stored.items() if ph not in level1},
                    sync_as=sync_as)
    return program, level1


def synced_by_fqn(captured: Captured, programs: list[RankProgram]) -> dict[str, tuple[int, ...]]:
    """The axes each parameter's gradient is summed over once per step, by fqn (a program's
    ``grad_sync`` is by placeholder, which another capture may name otherwise)."""
    return {captured.params[name]: axes for program in programs for name, axes in program.grad_sync.items()}


def recompute_plan(program: RankProgram, plan: Plan) -> None:
    """Activation checkpointing of the plan's layers. After a mixed-precision policy is applied
    (``apply_precision``): the policy finds each parameter's gathers and readers in the whole
    graph, which recomputation splits into checkpointed submodules."""
    if plan.recompute:
        program.gm = recompute_layers(program.gm, plan_layers(plan), layers_to_recompute(plan.recompute))


def stored_layouts(captured: Captured, plan: Plan) -> dict[str, Spec]:
    """Placeholder -> where the plan stores it, for parameters stored otherwise than used."""
    out = {}
    for ph, fqn in captured.params.items():
        if fqn in plan.params and plan.zero.get(fqn, 0) in (1, 2):
            out[ph] = parse_spec(plan.params[fqn])
    return out


def zero1_layouts(graph: StrategyGraph, choice: dict[fx.Node, int], stored: dict[str, Spec]) -> set[str]:
    """The ZeRO-1 parameters (placeholder -> stored layout) that can be held as their ops
    use them: every op reads them in one layout, of which the stored one is a further
    split. Their placeholders' strategies are set to that layout in ``choice``."""
    held = set()
    for node, ns in graph.nodes.items():
        if node.name not in stored:
            continue
        needs = set()
        for user in node.users:
            user_ns = graph.nodes.get(user)
            if user_ns is None or user_ns.info is None:
                needs.add(None)  # returned as it is: no op's layout to follow
                continue
            chosen = user_ns.strategies[choice[user]]
            needs.update(need for src, need in zip(tensor_inputs(user), chosen.inputs) if src is node)
        if len(needs) != 1 or None in needs:
            continue
        need = needs.pop()
        outputs = [s.output for s in ns.strategies]
        shape = local_shape(tuple(node.meta["val"].shape), need, graph.mesh_shape)
        if need in outputs and slice_axes(shape, need, stored[node.name], graph.mesh_shape):
            choice[node] = outputs.index(need)
            held.add(node.name)
    return held


def backward_order(gm: fx.GraphModule) -> list[str]:
    """Placeholders in the order backward reaches them: the reverse of their first use."""
    first_use: dict[str, None] = {}
    for node in gm.graph.nodes:
        for x in node.all_input_nodes:
            if x.op == "placeholder":
                first_use.setdefault(x.name, None)
    return list(reversed(first_use))



class Variants:
    """Programs by key (input shapes, mode): the compiled one always kept, and at most
    ``limit`` others, the least recently used dropped first (a loop over ever new batch
    sizes, e.g. the last short batch of each epoch, keeps a bounded number)."""

    def __init__(self, compiled_key: tuple, compiled: object, limit: int = 8):
        self.compiled_key, self.compiled, self.limit = compiled_key, compiled, limit
        self._others: OrderedDict[tuple, object] = OrderedDict()

    def get(self, key: tuple, build: Callable[[], object]) -> object:
        if key == self.compiled_key:
            return self.compiled
        if key in self._others:
            self._others.move_to_end(key)
        else:
            self._others[key] = build()
            while len(self._others) > self.limit:
                self._others.popitem(last=False)
        return self._others[key]

    def __len__(self) -> int:
        return 1 + len(self._others)
