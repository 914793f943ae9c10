"""Normalisations over the trailing dims: any leading dim can be split (data or sequence
parallel); the normalised dims and the affine weights stay whole."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.ops import aten

from passes.rules.registry import register
from passes.strategy import AxisOption, OpInfo

R = Replicate()


@register(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def layer_norm(info: OpInfo) -> list[AxisOption]:
    x = info.inputs[0]
    n_norm = len(info.args[1])
    rest = (R,) * (len(info.inputs) - 1)
    return [
        AxisOption((Shard(d),) + rest, (Shard(d),) * len(info.outputs))
        for d in range(x.ndim - n_norm)
    ]
