"""What a plan's ZeRO-3 buckets hold while they gather and reduce.

Parameters stored split where their ops use them whole are gathered a bucket per layer
(``autopar.passes.lowering.buckets``): a repeated layer's apart from those around it (an
embedding, a head). ``ZeroThreeBucket`` counts a bucket's elements on one device.

The runtime overlaps the buckets' collectives with compute as FSDP2 does: while one bucket
computes, the all-gather of the next is in flight (in forward; in backward too where a
``backward()`` runs it, ``ParallelModule``), and one bucket's gradient reduce-scatter runs
while backward goes on. So a layer's forward holds the larger of its own gather's working
bytes and its wholes beside the next gather in flight (``forward_gather_memory``), and a
one-stage plan's backward holds, beside the bucket it runs, the one before it gathered ahead
and the one after it reduce-scattering (``in_flight_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard

from autopar.costmodels.memory import (gather_ahead_bytes, gather_working_bytes, scatter_in_flight_bytes,
                                       scatter_working_bytes)
from autopar.costmodels.precision import MixedPrecision
from autopar.passes.layers import first_segments_of
from autopar.passes.placements import local_shape
from autopar.passes.strategy_graph import tensor_inputs


@dataclass
class ZeroThreeBucket:
    """A layer's parameters stored split where their ops use them whole (ZeRO-3), in elements
    on one device: gathered at each use as one bucket (``autopar.passes.lowering.buckets``)."""

    shard: float = 0.0
    whole: float = 0.0
    largest: float = 0.0
    dtype: torch.dtype | None = None  # the parameters' own dtype (the master's under a policy)

    def add(self, numel: float, gathered_over: int, dtype: torch.dtype) -> None:
        if gathered_over > 1:
            self.shard += numel
            self.whole += numel * gathered_over
            self.largest = max(self.largest, numel * gathered_over)
            self.dtype = dtype

    def _dtypes(self, precision: str | MixedPrecision) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(master, compute, reduce) dtypes of the bucket's parameters."""
        if isinstance(precision, MixedPrecision):
            return precision.master, precision.compute, precision.reduce
        return self.dtype, self.dtype, self.dtype

    def working(self, precision: str | MixedPrecision) -> tuple[float, float]:
        """Bytes the bucket's gather, and its gradients' reduce-scatter, hold while they run."""
        if self.dtype is None:
            return 0.0, 0.0
        master, compute, reduce = self._dtypes(precision)
        return (gather_working_bytes(self.shard, self.whole, self.largest, master, compute),
                scatter_working_bytes(self.shard, self.whole, compute, reduce))

    def wholes(self, precision: str | MixedPrecision) -> float:
        """Bytes of the bucket's parameters gathered whole, as its ops use them."""
        return 0.0 if self.dtype is None else self.whole * self._dtypes(precision)[1].itemsize

    def in_flight(self, precision: str | MixedPrecision) -> tuple[float, float]:
        """Bytes the bucket's gather, and its gradients' reduce-scatter, hold while they run
        beside compute (started ahead, waited for later)."""
        if self.dtype is None:
            return 0.0, 0.0
        master, compute, reduce = self._dtypes(precision)
        return (gather_ahead_bytes(self.shard, self.whole, master, compute),
                scatter_in_flight_bytes(self.shard, self.whole, reduce))


def gathered_over(graph, param: fx.Node, spec, choice, mesh) -> int:
    """How many devices a parameter stored as ``spec`` is gathered from for its readers: the mesh
    axes it is split over where one of them needs it whole (ZeRO-3; 1: used as it lies)."""
    axes: set[int] = set()
    for user in param.users:
        ns = graph.nodes.get(user)
        if ns is None or ns.follows is not None:
            continue
        strategy = ns.strategies[choice[user]]
        for src, need in zip(tensor_inputs(user), strategy.inputs):
            if src is param and need is not None:
                axes |= {a for a, (p, q) in enumerate(zip(spec, need)) if isinstance(p, Shard) and isinstance(q, Replicate)}
    return math.prod(mesh[a] for a in axes)


def forward_gather_memory(layers: Sequence[Iterable[ZeroThreeBucket]], precision: str | MixedPrecision) -> np.ndarray:
    """Per layer, the bytes its forward's ZeRO-3 gathers hold at their most: its own gather
    running, or its wholes while the next bucket (its own other one, or the next layer's) is
    gathered ahead."""
    layers = [list(buckets) for buckets in layers]
    working = [max((b.working(precision)[0] for b in bs), default=0.0) for bs in layers]
    wholes = [max((b.wholes(precision) for b in bs), default=0.0) for bs in layers]
    ahead = [max((b.in_flight(precision)[0] for b in bs), default=0.0) for bs in layers] + [0.0]
    return np.array([max(w, h + max(ahead[l], ahead[l + 1])) for l, (w, h) in enumerate(zip(working, wholes))])


def in_flight_bytes(buckets: Sequence[ZeroThreeBucket], precision: str | MixedPrecision) -> float:
    """Bytes a one-stage plan holds beyond its ZeRO-3 gathers one at a time, ``buckets`` in the
    order forward gathers them: while backward runs bucket k, the bucket before it is gathered
    again ahead and the gradients of the one after it are reduce-scattered (a lone bucket
    overlaps nothing); at the most over k."""
    flights = [b.in_flight(precision) for b in buckets]
    ahead = [0.0] + [g for g, _ in flights]  # ahead[k]: bucket k - 1's gather
    scatter = [s for _, s in flights[1:]] + [0.0]  # scatter[k]: bucket k + 1's reduce-scatter
    return max((a + r for a, r in zip(ahead, scatter)), default=0.0)


def plan_buckets(costs, choice) -> list[ZeroThreeBucket]:
    """The ZeRO-3 buckets of a one-stage plan (``costs``: ``autopar.passes.costing.Costs``) in
    the order forward gathers them, grouped as codegen groups them: by the segment of the graph
    their first reader is in (a repeated layer, or the stretch between two)."""
    graph, mesh = costs.graph, costs.graph.mesh_shape
    segment = first_segments_of(graph)
    buckets: dict[int, ZeroThreeBucket] = {}
    for ph in costs.zero_node:
        spec = graph.nodes[ph].strategies[choice[ph]].output
        numel = math.prod(local_shape(tuple(ph.meta["val"].shape), spec, mesh))
        buckets.setdefault(segment.get(ph, math.inf), ZeroThreeBucket()).add(
            numel, gathered_over(graph, ph, spec, choice, mesh), ph.meta["val"].dtype)
    return [buckets[k] for k in sorted(buckets) if buckets[k].dtype is not None]
