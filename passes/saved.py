"""Which values of a captured graph autograd keeps for backward, and in which placement.

An op's output costs activation memory only while some backward needs it: its own
(softmax keeps its output), or a consumer's (a linear keeps its input; an add keeps
nothing). Which inputs and outputs an op's backward saves is found by running the op
once on meta tensors of the node's shapes, with ``requires_grad`` where the graph's
values carry a gradient (``mul(x, cos)`` keeps ``cos`` only: no gradient flows to
``cos``), under ``saved_tensors_hooks``, and matching the saved tensors to the arguments
and results. Attention runs on fake CPU tensors instead, so that torch picks the kernel
the dry run runs (its logsumexp and a boolean mask's converted copy are saved too).

A consumer saves its input as it reads it: where the plan moves a value to another
placement for it (an all-gather before a column-parallel matmul), the moved copy is what
backward keeps, not the producer's shard. So a saved input is charged to its consumer
(``SavedValues.reads``), at the placement the consumer's strategy needs; what an op keeps
of its own output (and what the graph returns) is charged to the producer
(``SavedValues.held``). Readers that save one value share its bytes: where they read it in
one placement (as codegen shares a move among them, or all in place) that is one copy.
A view keeps its base alive, so a kept view keeps what it views; a ``reshape`` or
``contiguous`` that cannot view its input (an expanded or transposed one) is a copy.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterable, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

VIEWS = {"aten.view.default", "aten.reshape.default", "aten.transpose.int", "aten.permute.default",
         "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.expand.default",
         "aten.slice.Tensor", "aten.select.int", "aten.t.default", "aten.alias.default",
         "aten.detach.default", "aten.contiguous.default", "aten._unsafe_view.default",
         "aten.flatten.using_ints", "aten.unflatten.int", "aten.split.Tensor", "aten.chunk.default"}
# views whose result holds fewer (or more) elements than what they view: a kept one keeps the
# whole base, so its base is charged, not the view's own size
RESIZING_VIEWS = {"aten.expand.default", "aten.slice.Tensor", "aten.select.int", "aten.split.Tensor",
                  "aten.chunk.default"}
# views that copy where the input's strides do not allow a view (an expanded or transposed input)
MAYBE_COPIES = {"aten.reshape.default", "aten.contiguous.default", "aten.flatten.using_ints"}
VIEW_KEY = "autopar_is_view"  # node.meta: whether a MAYBE_COPIES node views its input
# kernels that torch picks by device: probed on fake CPU tensors, as the dry run runs them
BY_DEVICE = {"aten.scaled_dot_product_attention.default"}


class Roles(NamedTuple):
    """What an op's backward saves: ``inputs`` (position of a tensor input -> bytes saved per
    byte of that input: 1 for the input itself, other for a tensor it makes from it, such as
    attention's logsumexp or a boolean mask converted to the query's dtype), and whether it
    saves its ``output``."""

    inputs: dict[int, float]
    output: bool


def saved_roles(node: fx.Node, cache: dict, grad: tuple[bool, ...] | None = None) -> Roles | None:
    """What ``node``'s backward saves (``Roles``), with ``grad[i]``: whether tensor input i
    carries a gradient (default: every float one); None when the op cannot run on meta
    tensors (the caller assumes the output is kept)."""
    name = str(node.target)
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    key = (name, str(spec), tuple(_signature(a) for a in flat), grad)
    if key not in cache:
        cache[key] = _probe(node.target, flat, spec, grad, by_device=name in BY_DEVICE)
    return cache[key]


def _signature(a: Any) -> Any:
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)
    return repr(a)


@torch.enable_grad()  # what autograd saves, whatever grad mode the caller plans under (an eval forward's no_grad)
def _probe(target, flat: list, spec, grad: tuple[bool, ...] | None, by_device: bool) -> Roles | None:
    mode = FakeTensorMode() if by_device else contextlib.nullcontext()
    device = "cpu" if by_device else "meta"
    with mode:
        args, tensors = [], []
        for a in flat:
            val = a.meta.get("val") if isinstance(a, fx.Node) else None
            if not isinstance(val, torch.Tensor):
                args.append(val if isinstance(a, fx.Node) else a)
                continue
            wants = val.dtype.is_floating_point and (grad is None or grad[len(tensors)])
            t = torch.empty(val.shape, dtype=val.dtype, device=device).requires_grad_(wants)
            tensors.append(t)
            args.append(t)
        kept: list[torch.Tensor] = []
        call_args, call_kwargs = pytree.tree_unflatten(args, spec)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
                out = target(*call_args, **call_kwargs)
        except Exception:  # noqa: BLE001 - an op meta tensors cannot run: assume the worst
            return None
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    inputs: dict[int, float] = {}
    for k in kept:
        if any(_same(k, o) for o in outs):
            continue
        i = next((i for i, t in enumerate(tensors) if _same(k, t)), None)
        if i is not None:
            inputs[i] = max(inputs.get(i, 0.0), 1.0)
        elif tensors:  # made by the op from an input: charged per byte of the input its shape matches
            j = next((j for j, t in enumerate(tensors) if t.shape == k.shape), 0)
            inputs[j] = inputs.get(j, 0.0) + _nbytes(k) / max(_nbytes(tensors[j]), 1)
    return Roles(inputs, any(_same(k, o) for k in kept for o in outs))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same(saved: torch.Tensor, value: torch.Tensor) -> bool:
    """``saved`` is ``value`` or a view of it (a matmul on 3-D input saves its 2-D view)."""
    base = value._base if value._base is not None else value
    return saved is value or saved is base or saved._base is base


def is_view(node: fx.Node) -> bool:
    """``node``'s output shares its input's memory: a view op, less a ``reshape`` or
    ``contiguous`` whose input's strides make it a copy (checked on a meta tensor of them),
    and a cast to the dtype its input has."""
    name = str(node.target)
    if node.target is operator.getitem:
        return True
    if node.target is torch.ops.aten.to.dtype:  # ``x.to(x.dtype)`` is ``x`` itself, another dtype a copy
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        return isinstance(src, torch.Tensor) and node.meta.get("val") is not None and \
            node.meta["val"].dtype == src.dtype
    if name not in VIEWS:
        return False
    if name not in MAYBE_COPIES:
        return True
    if VIEW_KEY not in node.meta:  # worked out once per node: the planner asks for every costing
        node.meta[VIEW_KEY] = _views_its_input(node)
    return node.meta[VIEW_KEY]


def _views_its_input(node: fx.Node) -> bool:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return True
    x = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    try:
        out = node.target(x, *node.args[1:], **node.kwargs)
    except Exception:  # noqa: BLE001 - a view we cannot replay: as before, a view
        return True
    return out is x or out._base is x


class SavedValues(NamedTuple):
    """What backward keeps: ``held``, values kept in their producer's placement (an op's own
    output its backward saves, what the graph returns, what a checkpoint holds, the bases of
    kept views); ``reads``, per consumer, the inputs its backward saves as it reads them:
    (tensor input position, value, bytes per byte of that input in the consumer's placement,
    its share already applied)."""

    held: frozenset[fx.Node]
    reads: dict[fx.Node, tuple[tuple[int, fx.Node, float], ...]]


def saved_values(graph_nodes, on_grad_path: set[fx.Node], held: Iterable[fx.Node] = ()) -> SavedValues:
    """Where each kept value of ``graph_nodes`` is charged (``SavedValues``); ``held``: nodes
    kept for another reason (a checkpointed layer's inputs)."""
    graph_nodes = list(graph_nodes)
    cache: dict = {}
    kept: set[fx.Node] = set(held)
    reads: dict[fx.Node, list[tuple[int, fx.Node, float]]] = {}
    for node in (n for n in graph_nodes if n.op == "call_function"):
        if node not in on_grad_path and not any(u in on_grad_path for u in node.users):
            continue
        if is_view(node):
            continue
        sources = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        roles = saved_roles(node, cache, tuple(s in on_grad_path for s in sources))
        if roles is None:
            kept.add(node)
            continue
        if roles.output:
            kept.add(node)
        for i, per_byte in roles.inputs.items():
            src = sources[i] if i < len(sources) else None
            if src is None or src.op == "placeholder":  # state, or an input charged where it enters
                continue
            if per_byte == 1.0 and str(src.target) in RESIZING_VIEWS:  # keeps its base, where that lies
                kept.add(src)
                continue
            reads.setdefault(node, []).append((i, src, per_byte))
    # what the graph returns lives until the loss's backward has read it
    for node in graph_nodes:
        if node.op == "output":
            kept.update(a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node))
    kept = keep_bases(graph_nodes, kept)
    return SavedValues(frozenset(kept), _shared(graph_nodes, kept, reads))


def _shared(graph_nodes, held: set[fx.Node], reads: dict) -> dict:
    """Each read of a value itself (1 byte per byte) pays its share of one copy: the value's
    readers that save it, and its producer where it keeps it too, hold one tensor where they
    read it in one placement (in place, or one move that codegen shares among them)."""
    order = {n: i for i, n in enumerate(graph_nodes)}
    readers: dict[fx.Node, int] = {}
    for node_reads in reads.values():
        for _, src, per_byte in node_reads:
            if per_byte == 1.0:
                readers[root(src)] = readers.get(root(src), 0) + 1
    shared = {}
    for node, node_reads in sorted(reads.items(), key=lambda item: order[item[0]]):
        shared[node] = tuple(
            (i, src, per_byte if per_byte != 1.0 else 1.0 / (readers[root(src)] + (root(src) in held)))
            for i, src, per_byte in node_reads)
    return shared


def root(node: fx.Node) -> fx.Node:
    """What holds ``node``'s memory: back through the views that keep its size."""
    while node.op == "call_function" and str(node.target) not in RESIZING_VIEWS and is_view(node):
        node = node.args[0]
    return node


def keep_bases(graph_nodes, kept: set[fx.Node]) -> set[fx.Node]:
    """``kept`` and what its views (and getitems) view: a kept view keeps its base, so walk
    back to what holds the memory (a new set)."""
    kept = set(kept)
    for node in reversed([n for n in graph_nodes if n.op == "call_function"]):
        if node in kept and is_view(node):
            kept.add(node.args[0])
    return kept


def weight_gradient_starts(graph_nodes, trainable: Iterable[fx.Node], state: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """The ops where a split backward's weight gradients start: each reads a value made from
    ``trainable`` parameters alone (the parameter, or its cast or view) beside one made from
    the inputs. torch's input-gradient part (``stage_backward_input``) keeps the gradient of
    each one's output until the weight-gradient part starts from it. ``state``: placeholders
    that are neither (buffers, constants)."""
    from_weights, neutral = set(trainable), set(state)
    out = set()
    for node in graph_nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        weights = [i for i in inputs if i in from_weights]
        if not weights:
            continue
        if all(i in from_weights or i in neutral for i in inputs):
            from_weights.add(node)
        else:
            out.add(node)
    return out
