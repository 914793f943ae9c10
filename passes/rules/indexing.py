"""Gathers and scatters by index tensors: ``x[idx]``, ``index_put_``, ``gather``,
``index_select``, ``index_copy_`` (a static key-value cache's write), ``index_add``,
``scatter`` (DeepSeek-V3's group mask), ``scatter_add``, ``scatter_reduce``.

A dim of ``x`` that is not indexed can stay split. The index tensors can be split
together along a dim of theirs (each device gathers its own rows of the result) while
``x`` stays whole. Gathering and overwriting are linear in the values, so Partial
values pass through.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules.registry import register
from autopar.passes.rules.view import norm
from autopar.passes.op_strategies import AxisOption, OpInfo, TensorMeta

R = Replicate()


def _index_layout(info: OpInfo, indices: list) -> tuple[list[int], int, int]:
    """Indexed dims of x, where the broadcast index dims land in the result, and their count."""
    indexed = [d for d, ix in enumerate(indices) if ix is not None]
    index_ndim = max(ix.ndim for ix in indices if ix is not None)
    consecutive = indexed == list(range(indexed[0], indexed[-1] + 1))
    return indexed, (indexed[0] if consecutive else 0), index_ndim


def _x_dim_in_result(d: int, indexed: list[int], at: int, index_ndim: int) -> int:
    if at > 0 and d < at:
        return d
    return d - sum(1 for i in indexed if i < d) + index_ndim


@register(aten.index.Tensor)
def index(info: OpInfo) -> list[AxisOption]:
    x, indices = info.args[0], list(info.args[1])
    if not any(isinstance(ix, TensorMeta) for ix in indices):
        return []
    indexed, at, index_ndim = _index_layout(info, indices)
    n_ix = len(info.inputs) - 1
    options = [
        AxisOption((Shard(d),) + (R,) * n_ix, (Shard(_x_dim_in_result(d, indexed, at, index_ndim)),))
        for d in range(x.ndim)
        if d not in indexed and d < len(indices) or d >= len(indices)
    ]
    present = [ix for ix in indices if ix is not None]
    if all(ix.shape == present[0].shape for ix in present):  # no broadcasting among indices
        options += [
            AxisOption((R,) + (Shard(k),) * n_ix, (Shard(at + k),)) for k in range(index_ndim)
        ]
    options.append(AxisOption((Partial(),) + (R,) * n_ix, (Partial(),)))
    return options


@register(aten.index_put_.default, aten.index_put.default)
def index_put(info: OpInfo) -> list[AxisOption]:
    """Write ``values`` into ``x`` at the indexed positions; non-indexed dims can be split
    when ``values`` has them whole-sized (else it broadcasts and stays replicated)."""
    x, indices, values = info.args[0], list(info.args[1]), info.args[2]
    n_ix = sum(1 for ix in indices if ix is not None)
    indexed, at, index_ndim = _index_layout(info, indices)
    options = []
    for d in range(x.ndim):
        if d in indexed:
            continue
        r = _x_dim_in_result(d, indexed, at, index_ndim)  # where d sits in x[indices]
        k = r - (index_ndim + x.ndim - len(indexed) - values.ndim)
        v = Shard(k) if k >= 0 and values.shape[k] == x.shape[d] and x.shape[d] > 1 else R
        options.append(AxisOption((Shard(d),) + (R,) * n_ix + (v,), (Shard(d),)))
    options.append(AxisOption((Partial(),) + (R,) * n_ix + (Partial(),), (Partial(),)))
    return options


@register(aten.index_copy_.default, aten.index_copy.default)
def index_copy(info: OpInfo) -> list[AxisOption]:
    """Write ``source``'s slices into ``x`` at ``index`` along ``dim``: every other dim can be
    split, ``source`` (x's dims, ``dim`` as long as the index) split alike."""
    x = info.inputs[0]
    dim = norm(info.args[1], x.ndim)
    options = [AxisOption((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(x.ndim) if d != dim]
    options.append(AxisOption((Partial(), R, Partial()), (Partial(),)))
    return options


@register(aten.gather.default)
def gather(info: OpInfo) -> list[AxisOption]:
    x, index_ = info.inputs[0], info.inputs[1]
    dim = norm(info.args[1], x.ndim)
    options = [
        AxisOption((Shard(d), Shard(d)), (Shard(d),))
        for d in range(x.ndim)
        if d != dim and x.shape[d] == index_.shape[d]
    ]
    options.append(AxisOption((Partial(), R), (Partial(),)))
    return options


@register(aten.index_select.default)
def index_select(info: OpInfo) -> list[AxisOption]:
    x = info.inputs[0]
    dim = norm(info.args[1], x.ndim)
    options = [AxisOption((Shard(d), R), (Shard(d),)) for d in range(x.ndim) if d != dim]
    options.append(AxisOption((R, Shard(0)), (Shard(dim),)))
    options.append(AxisOption((Partial(), R), (Partial(),)))
    return options


@register(aten.index_add.default, aten.index_add_.default)
def index_add(info: OpInfo) -> list[AxisOption]:
    """``x`` plus ``source``'s slices added at ``index`` along ``dim``: linear in both."""
    x = info.inputs[0]
    dim = norm(info.args[1], x.ndim)
    options = [AxisOption((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(x.ndim) if d != dim]
    options.append(AxisOption((Partial(), R, Partial()), (Partial(),)))
    return options


def _scatter_options(info: OpInfo, linear: bool) -> list[AxisOption]:
    """``out = self`` with ``src`` (or a number) written at ``index`` along ``dim``. Any other
    dim d splits ``self``, ``index`` (and ``src``) alike where they all span it whole (only
    ``index``'s extent is written). ``linear``: self and src pending sums give one."""
    x, index_ = info.inputs[0], info.inputs[1]
    dim = norm(info.args[1], x.ndim)
    n = len(info.inputs)
    options = [
        AxisOption((Shard(d),) * n, (Shard(d),))
        for d in range(x.ndim)
        if d != dim and all(m.ndim == x.ndim and m.shape[d] == x.shape[d] for m in info.inputs[1:])
    ]
    if linear:
        options.append(AxisOption((Partial(), R) + (Partial(),) * (n - 2), (Partial(),)))
    return options


@register(aten.scatter.src, aten.scatter_.src, aten.scatter_add.default, aten.scatter_add_.default)
def scatter_src(info: OpInfo) -> list[AxisOption]:
    return _scatter_options(info, linear=True)


@register(aten.scatter.value, aten.scatter_.value)
def scatter_value(info: OpInfo) -> list[AxisOption]:
    """Written zeros keep a pending sum one (each part is zeroed there)."""
    value = info.args[3] if len(info.args) > 3 else info.kwargs.get("value")
    return _scatter_options(info, linear=value == 0)


@register(aten.scatter_reduce.two, aten.scatter_reduce_.two)
def scatter_reduce(info: OpInfo) -> list[AxisOption]:
    """A sum that includes ``self`` is linear; the other reductions are not."""
    reduce = info.args[4] if len(info.args) > 4 else info.kwargs.get("reduce")
    include_self = info.args[5] if len(info.args) > 5 else info.kwargs.get("include_self", True)
    return _scatter_options(info, linear=reduce == "sum" and include_self)
