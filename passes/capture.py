"""Capture: an ``nn.Module`` and example inputs -> an ATen-level ``fx.GraphModule``.

``torch.export`` (non-strict, train mode) traces the model (a meta model of many identical
layers: a few of them, the rest copied by ``autopar.passes.capture_stamp`` as export would
make them, or the whole model wherever they are not shown alike); the graph is kept at the
pre-dispatch ATen level (``linear``, ``layer_norm``, ``scaled_dot_product_attention``
stay whole, which is the level sharding rules are written for). Then:

- parameters, buffers and constants are placeholders known by their qualified names;
- no-grad regions (``wrap_with_set_grad_enabled`` sub-graphs, e.g. rotary tables) are
  inlined, their nodes tagged ``meta["autopar_no_grad"]``;
- ``_assert_tensor_metadata`` checks, which return nothing, are dropped;
- a tied parameter (one tensor under two names) becomes one placeholder;
- an in-place op whose mutated input nothing reads afterwards becomes its functional twin;
- a mean cross-entropy becomes sum / count, so that both can be split across devices;
- a ``reshape`` that must copy (its input's strides allow no view: grouped-query attention's
  ``repeat_kv`` of an expanded key or value) reads a ``clone`` of its input, so that the copy
  is an op of its own, priced where it runs;
- a mixture-of-experts region (transformers' grouped-matmul experts) becomes one
  ``autopar::moe_experts`` op (``autopar.passes.capture_moe``), which can split tokens and
  experts on one axis (all-to-all dispatch).

Works on meta-device models: nothing is allocated. Hugging Face models are taken as
they are: the key-value cache is switched off while tracing, and ``ModelOutput``
results are kept as a pytree spec so that outputs can be rebuilt.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx.config
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.passes.capture_moe import fuse_moe_experts
from autopar.passes.capture_stamp import stamped_export


@dataclass
class Captured:
    """A captured model. Placeholders of ``gm`` appear in ``placeholders`` order."""

    gm: fx.GraphModule
    placeholders: list[str]
    params: dict[str, str] = field(default_factory=dict)  # placeholder name -> qualified name
    buffers: dict[str, str] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)
    constant_values: dict[str, torch.Tensor] = field(default_factory=dict)  # lifted by export
    user_inputs: list[str] = field(default_factory=list)
    user_outputs: list[int] = field(default_factory=list)  # positions among the graph's outputs
    out_spec: Any = None  # pytree spec of the model's own output structure
    in_spec: Any = None  # pytree spec of (positional inputs, keyword inputs), as exported
    model_name: str = ""
    # how many times a training step runs this program: the micro-batches it accumulates
    # (``train_step(accumulate=k)`` on a batch k times the one captured), their gradients synced once
    accumulate: int = 1

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def nodes(self, op: str | None = None) -> Iterator[fx.Node]:
        return (n for n in self.gm.graph.nodes if op is None or n.op == op)

    def state_values(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Placeholder name -> tensor, for every parameter, buffer and constant."""
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
        values = {}
        for ph, fqn in {**self.params, **self.buffers}.items():
            values[ph] = named[fqn]
        values.update(self.constant_values)
        return values

    def keyword_names(self) -> list[str]:
        """The keyword inputs of the example, in the order their tensors are placeholders."""
        return list(self.in_spec.child(1).context) if self.in_spec is not None else []

    def flatten_inputs(self, args: tuple, kwargs: dict | None = None) -> list[Any]:
        """The tensors of ``model(*args, **kwargs)`` in ``user_inputs`` order (keyword
        inputs as named in the example, in any order)."""
        kwargs = kwargs or {}
        names = self.keyword_names()
        if set(kwargs) != set(names):
            extra, missing = sorted(set(kwargs) - set(names)), sorted(set(names) - set(kwargs))
            remedy = "; ".join(
                ([f"leave out {', '.join(extra)}, or compile with {' and '.join(extra)} in example_kwargs (the plan "
                  "and program are made for the example's inputs)"] if extra else [])
                + ([f"pass {', '.join(missing)} as at compile time"] if missing else []))
            raise ValueError(
                f"autopar: expected the keyword inputs {names}, as in example_kwargs; found {sorted(kwargs)}; {remedy}"
            )
        return pytree.tree_leaves(args) + pytree.tree_leaves([kwargs[k] for k in names])

    def placeholder_values(self, model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None) -> list[Any]:
        values = self.state_values(model)
        flat_inputs = self.flatten_inputs(inputs, kwargs)
        values.update(zip(self.user_inputs, flat_inputs))
        return [values[name] for name in self.placeholders]

    def run(self, model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None) -> Any:
        """Run the captured graph with the model's current weights; returns the model's
        own output structure (a ``ModelOutput`` for Hugging Face models)."""
        flat = self.gm(*self.placeholder_values(model, inputs, kwargs))
        return self.unflatten_outputs(flat)

    def unflatten_outputs(self, flat: Any) -> Any:
        flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        user = [flat[i] for i in self.user_outputs]
        return pytree.tree_unflatten(user, self.out_spec) if self.out_spec is not None else user


@contextlib.contextmanager
def _huggingface_quirks(model: torch.nn.Module):
    """Hugging Face causal LMs put a DynamicCache in their output unless use_cache is off."""
    config = getattr(model, "config", None)
    had = config is not None and hasattr(config, "use_cache")
    old = config.use_cache if had else None
    if had:
        config.use_cache = False
    try:
        yield
    finally:
        if had:
            config.use_cache = old


@contextlib.contextmanager
def _without_stack_traces():
    """torch.export without a Python stack trace per node: nothing here reads them, and
    recording them is about a seventh of an export (12.1 -> 10.5 CPU s for 80 Llama layers).
    A torch older than the pinned one (a GPU user's own build) has no such switch: it records them."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    old = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = old


# draws on the host that a trace would bake into the program as constants
_HOST_DRAWS = {
    "numpy.random": ("rand", "randn", "random", "random_sample", "randint", "choice", "uniform", "normal",
                     "permutation", "shuffle", "binomial"),
    "random": ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss"),
}


@contextlib.contextmanager
def _host_draws_noted(found: list[str]) -> Iterator[None]:
    """Inside: every draw of ``numpy.random`` or ``random`` made by code outside torch is
    noted in ``found`` (its function and the caller's file and line)."""
    patched = []
    for module_name, names in _HOST_DRAWS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            original = getattr(module, name)

            def noting(*args, _original=original, _name=f"{module_name}.{name}", **kwargs):
                caller = traceback.extract_stack(limit=2)[0]
                if f"{os.sep}torch{os.sep}" not in caller.filename:
                    found.append(f"{_name} at {caller.filename}:{caller.lineno}")
                return _original(*args, **kwargs)

            setattr(module, name, noting)
            patched.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _host_draws_message(model: torch.nn.Module, found: list[str]) -> str:
    return (
        f"autopar: {type(model).__name__} drew random numbers on the host while it was captured "
        f"({'; '.join(dict.fromkeys(found))}); expected random values drawn by torch ops (torch.rand, dropout), "
        "which the runtime draws anew each step: a host draw is traced as a constant, and every step would reuse "
        "the same values. Switch that feature off for the run (e.g. Hugging Face's mask_time_prob=0 for "
        "SpecAugment) or draw with torch")


def capture(
    model: torch.nn.Module,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    train: bool = True,
) -> Captured:
    """Trace ``model(*example_inputs, **example_kwargs)`` into an ATen-level graph."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autopar: expected an nn.Module to capture, found {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            "autopar: expected example_inputs as a tuple of positional arguments, found "
            f"{type(example_inputs).__name__}; wrap a single tensor as (tensor,)"
        )
    example_inputs, example_kwargs = _on_the_weights_device(model, _distinct_tensors((example_inputs, example_kwargs or {})))
    was_training = model.training
    model.train(train)
    host_draws: list[str] = []

    def exported(m: torch.nn.Module) -> Any:
        return torch.export.export(m, example_inputs, example_kwargs, strict=False)

    try:
        with _huggingface_quirks(model), _without_stack_traces(), _host_draws_noted(host_draws):
            # many identical layers: a few exported, the rest copied (None where not shown identical)
            ep = stamped_export(model, exported) or exported(model)
    except Exception as exc:  # turned into one clear error that points at the model's code
        raise CaptureError(_capture_message(model, exc)) from exc
    finally:
        model.train(was_training)
    if host_draws:
        raise CaptureError(_host_draws_message(model, host_draws))
    captured = _from_exported(ep, type(model).__name__)
    _merge_tied_parameters(captured, model)
    for node in captured.gm.graph.nodes:  # export's per-function counter, read by nothing, that a stamped copy cannot
        node.meta.pop("torch_fn", None)   # number as export would (its assert checks' numbers skip)
    captured.gm.graph.lint()
    captured.gm.recompile()  # once, after every rewrite: Python code for 5,600 nodes takes a while
    return captured


class CaptureError(RuntimeError):
    pass


def on_device(captured: Captured, device: torch.device) -> Captured:
    """``captured`` with what it makes or moves onto a device made on ``device`` instead, in
    place (``retarget_devices``)."""
    retarget_devices(captured.gm, device)
    return captured


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """``gm`` with every device its ops name (``arange(device=...)``, ``x.to(device)``) made
    ``device``, in place: a program captured where the model's weights were (the meta device,
    or the host) that runs where the mesh is (a GPU under nccl, or fake tensors)."""
    def moved(v: Any) -> Any:
        return device if isinstance(v, torch.device) else v

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = tuple(moved(v) for v in node.args)
            node.kwargs = {k: moved(v) for k, v in node.kwargs.items()}
    gm.recompile()
    return gm


def _on_the_weights_device(model: torch.nn.Module, tree: Any) -> Any:
    """Inputs on another device than the model's weights (tokens already on the GPU, the model
    still on the host, where ``autopar.compile`` takes it) are traced on the weights' device:
    only their shapes, dtypes and values shape the program, not where they live. A meta model
    traces any inputs as they are."""
    weight = next(itertools.chain(model.parameters(), model.buffers()), None)
    if weight is None or weight.device.type == "meta":
        return tree
    return pytree.tree_map(
        lambda x: x.to(weight.device) if isinstance(x, torch.Tensor) and x.device != weight.device else x, tree)


def _distinct_tensors(tree: Any) -> Any:
    """One tensor given as two inputs (Hugging Face's ``labels=input_ids``) would be traced
    as one input feeding both: each later use gets its own copy, so each is an input."""
    seen: set[int] = set()

    def distinct(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    return pytree.tree_map(distinct, tree)


def _from_exported(ep: torch.export.ExportedProgram, model_name: str) -> Captured:
    gm = _numbered_afresh(ep.graph_module)
    sig = ep.graph_signature
    captured = Captured(gm=gm, placeholders=[], out_spec=ep.call_spec.out_spec, in_spec=ep.call_spec.in_spec,
                        model_name=model_name)
    kinds = {
        InputKind.PARAMETER: captured.params,
        InputKind.BUFFER: captured.buffers,
        InputKind.CONSTANT_TENSOR: captured.constants,
    }
    for spec in sig.input_specs:
        name = spec.arg.name
        captured.placeholders.append(name)
        if spec.kind in kinds:
            kinds[spec.kind][name] = spec.target
            if spec.kind == InputKind.CONSTANT_TENSOR:
                captured.constant_values[name] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            captured.user_inputs.append(name)
        else:
            raise CaptureError(
                f"autopar: the captured graph has an input of kind {spec.kind.name} "
                f"({name}), which autopar does not handle yet; expected parameters, buffers, "
                "constants and user inputs. Remove the custom-op side effects or file an issue."
            )
    captured.user_outputs = [
        i for i, spec in enumerate(sig.output_specs) if spec.kind == OutputKind.USER_OUTPUT
    ]
    _inline_no_grad_regions(gm)
    _drop_metadata_asserts(gm)
    _functionalize_inplace(gm)
    _mean_loss_as_sum_over_count(gm)
    _copying_reshapes(gm)
    fuse_moe_experts(gm)  # mixture-of-experts regions as one op: expert parallelism can dispatch all-to-all
    return captured


def _numbered_afresh(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its graph copied node by node, in order: names the rewrites below add are then
    numbered from the graph's own names, not also from names export made and removed (which a
    stamped graph, ``autopar.passes.capture_stamp``, never had)."""
    graph = fx.Graph()
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(graph.graph_copy(gm.graph, {}), output.type).meta = dict(output.meta)
    names = graph._graph_namespace
    for old, new in zip(gm.graph.nodes, graph.nodes):
        if new.name != old.name:  # fx renames what shadows a builtin (an input named `input`); export kept it
            names._used_names.add(old.name)
            names._obj_to_name[new] = new.name = old.name
    return fx.GraphModule(gm, graph)


def _inline_no_grad_regions(gm: fx.GraphModule) -> None:
    """Splice ``wrap_with_set_grad_enabled(False, body, *args)`` bodies into the graph."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node.target, "_name", "") != "wrap_with_set_grad_enabled":
            continue
        enabled, body_ref, *operands = node.args
        body = getattr(gm, body_ref.target)
        env: dict[fx.Node, Any] = {}
        outputs: Any = None
        placeholders = iter(operands)
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(placeholders)
                elif inner.op == "output":
                    outputs = fx.map_arg(inner.args[0], lambda n: env[n])
                else:
                    copied = gm.graph.node_copy(inner, lambda n: env[n])
                    if not enabled:
                        copied.meta["autopar_no_grad"] = True
                    env[inner] = copied
        outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                gm.graph.erase_node(user)
            else:
                raise CaptureError(
                    f"autopar: expected only indexing of the no-grad region {node.name}, "
                    f"found a use by {user.format_node()}; please file an issue with the model"
                )
        gm.graph.erase_node(node)
        gm.graph.erase_node(body_ref)
        delattr(gm, body_ref.target)


def _merge_tied_parameters(captured: Captured, model: torch.nn.Module) -> None:
    """One placeholder per parameter object: export lifts a tied weight (GPT-2's embedding
    and LM head) once per name, which would train two copies."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    placeholders = {n.name: n for n in captured.nodes("placeholder")}
    for ph, fqn in list(captured.params.items()):
        key = id(by_name[fqn])
        if key not in first:
            first[key] = ph
            continue
        keep = placeholders[first[key]]
        placeholders[ph].replace_all_uses_with(keep)
        captured.gm.graph.erase_node(placeholders[ph])
        captured.placeholders.remove(ph)
        del captured.params[ph]


# In-place ops whose result, not their mutated input, is what later nodes read.
_FUNCTIONAL = {
    "aten.detach_.default": torch.ops.aten.detach.default,
    "aten.div_.Tensor": torch.ops.aten.div.Tensor,
    "aten.mul_.Tensor": torch.ops.aten.mul.Tensor,
    "aten.add_.Tensor": torch.ops.aten.add.Tensor,
    "aten.sub_.Tensor": torch.ops.aten.sub.Tensor,
    "aten.index_put_.default": torch.ops.aten.index_put.default,
    "aten.masked_fill_.Scalar": torch.ops.aten.masked_fill.Scalar,
}


def _functionalize_inplace(gm: fx.GraphModule) -> None:
    """Swap an in-place op for its functional twin when nothing reads the mutated input
    afterwards: sharded programs then never write into a collective's output buffer."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        twin = _FUNCTIONAL.get(str(node.target)) if node.op == "call_function" else None
        if twin is None or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        if any(order[u] > order[node] for u in mutated.users if u is not node):
            continue
        node.target = twin


def _mean_loss_as_sum_over_count(gm: fx.GraphModule) -> None:
    """``cross_entropy(..., reduction="mean")`` -> sum of per-token losses / count of
    counted targets. The same number, but both parts can be split across devices and
    summed (a mean of ignore_index-dependent counts cannot), so data parallelism never
    has to gather the logits."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
            continue
        x, target, *rest = node.args
        weight = rest[0] if len(rest) > 0 else node.kwargs.get("weight")
        reduction = rest[1] if len(rest) > 1 else node.kwargs.get("reduction", 1)
        ignore_index = rest[2] if len(rest) > 2 else node.kwargs.get("ignore_index", -100)
        smoothing = rest[3] if len(rest) > 3 else node.kwargs.get("label_smoothing", 0.0)
        if reduction != 1 or weight is not None or target.meta["val"].is_floating_point():
            continue  # class weights or probability targets: left as they are
        with gm.graph.inserting_before(node):
            per_token = _meta_call(gm, aten.cross_entropy_loss.default, (x, target, None, 0, ignore_index, smoothing))
            total = _meta_call(gm, aten.sum.default, (per_token,))
            counted = _meta_call(gm, aten.ne.Scalar, (target, ignore_index))
            count = _meta_call(gm, aten.sum.default, (counted,), {"dtype": x.meta["val"].dtype})
            mean = _meta_call(gm, aten.div.Tensor, (total, count))
        mean.meta = {**node.meta, "val": mean.meta["val"]}
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)


def fuse_grouped_query_attention(gm: fx.GraphModule) -> None:
    """Attention reading Hugging Face's ``repeat_kv`` of its keys and values (each key-value
    head expanded and copied to its query heads: ``reshape(expand(unsqueeze(x, 2)))``) reads
    ``x`` itself with ``enable_gqa=True``: the same values, without the copy. Serving kernels
    read the cache's key-value heads as they lie; a decode step that copied the cache to every
    query head would move it ``query heads / key-value heads`` times over."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        sources = [_repeated_heads(a) for a in node.args[1:3]]
        if None in sources:
            continue
        copies = node.args[1:3]
        node.args = (node.args[0], *sources, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for copy in copies:  # the repeat's reshape, clone, expand and unsqueeze, where nothing else reads them
            while isinstance(copy, fx.Node) and copy.op == "call_function" and not copy.users:
                below = copy.args[0]
                gm.graph.erase_node(copy)
                copy = below


def _repeated_heads(node: Any) -> fx.Node | None:
    """``x`` where ``node`` is ``reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h * n, s, d])``
    (a ``clone`` between expand and reshape allowed), else None."""
    aten = torch.ops.aten
    if not isinstance(node, fx.Node) or node.target is not aten.reshape.default:
        return None
    expanded = node.args[0]
    if isinstance(expanded, fx.Node) and expanded.target is aten.clone.default:
        expanded = expanded.args[0]
    if not isinstance(expanded, fx.Node) or expanded.target is not aten.expand.default:
        return None
    unsqueezed = expanded.args[0]
    if not isinstance(unsqueezed, fx.Node) or unsqueezed.target is not aten.unsqueeze.default or unsqueezed.args[1] != 2:
        return None
    x = unsqueezed.args[0]
    b, h, s, d = x.meta["val"].shape
    n = expanded.meta["val"].shape[2]
    return x if tuple(node.meta["val"].shape) == (b, h * n, s, d) else None


def _copying_reshapes(gm: fx.GraphModule) -> None:
    """``reshape(x, shape)`` -> ``reshape(clone(x), shape)`` where ``x``'s strides allow no
    view: the same value, with the copy ``reshape`` makes at run time an op of its own (and
    still a ``reshape``, which copies again only where a resharded shard comes non-contiguous)."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.reshape.default:
            continue
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(x, torch.Tensor):
            continue
        try:
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(node.args[1])
            continue  # a view: nothing is copied
        except (RuntimeError, ValueError):  # (under a fake tensor mode, a ValueError)
            pass
        with gm.graph.inserting_before(node):
            copy = _meta_call(gm, aten.clone.default, (node.args[0],), {"memory_format": torch.contiguous_format})
            copy.meta = {**node.meta, "val": copy.meta["val"]}  # the reshape's module and layer: it runs there
            node.args = (copy, node.args[1])


def _meta_call(gm: fx.GraphModule, op: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new call node with meta["val"] worked out on meta tensors."""
    node = gm.graph.call_function(op, args, kwargs or {})

    def as_meta(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        return a

    node.meta["val"] = op(*fx.map_arg(args, as_meta), **(kwargs or {}))
    return node


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and str(node.target) == "aten._assert_tensor_metadata.default":
            gm.graph.erase_node(node)


_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(os.path.abspath(__file__))


def _capture_message(model: torch.nn.Module, exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f for f in frames
        if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_OUR_DIR)
        and "contextlib" not in f.filename
    ]
    where = ""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}"
    if user:
        f = user[-1]
        code = f"{f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"
        where = f" The failing model code is {code}."
        if frames and frames[-1] is f:  # raised by the user's own line, not by torch.export tracing it
            subject = getattr(model, "capture_subject", f"{type(model).__name__}.forward")
            return (f"autopar: {subject} raised {text}, at {code}; expected it to run on the example inputs "
                    f"(an error in that code, not a tracing limit); fix it there")
    hint = (
        "Make the forward traceable by torch.export: no Python branching on tensor values "
        "(use torch.where or torch.cond), no .item()/.tolist() feeding shapes, no in-place "
        "changes to module attributes; or pass example inputs of the shapes the model expects."
    )
    if "data-dependent" in str(exc).lower() or "GuardOnDataDependent" in type(exc).__name__:
        hint = (
            "The model branches on, or takes a shape from, a tensor's value; a plan is static (every "
            "step runs the same ops). Replace the Python branch with torch.where / torch.cond, or make "
            "that value a constant; a random draw that decides which ops run (LayerDrop, stochastic "
            "depth) cannot be planned: switch it off for training under autopar."
        )
        layerdrop = _layer_drop(model, exc, user[-1] if user else None)
        if layerdrop:
            hint = (f"set config.{layerdrop[0]}=0 (found {layerdrop[1]}: LayerDrop draws at random which "
                    "layers run, which a static plan cannot express).")
    return (
        f"autopar: could not capture {type(model).__name__} with torch.export "
        f"(expected a traceable forward; found {text}).{where} What to do: {hint}"
    )


def _layer_drop(model: torch.nn.Module, exc: Exception, failing: traceback.FrameSummary | None
                ) -> tuple[str, float] | None:
    """The config's LayerDrop, when the failing model code reads it in training: a Hugging Face
    config's ``layerdrop`` (``encoder_layerdrop``, ``decoder_layerdrop``) above 0 makes its
    forward draw ``torch.rand([])`` per layer and skip the layer in Python, a branch on a
    tensor's value. The model may be wrapped (with its loss)."""
    if failing is None or not model.training:
        return None
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename, tb.tb_lineno) != (failing.filename, failing.lineno):
        tb = tb.tb_next
    if tb is None or not any(name.endswith("layerdrop") for name in tb.tb_frame.f_code.co_names):
        return None
    for module in model.modules():
        config = getattr(getattr(module, "config", None), "__dict__", {})
        for name, value in sorted(config.items()):
            if name.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
                return name, value
    return None
