"""Ops over the trailing spatial dims of ``[N, C, *spatial]``: pooling, upsampling, padding.

Each output element reads a window of one (sample, channel) plane, so every leading
dim (batch, channels) can be split and the spatial dims stay whole (a window crossing a
shard boundary would need a halo exchange). Max-pool indices count within a plane, so
they split with the values.

Pending values pass through where the op allows it: averaging, adaptive averaging and
upsampling are linear (a Partial sum in, a Partial sum out); a max pool of a pending
max is the pending max of the pools (``P(max)`` in and out). Padding is linear when the
fill is zero (or copies edges: reflect, replicate, circular); its unpadded dims split.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules.registry import register
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


def leading_options(info: OpInfo, n_spatial: int) -> list[AxisOption]:
    """S(d) -> S(d) for every dim before the last ``n_spatial`` (all outputs alike)."""
    x = info.inputs[0]
    rest = (R,) * (len(info.inputs) - 1)
    n_out = len(info.outputs)
    return [AxisOption((Shard(d),) + rest, (Shard(d),) * n_out) for d in range(x.ndim - n_spatial)]


def pending(info: OpInfo, reduce_op: str = "sum") -> AxisOption:
    rest = (R,) * (len(info.inputs) - 1)
    return AxisOption((Partial(reduce_op),) + rest, (Partial(reduce_op),) * len(info.outputs))


MAX_POOLS = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3}

MAX_POOLS_WITH_INDICES = {
    aten.max_pool1d_with_indices.default: 1, aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3, aten.adaptive_max_pool1d.default: 1,
    aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
}

# Padding that copies border values: linear, and the last 1-3 dims are the padded ones.
PADS = {
    aten.reflection_pad1d.default: 1, aten.reflection_pad2d.default: 2, aten.reflection_pad3d.default: 3,
    aten.replication_pad1d.default: 1, aten.replication_pad2d.default: 2, aten.replication_pad3d.default: 3,
}

LINEAR = {
    aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
    aten.adaptive_avg_pool3d.default: 3, aten._adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool3d.default: 3,
    aten.upsample_nearest1d.vec: 1, aten.upsample_nearest2d.vec: 2, aten.upsample_nearest3d.vec: 3,
    aten.upsample_nearest2d.default: 2, aten.upsample_linear1d.vec: 1,
    aten.upsample_bilinear2d.vec: 2, aten.upsample_bilinear2d.default: 2,
    aten.upsample_bicubic2d.vec: 2, aten.upsample_trilinear3d.vec: 3,
    **PADS,
}


@register(*MAX_POOLS)
def max_pool(info: OpInfo) -> list[AxisOption]:
    return leading_options(info, MAX_POOLS[info.op]) + [pending(info, "max")]


@register(*MAX_POOLS_WITH_INDICES)
def max_pool_with_indices(info: OpInfo) -> list[AxisOption]:
    return leading_options(info, MAX_POOLS_WITH_INDICES[info.op])


@register(*LINEAR)
def linear_spatial(info: OpInfo) -> list[AxisOption]:
    return leading_options(info, LINEAR[info.op]) + [pending(info)]


def _pad_spec(info: OpInfo) -> tuple[list[int], str, float]:
    """(pad list, mode, fill value) of ``pad`` or ``constant_pad_nd``."""
    pad = list(info.args[1])
    if info.op == aten.constant_pad_nd.default:
        value = info.args[2] if len(info.args) > 2 else info.kwargs.get("value", 0)
        return pad, "constant", value
    mode = info.args[2] if len(info.args) > 2 else info.kwargs.get("mode", "constant")
    value = info.args[3] if len(info.args) > 3 else info.kwargs.get("value", None)
    return pad, mode, 0 if value is None else value


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(info: OpInfo) -> list[AxisOption]:
    """``pad`` lists (before, after) pairs from the last dim backwards."""
    x = info.inputs[0]
    widths, mode, value = _pad_spec(info)
    padded = {x.ndim - 1 - i for i in range(len(widths) // 2) if widths[2 * i] or widths[2 * i + 1]}
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in padded]
    if mode != "constant" or value == 0:
        options.append(pending(info))
    return options


@register(aten.grid_sampler_2d.default)
def grid_sampler(info: OpInfo) -> list[AxisOption]:
    """``input`` [N, C, H, W] sampled at ``grid`` [N, Ho, Wo, 2]: batch with batch, channels
    alone, output rows with the grid's; linear in ``input``."""
    return [
        AxisOption((Shard(0), Shard(0)), (Shard(0),)),
        AxisOption((Shard(1), R), (Shard(1),)),
        AxisOption((R, Shard(1)), (Shard(2),)),
        AxisOption((R, Shard(2)), (Shard(3),)),
        AxisOption((Partial(), R), (Partial(),)),
    ]
