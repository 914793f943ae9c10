"""Memory of the loss that a plan made without one trains with.

A model planned alone (``autopar.plan(model, mesh, inputs)``, no ``loss_fn``) ends at its
outputs, yet every training step runs a loss over them: its own small program, laid out
from the outputs' placements (``autopar.runtime.loss.build_loss_program``). That program can hold
more than the model: a mean cross-entropy is never split over the class dim
(``autopar.passes.rules.loss``), so logits split over the vocabulary are gathered whole, their
log-softmax is kept for backward, and its backward makes two more tensors of that size.

The loss priced is the one ``autopar.dry_run`` trains a plan with when given none
(``default_loss``): cross-entropy against the input ids for a language model (first
output shaped ``ids.shape + (vocab,)``), else the first output's mean square. Its memory
per device, for one placement of the output, is measured, not modelled: the loss graph is
laid out as the runtime lays it out (``best_target_layout``), each op runs on fake tensors
of its local shapes, and torch's ``MemTracker`` reports the peak of the loss's forward and
backward by kind -- what its backward keeps (activations) and what exists only while it
runs (temporary: gradients being made, a gathered copy).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Partial, Replicate
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils import _pytree as pytree

from autopar.costmodels.precision import OUTPUT_DTYPE_KEY
from autopar.passes.capture import Captured, capture
from autopar.passes.placements import Spec, local_shape
from autopar.passes.propagate import choose_by_propagation, reshard_bytes
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph, tensor_inputs
from autopar.passes.op_strategies import TensorMeta


def _first_output(outputs: Any) -> torch.Tensor:
    return next(t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor))


def cross_entropy(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the first output's last dim (the classes) against ``target``."""
    logits = _first_output(outputs)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def mean_square(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    return (_first_output(outputs) - target).pow(2).mean()


def output_node(captured: Captured) -> fx.Node:
    """The node of the graph's first user output."""
    output = next(iter(captured.nodes("output")))
    outs = [n for n in pytree.tree_leaves(output.args[0]) if isinstance(n, fx.Node)]
    return outs[captured.user_outputs[0]]


def output_value(captured: Captured) -> torch.Tensor:
    """The fake value of the graph's first user output."""
    return output_node(captured).meta["val"]


def has_loss(captured: Captured) -> bool:
    """The graph ends in a loss: its first user output is one number."""
    return output_value(captured).numel() == 1


def default_loss(captured: Captured) -> tuple[Callable, torch.Tensor]:
    """(loss_fn, meta target) ``autopar.dry_run`` trains a whole-batch capture with when
    given no loss: cross-entropy against the first input's ids for a language model,
    else the mean square of the first output against a target shaped like it."""
    first = output_value(captured)
    placeholders = {n.name: n for n in captured.nodes("placeholder")}
    ids = placeholders[captured.user_inputs[0]].meta.get("val") if captured.user_inputs else None
    if (isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point and first.dim() == ids.dim() + 1
            and tuple(first.shape[:-1]) == tuple(ids.shape)):
        return cross_entropy, torch.empty(tuple(ids.shape), dtype=torch.long, device="meta")
    return mean_square, torch.empty(tuple(first.shape), dtype=first.dtype, device="meta")


class _LossOfFirst(nn.Module):
    """``loss_fn(first_output, target)`` as a module to capture."""

    def __init__(self, loss_fn: Callable):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)


def best_target_layout(graph: StrategyGraph, fixed: dict, target: fx.Node) -> dict[fx.Node, int]:
    """Lay the target out however makes the loss cheapest (usually: like the outputs' batch),
    and of layouts that move as little, the one that holds the least of it on a device (a
    replicated target moves nothing either, and holds all of it on every device): the choice
    the runtime's loss program makes (``autopar.runtime.loss.build_loss_program``)."""
    best, best_key = None, (math.inf, math.inf)
    meta = TensorMeta.of(target.meta["val"])
    for strategy in graph[target].strategies:
        choice = choose_by_propagation(graph, {**fixed, target: strategy.output})
        cost = 0.0
        for node, ns in graph.nodes.items():
            if ns.info is None:
                continue
            chosen = ns.strategies[choice[node]]
            for src, need in zip(tensor_inputs(node), chosen.inputs):
                spec = output_spec(graph, src, choice[src])
                cost += reshard_bytes(TensorMeta.of(src.meta["val"]), spec, need, graph.mesh_shape)
        key = (cost, math.prod(local_shape(meta.shape, strategy.output, graph.mesh_shape)))
        if key < best_key:
            best, best_key = choice, key
    return best


def output_spec(graph: StrategyGraph, node: fx.Node, index: int) -> Spec:
    ns = graph[node]
    chosen = ns.strategies[index]
    return chosen.outputs[ns.follows[1]] if ns.follows else chosen.output


@dataclass
class LossMemory:
    """Bytes per device the loss holds, by kind, for a placement of the model's first output:
    ``of(spec)`` -> {"activations": kept for its backward, "temporary": alive only while it runs}."""

    graph: StrategyGraph
    output: fx.Node
    target: fx.Node
    _priced: dict[Spec, dict[str, float]] = field(default_factory=dict)
    _measured: dict[tuple, dict[str, float]] = field(default_factory=dict)  # by ``_local_run``

    def of(self, spec: Spec) -> dict[str, float]:
        # an output that is a pending sum is summed before the loss reads it (codegen's
        # reduce_outputs): the loss sees it replicated on that axis
        spec = tuple(Replicate() if isinstance(p, Partial) else p for p in spec)
        if spec not in self._priced:
            choice = best_target_layout(self.graph, {self.output: spec}, self.target)
            run = _local_run(self.graph, choice)
            if run not in self._measured:
                self._measured[run] = _measure(self.graph, choice)
            self._priced[spec] = self._measured[run]
        return self._priced[spec]


def loss_memory(captured: Captured, mesh_shape: tuple[int, ...]) -> LossMemory | None:
    """The default loss's memory for a capture that ends before its loss; None when the
    capture holds its loss already (its memory is the graph's own)."""
    first = output_value(captured) if captured.user_outputs else None
    if not isinstance(first, torch.Tensor) or not first.dtype.is_floating_point or has_loss(captured):
        return None
    loss_fn, target = default_loss(captured)
    # under a mixed-precision policy's output_dtype the loss reads the output cast to it
    dtype = output_node(captured).meta.get(OUTPUT_DTYPE_KEY, first.dtype)
    example = (torch.empty(tuple(first.shape), dtype=dtype, device="meta"), target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(_LossOfFirst(loss_fn), example)
    graph = build_strategy_graph(cap, tuple(mesh_shape))
    placeholders = {n.name: n for n in cap.nodes("placeholder")}
    output, target_node = (placeholders[name] for name in cap.user_inputs)
    return LossMemory(graph, output, target_node)


@torch.enable_grad()  # a backward is measured, whatever grad mode the caller plans under
def _measure(graph: StrategyGraph, choice: dict[fx.Node, int]) -> dict[str, float]:
    """Run the laid-out loss graph on fake tensors of its local shapes, forward and backward,
    under torch's MemTracker: its peak by kind. The model's output is the loss's to hold:
    alive until its last reader here, longer only where a backward keeps it; a value moved
    to another placement is a new tensor of the needed local shape (``_moved``)."""
    mesh = graph.mesh_shape
    order = [n for n in graph.captured.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    last_use = {src: i for i, node in enumerate(order) for src in node.all_input_nodes}
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = {node: _fake(node, output_spec(graph, node, choice[node]), mesh)
               for node in order if node.op == "placeholder"}
        tracker = MemTracker()
        with tracker:
            for node in env:
                env[node].view_as(env[node])  # the tracker registers a storage when it first sees it
            loss = _run(graph, choice, order, env, last_use)
            loss.backward()
        peak = _by_kind(tracker.get_tracker_snapshot("peak"))
    return peak


def _local_run(graph: StrategyGraph, choice: dict[fx.Node, int]) -> tuple:
    """What ``_measure`` runs under ``choice``, in local shapes: each input's, and per op the
    inputs it reads moved, with the shapes they are moved to (``_moves``, as ``_run`` moves
    them). Two choices alike in it run the same ops on the same shapes (``_moved`` makes a
    moved value from the shapes alone), so they measure alike: measured once (placements
    that mirror each other over mesh axes of one size, most often)."""
    mesh = graph.mesh_shape
    run = []
    for node in graph.captured.gm.graph.nodes:
        if node.op == "placeholder":
            run.append(local_shape(tuple(node.meta["val"].shape), output_spec(graph, node, choice[node]), mesh))
        elif node.op == "call_function":
            run.append(tuple(_moves(graph, choice, node)))
    return tuple(run)


def _moves(graph: StrategyGraph, choice: dict[fx.Node, int], node: fx.Node) -> list[tuple[fx.Node, tuple[int, ...]]]:
    """(input, the local shape it is moved to) for each input ``node``'s chosen strategy
    reads in another placement than its producer's."""
    if node not in graph.nodes:
        return []
    chosen = graph[node].strategies[choice[node]]
    return [(src, local_shape(tuple(src.meta["val"].shape), need, graph.mesh_shape))
            for src, need in zip(tensor_inputs(node), chosen.inputs)
            if need is not None and need != output_spec(graph, src, choice[src])]


def _by_kind(snapshot: dict) -> dict[str, float]:
    on_cpu = snapshot.get(torch.device("cpu"), {})
    return {"activations": float(on_cpu.get(_MemRefType.ACT, 0)),
            "temporary": float(on_cpu.get(_MemRefType.TEMP, 0) + on_cpu.get(_MemRefType.OTH, 0))}


def _run(graph: StrategyGraph, choice: dict, order: list[fx.Node], env: dict, last_use: dict) -> torch.Tensor:
    for i, node in enumerate(order):
        if node.op != "call_function":
            continue
        moved = {src: _moved(env[src], shape) for src, shape in _moves(graph, choice, node)}
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: moved.get(n, env.get(n)), (node.args, node.kwargs))
        env[node] = node.target(*args, **kwargs)
        for src in node.all_input_nodes:
            if last_use.get(src) == i:
                env.pop(src, None)  # freed as the runtime frees it: after its last reader
    output_node = next(n for n in graph.captured.gm.graph.nodes if n.op == "output")
    return _first_output(pytree.tree_map_only(fx.Node, env.get, output_node.args[0]))


def _fake(node: fx.Node, spec: Spec, mesh: tuple[int, ...]) -> torch.Tensor:
    """An input of the loss of its local shape: a float one made by an op (as the model's
    output is), so that autograd holds no reference to it, only to the 0-d leaf it grew from."""
    val = node.meta["val"]
    shape = local_shape(tuple(val.shape), spec, mesh)
    if not val.dtype.is_floating_point:
        return torch.empty(shape, dtype=val.dtype)
    return torch.empty((), dtype=val.dtype).requires_grad_().expand(shape).clone()


def _moved(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` made from ``x`` as a collective makes it, with autograd's
    link back: repeated where a dim is gathered (its backward sums back to ``x``'s shape, as a
    reduce-scatter does), cut where a dim is split, copied where only the values change (an
    all-reduce of a pending sum)."""
    have = tuple(x.shape)
    grown = x.repeat([max(n // h, 1) for n, h in zip(shape, have)]) if any(n > h for n, h in zip(shape, have)) else x
    for dim, n in enumerate(shape):
        if n < grown.shape[dim]:
            grown = grown.narrow(dim, 0, n)
    return grown if grown is not x and grown._base is None else grown.clone()
