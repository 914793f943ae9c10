"""Embedding lookup ``embedding(weight[V, H], ids[...]) -> [..., H]``.

- ids sharded (any dim), table replicated: data or sequence parallel;
- table sharded on the hidden dim: each device looks up its slice of every row;
- table sharded on the vocabulary (Megatron's vocab-parallel embedding): each device
  looks up the ids that fall in its rows, zeros elsewhere, and the output is a Partial.
  A ``padding_idx`` (a row whose gradient stays zero) is the device's own row number of
  it, or none where another device holds that row.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import shard_offset
from autopar.passes.rules.registry import kernel, register
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


@register(aten.embedding.default)
def embedding(info: OpInfo) -> list[AxisOption]:
    weight, ids = info.inputs
    options = [AxisOption((R, Shard(d)), (Shard(d),)) for d in range(ids.ndim)]
    options.append(AxisOption((Shard(1), R), (Shard(ids.ndim),)))
    options.append(AxisOption((Shard(0), R), (Partial(),), kernel="vocab_parallel_embedding"))
    return options


@kernel("vocab_parallel_embedding")
def vocab_parallel_embedding(info, strategy, args, kwargs, ctx):
    weight, ids = args[0], args[1]
    lo, hi = shard_offset(info.inputs[0].shape, strategy.inputs[0], ctx.mesh_shape, ctx.coord, 0)
    outside = (ids < lo) | (ids >= hi)
    local_ids = torch.where(outside, torch.zeros_like(ids), ids - lo)
    rest = list(args[2:])
    padding = rest[0] if rest else kwargs.get("padding_idx", -1)
    if padding >= 0:  # aten's -1: no padding row
        local_padding = padding - lo if lo <= padding < hi else -1
        rest, kwargs = ([local_padding, *rest[1:]], kwargs) if rest else (rest, {**kwargs, "padding_idx": local_padding})
    out = torch.ops.aten.embedding.default(weight, local_ids, *rest, **kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
