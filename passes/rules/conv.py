"""Convolutions (1-D, 2-D, 3-D, transposed), as torch.export leaves them.

Input ``[N, C_in, *spatial]`` (or unbatched ``[C_in, *spatial]``); weight
``[C_out, C_in/g, *k]``, or ``[C_in, C_out/g, *k]`` when transposed; bias ``[C_out]``.
Ways to split along one mesh axis:

- the batch: each device convolves its own samples (weights whole);
- output channels (``groups == 1``): the weight's output-channel dim and the bias split
  with the output's channels, the input stays whole (like a column-parallel linear);
- input channels (``groups == 1``): input channels and the weight's input-channel dim
  split, each device holds a pending sum of the output (Partial), the bias is a
  Partial too so that it is added once (like a row-parallel linear);
- whole groups (``groups > 1``, depthwise included): input channels, weight dim 0 and
  output channels split together and each device runs ``groups / n`` groups. Shards
  must hold whole groups; that follows from even shards exactly when the per-group
  input and output channel counts are coprime (any n dividing ``g*k`` and ``g*m``
  divides ``g*gcd(k, m)``), so only then is the option offered (depthwise: k = 1);
- the op being linear in its input and in its weight: one Partial operand gives a
  Partial output.

Spatial dims stay whole: splitting them needs halo exchanges, which no collective here does.
The backward pass is autograd's over the rewritten forward graph, so no rule is needed for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import local_shape
from autopar.passes.rules.registry import register, with_arg
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


@dataclass(frozen=True)
class ConvSignature:
    """Where a convolution op keeps its ``groups`` and whether it is transposed."""

    groups_at: int
    transposed_at: int | None = None  # index of a ``transposed`` flag, if the op has one
    transposed: bool = False  # fixed by the op when it has no flag


_FORWARD = ConvSignature(groups_at=6)
_TRANSPOSED = ConvSignature(groups_at=6, transposed=True)
_GENERIC = ConvSignature(groups_at=8, transposed_at=6)

SIGNATURES = {
    aten.conv1d.default: _FORWARD, aten.conv2d.default: _FORWARD, aten.conv3d.default: _FORWARD,
    aten.conv1d.padding: _FORWARD, aten.conv2d.padding: _FORWARD, aten.conv3d.padding: _FORWARD,
    aten.conv_transpose1d.default: _TRANSPOSED, aten.conv_transpose2d.input: _TRANSPOSED,
    aten.conv_transpose3d.input: _TRANSPOSED,
    aten.convolution.default: _GENERIC, aten._convolution.default: _GENERIC,
}


def _signature(info: OpInfo) -> ConvSignature:
    return SIGNATURES[info.op]


def _arg(info: OpInfo, index: int, name: str, default):
    if len(info.args) > index:
        return info.args[index]
    return info.kwargs.get(name, default)


def groups_of(info: OpInfo) -> int:
    return int(_arg(info, _signature(info).groups_at, "groups", 1))


def is_transposed(info: OpInfo) -> bool:
    sig = _signature(info)
    if sig.transposed_at is None:
        return sig.transposed
    return bool(_arg(info, sig.transposed_at, "transposed", False))


def _channel_dim(info: OpInfo) -> int:
    """1 for a batched input, 0 for an unbatched one (same rank as the weight minus one)."""
    x, w = info.inputs[0], info.inputs[1]
    return 1 if x.ndim == w.ndim else 0


def _option(info: OpInfo, x: Placement, w: Placement, out: Placement) -> AxisOption:
    """Placements of (input, weight[, bias]) -> output; the bias follows the output's channels."""
    if len(info.inputs) == 2:
        return AxisOption((x, w), (out,))
    if isinstance(out, Shard) and out.dim == _channel_dim(info):
        bias: Placement = Shard(0)
    elif isinstance(out, Partial):
        bias = Partial()
    else:
        bias = R
    return AxisOption((x, w, bias), (out,))


def _whole_groups_divide(info: OpInfo) -> bool:
    g = groups_of(info)
    c = _channel_dim(info)
    c_in, c_out = info.inputs[0].shape[c], info.outputs[0].shape[c]
    return math.gcd(c_in // g, c_out // g) == 1


def conv_options(info: OpInfo) -> list[AxisOption]:
    c = _channel_dim(info)
    weight_out, weight_in = (1, 0) if is_transposed(info) else (0, 1)
    options = []
    if c == 1:
        options.append(_option(info, Shard(0), R, Shard(0)))
    if groups_of(info) == 1:
        options.append(_option(info, R, Shard(weight_out), Shard(c)))
        options.append(_option(info, Shard(c), Shard(weight_in), Partial()))
    elif _whole_groups_divide(info):
        options.append(_option(info, Shard(c), Shard(0), Shard(c)))
    options.append(_option(info, Partial(), R, Partial()))
    options.append(_option(info, R, Partial(), Partial()))
    return options


def localize_groups(info, strategy, args, kwargs, ctx):
    """A device holding whole groups runs ``groups * local / global`` of them."""
    g = groups_of(info)
    if g == 1:
        return args, kwargs
    w = info.inputs[1]
    local_rows = local_shape(w.shape, strategy.inputs[1], ctx.mesh_shape)[0]
    local_groups = g * local_rows // w.shape[0]
    at = _signature(info).groups_at
    if len(args) > at:
        return with_arg(args, at, local_groups), kwargs
    return args, {**kwargs, "groups": local_groups}


@register(*SIGNATURES, localize=localize_groups)
def convolution(info: OpInfo) -> list[AxisOption]:
    return conv_options(info)
