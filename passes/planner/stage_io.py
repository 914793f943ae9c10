"""What a pipeline stage holds of the values it receives and sends, per micro-batch in flight.

``autopar.runtime.stages.stage_parts`` makes every value cross each stage boundary between
the layer that makes it and the last layer that reads it, and torch's ``PipelineStage`` keeps
a micro-batch's received inputs and its outputs until that micro-batch's backward. So a stage
of layers ``[a, b)`` holds, per micro-batch in flight, one tensor for every value made before
``a`` and read at ``a`` or later (received, whether it reads it or passes it on: a Llama's
attention mask and rotary tables reach every stage) and one for every value it makes that a
later layer reads (sent: its last layer's hidden state). Its layers' activation memory
already charges some of these bytes: readers that save a value as it lies (each its share of
one copy, ``autopar.passes.saved``) and a producer that keeps its own output. ``held[a, b]``
is the rest: per value, its bytes less what the stage's layers are charged for it.

A recomputed layer keeps its inputs (``layer_numbers``' ``inputs``, each value on its first
reader's layer). Where a stage receives that value, the kept input is the received tensor
itself: ``credit[a, b]`` is those bytes, which recomputing the layer frees again (the stage
search adds them to the stage's recompute saving).

``held`` and ``credit`` are indexed by a stage's first layer and its end (one past its last),
as the stage DP takes spans (``autopar.passes.solve.stages.cut_stages``); ``crossing[l]`` is the
bytes crossing after layer ``l``: what a stage ending there sends. All in bytes of the whole
batch, as the other per-layer numbers, but for values without a batch dim (a Llama's rotary
tables), which every micro-batch receives and sends whole: those apart, per micro-batch.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np
import torch
from torch import fx

from autopar.passes.costing import Costs
from autopar.passes.edge_costs import local_bytes
from autopar.passes.loss_memory import output_spec
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.saved import root


class StageIO(NamedTuple):
    crossing: np.ndarray  # [L]: bytes of the values crossing after each layer, whole batch
    held: np.ndarray  # [L + 1, L + 1]: bytes a stage [a, b) holds beyond its layers' activations, whole batch
    credit: np.ndarray  # [L + 1, L + 1]: of them, what its recomputed layers' kept inputs charge too
    # the same for values without a batch dim (rotary tables), which every micro-batch has
    # whole: bytes per micro-batch
    crossing_fixed: np.ndarray
    held_fixed: np.ndarray


def no_stage_io(count: int) -> StageIO:
    """Nothing crossing ``count`` layers."""
    span = np.zeros((count + 1, count + 1))
    return StageIO(np.zeros(count), span, span, np.zeros(count), span)


def stage_io(costs: Costs, choice: Mapping[fx.Node, int], where: Mapping[fx.Node, int], count: int,
             kept_by: Mapping[fx.Node, int], dims: Mapping[fx.Node, list]) -> StageIO:
    """``choice``: the graph's chosen strategies; ``where``: node -> layer (``node_layers``);
    ``kept_by``: value -> the layer whose ``inputs`` charge it (a recomputed layer's kept input);
    ``dims``: the batch dims of every node (``microbatch.batch_dims``; empty: the graph has no
    batch, every value is the batch's)."""
    graph = costs.graph
    crossing, crossing_fixed = np.zeros(count), np.zeros(count)
    held, held_fixed, credit = (np.zeros((count + 1, count + 1)) for _ in range(3))
    a = np.arange(count + 1)[:, None]
    b = np.arange(count + 1)[None, :]
    user_inputs = set(graph.captured.user_inputs)
    crossers = []  # (value, layer made, last layer reading it, bytes): what crosses a boundary
    for value in graph.nodes:
        if value not in where or (value.op == "placeholder" and value.name not in user_inputs):
            continue  # state stays in the stage that reads it
        made = -1 if value.op == "placeholder" else where[value]  # the user's inputs reach stage 0
        last = max((where[u] for u in value.users if u in where), default=made)
        if last > max(made, 0) and (nbytes := output_bytes(costs, value, choice)):
            crossers.append((value, made, last, nbytes))
    charged = _charged_by_layer(costs, choice, where, count, {value for value, *_ in crossers})
    for value, made, last, nbytes in crossers:
        batched = not dims or bool(dims.get(value) and dims[value][0])
        (crossing if batched else crossing_fixed)[max(made, 0):last] += nbytes
        received = (made < a) & (a <= last) & (a < b)
        sent = (a <= made) & (made < b) & (b <= last)
        prefix = np.concatenate([[0.0], np.cumsum(charged.get(value, np.zeros(count)))])
        in_stage = prefix[b] - prefix[a]
        if batched:
            held += np.where(received | sent, np.maximum(nbytes - in_stage, 0.0), 0.0)
        else:  # its readers' shares are charged per whole batch: each micro-batch's copy is whole
            held_fixed += np.where(received | sent, nbytes, 0.0)
        if (kept := kept_by.get(value)) is not None:
            credit += np.where(received & (a <= kept) & (kept < b), nbytes, 0.0)
    return StageIO(crossing, held, credit, crossing_fixed, held_fixed)


def output_bytes(costs: Costs, node: fx.Node, choice: Mapping[fx.Node, int]) -> float:
    """Bytes of ``node``'s (tensor) output on one device under its chosen placement (kept with
    the graph's prices: each pipeline depth asks it of every value for every layout)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or node not in costs.graph.nodes:
        return 0.0
    key = ("output bytes", node, choice[node])
    if key not in costs.pricer.tables:
        costs.pricer.tables[key] = local_bytes(TensorMeta.of(val), output_spec(costs.graph, node, choice[node]),
                                               costs.graph.mesh_shape)
    return costs.pricer.tables[key]


def _charged_by_layer(costs: Costs, choice, where, count: int, values: set[fx.Node]) -> dict[fx.Node, np.ndarray]:
    """Of ``values``, value -> bytes per layer its activation memory charges for the value as
    it lies: the shares of readers that save it in its own placement (or a view of it that
    keeps its size), and its producer's, where the producer keeps it."""
    graph = costs.graph
    out: dict[fx.Node, np.ndarray] = {}

    def add(value: fx.Node, layer: int, nbytes: float) -> None:
        out.setdefault(value, np.zeros(count))[layer] += nbytes

    for value in costs.kept:
        if value in values and value in where and value in graph.nodes and value.op != "placeholder":
            add(value, where[value], output_bytes(costs, value, choice))
    user_inputs = set(graph.captured.user_inputs)
    for value in graph.captured.nodes("placeholder"):  # the user's inputs: charged where first read
        if value in values and value.name in user_inputs and value in where and value in graph.nodes:
            add(value, where[value], output_bytes(costs, value, choice))
    for reader, reads in costs.saved_reads.items():
        if reader not in where or reader not in graph.nodes:
            continue
        inputs = graph.nodes[reader].strategies[choice[reader]].inputs
        for position, src, per_byte in reads:
            # per byte of the value: a share of it (at most 1), or all of it and the statistics
            # the op makes from it (a norm's mean and rstd: 1 to 2); 2 or more is a wider copy
            # the op makes instead (a boolean mask in the query's dtype), a tensor of its own
            if per_byte >= 2.0 or src not in graph.nodes or position >= len(inputs) or root(src) not in values:
                continue
            if inputs[position] != output_spec(graph, src, choice[src]):
                continue  # moved for the reader: the saved copy is another tensor
            add(root(src), where[reader], min(per_byte, 1.0) * output_bytes(costs, src, choice))
    return out
