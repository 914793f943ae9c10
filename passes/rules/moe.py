"""Mixture-of-experts contractions: the grouped matmuls of an MoE layer's experts.

``grouped_mm(x[T, K], w[E, K, N], offs[E])`` multiplies the rows of x, sorted by expert,
with their expert's matrix (offs: the cumulative row counts per expert). Two ops compute
it: ``aten._grouped_mm`` (what transformers calls for bf16 weights, and on the meta
device) and ``transformers.grouped_mm_fallback`` (its float32 CPU path). Both are a
contraction over K with the expert as a grouping index:

- N split: each device computes its columns of every row (each expert's MLP column
  parallel);
- K split: each device holds a partial sum (row parallel);
- E split (expert parallel): each device holds whole experts and computes only the rows
  routed to them, zeros elsewhere (``local_experts``); the output is a Partial whose
  parts are disjoint rows. The tokens reach every device of the axis (gathered before,
  reduced after: Megatron-Core's "allgather" token dispatcher).
- rows split: each device computes a block of the rows (sorted by expert) with every
  expert's matrix, the experts its block spans (``local_experts`` too). The routing
  (``sort``) is whole, so the tokens are gathered over such an axis, but the expert work
  and its activations are split there instead of repeated.

A bias (``aten._grouped_mm``'s [E, N]) splits with N and no other way here. The rule
gives the registry its work (FLOPs over the rows a device computes, :func:`rows_share`) and
its weight per expert (split by a manual layout as a linear's); the kernel, how explain()
words it.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import costmodels
from autopar.passes.placements import local_shape, shard_offset
from autopar.passes.rules.registry import ExpertWeight, KernelExplain, OpWork, kernel, register
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()

EXPERT_KERNEL = "local_experts"  # named on strategies: plans and explain() read it
GROUPED_MM_OPS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


def _work(info: OpInfo, strategy, mesh_shape, dtype: str) -> OpWork:
    """The registry's ``work``: one matmul, 2 x rows x K x N FLOPs over the rows this device
    computes (``rows_share``), its local inputs and outputs streamed."""
    ins = [(local_shape(m.shape, s, mesh_shape), m) for m, s in zip(info.inputs, strategy.inputs) if s is not None]
    outs = [local_shape(m.shape, s, mesh_shape) for m, s in zip(info.outputs, strategy.outputs)]
    out_bytes = float(sum(math.prod(x) * m.dtype.itemsize for x, m in zip(outs, info.outputs)))
    moved = sum(math.prod(x) * m.dtype.itemsize for x, m in ins) + out_bytes
    flops = 2.0 * math.prod(outs[0]) * ins[0][0][-1] * rows_share(info, strategy, mesh_shape)
    return OpWork((costmodels.Op(flops, moved, dtype, info.name, out_bytes),))


@register(*GROUPED_MM_OPS, work=_work, expert_weights=(ExpertWeight(1),))  # x, w[E, K, N], offs
def grouped_mm(info: OpInfo) -> list[AxisOption]:
    if len(info.inputs) > 3:  # x, w, offs, bias[E, N]
        return [AxisOption((R, Shard(2), R, Shard(1)), (Shard(1),))]
    return [
        AxisOption((R, Shard(2), R), (Shard(1),)),
        AxisOption((Shard(1), Shard(1), R), (Partial(),)),
        AxisOption((R, Shard(0), R), (Partial(),), kernel=EXPERT_KERNEL),
        AxisOption((Shard(0), R, R), (Shard(0),), kernel=EXPERT_KERNEL),
        AxisOption((Partial(), R, R), (Partial(),)),
    ]


def rows_share(info: OpInfo, strategy, mesh_shape) -> float:
    """The share of a grouped matmul's rows that one device computes: under ``local_experts``
    the rows routed to its experts (routing taken as balanced, what the router's load-balancing
    loss aims at), else every row."""
    if strategy.kernel != EXPERT_KERNEL:
        return 1.0
    experts = info.inputs[1].shape
    return local_shape(experts, strategy.inputs[1], mesh_shape)[0] / experts[0]


def _routed_rows(inputs: tuple) -> list[tuple[str, None]]:
    """explain()'s phrase of a grouped matmul that runs only this rank's experts."""
    return [("grouped matmuls run only the tokens routed to this rank's experts (allgather dispatch: tokens "
             "gathered before, outputs reduced after)", None)]


@kernel(EXPERT_KERNEL, explain=KernelExplain(1, _routed_rows))
def local_experts(info, strategy, args, kwargs, ctx):
    """This device's block of rows (all rows, where x is not split by rows) through this
    device's experts (all, where w is not split by expert); rows of other experts are zero.

    Without reading the offsets on the host (a fake-tensor dry run has no values): the rows
    are rotated so that the first of this device's experts in its block comes first, run
    through the op with those experts' offsets in the block, rows past them masked to zero
    (the op leaves them unwritten, in forward and in its input gradient), and rotated back."""
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs["offs"]
    rest = {k: v for k, v in kwargs.items() if k != "offs"}
    e0, e1 = shard_offset(info.inputs[1].shape, strategy.inputs[1], ctx.mesh_shape, ctx.coord, 0)
    r0, _ = shard_offset(info.inputs[0].shape, strategy.inputs[0], ctx.mesh_shape, ctx.coord, 0)
    n = x.shape[0]
    if n == 0:
        return info.op(x, w, offs[e0:e1], **rest)
    bounds = torch.cat([offs.new_zeros(1), offs])  # expert e's rows: [bounds[e], bounds[e + 1])
    local = (bounds[e0:e1 + 1] - r0).clamp(0, n)  # this device's experts' rows, within its block
    start = local[0]
    rows = torch.arange(n, device=x.device)
    mine = (rows < (local[-1] - start)).unsqueeze(-1)
    rotated = torch.where(mine, x[(rows + start) % n], torch.zeros((), dtype=x.dtype, device=x.device))
    out = info.op(rotated, w, local[1:] - start, **rest)
    out = torch.where(mine, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out[(rows - start) % n]
