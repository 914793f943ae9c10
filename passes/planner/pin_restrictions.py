"""Pins as restrictions of the integer program: strategies a pin forbids get an infinite time.

``pin_masks`` reads the pins of one intra-op mesh (``constraints.MeshRoles`` per axis, the
ZeRO levels of ``Constraints``) as masks of the strategies each node keeps, so every pin is a
restriction of single decisions, which the solver, its heuristics and the layouts'
completion all handle (as they handle a manual layout's placements):

- the batch: an axis that keeps it whole forbids the inputs' placements and reads that cut
  sequences there (``microbatch.sequences_split``), and where a pinned micro-batch count
  needs it, every strategy that does; one that splits it keeps only the inputs' placements
  split along their batch dim there;
- the weights, per axis: a tensor-parallel axis stores each weight as Megatron does
  (``megatron.megatron_dims``: a linear by column or row, an embedding by vocabulary, the rest
  whole) and every op reads it as stored there (through its views: no weight moves); an axis
  that reads weights whole (data parallel, or any axis but the tensor-parallel ones when ``tp``
  is pinned) forbids an op reading one split there;
- ZeRO: levels 0-2 store a weight whole on every axis that is not tensor parallel (never
  gathered) and fix its ZeRO node's level; level 3 stores it split on each of those axes that
  can split it and reads it whole there (gathered at use: FSDP), as torchtitan's fsdp+tp;
- a parameter's placement pinned (``placement_pins``): stored so on each axis (over ZeRO's
  storage); a Megatron role (colwise, rowwise) sets its split on the tensor-parallel axes;
- a whole manual layout pinned (``layout=``, ``layout_masks``): every parameter and input
  placed as the layout places it on every axis, and its ZeRO levels; every other op searched;
- a module's output pinned (``output_masks``): the strategies of the node that makes each value
  its forward returns (``module_outputs``: its nodes read outside it; a getitem's, its
  producer's) keep those that place it as pinned on each axis (a role: on the
  tensor-parallel axes).

``restricted`` adds them to a ``Costs``' problem; ``broken`` checks a plan's choice against
the same masks (``autopar.passes.planner.search`` returns the unconstrained plan where it
honours the pins).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.costing import Costs
from autopar.passes.placements import parse_spec
from autopar.passes.planner.constraints import (MEGATRON_ROLES, OUTPUT_ROLES, AxisPin, Constraints, MeshRoles,
                                                module_matches, name_matches)
from autopar.passes.planner.layout_placements import layout_placements
from autopar.passes.planner.linears import linears
from autopar.passes.planner.megatron import megatron_dims
from autopar.passes.planner.microbatch import batch_dims, batch_size, sequences_split
from autopar.passes.planner.request import PlanningError
from autopar.passes.state_costs import zero_split_dim
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs

CASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.alias.default"}  # a weight in another dtype is the weight
WHOLE, SPLIT = 0, -3  # placement codes (``_codes``): Replicate; "any Shard" in a wanted set


@dataclass
class PinMasks:
    """Per graph node, the strategies the pins leave it (with the pins that say so); per
    parameter, the ZeRO level 0-2 pinned for its ZeRO node."""

    nodes: dict[fx.Node, tuple[np.ndarray, str]] = field(default_factory=dict)
    zero: dict[fx.Node, tuple[int, str]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.zero)

    def pins(self) -> list[str]:
        """The pins behind the masks, each once."""
        return sorted({pin for _, why in (*self.nodes.values(), *self.zero.values()) for pin in why.split(" and ")})


def weights(graph: StrategyGraph) -> dict[fx.Node, fx.Node]:
    """Each parameter placeholder, and each view or cast of one, -> the parameter."""
    params = graph.captured.params
    out: dict[fx.Node, fx.Node] = {}
    for node in graph.captured.nodes():
        if node.op == "placeholder" and node.name in params:
            out[node] = node
        elif node.op == "call_function" and node in graph.nodes and (
                getattr(node.target, "is_view", False) or str(node.target) in CASTS):
            inputs = tensor_inputs(node)
            if len(inputs) == 1 and inputs[0] in out:
                out[node] = out[inputs[0]]
    return out


def _code(p) -> int:
    """Replicate 0, Shard(d) 1 + d, Partial -1, no tensor -2."""
    return WHOLE if isinstance(p, Replicate) else 1 + p.dim if isinstance(p, Shard) else -1 if isinstance(
        p, Partial) else -2


def _codes(specs, a: int) -> np.ndarray:
    """Axis ``a``'s placement code of each spec (``_code``)."""
    return np.array([_code(spec[a]) if spec is not None else -2 for spec in specs], dtype=np.int64)


def pin_masks(graph: StrategyGraph, roles: MeshRoles | None, pins: Constraints | None) -> PinMasks:
    """The masks of ``roles`` and ``pins``' ZeRO levels on ``graph`` (module docstring); an
    ``autopar:`` error naming the pin where one leaves a node no strategy."""
    out = PinMasks()
    mesh = graph.mesh_shape
    axes = roles.axes if roles is not None else tuple(AxisPin() for _ in mesh)
    if len(axes) != len(mesh):
        raise PlanningError(f"autopar: pins for {len(axes)} mesh axes given for mesh {mesh}; expected one per axis")
    cache: dict[tuple, np.ndarray] = {}  # repeated layers share their strategy tables: masks worked out once
    batch = batch_size(graph)
    for kind in ("whole", "unsplit"):
        kept = tuple(a for a, pin in enumerate(axes) if pin.batch == kind)
        if kept and batch:
            _batch_whole(graph, out, kept, batch, axes, cache, everywhere=kind == "unsplit")
    split = [a for a, pin in enumerate(axes) if pin.batch == "split"]
    if split:
        _batch_split(graph, out, split, axes)
    params = graph.captured.params
    placeholders = [n for n in graph.nodes if n.name in params]
    levels: dict[fx.Node, tuple[int, str]] = {}
    if pins is not None:
        check_patterns(pins, params)
    if pins is not None and (pins.zero is not None or pins.zero_by_name):
        levels = {ph: (level, _zero_pin(pins, params[ph.name])) for ph in placeholders
                  if (level := pins.zero_of(params[ph.name])) is not None}
        out.zero = {ph: pinned for ph, pinned in levels.items() if pinned[0] < 3}
    tp = [a for a, pin in enumerate(axes) if pin.weights == "stored"]
    dims = megatron_dims(graph) if tp else {}
    placed = placement_pins(graph, pins, roles) if pins is not None and pins.params else {}
    of_weight = weights(graph)
    for a, pin in enumerate(axes):
        if a in tp:  # Megatron's storage (or the placement pinned), read as stored
            storage = {ph: (_store(graph, ph, a, WHOLE if ph not in dims else 1 + dims[ph]), pin.weights_pin)
                       for ph in placeholders}
            storage.update({ph: (want[a], why) for ph, (want, why) in placed.items() if want[a] is not None})
            _read_as_stored(graph, out, a, storage, of_weight, cache)
            continue
        if mesh[a] == 1:
            continue
        for ph, (want, why) in placed.items():  # a placement pinned wins over ZeRO's storage
            if want[a] is not None:
                _and_node(out, ph, _stored_mask(graph, ph, a, want[a]), why, f"storing {params[ph.name]} as pinned "
                          f"on axis {a}")
        storage = {ph: (WHOLE, why) if level < 3 else (SPLIT, why) for ph, (level, why) in levels.items()
                   if ph not in placed or placed[ph][0][a] is None}
        for ph, (want, why) in storage.items():
            _and_node(out, ph, _stored_mask(graph, ph, a, want), why, f"storing {params[ph.name]} "
                      f"{'whole' if want == WHOLE else 'split'} on axis {a}", optional=want == SPLIT)
        readers_whole = {ph: pin.weights_pin for ph in placeholders} if pin.weights == "whole" else {}
        readers_whole.update({ph: why for ph, (want, why) in storage.items() if want == SPLIT})
        _read_whole(graph, out, a, readers_whole, of_weight, cache)
    if pins is not None and pins.layout is not None:
        layout_masks(graph, out, pins)
    if pins is not None and pins.outputs:
        output_masks(graph, out, pins, roles)
    if any(level == 3 for level, _ in levels.values()) and not any(
            size > 1 and a not in tp for a, size in enumerate(mesh)):
        why = next(w for level, w in levels.values() if level == 3)
        raise PlanningError(f"autopar: pin {why} cannot hold on the intra-op mesh {mesh}: ZeRO-3 splits weights over "
                            f"the axes that are not tensor parallel, and none is left ({axes[tp[0]].weights_pin if tp else ''}"
                            "); pin another ZeRO level, or fewer tensor-parallel devices")
    return out


def layout_masks(graph: StrategyGraph, out: PinMasks, pins: Constraints) -> None:
    """``pins.layout``'s placements of every placeholder (its intra-op layout on ``graph``'s mesh:
    ``layout_placements``) and its ZeRO levels, where no ZeRO pin sets one, added to ``out``."""
    fixed, zero = layout_placements(pins.intra_layout, graph)
    why = f"layout={pins.layout}"
    for node, spec in fixed.items():
        if node not in graph.nodes:
            continue
        keep = np.ones(len(graph.nodes[node].strategies), dtype=bool)
        for a, placement in enumerate(spec):
            keep &= _codes([s.output for s in graph.nodes[node].strategies], a) == _code(placement)
        _and_node(out, node, keep, why, f"placing {node.name} as {pins.intra_layout} does")
    for ph, level in zero.items():
        out.zero.setdefault(ph, (level, why))


def module_outputs(captured) -> dict[str, list[fx.Node]]:
    """Module name -> the nodes that make what its forward returns: its nodes (those run under
    it: ``nn_module_stack``) that a node outside it, or the graph's output, reads."""
    inside: dict[fx.Node, set[str]] = {
        node: {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()} for node in captured.nodes()}
    out: dict[str, list[fx.Node]] = {}
    for node, paths in inside.items():
        for path in sorted(paths):
            if any(path not in inside.get(user, ()) for user in node.users):
                out.setdefault(path, []).append(node)
    return out


def output_masks(graph: StrategyGraph, out: PinMasks, pins: Constraints, roles: MeshRoles | None) -> None:
    """Each pinned module's outputs (``module_outputs``) placed as pinned on ``graph``'s mesh: a
    spec's placement of the axis as given each axis is a part of, a role's on the
    tensor-parallel axes (``sequence``: split along dim 1; ``colwise``: along the last dim;
    ``rowwise``: whole), added to ``out``."""
    mesh = graph.mesh_shape
    given = roles.given_axis if roles is not None and roles.given_axis else tuple(range(len(mesh)))
    tp = [a for a, pin in enumerate(roles.axes if roles is not None else ()) if pin.weights == "stored"]
    outputs = graph.once(("module outputs",), lambda: module_outputs(graph.captured))
    for module, nodes in outputs.items():
        if (pinned := pins.output_of(module)) is None:
            continue
        pattern, placement = pinned
        why = f"output:{pattern}={placement}"
        for node in nodes:
            value = node.meta.get("val")
            if node not in graph.nodes or not isinstance(value, torch.Tensor):
                continue
            ns = graph.nodes[node]
            maker, index = ns.follows if ns.follows is not None else (node, 0)
            specs = [s.outputs[index] if index < len(s.outputs) else None for s in graph.nodes[maker].strategies]
            if placement in OUTPUT_ROLES:
                split = {"sequence": 1, "colwise": value.dim() - 1, "rowwise": None}[placement]
                want = [(WHOLE if split is None else 1 + split) if a in tp else None for a in range(len(mesh))]
            else:
                spec = parse_spec(placement)
                want = [_code(spec[given[a]]) if mesh[a] > 1 else None for a in range(len(mesh))]
            keep = np.ones(len(specs), dtype=bool)
            for a, code in enumerate(want):
                if code is not None:
                    keep &= _codes(specs, a) == code
            _and_node(out, maker, keep, why, f"placing {module}'s output {node.name} {list(value.shape)} as pinned")


def placement_pins(graph: StrategyGraph, pins: Constraints, roles: MeshRoles | None) -> dict[fx.Node, tuple[list[int | None], str]]:
    """Parameter placeholder -> (its pinned placement code per axis of ``graph``'s mesh, None
    where it pins none; the pin): a spec's placement of the axis as given each axis is a part
    of (``MeshRoles.given_axis``), a Megatron role's split on the tensor-parallel axes only."""
    mesh = graph.mesh_shape
    given = roles.given_axis if roles is not None and roles.given_axis else tuple(range(len(mesh)))
    tp = [a for a, pin in enumerate(roles.axes if roles is not None else ()) if pin.weights == "stored"]
    params = graph.captured.params
    found = linears(graph)
    column = {lin.weight: lin.column for lin in found.values()} | {
        lin.bias: lin.bias_dim for lin in found.values() if lin.bias is not None}
    row = {lin.weight: lin.row for lin in found.values()} | {lin.bias: None for lin in found.values()
                                                             if lin.bias is not None}
    out = {}
    for ph in (n for n in graph.nodes if n.name in params):
        pinned = pins.placement_of(params[ph.name])
        if pinned is None:
            continue
        pattern, placement = pinned
        why = f"{pattern}={placement}"
        if placement in MEGATRON_ROLES:
            dims = column if placement == "colwise" else row
            if ph not in dims:
                raise PlanningError(f"autopar: pin {why} names {params[ph.name]}, which is no linear's weight or bias; "
                                    f"expected {placement} on linears (a module's name names its weight and bias)")
            dim = dims[ph]
            out[ph] = ([(WHOLE if dim is None else 1 + dim) if a in tp else None for a in range(len(mesh))], why)
        else:
            spec = parse_spec(placement)
            out[ph] = ([_code(spec[given[a]]) if mesh[a] > 1 else None for a in range(len(mesh))], why)
    return out


def _store(graph: StrategyGraph, ph: fx.Node, a: int, want: int) -> int:
    """``want`` where some strategy stores ``ph`` so on axis ``a``, else whole (a split that
    does not divide)."""
    return want if (_codes([s.output for s in graph.nodes[ph].strategies], a) == want).any() else WHOLE


def _stored_mask(graph: StrategyGraph, ph: fx.Node, a: int, want: int) -> np.ndarray:
    codes = _codes([s.output for s in graph.nodes[ph].strategies], a)
    return codes > 0 if want == SPLIT else codes == want


def _read_as_stored(graph: StrategyGraph, out: PinMasks, a: int, storage: dict, of_weight: dict, cache) -> None:
    """Each parameter stored as ``storage`` says on axis ``a`` (placement code, pin), and every
    view of a split one, and every op reading one, reading it where it lies: no weight moves."""
    params = graph.captured.params
    placed: dict[fx.Node, int] = {}  # weight or view of one -> its placement code on axis a, where split
    for node in graph.captured.nodes():
        if node not in of_weight or node not in graph.nodes:
            continue
        if node.op == "placeholder":
            want, why = storage[node]
            _and_node(out, node, _stored_mask(graph, node, a, want), why, f"storing {params[node.name]} as "
                      f"Megatron does on axis {a}")
            if want != WHOLE:
                placed[node] = want
            continue
        source = tensor_inputs(node)[0]
        if source not in placed:
            continue
        ns = graph.nodes[node]
        keep = _reads(ns, 0, a, placed[source], cache)
        _and_node(out, node, keep, storage[of_weight[node]][1], f"reading {params[of_weight[node].name]} as stored")
        outputs = {int(c) for c in _codes([s.output for s in ns.strategies], a)[keep]}
        if len(outputs) == 1 and outputs.pop() > 0:
            placed[node] = int(_codes([s.output for s in ns.strategies], a)[keep][0])
    for dst, ns, position, src in _weight_reads(graph, of_weight):
        if src in placed:
            _and_node(out, dst, _reads(ns, position, a, placed[src], cache), storage[of_weight[src]][1],
                      f"reading {params[of_weight[src].name]} as stored on axis {a}")


def _read_whole(graph: StrategyGraph, out: PinMasks, a: int, whole: dict[fx.Node, str], of_weight: dict,
                cache) -> None:
    """Every op reading a parameter of ``whole`` (or a view of one) reads it whole on axis ``a``."""
    if not whole:
        return
    params = graph.captured.params
    for dst, ns, position, src in _weight_reads(graph, of_weight):
        if of_weight[src] in whole:
            _and_node(out, dst, _reads(ns, position, a, WHOLE, cache), whole[of_weight[src]],
                      f"reading {params[of_weight[src].name]} whole on axis {a}")


def _weight_reads(graph: StrategyGraph, of_weight: dict):
    """(op, its strategies, input position, the weight or view it reads) for every op that reads
    a weight and is not itself a view of one (a getitem reads its producer as it lies)."""
    for dst, ns in graph.nodes.items():
        if dst.op == "placeholder" or ns.follows is not None or dst in of_weight:
            continue
        for position, src in enumerate(tensor_inputs(dst)):
            if src in of_weight and src in graph.nodes:
                yield dst, ns, position, src


def _reads(ns, position: int, a: int, want: int, cache) -> np.ndarray:
    """The strategies of ``ns`` that read input ``position`` placed ``want`` on axis ``a``."""
    key = (id(ns.strategies), position, a, want)
    if key not in cache:
        cache[key] = _codes([s.inputs[position] for s in ns.strategies], a) == want
    return cache[key]


def _zero_pin(pins: Constraints, fqn: str) -> str:
    pattern = next((p for p, _ in pins.zero_by_name if name_matches(p, fqn)), None)
    return f"zero:{pattern}={pins.zero_of(fqn)}" if pattern is not None else f"zero={pins.zero}"


def check_outputs(pins: Constraints, captured) -> None:
    """An ``autopar:`` error for an output pin's pattern that names no module the model runs."""
    modules = module_outputs(captured) if pins.outputs else {}
    for pattern, placement in pins.outputs:
        if not any(module_matches(pattern, module) for module in modules):
            example = next((m for m in modules if "." in m), next(iter(modules), "none"))
            raise PlanningError(f"autopar: pin output:{pattern}={placement} names no module of this model; expected a "
                                f"pattern of module names such as {example!r} (* stands for any characters)")


def check_patterns(pins: Constraints, params: dict[str, str]) -> None:
    """An ``autopar:`` error for a ZeRO or placement pin's pattern that names no parameter
    (``params``: placeholder -> qualified name)."""
    named = [(pattern, f"zero:{pattern}={level}") for pattern, level in pins.zero_by_name]
    named += [(pattern, f"{pattern}={placement}") for pattern, placement in pins.params]
    for pattern, pin in named:
        if not any(name_matches(pattern, fqn) for fqn in params.values()):
            example = next(iter(params.values()), "none")
            raise PlanningError(f"autopar: pin {pin} names no parameter of this model; expected a pattern of "
                                f"fully-qualified names such as {example!r} (a module's name names its "
                                "parameters; * stands for any characters)")


def _batch_whole(graph: StrategyGraph, out: PinMasks, axes: tuple[int, ...], batch: int, pins, cache,
                 everywhere: bool) -> None:
    """No strategy cuts sequences over ``axes`` (``microbatch.sequences_split``): of the inputs
    (as placed and as their readers read them: the batch is not split there), or with
    ``everywhere`` of any value (a micro-batch's sequences are not split there either)."""
    dims = batch_dims(graph, batch)
    mesh = graph.mesh_shape
    why = " and ".join(dict.fromkeys(pins[a].batch_pin for a in axes))
    given = [n for n in graph.captured.nodes("placeholder") if n.name in graph.captured.user_inputs]
    for node in given:
        if node in graph.nodes and dims.get(node):
            keep = np.array([not any(sequences_split(node, i, spec, dims, batch, mesh, axes) > 1
                                     for i, spec in enumerate(s.outputs)) for s in graph.nodes[node].strategies])
            _and_node(out, node, keep, why, f"keeping the batch whole on axes {list(axes)}")
    for node, ns in graph.nodes.items():
        if node.op == "placeholder" or ns.follows is not None:
            continue
        inputs = tensor_inputs(node)
        if not everywhere and not any(u in given for u in inputs):
            continue
        if not dims.get(node) and not any(dims.get(u) for u in inputs):
            continue
        key = ("batch whole", id(ns.strategies), axes, *(tuple(dims.get(u, ())) for u in (node, *inputs)),
               *(tuple(getattr(u.meta.get("val"), "shape", ())) for u in (node, *inputs)))
        if key not in cache:
            cache[key] = np.array([
                not any(sequences_split(node, i, spec, dims, batch, mesh, axes) > 1 for i, spec in enumerate(s.outputs))
                and not any(sequences_split(u, 0, spec, dims, batch, mesh, axes) > 1 for u, spec in zip(inputs, s.inputs))
                for s in ns.strategies])
        if not everywhere:  # a reader of the inputs: how it reads them
            keep = np.array([not any(sequences_split(u, 0, spec, dims, batch, mesh, axes) > 1
                                     for u, spec in zip(inputs, s.inputs) if u in given) for s in ns.strategies])
            _and_node(out, node, keep, why, f"reading the inputs whole on axes {list(axes)}")
        elif not cache[key].all():
            _and_node(out, node, cache[key], why, f"keeping the batch whole on axes {list(axes)}")


def _batch_split(graph: StrategyGraph, out: PinMasks, axes: list[int], pins) -> None:
    """The inputs with a batch dim placed split along it on every axis of ``axes``."""
    batch = batch_size(graph)
    if not batch:
        return
    dims = batch_dims(graph, batch)
    for node in graph.captured.nodes("placeholder"):
        held = dims.get(node)
        if node.name not in graph.captured.user_inputs or node not in graph.nodes or not held or not held[0]:
            continue
        for a in axes:
            keep = np.array([isinstance(s.output[a], Shard) and s.output[a].dim in held[0]
                             for s in graph.nodes[node].strategies])
            shape = list(node.meta["val"].shape)
            _and_node(out, node, keep, pins[a].batch_pin,
                      f"splitting input {node.name} {shape} along its batch over axis {a} ({graph.mesh_shape[a]} "
                      f"devices): expected a batch the axis divides")


def _and_node(out: PinMasks, node: fx.Node, keep: np.ndarray, why: str, what: str, optional: bool = False) -> None:
    """``keep`` and what ``out`` keeps of ``node`` already; ``optional``: a mask that would leave
    nothing is not applied (a weight no placement splits there), else an ``autopar:`` error."""
    before, said = out.nodes.get(node, (None, ""))
    both = keep if before is None else before & keep
    if not both.any():
        if optional:
            return
        named = why if not said or why in said else f"{said} and {why}"
        raise PlanningError(f"autopar: pin {named} cannot hold: it leaves {node.name} ({node.target}) no strategy "
                            f"({what}); pin another degree, level or axis, or leave the pin out")
    out.nodes[node] = (both, why if not said or why in said else f"{said} and {why}")


def restricted(costs: Costs, masks: PinMasks) -> Costs:
    """``costs`` with ``masks``' forbidden strategies at an infinite time (the problem's own
    lists copied, never its arrays changed: the price caches share them)."""
    if masks.empty:
        return costs
    problem = costs.problem
    node_time = list(problem.node_time)
    for node, (keep, _) in masks.nodes.items():
        if node in costs.index:
            v = costs.index[node]
            node_time[v] = node_time[v] + np.where(keep, 0.0, np.inf)
        if node in costs.zero_node:  # a parameter: its ZeRO node leads its placement
            z = costs.zero_node[node]
            node_time[z] = node_time[z] + np.where(np.repeat(keep, len(node_time[z]) // len(keep)), 0.0, np.inf)
    for ph, (level, _) in masks.zero.items():
        z = costs.zero_node.get(ph)
        if z is None:
            continue
        times = node_time[z]
        per = len(times) // len(costs.graph.nodes[ph].strategies)
        keep = np.full(len(times), np.inf)
        for i in range(len(times) // per):  # the level where it means something, else level 0
            keep[i * per + (level if level < per and np.isfinite(times[i * per + level]) else 0)] = 0.0
        node_time[z] = times + keep
    return replace(costs, problem=replace(problem, node_time=node_time))


def broken(graph: StrategyGraph, choice: dict[fx.Node, int], zero: dict[str, int], masks: PinMasks) -> list[str]:
    """The pins a plan's ``choice`` (strategy per node) and ZeRO levels (``Plan.zero``, or the
    ZeRO nodes') break, each once; [] when it honours them all."""
    out = [pin for node, (keep, why) in masks.nodes.items() if node in choice and not keep[choice[node]]
           for pin in why.split(" and ")]
    params = graph.captured.params
    for ph, (level, why) in masks.zero.items():
        found = zero.get(params[ph.name], 0)
        if found == level:
            continue
        spec = graph.nodes[ph].strategies[choice[ph]].output
        if not (found == 0 and zero_split_dim(tuple(ph.meta["val"].shape), spec, graph.mesh_shape) is None):
            out.append(why)
    return list(dict.fromkeys(out))
