"""Reductions and scans along dims.

A dim that is not reduced can stay split. A reduced dim that is split leaves each
device with a partial result: a pending sum for ``sum`` (and ``mean``, scaled by the
local share of the count), a pending max/min for ``amax``/``amin``, a pending sum of
counts for ``histc``. Order-dependent ops (softmax, cumsum, topk, sort, argmax, var)
need their dim whole.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.placements import local_shape
from autopar.passes.rules.registry import kernel, register
from autopar.passes.rules.view import norm
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


def _reduced_dims(info: OpInfo, default_all: bool = True) -> tuple[set[int], bool]:
    x = info.inputs[0]
    dims = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(x.ndim)) if default_all else []
    if isinstance(dims, int):
        dims = [dims]
    keepdim = info.args[2] if len(info.args) > 2 else info.kwargs.get("keepdim", False)
    return {norm(d, x.ndim) for d in dims}, bool(keepdim)


def reduce_options(info: OpInfo, reduced_to: Partial | None, kernel_name: str | None = None) -> list[AxisOption]:
    x = info.inputs[0]
    reduced, keepdim = _reduced_dims(info)
    n_out = len(info.outputs)
    options = []
    for d in range(x.ndim):
        if d in reduced:
            if reduced_to is not None:
                options.append(AxisOption((Shard(d),), (reduced_to,) * n_out, kernel_name))
        else:
            o = d if keepdim else d - sum(1 for r in reduced if r < d)
            options.append(AxisOption((Shard(d),), (Shard(o),) * n_out))
    return options


@register(aten.sum.dim_IntList, aten.sum.default)
def sum_(info: OpInfo) -> list[AxisOption]:
    return reduce_options(info, Partial()) + [AxisOption((Partial(),), (Partial(),))]


@register(aten.nansum.default)
def nansum(info: OpInfo) -> list[AxisOption]:
    """A split reduced dim sums; a pending sum may hide a NaN in one part, so none enters."""
    return reduce_options(info, Partial())


@register(aten.mean.dim, aten.mean.default)
def mean(info: OpInfo) -> list[AxisOption]:
    return reduce_options(info, Partial(), "mean_of_shard") + [AxisOption((Partial(),), (Partial(),))]


@kernel("mean_of_shard")
def mean_of_shard(info, strategy, args, kwargs, ctx):
    """Local mean times local count / global count: the shards' results then sum."""
    x = info.inputs[0]
    reduced, _ = _reduced_dims(info)
    local = local_shape(x.shape, strategy.inputs[0], ctx.mesh_shape)
    scale = 1.0
    for d in reduced:
        scale *= local[d] / x.shape[d]
    return info.op(*args, **kwargs) * scale


@register(aten.amax.default, aten.max.default)
def amax(info: OpInfo) -> list[AxisOption]:
    return reduce_options(info, Partial("max"))


@register(aten.amin.default, aten.min.default)
def amin(info: OpInfo) -> list[AxisOption]:
    return reduce_options(info, Partial("min"))


@register(
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.dim,
    aten.var.correction, aten.std.dim, aten.std.correction, aten.logsumexp.default,
    aten.any.dim, aten.all.dim, aten.prod.dim_int, aten.var_mean.correction, aten.any.dims,
    aten.std_mean.correction, aten.median.dim, aten.nanmedian.dim,
)
def reduce_whole_dim(info: OpInfo) -> list[AxisOption]:
    return reduce_options(info, None)


def _along(info: OpInfo, default: int = -1) -> int:
    x = info.inputs[0]
    dim = info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", default)
    return norm(dim, x.ndim)


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(info: OpInfo) -> list[AxisOption]:
    dim = _along(info)
    n_out = len(info.outputs)
    return [AxisOption((Shard(d),), (Shard(d),) * n_out) for d in range(info.inputs[0].ndim) if d != dim]


@register(aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default)
def scan(info: OpInfo) -> list[AxisOption]:
    """A scan needs its dim whole, like softmax."""
    return softmax(info)


@register(aten.cumsum.default)
def cumsum(info: OpInfo) -> list[AxisOption]:
    return softmax(info) + [AxisOption((Partial(),), (Partial(),))]


@register(aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
def sort(info: OpInfo) -> list[AxisOption]:
    dim = info.kwargs.get("dim", -1)
    if len(info.args) > 1 and isinstance(info.args[1], int) and not isinstance(info.args[1], bool):
        dim = info.args[1]
    dim = norm(dim, info.inputs[0].ndim)
    n_out = len(info.outputs)
    return [AxisOption((Shard(d),), (Shard(d),) * n_out) for d in range(info.inputs[0].ndim) if d != dim]


@register(aten.topk.default)
def topk(info: OpInfo) -> list[AxisOption]:
    dim = norm(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", -1), info.inputs[0].ndim)
    return [AxisOption((Shard(d),), (Shard(d),) * 2) for d in range(info.inputs[0].ndim) if d != dim]


@register(aten.histc.default)
def histc(info: OpInfo) -> list[AxisOption]:
    """Counts over any split of the input add up, if the bin range is fixed (min < max);
    with min == max the range comes from the data, which a shard does not see whole."""
    lo = info.args[2] if len(info.args) > 2 else info.kwargs.get("min", 0)
    hi = info.args[3] if len(info.args) > 3 else info.kwargs.get("max", 0)
    if not lo < hi:
        return []
    return [AxisOption((Shard(d),), (Partial(),)) for d in range(info.inputs[0].ndim)]


@register(aten.diff.default)
def diff(info: OpInfo) -> list[AxisOption]:
    """Differences along one dim; ``prepend``/``append`` are split with the input."""
    x = info.inputs[0]
    dim = norm(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", -1), x.ndim)
    n_in = len(info.inputs)
    return [AxisOption((Shard(d),) * n_in, (Shard(d),)) for d in range(x.ndim) if d != dim]
