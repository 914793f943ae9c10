"""Ops that create tensors: they read no values, so their output can be born in any
layout (each device makes its own slice) — except ``arange``, whose values depend on
the position and which is made whole. ``empty*`` values are unspecified; the local
kernel fills zeros so that replicated copies agree and simulations are repeatable.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules.registry import kernel, local_out_shape, register, with_arg
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


def born_sharded(info: OpInfo, input_unread: bool, kernel_name: str | None = None) -> list[AxisOption]:
    ins = tuple(None if input_unread else R for _ in info.inputs)
    out = info.outputs[0]
    options = [AxisOption(ins, (Shard(d),), kernel_name) for d in range(out.ndim)]
    return options + _replicated_by(kernel_name, ins)


def _replicated_by(kernel_name: str | None, ins: tuple) -> list[AxisOption]:
    """The kernel runs when replicated too, even where no dim splits (a 0-d ``empty``):
    every device then makes the same zeros rather than its own garbage."""
    return [AxisOption(ins, (R,), kernel_name)] if kernel_name else []


def _localize_size(index: int):
    def localize(info, strategy, args, kwargs, ctx):
        return with_arg(args, index, local_out_shape(info, strategy, ctx)), kwargs

    return localize


@register(aten.zeros.default, aten.ones.default, aten.full.default, localize=_localize_size(0))
def filled(info: OpInfo) -> list[AxisOption]:
    return born_sharded(info, input_unread=True)


@register(aten.empty.memory_format, localize=_localize_size(0), values_unspecified=True)
def empty(info: OpInfo) -> list[AxisOption]:
    return born_sharded(info, input_unread=True, kernel_name="zeros_for_empty")


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, localize=_localize_size(1))
def new_filled(info: OpInfo) -> list[AxisOption]:
    return born_sharded(info, input_unread=True)


@register(aten.new_empty.default, localize=_localize_size(1), values_unspecified=True)
def new_empty(info: OpInfo) -> list[AxisOption]:
    return born_sharded(info, input_unread=True, kernel_name="zeros_for_empty")


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default)
def made_whole(info: OpInfo) -> list[AxisOption]:
    return []


def _like(info: OpInfo, zeros: bool, kernel_name: str | None = None) -> list[AxisOption]:
    """``*_like`` takes the local shape of its input: output laid out as the input."""
    x = info.inputs[0]
    options = [AxisOption((Shard(d),), (Shard(d),), kernel_name) for d in range(x.ndim)]
    if zeros:
        options.append(AxisOption((Partial(),), (Partial(),)))
    return options + _replicated_by(kernel_name, (R,))


@register(aten.zeros_like.default)
def zeros_like(info: OpInfo) -> list[AxisOption]:
    return _like(info, zeros=True)


@register(aten.ones_like.default, aten.full_like.default)
def ones_like(info: OpInfo) -> list[AxisOption]:
    return _like(info, zeros=False)


@register(aten.empty_like.default, values_unspecified=True)
def empty_like(info: OpInfo) -> list[AxisOption]:
    return _like(info, zeros=False, kernel_name="zeros_for_empty")


_ZEROS_FOR = {
    "aten.empty.memory_format": lambda args, kw: torch.zeros(*args[:1], **_creation_kwargs(kw)),
    "aten.new_empty.default": lambda args, kw: args[0].new_zeros(args[1], **_creation_kwargs(kw)),
    "aten.empty_like.default": lambda args, kw: torch.zeros_like(args[0], **_creation_kwargs(kw)),
}


def _creation_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in ("dtype", "device", "layout")}


@kernel("zeros_for_empty")
def zeros_for_empty(info, strategy, args, kwargs, ctx):
    return _ZEROS_FOR[str(info.op)](args, kwargs)
