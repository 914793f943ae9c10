"""A value its readers save in more than one placement: backward keeps one copy per placement.

The solver charges each reader that saves a value a share of one copy (``autopar.passes.saved``):
exact where they all read it in one placement, since codegen moves it once for them. Where
the chosen strategies read it in two (q's projection reads the normed hidden state split on
the sequence, k's and v's split on the batch), each placement is a tensor of its own, kept
until its reader's backward. Which placements the readers take is known only once the
strategies are chosen, so this is priced on an assignment, after the solve: the bytes beyond
the shares, on the value's first reader (``extra_copy_bytes``), added where a plan's memory is
summed (``assemble.memory_breakdown``, ``planner.layer_numbers``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from torch import fx

from autopar.passes.edge_costs import local_bytes
from autopar.passes.loss_memory import output_spec
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.saved import root
from autopar.passes.strategy_graph import StrategyGraph


class SharedRead(NamedTuple):
    reader: int  # problem node of the op whose backward saves the value
    position: int  # the value's tensor input position in that op
    meta: TensorMeta  # the value as read
    share: float  # bytes charged per byte of the value in the reader's placement
    scale: float  # 1, or 1/R inside R recomputed layers (backward rebuilds one at a time)


class ReadGroup(NamedTuple):
    value: fx.Node  # what holds the memory (``saved.root``)
    held: bool  # its producer keeps it too, in its own placement, and is charged for it
    reads: tuple[SharedRead, ...]


def read_groups(reads: Mapping[fx.Node, tuple], index: Mapping[fx.Node, int], charged: Mapping[int, object],
                held: set[fx.Node], scale: Mapping[int, float]) -> tuple[ReadGroup, ...]:
    """The values two or more charged readers save whole (``SavedValues.reads`` with 1 byte per
    byte, before shares: ``per_byte`` here is the share); ``charged``: the problem nodes whose
    reads the costs charge; ``scale``: per problem node, the factor its activation was given."""
    groups: dict[fx.Node, list[SharedRead]] = {}
    for node, node_reads in reads.items():
        v = index.get(node)
        if v is None or v not in charged:
            continue
        for position, src, share in node_reads:
            if share < 1.0:  # a shared whole read (what the op makes from an input is its own)
                groups.setdefault(root(src), []).append(
                    SharedRead(v, position, TensorMeta.of(src.meta["val"]), share, scale.get(v, 1.0)))
    return tuple(ReadGroup(value, value in held, tuple(sorted(rs))) for value, rs in groups.items() if len(rs) > 1)


def extra_copy_bytes(graph: StrategyGraph, nodes: Sequence[fx.Node], groups: Sequence[ReadGroup],
                     choice: Mapping[fx.Node, int]) -> dict[int, float]:
    """Problem node -> bytes per device its value's copies hold beyond the shares charged, for
    every value whose readers read it in more than one placement under ``choice``."""
    mesh = graph.mesh_shape
    out: dict[int, float] = {}
    for group in groups:
        specs = [_read_spec(graph, nodes[r.reader], choice, r.position) for r in group.reads]
        placements = {(r.meta.shape, spec): r.meta for r, spec in zip(group.reads, specs)}
        if len(placements) < 2 or None in specs:
            continue
        # the producer's own copy, already charged to it, where a reader reads it as it lies
        value = group.value.meta["val"]
        own = ((TensorMeta.of(value).shape, output_spec(graph, group.value, choice[group.value]))
               if group.held and group.value in graph.nodes else None)
        copies = sum(local_bytes(meta, key[1], mesh) for key, meta in placements.items() if key != own)
        charged = sum(r.share * local_bytes(r.meta, spec, mesh) for r, spec in zip(group.reads, specs))
        first = group.reads[0]
        out[first.reader] = out.get(first.reader, 0.0) + (copies - charged) * first.scale
    return out


def _read_spec(graph: StrategyGraph, reader: fx.Node, choice: Mapping[fx.Node, int], position: int):
    inputs = graph.nodes[reader].strategies[choice[reader]].inputs
    return inputs[position] if position < len(inputs) else None
