"""Normalisations. Layer and RMS norm normalise the trailing dims: any leading dim can
be split (data or sequence parallel); the normalised dims and the affine weights stay
whole. Batch and group norm normalise per channel (group): see below. Weight norm
(``_weight_norm``) normalises each slice along its ``dim``."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import local_shape
from autopar.passes.rules.registry import register, with_arg
from autopar.passes.op_strategies import AxisOption, OpInfo

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


# Batch norm: input [N, C, *], per-channel tensors (weight, bias, running mean and var)
# [C]. Statistics are per channel, so a channel split is exact in training and in eval.
# With running statistics (eval) every other dim splits freely too. Training statistics
# span the whole batch and plane: a batch split would give each device its own
# statistics (not synchronised batch norm), and synchronising them needs a reduction
# inside the op, which a local kernel cannot do; so it is not offered, and a
# data-parallel plan gathers the batch before the op.


@dataclass(frozen=True)
class BatchNormSignature:
    """Which positional arguments hold the per-channel tensors and the training flag."""

    n_channel_args: int  # weight, bias[, running_mean, running_var] after the input
    training_at: int | None  # None: the op never uses batch statistics


_BATCH_NORMS = {
    aten.batch_norm.default: BatchNormSignature(4, 5),
    aten.native_batch_norm.default: BatchNormSignature(4, 5),
    aten._native_batch_norm_legit.default: BatchNormSignature(4, 5),
    aten._native_batch_norm_legit_functional.default: BatchNormSignature(4, 5),
    aten._native_batch_norm_legit.no_stats: BatchNormSignature(2, 3),
    aten._native_batch_norm_legit_no_training.default: BatchNormSignature(4, None),
}


def uses_batch_statistics(info: OpInfo) -> bool:
    """Training mode, or no running statistics to use (``track_running_stats=False``)."""
    sig = _BATCH_NORMS[info.op]
    if sig.training_at is None:
        return False
    has_running = sig.n_channel_args == 4 and info.args[3] is not None and info.args[4] is not None
    return bool(info.args[sig.training_at]) or not has_running


def _per_channel(info: OpInfo, x: Placement, channel: Placement, aux: Placement) -> AxisOption:
    """The input gets ``x``, every per-channel tensor ``channel``; output 0 follows the
    input, the others (saved or updated statistics, ``[C]`` or empty) get ``aux``, or
    stay replicated when empty."""
    ins = (x,) + (channel,) * (len(info.inputs) - 1)
    outs = (x,) + tuple(aux if m.shape and m.shape[0] else R for m in info.outputs[1:])
    return AxisOption(ins, outs)


@register(*_BATCH_NORMS)
def batch_norm(info: OpInfo) -> list[AxisOption]:
    x = info.inputs[0]
    options = [_per_channel(info, Shard(1), Shard(0), Shard(0))]
    if not uses_batch_statistics(info):
        options += [_per_channel(info, Shard(d), R, R) for d in range(x.ndim) if d != 1]
    return options


# Group norm: input [N, C, *], statistics per (sample, group of C/G channels). The batch
# splits freely; channels split when each group is one channel (C == G): otherwise even
# shards of C need not hold whole groups. The local group count follows the shard.


def _group_norm_channels(info: OpInfo) -> tuple[int, int]:
    """(channels, groups) of ``group_norm`` or ``native_group_norm``."""
    x = info.inputs[0]
    if info.op == aten.group_norm.default:
        return x.shape[1], info.args[1]
    return info.args[4], info.args[6]


def _localize_group_norm(info, strategy, args, kwargs, ctx):
    x = info.inputs[0]
    local = local_shape(x.shape, strategy.inputs[0], ctx.mesh_shape)
    channels, groups = _group_norm_channels(info)
    local_groups = groups * local[1] // channels
    if info.op == aten.group_norm.default:
        return with_arg(args, 1, local_groups), kwargs
    args = with_arg(args, 3, local[0])
    args = with_arg(args, 4, local[1])
    return with_arg(args, 6, local_groups), kwargs


@register(aten.group_norm.default, aten.native_group_norm.default, localize=_localize_group_norm)
def group_norm(info: OpInfo) -> list[AxisOption]:
    """``native_group_norm`` also returns mean and rstd ``[N, G]``, split with the input."""
    n_affine = len(info.inputs) - 1
    stats = len(info.outputs) - 1
    options = [AxisOption((Shard(0),) + (R,) * n_affine, (Shard(0),) * (1 + stats))]
    channels, groups = _group_norm_channels(info)
    if channels == groups:
        options.append(AxisOption((Shard(1),) + (Shard(0),) * n_affine, (Shard(1),) * (1 + stats)))
    return options


@register(aten._weight_norm.default)
def weight_norm(info: OpInfo) -> list[AxisOption]:
    """``v * g / |v|``, the norm over every dim but ``dim`` (``g`` is sized 1 there): slices
    along ``dim`` are normalised apart, so ``v`` and ``g`` split there; linear in ``g``."""
    v = info.inputs[0]
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0)
    options = [AxisOption((R, Partial()), (Partial(),))]
    if 0 <= dim < v.ndim:  # -1: one norm over the whole tensor
        options.append(AxisOption((Shard(dim), Shard(dim)), (Shard(dim),)))
    return options
