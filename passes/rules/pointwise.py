"""Elementwise ops, with broadcasting: any output dim can be split, and each input
follows with the dim it broadcasts from (or stays replicated where it has size 1).

Partial (a pending sum) passes through ops that are linear in it: ``neg``, casts that keep
every digit (to the same dtype or a wider float: summing after a narrowing cast rounds each
rank's part, not the sum), scaling by a number, ``add``/``sub`` of two pending sums, ``mul`` by a replicated factor,
``div`` of a pending sum by a replicated divisor. The rest are one table (``UNARY``: any
number of operands, no pending sums), torch's ``Tag.pointwise`` ops that models call.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import shard_offset
from autopar.passes.rules.registry import register, with_arg
from autopar.passes.op_strategies import AxisOption, OpInfo, TensorMeta

R = Replicate()


def broadcast_options(info: OpInfo) -> list[AxisOption]:
    """S(d) of the output for every dim d that some input really has (size > 1)."""
    out = info.outputs[0]
    n_out = len(info.outputs)
    options = []
    for d in range(out.ndim):
        ins, real = [], False
        for m in info.inputs:
            k = d - (out.ndim - m.ndim)
            if k >= 0 and m.shape[k] == out.shape[d] and out.shape[d] > 1:
                ins.append(Shard(k))
                real = True
            else:
                ins.append(R)
        if real:
            options.append(AxisOption(tuple(ins), (Shard(d),) * n_out))
    return options


def _only_tensors(info: OpInfo, upto: int) -> bool:
    """The first ``upto`` positional operands are all tensors (no Python scalars)."""
    return all(isinstance(a, TensorMeta) for a in info.args[:upto])


def _partial_at(info: OpInfo, which: set[int]) -> AxisOption:
    ins = tuple(Partial() if i in which else R for i in range(len(info.inputs)))
    return AxisOption(ins, (Partial(),) * len(info.outputs))


UNARY_LINEAR = [
    aten.neg.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default,
    aten.mul.Scalar, aten.div.Scalar, aten.mul_.Scalar, aten.div_.Scalar, aten.neg_.default,
]

UNARY = [
    aten.abs.default, aten.exp.default, aten.log.default, aten.tanh.default,
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.sigmoid.default,
    aten.rsqrt.default, aten.sqrt.default, aten.sin.default, aten.cos.default,
    aten.reciprocal.default, aten.square.default, aten.erf.default, aten.log1p.default,
    aten.pow.Tensor_Scalar, aten.logical_not.default,
    aten.bitwise_not.default, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.eq.Scalar, aten.ne.Scalar, aten.ge.Scalar, aten.gt.Scalar,
    aten.le.Scalar, aten.lt.Scalar, aten.gelu_.default, aten.silu_.default, aten.relu_.default,
    aten.isnan.default, aten.isinf.default, aten.sign.default, aten.floor.default,
    aten.round.default, aten.trunc.default, aten.hardtanh.default, aten.leaky_relu.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarSelf,
    aten.where.ScalarOther, aten.maximum.default, aten.minimum.default,
    aten.pow.Tensor_Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.ge.Tensor, aten.gt.Tensor,
    aten.le.Tensor, aten.lt.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.floor_divide.default, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.fmod.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.add.Scalar, aten.sub.Scalar, aten.div.Tensor_mode,
    aten.lerp.Scalar, aten.addcmul.default, aten.addcdiv.default, aten.atan2.default,
    aten.min.other, aten.max.other, aten.fmin.default, aten.fmax.default, aten.clamp.Tensor,
    # trigonometric, hyperbolic, exponential and special functions
    aten.acos.default, aten.acosh.default, aten.asin.default, aten.asinh.default,
    aten.atan.default, aten.atanh.default, aten.cosh.default, aten.sinh.default, aten.tan.default,
    aten.expm1.default, aten.exp2.default, aten.log10.default, aten.log2.default,
    aten.erfc.default, aten.erfinv.default, aten.lgamma.default, aten.digamma.default,
    aten.i0.default, aten.sinc.default, aten.deg2rad.default, aten.rad2deg.default,
    aten.logit.default, aten.xlogy.Tensor, aten.logaddexp.default, aten.logaddexp2.default,
    aten.hypot.default, aten.copysign.Tensor, aten.nextafter.default, aten.heaviside.default,
    # activations
    aten.softplus.default, aten.elu.default, aten.hardsigmoid.default, aten.hardswish.default,
    aten.mish.default, aten.threshold.default, aten.softshrink.default, aten.hardshrink.default,
    # rounding, signs, tests, integer and bitwise arithmetic
    aten.ceil.default, aten.frac.default, aten.sgn.default, aten.signbit.default,
    aten.nan_to_num.default, aten.isfinite.default, aten.isposinf.default, aten.isneginf.default,
    aten.fmod.Tensor, aten.pow.Scalar, aten.div.Scalar_mode, aten.floor_divide.Scalar,
    aten.logical_xor.default, aten.bitwise_xor.Tensor, aten.bitwise_and.Scalar,
    aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar, aten.bitwise_left_shift.Tensor,
    aten.bitwise_right_shift.Tensor,
    # in place: ``self`` keeps the output's placement, as every option here gives it
    aten.exp_.default, aten.tanh_.default, aten.sigmoid_.default, aten.clamp_.default,
    aten.add_.Scalar, aten.sub_.Scalar, aten.masked_fill_.Scalar, aten.ceil_.default,
]


@register(*UNARY)
def pointwise(info: OpInfo) -> list[AxisOption]:
    return broadcast_options(info)


CASTS = [aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default]


@register(*UNARY_LINEAR)
def pointwise_linear(info: OpInfo) -> list[AxisOption]:
    return broadcast_options(info) + [_partial_at(info, {0})]


@register(*CASTS)
def cast(info: OpInfo) -> list[AxisOption]:
    """A pending sum passes through a cast that keeps every digit of it."""
    options = broadcast_options(info)
    if _keeps_digits(info.inputs[0].dtype, info.outputs[0].dtype):
        options.append(_partial_at(info, {0}))
    return options


def _keeps_digits(source, target) -> bool:
    """``target`` holds every value of ``source`` exactly: the same dtype, or a float at least as
    wide in both mantissa and exponent (bfloat16 -> float32, float32 -> float64)."""
    if source == target:
        return True
    if not (source.is_floating_point and target.is_floating_point):
        return False
    a, b = torch.finfo(source), torch.finfo(target)
    return b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny


@register(aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor)
def add(info: OpInfo) -> list[AxisOption]:
    """P + P -> P; a pending sum plus a plain value is not a pending sum."""
    options = broadcast_options(info)
    if _only_tensors(info, 2):
        options.append(_partial_at(info, {0, 1}))
    return options


@register(aten.mul.Tensor, aten.mul_.Tensor)
def mul(info: OpInfo) -> list[AxisOption]:
    options = broadcast_options(info) + [_partial_at(info, {0})]
    if len(info.inputs) == 2:
        options.append(_partial_at(info, {1}))
    return options


@register(aten.div.Tensor, aten.div_.Tensor)
def div(info: OpInfo) -> list[AxisOption]:
    """Only the numerator may be a pending sum."""
    options = broadcast_options(info)
    if isinstance(info.args[0], TensorMeta):
        options.append(_partial_at(info, {0}))
    return options


@register(aten.broadcast_tensors.default)
def broadcast_tensors(info: OpInfo) -> list[AxisOption]:
    """Every output has the common shape: split like a pointwise op's output (each
    device broadcasts its own shards against each other)."""
    return broadcast_options(info)


@register(aten.copy_.default, aten.fill_.Tensor, aten.fill_.Scalar, aten.copy.default,
          aten.fill.Tensor, aten.fill.Scalar)
def overwrite(info: OpInfo) -> list[AxisOption]:
    """``copy_(self, src)`` / ``fill_(self, value)`` write into (a view of) ``self``, so
    ``self`` keeps the output's placement in every option: then each device writes its
    own part of the tensor that ``self`` views. A pending sum copied over a pending sum
    stays one; a filled value is not a pending sum."""
    options = broadcast_options(info)
    if info.op in (aten.copy_.default, aten.copy.default):
        options.append(_partial_at(info, {0, 1}))
    return options


def _shift_diagonal(info, strategy, args, kwargs, ctx):
    """A shard starting at row r and column c keeps the elements of the whole tensor's
    triangle: its own diagonal is moved by r - c."""
    x, spec = info.inputs[0], strategy.inputs[0]
    row = shard_offset(x.shape, spec, ctx.mesh_shape, ctx.coord, x.ndim - 2)[0]
    col = shard_offset(x.shape, spec, ctx.mesh_shape, ctx.coord, x.ndim - 1)[0]
    diagonal = args[1] if len(args) > 1 else kwargs.pop("diagonal", 0)
    return with_arg(args[:1], 1, diagonal + row - col), kwargs


@register(aten.tril.default, aten.triu.default, localize=_shift_diagonal)
def triangle(info: OpInfo) -> list[AxisOption]:
    """Zero above (``tril``) or below (``triu``) a diagonal of the last two dims: a mask by
    position, so every dim splits (the shard's offsets shift its diagonal); linear."""
    return broadcast_options(info) + [_partial_at(info, {0})]
