"""The plan's tensor parallelism as torch's parallel styles, module by module.

torch lays tensor parallelism out per module (``parallelize_module``): each split module gets a
style that places its weights and says what its input arrives as and what its output leaves
as; the model's own Python runs between them on local tensors. A plan places every op. So the
styles come from the plan's weights (a linear whose weight is split by output features is
``ColwiseParallel``, by input features ``RowwiseParallel``; an embedding split by vocabulary
``RowwiseParallel``; any other module with split weights is laid out by ``distribute_module``
with the plan's placements), and what each style hands on is what the plan's next op reads.

Whether that is right is checked by running the torch program's placements over the captured
graph on the tensor axis (``simulate``): an op the model runs between styles computes on
whatever local tensors it gets, which is the plan's op when its inputs are placed as the plan
places them, or the whole op when they are all whole. Anything else would compute wrongly, so
the style that handed the split value on hands it on whole instead (``Replicate``), and the
export says so; a module with whole weights reached by split activations (a norm under
sequence parallelism) runs as ``SequenceParallel``, which sums its weights' gradients; a split
model output stays a DTensor (the loss then runs under ``loss_parallel``). What the model makes
before its first repeated layer leaves whole, since its Python reads those shapes (positions,
masks); a hidden state the plan splits there is split on entry to the first layer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.passes.capture import Captured
from autopar.passes.export.reading import Reading, inputs_of, kernel_of, outputs, planned_strategies
from autopar.passes.placements import parse_spec

WHOLE = Replicate()


@dataclass
class Style:
    """One module's parallel style on the tensor axis."""

    module: str
    kind: str  # "colwise", "rowwise", "sequence", "distribute", or "entry" (a layer's input split on entry)
    type_name: str
    input_layout: Placement = WHOLE  # what the torch program hands the module
    input_ndim: int = 0
    output_layout: Placement = WHOLE  # what the module hands on
    local_output: bool = True  # False: a DTensor (the model's split output)
    params: dict[str, Placement] = field(default_factory=dict)  # direct parameters' placements
    wanted_input: Placement = WHOLE  # "distribute": what the plan's first op of the module reads
    output_ndim: int = 0  # the dims of what it hands on (``Shard(ndim - 1)`` is written ``Shard(-1)``)
    notes: list[str] = field(default_factory=list)


@dataclass
class TensorParallel:
    """The styles of one export, its re-tied parameters and what torch cannot say."""

    styles: dict[str, Style]
    ties: list[tuple[str, str]]  # (alias, canonical) qualified names to tie again after placing
    loss_parallel: bool
    notes: dict[str, list[str]]  # module path -> what differs from the plan there


@dataclass
class _Decisions:
    whole: set[str] = field(default_factory=set)  # styles forced to hand their output on whole
    dtensor: set[str] = field(default_factory=set)  # styles handing on a DTensor
    sequence: dict[str, int] = field(default_factory=dict)  # module -> its split dim (SequenceParallel)
    why_whole: dict[str, str] = field(default_factory=dict)


def tensor_parallel(plan, reading: Reading, model: nn.Module, captured: Captured) -> TensorParallel | None:
    """The styles laying out ``model`` as ``plan`` does on its tensor axes; None without one."""
    if not reading.axes.tensor:
        return None
    tp = _TensorAxis(reading)
    canonical = canonical_names(model)
    placed, kept_whole = {}, []
    for path, module in model.named_modules():
        own = {name: tp.of(reading.params.get(canonical.get(_join(path, name), ""))) for name, _ in
               module.named_parameters(recurse=False)}
        if any(isinstance(p, Shard) for p in own.values()):
            if path:
                placed[path] = _base_style(path, module, own)
            else:
                kept_whole.append("the plan splits the model's own parameters (" + ", ".join(own) + "); torch's "
                                  "styles place a submodule's: kept whole")
    graph = _PlannedGraph(plan, captured, tp, reading.layers.values())
    decisions = _Decisions()
    for _ in range(4 * len(list(model.modules())) + 4):  # each round decides one more module
        styles = {path: _styled(style, decisions) for path, style in placed.items()}
        styles.update({path: _sequence_style(path, model.get_submodule(path), dim)
                       for path, dim in decisions.sequence.items()})
        if graph.entry is not None and graph.entry[0] not in decisions.whole:
            layer, _, split = graph.entry
            styles[layer] = Style(layer, "entry", type(model.get_submodule(layer)).__name__, output_layout=split)
        if not _simulate(graph, styles, decisions):
            notes = graph.notes(styles, decisions)
            if kept_whole:
                notes.setdefault("", []).extend(kept_whole)
            for path, style in styles.items():
                notes.setdefault(path, [])[:0] = style.notes
            loss_parallel = any(not s.local_output for s in styles.values())
            return TensorParallel(styles, _ties(model, canonical, styles), loss_parallel,
                                  {k: v for k, v in notes.items() if v})
    raise RuntimeError("autopar: export found no torch layout consistent with the plan's tensor parallelism after "
                       "trying every module; please report this plan")


class _TensorAxis:
    """Placements on the plan's tensor axes, as one (torch flattens several into one axis)."""

    def __init__(self, reading: Reading):
        self.index = [reading.axes.intra.index(a) for a in reading.axes.tensor]

    def of(self, spec) -> Placement | None:
        if spec is None:
            return None
        found = {spec[i] for i in self.index}
        return found.pop() if len(found) == 1 else None  # None: split differently on two tensor axes


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases too) -> the name ``named_parameters()`` gives it."""
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(param), name)
    return out


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _base_style(path: str, module: nn.Module, own: dict[str, Placement | None]) -> Style:
    weight, bias = own.get("weight"), own.get("bias", WHOLE)
    kind = type(module).__name__
    if isinstance(module, nn.Linear) and isinstance(weight, Shard):
        if weight.dim == 0 and (module.bias is None or bias == Shard(0)):
            return Style(path, "colwise", kind, params=own)
        if weight.dim == 1 and (module.bias is None or bias == WHOLE):
            return Style(path, "rowwise", kind, params=own)
    if isinstance(module, nn.Embedding) and isinstance(weight, Shard) and set(own) == {"weight"}:
        return Style(path, "rowwise" if weight.dim == 0 else "colwise", kind, params=own)
    split = ", ".join(f"{n} {_short(p)}" for n, p in own.items())
    return Style(path, "distribute", kind, params={n: p or WHOLE for n, p in own.items()}, notes=[
        f"the plan splits this {kind}'s weights ({split}); torch's ColwiseParallel and RowwiseParallel take only "
        "nn.Linear and nn.Embedding as they store them, so distribute_module places them as the plan does"])


def _sequence_style(path: str, module: nn.Module, dim: int) -> Style:
    """``SequenceParallel`` of a module with whole weights that runs on activations split along ``dim``."""
    return Style(path, "sequence", type(module).__name__, input_layout=Shard(dim), output_layout=Shard(dim),
                 params={name: WHOLE for name, _ in module.named_parameters(recurse=False)})


def _styled(style: Style, decisions: _Decisions) -> Style:
    out = Style(style.module, style.kind, style.type_name, params=style.params, notes=list(style.notes))
    if style.module in decisions.dtensor:
        out.local_output = False
    return out


def _short(p: Placement | None) -> str:
    if p is None:
        return "split differently on each tensor axis"
    return f"S({p.dim})" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"


class _PlannedGraph:
    """The captured graph with the plan's placements of each node on the tensor axis."""

    def __init__(self, plan, captured: Captured, tp: _TensorAxis, layers):
        self.captured = captured
        self.nodes = list(captured.gm.graph.nodes)
        self.strategy, self.module = planned_strategies(plan, captured)
        self.tp = tp
        self.whole_ops: set[fx.Node] = set()  # ops the plan splits that the torch program runs whole
        self.layers = list(layers)
        in_layer = [n for n in self.nodes if self.layer_of(n) is not None]
        self.first_layer_op = in_layer[0] if in_layer else None
        self.entry = self._entry()

    def layer_of(self, node: fx.Node) -> str | None:
        """The repeated layer ``node`` runs in, or None."""
        path = self.module.get(node)
        if path is None:
            return None
        return next((layer for layer in self.layers if path == layer or path.startswith(layer + ".")), None)

    def before_layers(self, node: fx.Node) -> bool:
        """Whether ``node`` runs before the first repeated layer (the model's prologue)."""
        return self.first_layer_op is not None and self.nodes.index(node) < self.nodes.index(self.first_layer_op)

    def _entry(self) -> tuple[str, fx.Node, Placement] | None:
        """(the first layer, the hidden state it reads from the prologue, its split): where the plan
        splits the layers' hidden state over the tensor axis from the first layer on. The model's
        Python reads the shapes of what its prologue makes (positions, masks), so torch splits it on
        entry to the first layer (``PrepareModuleInput``), not before."""
        op = self.first_layer_op
        if op is None:
            return None
        for arg, wanted in zip(_tensor_inputs(op), self.plan_inputs(op) or []):
            if arg.op != "placeholder" and self.layer_of(arg) is None and isinstance(wanted, Shard) \
                    and _ndim(arg) >= 2:
                return self.layer_of(op), arg, wanted
        return None

    def plan_inputs(self, node: fx.Node) -> list[Placement | None] | None:
        text = self.strategy.get(node)
        return None if text is None else [self.tp.of(s) for s in inputs_of(text)]

    def plan_outputs(self, node: fx.Node) -> list[Placement | None] | None:
        text = self.strategy.get(node)
        return None if text is None else [self.tp.of(parse_spec(s)) for s in outputs(text)]

    def plan_value(self, node: fx.Node) -> Placement | None:
        """The plan's placement of the value ``node`` computes (a getitem's: its item's)."""
        found = self.plan_outputs(node)
        if not found:
            return None
        if node.target is operator.getitem and len(found) > 1:
            return found[node.args[1]]
        return found[0]

    def notes(self, styles: dict[str, Style], decisions: _Decisions) -> dict[str, list[str]]:
        """Per module, the plan's choices the torch program does not make there."""
        notes: dict[str, list[str]] = {}
        for path, why in decisions.why_whole.items():
            notes.setdefault(path, []).append(why)
        whole_here: dict[str, int] = {}
        for node in self.nodes:
            path = self.module.get(node)
            if path is None or _owner(path, styles) is not None:
                continue
            split = [p for p in (self.plan_outputs(node) or []) if isinstance(p, Shard)]  # sums: noted at styles
            if split and node in self.whole_ops:
                whole_here[path] = whole_here.get(path, 0) + 1
        for path, count in whole_here.items():
            notes.setdefault(path, []).append(
                f"{count} of its ops the plan splits over the tensor axis run whole here, on every rank of that "
                "axis: the model's Python between torch's styles computes on what it is handed")
        return notes


def _owner(path: str, styles: dict[str, Style]) -> str | None:
    """The styled module ``path`` lies in (the innermost; a layer split on entry places no op), or None."""
    best = None
    for module, style in styles.items():
        if style.kind != "entry" and (path == module or path.startswith(module + ".")) and \
                (best is None or len(module) > len(best)):
            best = module
    return best


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """A node's tensor arguments in pytree order: the order a strategy lists its inputs."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def _consumer_layout(wanted: Placement | None) -> Placement:
    """What a style hands on for a consumer that reads ``wanted``: a sum is reduced first."""
    return wanted if isinstance(wanted, Shard) else WHOLE


def _ndim(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _simulate(graph: _PlannedGraph, styles: dict[str, Style], decisions: _Decisions) -> bool:
    """Run the torch program's placements over the graph; decide one more module and return
    True when something must change, False when the program computes what the plan does."""
    placed: dict[fx.Node, list[Placement]] = {}
    origin: dict[fx.Node, str] = {}  # the style a split value was handed on by
    dtensor: set[fx.Node] = set()
    graph.whole_ops = set()
    met: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            placed[node] = [WHOLE]
            continue
        if node.op == "output":
            return _check_outputs(graph, node, placed, origin, dtensor, styles, decisions)
        if node.op != "call_function":
            placed[node] = [WHOLE]
            continue
        owner = _owner(graph.module[node], styles)
        args = _tensor_inputs(node)
        got = [_value(placed, a) for a in args]
        if graph.entry is not None and graph.entry[0] in styles:  # split on entry to the first layer
            layer, hidden, split = graph.entry
            if graph.layer_of(node) == layer and hidden in args:
                got = [split if a is hidden else p for a, p in zip(args, got)]
                origin.setdefault(hidden, layer)  # the split's source, should the layer's ops not take it
        if owner is not None:
            style = styles[owner]
            outside = [(a, p) for a, p in zip(args, got) if a.op != "placeholder" and not _inside(graph, a, owner)]
            if outside and owner not in met:
                met.add(owner)
                if style.kind == "sequence" and outside[0][1] != style.input_layout:  # handed whole now
                    del decisions.sequence[owner]
                    return True
                style.input_layout, style.input_ndim = outside[0][1], _ndim(outside[0][0])
                wanted = (graph.plan_inputs(node) or [None] * len(args))[args.index(outside[0][0])]
                style.wanted_input = wanted if isinstance(wanted, (Shard, Replicate)) else WHOLE
            users = [u for u in node.users if u.op == "output" or not _inside(graph, u, owner)]
            if users:
                out = _handed_on(graph, node, users, style, decisions)
                style.output_layout, style.output_ndim = out, _ndim(node)
                placed[node] = [out]
                if isinstance(out, Shard):
                    origin[node] = owner
                if not style.local_output:
                    dtensor.add(node)
            else:
                placed[node] = [WHOLE]
            continue
        if _run_between(graph, node, args, got, placed, origin, dtensor, decisions):
            return True
    return False


def _inside(graph: _PlannedGraph, node: fx.Node, module: str) -> bool:
    path = graph.module.get(node)
    return path is not None and (module == "" or path == module or path.startswith(module + "."))


def _value(placed: dict[fx.Node, list[Placement]], node: fx.Node) -> Placement:
    return placed.get(node, [WHOLE])[0]


def _handed_on(graph: _PlannedGraph, node: fx.Node, users: list[fx.Node], style: Style,
               decisions: _Decisions) -> Placement:
    """What a style hands on: what its first consumer outside reads in the plan (the plan's
    own placement of a model output), unless decided whole."""
    if style.module in decisions.whole:
        return WHOLE
    user = users[0]
    if user.op == "output":
        wanted = graph.plan_value(node)
    else:
        wanted = (graph.plan_inputs(user) or [None] * 64)[_tensor_inputs(user).index(node)]
    if isinstance(wanted, Partial):
        style.notes.append("the plan hands its output on as a partial sum, reduced after the ops that follow; "
                           "torch's style reduces it at the module's output")
    if graph.before_layers(node):  # the model's Python reads the prologue's shapes; split on entry to the layers
        return WHOLE
    return _consumer_layout(wanted)


def _run_between(graph, node, args, got, placed, origin, dtensor, decisions) -> bool:
    """One op of the model's own Python between styles: the plan's op on local shards when it
    is handed what the plan reads, the whole op when handed whole values; else a decision."""
    val = node.meta.get("val")
    n_out = len(val) if isinstance(val, (tuple, list)) else 1
    if node.target is operator.getitem:
        parent = args[0]
        items = placed.get(parent, [WHOLE])
        placed[node] = [items[node.args[1]] if node.args[1] < len(items) else WHOLE]
        if parent in origin:
            origin[node] = origin[parent]
        if parent in dtensor:
            dtensor.add(node)
        return False
    as_dtensor = [a in dtensor for a in args]
    if any(as_dtensor):  # DTensor places each op itself
        if not all(as_dtensor):  # a DTensor meets a local tensor: torch cannot mix them
            return _decide_whole(graph, decisions, origin[next(a for a, d in zip(args, as_dtensor) if d)],
                                 f"its output meets a local tensor at {node.target}")
        dtensor.add(node)
        placed[node] = list(graph.plan_outputs(node) or got[:1] * n_out)
        origin[node] = origin[args[0]]
        return False
    if all(p == WHOLE for p in got):
        placed[node] = [WHOLE] * n_out
        if any(isinstance(p, (Shard, Partial)) for p in (graph.plan_outputs(node) or [])):
            graph.whole_ops.add(node)
        return False
    wanted = graph.plan_inputs(node)
    fits = (wanted is not None and kernel_of(graph.strategy[node]) is None and len(wanted) == len(got)
            and all(w is None or w == p for w, p in zip(wanted, got)))
    if fits:
        params = _params_read(graph, node)
        if params:  # whole weights meet split activations: their gradients need a sum
            module = _module_holding(params[0], graph.captured)
            dim = next(p.dim for p in got if isinstance(p, Shard))
            if module is not None and module not in decisions.sequence:
                decisions.sequence[module] = dim
                return True
        placed[node] = list(graph.plan_outputs(node))
        source = next((origin[a] for a, p in zip(args, got) if isinstance(p, Shard) and a in origin), None)
        if source is not None:
            origin[node] = source
        return False
    culprit = next((origin[a] for a, p in zip(args, got) if isinstance(p, Shard) and a in origin), None)
    if culprit is None:
        raise RuntimeError(f"autopar: export lost track of where {node.name}'s split input comes from; please report")
    planned = ", ".join(_short(w) for w in (wanted or []))
    return _decide_whole(graph, decisions, culprit, f"{node.target} reads it as the plan places it "
                                                    f"({planned or 'unknown'}) only in the plan's own per-op layout")


def _decide_whole(graph: _PlannedGraph, decisions: _Decisions, module: str, why: str) -> bool:
    entry = graph.entry is not None and module == graph.entry[0]
    if module in decisions.whole:
        raise RuntimeError(f"autopar: export could not lay out {module} consistently; please report this plan")
    decisions.whole.add(module)
    decisions.dtensor.discard(module)
    decisions.why_whole[module] = (f"the plan splits this layer's input on entry, which its ops cannot take split "
                                   f"({why}): handed in whole (Replicate) instead" if entry else
                                   f"the plan keeps this module's output split into the next ops, which torch's "
                                   f"eager code cannot take split ({why}): handed on whole (Replicate) instead")
    return True


def _params_read(graph: _PlannedGraph, node: fx.Node) -> list[str]:
    """The trainable parameters (placeholder names) ``node`` reads directly."""
    return [a.name for a in _tensor_inputs(node) if a.op == "placeholder" and a.name in graph.captured.params]


def _module_holding(placeholder: str, captured: Captured) -> str | None:
    fqn = captured.params.get(placeholder)
    return fqn.rsplit(".", 1)[0] if fqn and "." in fqn else None


def _check_outputs(graph, node, placed, origin, dtensor, styles, decisions) -> bool:
    """A model output must leave whole, or as a DTensor split by its last dim (the loss then
    runs under ``loss_parallel``)."""
    for value in _tensor_inputs(node):
        p = _value(placed, value)
        if not isinstance(p, Shard):
            continue
        source = origin.get(value)
        if source is None:
            raise RuntimeError(f"autopar: export lost track of where output {value.name} is split; please report")
        last = p.dim in (-1, _ndim(value) - 1)
        if value in dtensor and last:
            continue
        if last and styles[source].kind in ("colwise", "distribute") and source not in decisions.dtensor:
            decisions.dtensor.add(source)
            return True
        return _decide_whole(graph, decisions, source, "the model's output leaves whole")
    return False


def _ties(model: nn.Module, canonical: dict[str, str], styles: dict[str, Style]) -> list[tuple[str, str]]:
    """Tied parameters a style placed: parallelize_module places each module's copy, so each
    alias is pointed at the canonical one again afterwards."""
    out = []
    for name, first in canonical.items():
        if name != first and (_owner(name.rsplit(".", 1)[0], styles) or _owner(first.rsplit(".", 1)[0], styles)):
            out.append((name, first))
    return out
