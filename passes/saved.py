"""Which values of a captured graph autograd keeps for backward.

An op's output costs activation memory only while some backward needs it: its own
(softmax keeps its output), or a consumer's (a linear keeps its input; an add keeps
nothing). Which inputs and outputs an op's backward saves is found by running the op
once on meta tensors of the node's shapes under ``saved_tensors_hooks`` and matching
the saved tensors to the arguments and results. A view keeps its base alive, so a kept
view keeps what it views.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
from torch import fx
from torch.utils import _pytree as pytree

VIEWS = {"aten.view.default", "aten.reshape.default", "aten.transpose.int", "aten.permute.default",
         "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.expand.default",
         "aten.slice.Tensor", "aten.select.int", "aten.t.default", "aten.alias.default",
         "aten.detach.default", "aten.contiguous.default", "aten._unsafe_view.default",
         "aten.flatten.using_ints", "aten.unflatten.int", "aten.split.Tensor", "aten.chunk.default"}
# the CPU/GPU flash kernels keep q, k, v and the output (meta runs the math path instead)
ATTENTION = {"aten.scaled_dot_product_attention.default": ({0, 1, 2}, True)}


def saved_roles(node: fx.Node, cache: dict) -> tuple[set[int], bool] | None:
    """(positions of the tensor inputs its backward saves, whether it saves its output);
    None when the op cannot run on meta tensors (the caller assumes the output is kept)."""
    name = str(node.target)
    if name in ATTENTION:
        return ATTENTION[name]
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    key = (name, str(spec), tuple(_signature(a) for a in flat))
    if key not in cache:
        cache[key] = _probe(node.target, flat, spec)
    return cache[key]


def _signature(a: Any) -> Any:
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)
    return repr(a)


def _probe(target, flat: list, spec) -> tuple[set[int], bool] | None:
    args, tensors = [], []
    for a in flat:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if not isinstance(val, torch.Tensor):
                args.append(val)
                continue
            t = torch.empty(val.shape, dtype=val.dtype, device="meta").requires_grad_(val.dtype.is_floating_point)
            tensors.append(t)
            args.append(t)
        else:
            args.append(a)
    kept: list[torch.Tensor] = []
    call_args, call_kwargs = pytree.tree_unflatten(args, spec)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = target(*call_args, **call_kwargs)
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run: assume the worst
        return None
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    inputs = {i for i, t in enumerate(tensors) if any(_same(k, t) for k in kept)}
    return inputs, any(_same(k, o) for k in kept for o in outs)


def _same(saved: torch.Tensor, value: torch.Tensor) -> bool:
    """``saved`` is ``value`` or a view of it (a matmul on 3-D input saves its 2-D view)."""
    base = value._base if value._base is not None else value
    return saved is value or saved is base or saved._base is base


def kept_for_backward(graph_nodes, on_grad_path: set[fx.Node], held: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """The nodes (of ``graph_nodes``, in graph order) whose output some backward keeps;
    ``held``: nodes kept for another reason (a checkpointed layer's inputs)."""
    cache: dict = {}
    kept: set[fx.Node] = set(held)
    nodes = [n for n in graph_nodes if n.op == "call_function"]
    for node in nodes:
        if node not in on_grad_path and not any(u in on_grad_path for u in node.users):
            continue
        if node.target is operator.getitem:
            continue
        roles = saved_roles(node, cache) if str(node.target) not in VIEWS else (set(), False)
        if roles is None:
            kept.add(node)
            continue
        inputs, output = roles
        if output:
            kept.add(node)
        sources = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        for i in inputs:
            if i < len(sources):
                kept.add(sources[i])
    # what the graph returns lives until the loss's backward has read it
    for node in graph_nodes:
        if node.op == "output":
            kept.update(a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node))
    return keep_bases(graph_nodes, kept)


def keep_bases(graph_nodes, kept: set[fx.Node]) -> set[fx.Node]:
    """``kept`` and what its views (and getitems) view: a kept view keeps its base, so walk
    back to what holds the memory (a new set)."""
    kept = set(kept)
    for node in reversed([n for n in graph_nodes if n.op == "call_function"]):
        if node in kept and (str(node.target) in VIEWS or node.target is operator.getitem):
            kept.add(node.args[0])
    return kept
