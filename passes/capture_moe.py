"""Mixture-of-experts regions of a captured graph as one op each (``autopar::moe_experts``).

transformers' grouped-matmul experts capture as some thirty ops: the flattened top-k ids
sorted by expert, the rows gathered by ``perm // k``, ``histc`` and ``cumsum`` for the
offsets, two grouped matmuls around ``silu(gate) * up``, the rows weighted, put back by the
inverse permutation, and summed per token. Op by op, the routing is whole: ``sort`` has only
a replicated strategy, so every rank of an expert-parallel axis needs every token. As one
op, the region can be split as a whole (``autopar.passes.rules.moe_experts``): tokens and
experts split on the same axis is expert parallelism with all-to-all dispatch.

:func:`fuse_moe_experts` finds each region from its first grouped matmul, checks every link
of the pattern, and replaces the region's output with one call; a region that differs
anywhere is left as it is (its ops keep their own rules).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar.passes.rules.moe import GROUPED_MM_OPS
from autopar.passes.rules.moe_experts import MOE_EXPERTS

aten = torch.ops.aten


def fuse_moe_experts(gm: fx.GraphModule) -> int:
    """Replace every recognised experts region of ``gm`` by one ``moe_experts`` call; returns
    how many. The graph is linted; the caller recompiles."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and str(node.target) in GROUPED_MM_OPS and node.graph is gm.graph:
            region = match_region(node)
            if region is not None:
                _replace(gm, region)
                fused += 1
    if fused:
        gm.graph.lint()
    return fused


class Region:
    """The values an experts region reads and the node that holds its result."""

    def __init__(self, hidden, ids, weights, w_gate_up, w_down, grouped_mm: str, output: fx.Node):
        self.hidden, self.ids, self.weights = hidden, ids, weights
        self.w_gate_up, self.w_down, self.grouped_mm, self.output = w_gate_up, w_down, grouped_mm, output


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _through_casts(node):
    """``node``'s source past ``to`` casts (the region casts to the weights' dtype)."""
    while _is(node, aten.to.dtype, aten._to_copy.default):
        node = node.args[0]
    return node


def _only_user(node: fx.Node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def match_region(up: fx.Node) -> Region | None:
    """The experts region whose first grouped matmul is ``up``, or None where any link differs."""
    try:
        return _match(up)
    except (IndexError, AttributeError, TypeError, KeyError):
        return None


def _match(up: fx.Node) -> Region | None:
    x, w_gate_up, offs = up.args[:3]
    if len(up.args) > 3 or up.kwargs:
        return None  # a bias: not this pattern
    gathered = _through_casts(x)
    if not _is(gathered, aten.index.Tensor):
        return None
    hidden, (row_token,) = gathered.args
    if not _is(row_token, aten.floor_divide.default):
        return None
    perm, k = row_token.args
    ids_sorted = _sorted_ids(perm)
    if ids_sorted is None or not _offsets_of(offs, ids_sorted):
        return None
    flat_ids = perm.args[0].args[0]  # getitem(sort(reshape(ids)), 1)
    if not _is(flat_ids, aten.reshape.default, aten.view.default):
        return None
    ids = flat_ids.args[0]
    act = _gated_activation(up)
    if act is None:
        return None
    down = _only_user(act)
    down = _only_user(down) if _is(down, aten.to.dtype) else down
    if down is None or str(down.target) != str(up.target) or down.args[2] is not offs or _through_casts(down.args[0]) is not act:
        return None
    weights, output = _combined(down, perm)
    if weights is None or ids.meta["val"].shape[-1] != k or output.meta["val"].dtype != hidden.meta["val"].dtype:
        return None
    return Region(hidden, ids, weights, w_gate_up, down.args[1], str(up.target), output)


def _sorted_ids(perm):
    """The sort's values beside ``perm`` = ``getitem(sort(flat_ids), 1)``."""
    if not (_is(perm, operator.getitem) and perm.args[1] == 1 and _is(perm.args[0], aten.sort.default)):
        return None
    values = [u for u in perm.args[0].users if _is(u, operator.getitem) and u.args[1] == 0]
    return values[0] if len(values) == 1 else None


def _offsets_of(offs, ids_sorted) -> bool:
    """``offs = cumsum(histc(ids_sorted as float))``."""
    if not _is(offs, aten.cumsum.default) or offs.args[1] != 0:
        return False
    histc = offs.args[0]
    return _is(histc, aten.histc.default) and _through_casts(histc.args[0]) is ids_sorted


def _gated_activation(up: fx.Node):
    """``silu(gate) * up`` of ``chunk(up_out, 2, -1)``; the product node."""
    chunk = _only_user(up)
    if not _is(chunk, aten.chunk.default) or chunk.args[1] != 2 or chunk.args[2] not in (-1, 1):
        return None
    halves = {u.args[1]: u for u in chunk.users if _is(u, operator.getitem)}
    if set(halves) != {0, 1}:
        return None
    silu = _only_user(halves[0])
    product = _only_user(silu) if _is(silu, aten.silu.default) else None
    if not _is(product, aten.mul.Tensor) or set(product.args) != {silu, halves[1]}:
        return None
    return product


def _combined(down: fx.Node, perm: fx.Node):
    """(per-token weights [T, k], the region's output) from ``down``: rows weighted by
    ``flat_weights[perm]``, put back by perm's inverse, viewed [T, k, H], summed over k."""
    weighted = _only_user(down)
    if not _is(weighted, aten.mul.Tensor) or weighted.args[0] is not down:
        return None, None
    unsqueezed = weighted.args[1]
    row_weights = unsqueezed.args[0] if _is(unsqueezed, aten.unsqueeze.default) else None
    if not _is(row_weights, aten.index.Tensor) or list(row_weights.args[1]) != [perm]:
        return None, None
    flat_weights = row_weights.args[0]
    if not _is(flat_weights, aten.reshape.default, aten.view.default):
        return None, None
    back = _only_user(weighted)
    if not _is(back, aten.index.Tensor) or not _inverse_of(back.args[1][0], perm):
        return None, None
    viewed = _only_user(back)
    summed = _only_user(viewed) if _is(viewed, aten.view.default, aten.reshape.default) else None
    if not _is(summed, aten.sum.dim_IntList) or list(summed.args[1]) != [1]:
        return None, None
    cast = _only_user(summed)
    return flat_weights.args[0], cast if _is(cast, aten.to.dtype) else summed


def _inverse_of(node, perm) -> bool:
    """``index_put(empty_like(perm), [perm], arange(n))``: the inverse permutation."""
    return _is(node, aten.index_put.default, aten.index_put_.default) and list(node.args[1]) == [perm] \
        and _is(node.args[0], aten.empty_like.default) and _is(node.args[2], aten.arange.default, aten.arange.start)


def _replace(gm: fx.GraphModule, region: Region) -> None:
    graph = gm.graph
    with graph.inserting_before(region.output):
        call = graph.call_function(MOE_EXPERTS, (region.hidden, region.ids, region.weights, region.w_gate_up,
                                                 region.w_down, region.grouped_mm))
    call.meta = dict(region.output.meta)  # the same value: shape, dtype, module path
    region.output.replace_all_uses_with(call)
    _erase_dead(graph, region.output)


def _erase_dead(graph: fx.Graph, start: fx.Node) -> None:
    """Erase ``start`` and, going back, every node of the region left without users."""
    stack = [start]
    while stack:
        node = stack.pop()
        if node.op != "call_function" or node.users:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)
