"""Mixture-of-experts contractions.

``transformers.grouped_mm_fallback(x[T, K], w[E, K, N], offsets[E])`` multiplies the rows
of x, sorted by expert, with their expert's matrix (offsets are the cumulative row
counts per expert). It is a contraction over K with the expert as a grouping index:

- N split: each device computes its columns of every row (column parallel);
- K split: each device holds a partial sum (row parallel);
- E split (expert parallel): each device holds whole experts and computes only the rows
  routed to them, zeros elsewhere; the output is a Partial whose parts are disjoint rows.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.placements import shard_offset
from autopar.passes.rules.registry import kernel, register
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()

GROUPED_MM = "transformers.grouped_mm_fallback.default"


@register(GROUPED_MM)
def grouped_mm(info: OpInfo) -> list[AxisOption]:
    return [
        AxisOption((R, Shard(2), R), (Shard(1),)),
        AxisOption((Shard(1), Shard(1), R), (Partial(),)),
        AxisOption((R, Shard(0), R), (Partial(),), kernel="local_experts"),
        AxisOption((Partial(), R, R), (Partial(),)),
    ]


@kernel("local_experts")
def local_experts(info, strategy, args, kwargs, ctx):
    """Rows of this device's experts through its expert matrices; other rows are zero."""
    x, w, offsets = args[0], args[1], args[2]
    e0, e1 = shard_offset(info.inputs[1].shape, strategy.inputs[1], ctx.mesh_shape, ctx.coord, 0)
    ends = offsets.tolist()
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = ends[e0 - 1] if e0 > 0 else 0
    for local_e, end in enumerate(ends[e0:e1]):
        if end > start:
            out[start:end] = x[start:end] @ w[local_e]
        start = end
    return out
