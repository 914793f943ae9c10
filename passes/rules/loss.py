"""Losses. Batch (and extra spatial) dims of the prediction and target can be split:
unreduced losses stay split, summed losses become pending sums. A mean over a split
batch is exact only when the count is known locally: for ``mse_loss`` it is (each
shard's mean is scaled by its share of the elements); for ``cross_entropy`` with
``ignore_index`` it is not (ignored targets are data-dependent), so a mean
cross-entropy stays replicated; splitting it needs a rewrite to sum / count of
non-ignored targets, with both reduced before the division.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import local_shape
from autopar.passes.rules.registry import kernel, register
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()

NONE, MEAN, SUM = 0, 1, 2  # at::Reduction


def _reduction(info: OpInfo, position: int) -> int:
    return info.args[position] if len(info.args) > position else info.kwargs.get("reduction", MEAN)


@register(aten.cross_entropy_loss.default)
def cross_entropy(info: OpInfo) -> list[AxisOption]:
    x, target = info.inputs[0], info.inputs[1]
    reduction = _reduction(info, 3)
    if reduction == MEAN:
        return []
    extra = (R,) * (len(info.inputs) - 2)  # class weights
    class_dim = 1 if x.ndim > 1 else None
    options = []
    for d in range(x.ndim):
        if d == class_dim or x.ndim == 1:
            continue
        t = d if d == 0 else d - 1  # target has no class dim
        out = Shard(t) if reduction == NONE else Partial()
        if target.ndim == x.ndim:  # class probabilities: same layout as the prediction
            t = d
        options.append(AxisOption((Shard(d), Shard(t)) + extra, (out,)))
    return options


@register(aten.mse_loss.default, aten.l1_loss.default)
def elementwise_loss(info: OpInfo) -> list[AxisOption]:
    reduction = _reduction(info, 2)
    x = info.inputs[0]
    if reduction == NONE:
        return [AxisOption((Shard(d), Shard(d)), (Shard(d),)) for d in range(x.ndim)]
    name = "mean_loss_of_shard" if reduction == MEAN else None
    return [AxisOption((Shard(d), Shard(d)), (Partial(),), name) for d in range(x.ndim)]


@kernel("mean_loss_of_shard")
def mean_loss_of_shard(info, strategy, args, kwargs, ctx):
    x = info.inputs[0]
    local = local_shape(x.shape, strategy.inputs[0], ctx.mesh_shape)
    scale = 1.0
    for size, whole in zip(local, x.shape):
        scale *= size / whole
    return info.op(*args, **kwargs) * scale
