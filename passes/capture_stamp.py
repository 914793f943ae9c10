"""Capture by stamping: a model of many identical layers exported with a few of them, the
rest copied from the last one traced (``stamped_export``).

``torch.export`` runs every layer's Python code under tracing: for 80 Llama layers that is
nearly all of a capture. When a model's ``nn.ModuleList`` holds ``STAMP_MIN`` or more layers of
one class with the same parameters and buffers (names, shapes, dtypes), the model is exported
with the list cut to ``TRACED`` layers (put back at once), and the last traced layer's nodes are
copied for the others: placeholders named, and nodes numbered, as export names them.

The copy must be the graph export would have made, or nothing: anything not shown identical
returns None and the caller exports the whole model. Shown identical means:

- the weights are on the meta device (checking a layer means running it: free only there);
- the list's code around the layers (``_StubLayer`` in each place, exported once) makes no
  node between two layers, hands each layer the previous one's outputs and the same other
  values, and before and after the loop runs the same ops as with ``TRACED`` layers;
- each layer, run on its own on meta tensors, calls the same torch functions and modules with
  the same arguments (shapes, values, where each tensor comes from) as every other layer;
- in the export with ``TRACED`` layers, layer ``TRACED - 1`` is layer ``TRACED - 2`` copied
  by the same rule that copies the rest (names, arguments, module paths), and every name the
  copies renumber is numbered in graph order without gaps.
"""

from __future__ import annotations

import contextlib
import re
import types
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputSpec, TensorArgument
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

STAMP_MIN = 6  # with fewer, little is left to copy
TRACED = 4  # layers exported: the copied one, two to check the copy rule on, and the first

_SUFFIX = re.compile(r"^(.*)_(\d+)$")


class _NotIdentical(Exception):
    """A stamped graph could differ from the real one: export the whole model."""


def stamped_export(model: nn.Module, export: Callable[[nn.Module], Any]) -> Any | None:
    """What ``export(model)`` returns (the graph module, signature, constants and call spec
    ``capture`` reads) built from an export of ``TRACED`` layers, or None where that cannot
    be shown identical (see the module docstring)."""
    found = _repeated_layers(model)
    if found is None:
        return None
    parent, attr, path, layers = found
    try:
        outputs: list[Any] = []
        with _swapped(parent, attr, nn.ModuleList(list(layers)[:TRACED])) as traced:
            handle = traced[TRACED - 1].register_forward_hook(lambda m, a, k, out: outputs.append(out),
                                                              with_kwargs=True)
            try:
                ep = export(model)
            finally:
                handle.remove()
        if len(outputs) != 1:
            return None
        calls: list[tuple] = []
        stubs = nn.ModuleList(_StubLayer(calls, outputs[0], layer) for layer in layers)
        with _swapped(parent, attr, stubs):
            stub_ep = export(model)
        _check_loop(stub_ep, ep, calls, path, len(layers))
        _check_layers_alike(layers, calls)
        return _stamp(ep, path, len(layers))
    except _NotIdentical:
        return None
    except Exception:  # the cut model failed to export: the whole model's export says why, or works
        return None


def _repeated_layers(model: nn.Module) -> tuple[nn.Module, str, str, nn.ModuleList] | None:
    """(parent, attribute, path, list) of the longest ``nn.ModuleList`` of ``STAMP_MIN`` or more
    distinct layers of one class and one parameter and buffer signature, in a meta model."""
    state = list(model.parameters()) + list(model.buffers())
    if not state or any(t.device.type != "meta" for t in state):
        return None
    best = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < STAMP_MIN or not path:
            continue
        if len({id(m) for m in module}) != len(module) or len({_signature(m) for m in module}) != 1:
            continue
        if best is None or len(module) > len(best[3]):
            parent_path, _, attr = path.rpartition(".")
            best = (model.get_submodule(parent_path), attr, path, module)
    if best is None:
        return None
    shared = [id(p) for m in best[3] for _, p in m.named_parameters(remove_duplicate=False)]
    return best if len(set(shared)) == len(shared) and not _shared_elsewhere(model, best[3]) else None


def _signature(layer: nn.Module) -> tuple:
    return (type(layer),
            tuple((n, type(m)) for n, m in layer.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in layer.named_parameters(remove_duplicate=False)),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers(remove_duplicate=False)))


def _shared_elsewhere(model: nn.Module, layers: nn.ModuleList) -> bool:
    """Whether a layer's parameter is also the model's under another name (a tied weight)."""
    inside = {id(p) for p in layers.parameters()}
    outside = [p for n, p in model.named_parameters(remove_duplicate=False) if id(p) in inside]
    return len(outside) != len(inside)


@contextlib.contextmanager
def _swapped(parent: nn.Module, attr: str, replacement: nn.ModuleList):
    original = getattr(parent, attr)
    setattr(parent, attr, replacement)
    try:
        yield replacement
    finally:
        setattr(parent, attr, original)


class _StubLayer(nn.Module):
    """Stands in a layer's place to export the code around the layers: notes what it is
    handed and returns outputs shaped as the traced layer's, made from what it is handed."""

    def __init__(self, calls: list, output: Any, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():  # what the code around may read (e.g. a layer's attention type)
            if not name.startswith("_") and name != "training" and not isinstance(value, (torch.Tensor, nn.Module)):
                setattr(self, name, value)
        self._calls = calls
        leaves, self._spec = pytree.tree_flatten(output)
        self._shapes = [(t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves]
        self._leaves = [None if isinstance(t, torch.Tensor) else t for t in leaves]  # no tensor attribute to lift

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        if first is None:
            raise _NotIdentical("a layer handed no tensor")
        out = [first.new_empty_strided(s[0], s[1], dtype=s[2]) if s else v for s, v in zip(self._shapes, self._leaves)]
        made = [k for k, s in enumerate(self._shapes) if s]
        if not made:
            raise _NotIdentical("a layer returns no tensor")
        for x in leaves[1:] if not self._calls else []:  # the first reads all it is handed, or export would
            if isinstance(x, torch.Tensor):               # drop what only layers read (later ones: the same, checked)
                out[made[0]] = out[made[0]] + (x.sum() * 0).to(out[made[0]].dtype)
        self._calls.append((leaves, spec, out))
        return pytree.tree_unflatten(out, self._spec)


# --- the code around the layers ---------------------------------------------------------

def _layer_index(path: str, container: str) -> int | None:
    if not path.startswith(container + "."):
        return None
    match = re.match(r"(\d+)(?:\.|$)", path[len(container) + 1:])
    return int(match.group(1)) if match else None


def _node_layer(node: fx.Node, container: str) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        index = _layer_index(path, container)
        if index is not None:
            return index
    return None


def _parts(gm: fx.GraphModule, container: str, count: int) -> tuple[list, list[list], list]:
    """The op nodes before the layers, each layer's (contiguous, in order), and after."""
    before: list[fx.Node] = []
    layers: list[list[fx.Node]] = [[] for _ in range(count)]
    after: list[fx.Node] = []
    current = -1
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        index = _node_layer(node, container)
        if index is None:
            (before if current < 0 else after).append(node)
        elif after or index not in (current, current + 1) or index >= count:
            raise _NotIdentical(f"layer {index}'s nodes are not in one run after layer {current}'s")
        else:
            current = index
            layers[index].append(node)
    if current != count - 1:
        raise _NotIdentical("a layer made no node")
    return before, layers, after


def _check_loop(stub_ep: Any, ep: Any, calls: list[tuple], container: str, count: int) -> None:
    """The code around the layers is the same for every layer, and for ``TRACED`` and
    ``count`` of them."""
    if len(calls) != count:
        raise _NotIdentical("not every layer ran once")
    first_leaves, first_spec, _ = calls[0]
    sources = None
    for i in range(1, count):
        leaves, spec, _ = calls[i]
        if spec != first_spec or len(leaves) != len(first_leaves):
            raise _NotIdentical("layers are handed different arguments")
        # each argument: the first layer's (a value, or a tensor all layers share) or the previous layer's output k
        where = tuple(_source(leaf, leaf0, calls[i - 1][2]) for leaf, leaf0 in zip(leaves, first_leaves))
        if sources is not None and where != sources:
            raise _NotIdentical("layers are handed their arguments from different places")
        sources = where
    before_stub, _, after_stub = _parts(stub_ep.graph_module, container, count)
    before, layers, after = _parts(ep.graph_module, container, TRACED)
    if _describe(before_stub) != _describe(before):
        raise _NotIdentical("the code before the layers depends on how many there are")
    after_stub.append(_output(stub_ep))
    after.append(_output(ep))
    stub_last = _last_outputs(_stub_nodes(stub_ep, count - 1, container), after_stub)
    if _relabeled(after_stub, stub_last) != _relabeled(after, _last_outputs(layers[-1], after)):
        raise _NotIdentical("the code after the layers depends on how many there are")
    if _outside_inputs(stub_ep, container) != _outside_inputs(ep, container):
        raise _NotIdentical("the model's other inputs depend on how many layers there are")
    specs = [(s.kind, s.target) for s in stub_ep.graph_signature.output_specs]
    if specs != [(s.kind, s.target) for s in ep.graph_signature.output_specs]:
        raise _NotIdentical("outputs differ")


def _output(ep: Any) -> fx.Node:
    return next(n for n in reversed(ep.graph_module.graph.nodes) if n.op == "output")


def _outside_inputs(ep: Any, container: str) -> list[tuple]:
    """The program's inputs that are not a layer's, with the constants' shapes and dtypes (and
    values, where they have some)."""
    def constant(name: str) -> Any:
        t = ep.constants[name]
        if not isinstance(t, torch.Tensor):
            return repr(t)
        return (tuple(t.shape), t.dtype, None if t.is_meta else t.tolist())

    return [(s.kind, s.arg.name, s.target, constant(s.target) if s.target in ep.constants else None)
            for s in ep.graph_signature.input_specs if not (s.target and _layer_index(s.target, container) is not None)]


def _source(leaf: Any, first: Any, previous: list[Any]) -> tuple:
    if not isinstance(leaf, torch.Tensor):
        if isinstance(first, torch.Tensor) or type(leaf) is not type(first) or leaf != first:
            raise _NotIdentical("layers are handed different values")
        return ("value",)
    for k, out in enumerate(previous):
        if leaf is out:
            return ("previous", k)
    if leaf is first:
        return ("shared",)
    raise _NotIdentical("a layer is handed a tensor that is neither the previous layer's output nor shared")


def _stub_nodes(ep: Any, index: int, container: str) -> list[fx.Node]:
    return [n for n in ep.graph_module.graph.nodes if n.op == "call_function" and _node_layer(n, container) == index]


def _last_outputs(last: list[fx.Node], after: list[fx.Node]) -> dict[fx.Node, tuple]:
    """The last layer's nodes that code after the layers reads, numbered in the order it first reads them."""
    mine = set(last)
    read = [a for n in after for a in n.all_input_nodes if a in mine]
    return {n: ("last", k) for k, n in enumerate(dict.fromkeys(read))}


def _describe(nodes: list[fx.Node]) -> list[tuple]:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), _val(n), n.meta.get("nn_module_stack"))
            for n in nodes]


def _relabeled(nodes: list[fx.Node], labels: dict[fx.Node, tuple]) -> list[tuple]:
    """Nodes as ops and where their inputs come from, names aside."""
    local = {n: ("after", k) for k, n in enumerate(nodes)}

    def label(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return local.get(a) or labels.get(a) or ("node", a.name)
        return a

    return [(n.op, str(n.target), repr(fx.node.map_aggregate(n.args, label)),
             repr(fx.node.map_aggregate(n.kwargs, label)), _val(n), n.meta.get("nn_module_stack")) for n in nodes]


def _val(node: fx.Node) -> Any:
    """What a node's value looks like (whether it needs a gradient aside: a stub's outputs need none)."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype, v.stride()
    return repr(v)


# --- each layer on its own -----------------------------------------------------------------

class _Calls(TorchFunctionMode):
    """Notes each torch function called (and, through a hook, each module), with its arguments:
    a tensor as where it comes from (an input, a parameter, an earlier call) and its shape."""

    def __init__(self, labels: dict[int, tuple]):
        super().__init__()
        self.labels = labels
        self.log: list[tuple] = []
        self.kept: list[Any] = []  # what was labelled stays alive, so that no id is reused

    def label(self, tree: Any) -> str:
        def one(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (self.labels.get(id(x), ("other", id(x))), tuple(x.shape), x.dtype, x.stride(), x.requires_grad)
            return repr(x)
        return repr(pytree.tree_map(one, tree))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = (getattr(func, "__qualname__", repr(func)), self.label((args, kwargs)), torch.is_grad_enabled())
        out = func(*args, **kwargs)
        for k, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor) and id(t) not in self.labels:
                self.labels[id(t)] = ("made", len(self.log), k)
                self.kept.append(t)
        self.log.append(entry)
        return out


def _check_layers_alike(layers: nn.ModuleList, calls: list[tuple]) -> None:
    """Every layer from the second on, run alone on meta tensors shaped as it is handed them,
    calls the same functions and modules with the same arguments: none does something of its
    own (a branch on its index, an attribute of its own)."""
    shared: dict[int, torch.Tensor] = {}
    first_log = None
    for layer, (leaves, spec, _) in list(zip(layers, calls))[1:]:
        inputs = [_meta_like(x, shared) if isinstance(x, torch.Tensor) else x for x in leaves]
        labels = {id(t): ("input", k) for k, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        modules = {id(m): name for name, m in layer.named_modules()}
        for name, t in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]:
            labels[id(t)] = ("state", name)
        mode = _Calls(labels)

        def note(module: nn.Module, args: Any, _mode: _Calls = mode) -> None:
            _mode.log.append(("module", modules.get(id(module), ("other", id(module)))))

        args, kwargs = pytree.tree_unflatten(inputs, spec)
        hook = nn.modules.module.register_module_forward_pre_hook(note)
        try:
            with mode:
                layer(*args, **kwargs)
        finally:
            hook.remove()
        if first_log is not None and mode.log != first_log:
            raise _NotIdentical("a layer runs other ops than the others")
        if first_log is None:
            first_log = mode.log


def _meta_like(x: torch.Tensor, shared: dict[int, torch.Tensor]) -> torch.Tensor:
    """A meta tensor shaped as ``x`` (one per tensor all layers share: shared stays shared)."""
    if id(x) not in shared:
        shared[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta",
                                            requires_grad=x.requires_grad)
    return shared[id(x)]


# --- the copy --------------------------------------------------------------------------------

def _split(name: str) -> tuple[str, int]:
    """fx's numbering of a name: ``linear_7`` -> ("linear", 7), ``silu`` -> ("silu", 0)."""
    match = _SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _numbered(base: str, number: int) -> str:
    return base if number == 0 else f"{base}_{number}"


def _stamp(ep: Any, container: str, count: int) -> Any:
    """``ep`` (``TRACED`` layers) with layers ``TRACED``.. ``count - 1`` copied from the last,
    once the same rule is shown to rebuild ``ep`` itself from its first ``TRACED - 1`` layers."""
    rebuilt = _copied(ep, container, TRACED - 2, TRACED)
    if not _same_program(rebuilt, ep):
        raise _NotIdentical("the copy rule does not rebuild the traced layers")
    return _copied(ep, container, TRACED - 1, count)


def _copied(ep: Any, container: str, template: int, count: int) -> Any:
    """``ep``'s program with layers ``template + 1``.. ``count - 1`` copies of layer ``template``:
    each name numbered on by as many as one layer adds to its base, placeholders and module paths
    renamed to the layer's index, arguments from the layer before read from the copy before."""
    gm = ep.graph_module
    before, layers, after = _parts(gm, container, TRACED)
    previous, copied = layers[template - 1], layers[template]
    if len(previous) != len(copied) or any(
            n.op != "call_function" or isinstance(n.target, torch._ops.HigherOrderOperator) for n in copied):
        raise _NotIdentical("the layers' nodes differ in number or kind")
    _check_numbering([n for layer in layers for n in layer] + after)
    step = _steps(previous, copied, lambda n: n.name)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs, stamped_inputs = _placeholders(ep, graph, env, container, template, count)

    def copy_as_is(node: fx.Node) -> None:
        env[node] = graph.node_copy(node, lambda a: env[a])

    for node in before + [n for layer in layers[:template + 1] for n in layer]:
        copy_as_is(node)
    position = {n: k for k, n in enumerate(copied)}
    before_position = {n: k for k, n in enumerate(previous)}
    last = [env[n] for n in copied]
    for j in range(template + 1, count):
        made: list[fx.Node] = []

        def read(a: fx.Node, _made: list = made, _last: list = last, _j: int = j) -> fx.Node:
            if a in position:
                return _made[position[a]]
            if a in before_position:
                return _last[before_position[a]]
            if a in stamped_inputs:
                return stamped_inputs[a][_j]
            if _node_layer(a, container) is not None:
                raise _NotIdentical("a layer reads a layer other than the one before it")
            return env[a]

        for node in copied:
            made.append(_create(graph, node, read, _renumbered(node.name, step, j - template),
                                _moved_meta(node.meta, container, template, j)))
        last = made
    final = {n: last[k] for k, n in enumerate(layers[-1])}
    layer_nodes = {n for layer in layers for n in layer}

    def read_after(a: fx.Node) -> fx.Node:
        if a in final:
            return final[a]
        if a in layer_nodes:
            raise _NotIdentical("the code after the layers reads a layer before the last")
        return env[a]

    for node in after:
        env[node] = _create(graph, node, read_after, _renumbered(node.name, step, count - TRACED),
                            dict(node.meta))
    out = _output(ep)
    env[out] = graph.output(fx.map_arg(out.args[0], read_after), out.type)
    env[out].meta = dict(out.meta)
    outputs = pytree.tree_leaves(out.args[0])
    new_outputs = pytree.tree_leaves(env[out].args[0])
    names = {o.name: n.name for o, n in zip(outputs, new_outputs) if isinstance(o, fx.Node)}
    output_specs = [OutputSpec(kind=s.kind, arg=TensorArgument(name=names.get(s.arg.name, s.arg.name)), target=s.target)
                    if isinstance(s.arg, TensorArgument) else s for s in ep.graph_signature.output_specs]
    return types.SimpleNamespace(graph_module=fx.GraphModule(gm, graph), constants=ep.constants, call_spec=ep.call_spec,
                                 graph_signature=ExportGraphSignature(specs, output_specs))


def _check_numbering(nodes: list[fx.Node]) -> None:
    """Each base's numbers, over the layers and what follows them, in graph order and without a
    gap: no hidden name (a node made and removed) that copies would have to number past."""
    seen: dict[str, int] = {}
    for node in nodes:
        base, number = _split(node.name)
        if base in seen and number != seen[base] + 1:
            raise _NotIdentical(f"{node.name} is not numbered on from {_numbered(base, seen[base])}")
        seen[base] = number


def _steps(previous: list[fx.Node], copied: list[fx.Node], name_of: Callable[[fx.Node], str]) -> dict[str, int]:
    """How far one layer moves each base's numbers on (the same for every node of a base)."""
    step: dict[str, int] = {}
    for a, b in zip(previous, copied):
        (base_a, na), (base_b, nb) = _split(name_of(a)), _split(name_of(b))
        if base_a != base_b or step.setdefault(base_a, nb - na) != nb - na:
            raise _NotIdentical(f"{name_of(a)} and {name_of(b)} are not one node of two layers")
    return step


def _renumbered(name: str, step: dict[str, int], layers: int) -> str:
    base, number = _split(name)
    return _numbered(base, number + layers * step.get(base, 0))


def _moved_meta(meta: dict, container: str, old: int, new: int) -> dict:
    """A copied node's meta, its module paths in layer ``new`` (export's ``torch_fn``, which no
    pass reads, is left as copied: ``capture`` drops it, since its numbers skip where names do not)."""
    moved = dict(meta)
    moved["nn_module_stack"] = {_moved_path(key, container, old, new): (_moved_path(path, container, old, new), kind)
                                for key, (path, kind) in meta["nn_module_stack"].items()}
    return moved


def _moved_path(path: str, container: str, old: int, new: int) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.7.mlp`` (also inside export's ``L__self__...`` keys)."""
    return re.sub(rf"(^|__){re.escape(container)}\.{old}(?=\.|$)", lambda m: f"{m.group(1)}{container}.{new}", path)


def _create(graph: fx.Graph, node: fx.Node, read: Callable, name: str, meta: dict) -> fx.Node:
    made = graph.create_node(node.op, node.target, fx.map_arg(node.args, read), fx.map_arg(node.kwargs, read),
                             name=name, type_expr=node.type)
    if made.name != name:
        raise _NotIdentical(f"{name} is taken")
    made.meta = meta
    return made


def _placeholders(ep: Any, graph: fx.Graph, env: dict, container: str, template: int,
                  count: int) -> tuple[list, dict[fx.Node, dict[int, fx.Node]]]:
    """The program's inputs: those of layers after ``template`` left out, and ``template``'s
    repeated for each copy right after its own, named as export names them (``p_<path>``)."""
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    specs = list(ep.graph_signature.input_specs)
    layer_of = [_layer_index(s.target, container) if s.target else None for s in specs]
    mine = [k for k, i in enumerate(layer_of) if i == template]
    if any(specs[k].kind not in (InputKind.PARAMETER, InputKind.BUFFER) for k in mine):
        raise _NotIdentical("a layer has inputs other than parameters and buffers (a lifted constant)")
    old, stamped_inputs, kept = container.replace(".", "_") + f"_{template}_", {}, []
    for k, spec in enumerate(specs):
        if layer_of[k] is not None and layer_of[k] > template:
            continue
        env[nodes[spec.arg.name]] = graph.placeholder(spec.arg.name, nodes[spec.arg.name].type)
        env[nodes[spec.arg.name]].meta = dict(nodes[spec.arg.name].meta)
        kept.append(spec)
        if mine and k == mine[-1]:
            for j in range(template + 1, count):
                for m in mine:
                    source = specs[m]
                    if source.arg.name.count(old) != 1:
                        raise _NotIdentical(f"cannot rename {source.arg.name} for layer {j}")
                    name = source.arg.name.replace(old, container.replace(".", "_") + f"_{j}_")
                    node = graph.placeholder(name, nodes[source.arg.name].type)
                    if node.name != name:
                        raise _NotIdentical(f"{name} is taken")
                    node.meta = dict(nodes[source.arg.name].meta)
                    stamped_inputs.setdefault(nodes[source.arg.name], {})[j] = node
                    kept.append(type(source)(kind=source.kind, arg=TensorArgument(name=name),
                                             target=_moved_path(source.target, container, template, j),
                                             persistent=source.persistent))
    if mine and mine != list(range(mine[0], mine[-1] + 1)):
        raise _NotIdentical("a layer's inputs are not side by side")
    return kept, stamped_inputs


def _same_program(a: Any, b: Any) -> bool:
    """Same nodes (names, ops, arguments, meta but ``torch_fn``), inputs and outputs."""
    def nodes(gm: fx.GraphModule) -> list[tuple]:
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), _val(n),
                 {k: v for k, v in n.meta.items() if k not in ("val", "torch_fn")}) for n in gm.graph.nodes]

    return (nodes(a.graph_module) == nodes(b.graph_module)
            and [str(s) for s in a.graph_signature.input_specs] == [str(s) for s in b.graph_signature.input_specs]
            and [str(s) for s in a.graph_signature.output_specs] == [str(s) for s in b.graph_signature.output_specs])
