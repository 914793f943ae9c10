"""Views and data movement: reshape, transpose, slicing, splitting, joining, expanding,
repeating, rolling, flipping, and writing a slice back (``slice_scatter``).

They move no data between devices: a shard of the input maps to a shard of the output
(a dim is renamed, or folded into a larger one as its leading part), and a pending sum
(Partial) stays pending. A dim that is cut by the op (sliced, split, concatenated)
cannot stay sharded.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules.registry import kernel, local_out_shape, register, with_arg
from autopar.passes.op_strategies import AxisOption, OpInfo

R = Replicate()


def norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def remap(info: OpInfo, dim_map: dict[int, int], partial: bool = True) -> list[AxisOption]:
    """One input (the first), one or more outputs: S(in) -> S(out) for each mapped dim."""
    n_in, n_out = len(info.inputs), len(info.outputs)
    rest = (R,) * (n_in - 1)
    options = [
        AxisOption((Shard(i),) + rest, (Shard(o),) * n_out) for i, o in dim_map.items()
    ]
    if partial:
        options.append(AxisOption((Partial(),) + rest, (Partial(),) * n_out))
    return options


def reshape_dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim that a shard carries over to under a reshape.

    Cutting dim ``a`` into N pieces cuts the flat data into prod(shape[:a]) outer
    blocks, each into N contiguous parts. Two dims give the same cut exactly when
    their prefix products are equal (and both divide by N, which ``fits`` checks).
    """
    by_prefix: dict[int, int] = {}
    prefix = 1
    for b, size in enumerate(out_shape):
        if size > 1:
            by_prefix.setdefault(prefix, b)
        prefix *= size
    mapping = {}
    prefix = 1
    for a, size in enumerate(in_shape):
        if size > 1 and prefix in by_prefix:
            mapping[a] = by_prefix[prefix]
        prefix *= size
    return mapping


def _localize_shape(index: int):
    def localize(info, strategy, args, kwargs, ctx):
        return with_arg(args, index, local_out_shape(info, strategy, ctx)), kwargs

    return localize


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, localize=_localize_shape(1))
def reshape(info: OpInfo) -> list[AxisOption]:
    return remap(info, reshape_dim_map(info.inputs[0].shape, info.outputs[0].shape))


@register(aten.flatten.using_ints)
def flatten(info: OpInfo) -> list[AxisOption]:
    return remap(info, reshape_dim_map(info.inputs[0].shape, info.outputs[0].shape))


def _unflatten_localize(info, strategy, args, kwargs, ctx):
    dim = norm(args[1], info.inputs[0].ndim)
    local = local_out_shape(info, strategy, ctx)
    return with_arg(args, 2, local[dim : dim + len(args[2])]), kwargs


@register(aten.unflatten.int, localize=_unflatten_localize)
def unflatten(info: OpInfo) -> list[AxisOption]:
    return remap(info, reshape_dim_map(info.inputs[0].shape, info.outputs[0].shape))


@register(aten.transpose.int, aten.swapaxes.default)
def transpose(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    a, b = norm(info.args[1], n), norm(info.args[2], n)
    swap = {a: b, b: a}
    return remap(info, {d: swap.get(d, d) for d in range(n)})


@register(aten.t.default, aten.numpy_T.default)
def t(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    return remap(info, {d: n - 1 - d for d in range(n)})


@register(aten.permute.default)
def permute(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    perm = [norm(d, n) for d in info.args[1]]
    return remap(info, {src: dst for dst, src in enumerate(perm)})


@register(aten.unsqueeze.default)
def unsqueeze(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    at = norm(info.args[1], n + 1)
    return remap(info, {d: d if d < at else d + 1 for d in range(n)})


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(info: OpInfo) -> list[AxisOption]:
    shape = info.inputs[0].shape
    out_dims = iter(range(info.outputs[0].ndim))
    mapping = {}
    for d, size in enumerate(shape):
        if len(info.outputs[0].shape) == len(shape) or not _squeezed(info, d, size):
            mapping[d] = next(out_dims)
    options = remap(info, {d: o for d, o in mapping.items() if shape[d] > 1})
    if info.op == aten.squeeze.default:  # a shard of one row must not be squeezed away
        options = [AxisOption(o.inputs, o.outputs, "squeeze_whole_ones") for o in options]
    return options


@kernel("squeeze_whole_ones")
def squeeze_whole_ones(info, strategy, args, kwargs, ctx):
    """``squeeze()`` of the dims that are 1 in the whole tensor, not in this shard."""
    ones = [d for d, size in enumerate(info.inputs[0].shape) if size == 1]
    return aten.squeeze.dims(args[0], ones)


def _squeezed(info: OpInfo, d: int, size: int) -> bool:
    if size != 1:
        return False
    if len(info.args) < 2:
        return True
    dims = info.args[1] if isinstance(info.args[1], (list, tuple)) else [info.args[1]]
    return d in {norm(x, info.inputs[0].ndim) for x in dims}


@register(aten.expand.default, localize=_localize_shape(1))
def expand(info: OpInfo) -> list[AxisOption]:
    """A real dim keeps its shard; a broadcast dim can be born sharded (each device
    expands to its own slice) from a replicated input."""
    src, out = info.inputs[0], info.outputs[0]
    options = []
    for d in range(out.ndim):
        k = d - (out.ndim - src.ndim)
        if k >= 0 and src.shape[k] == out.shape[d]:
            options.append(AxisOption((Shard(k),), (Shard(d),)))
        else:
            options.append(AxisOption((R,), (Shard(d),)))
    options.append(AxisOption((Partial(),), (Partial(),)))
    return options


def _except(info: OpInfo, dim: int, shift_after: int = 0) -> dict[int, int]:
    n = info.inputs[0].ndim
    return {d: (d - shift_after if d > dim else d) for d in range(n) if d != dim}


@register(aten.slice.Tensor)
def slice_(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    dim = norm(info.args[1] if len(info.args) > 1 else 0, n)
    mapping = _except(info, dim)
    if info.outputs[0].shape == info.inputs[0].shape:  # a slice that keeps everything
        mapping[dim] = dim
    return remap(info, mapping)


@register(aten.select.int)
def select(info: OpInfo) -> list[AxisOption]:
    dim = norm(info.args[1], info.inputs[0].ndim)
    return remap(info, _except(info, dim, shift_after=1))


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(info: OpInfo) -> list[AxisOption]:
    dim = norm(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0), info.inputs[0].ndim)
    return remap(info, _except(info, dim))


@register(aten.unbind.int)
def unbind(info: OpInfo) -> list[AxisOption]:
    dim = norm(info.args[1] if len(info.args) > 1 else 0, info.inputs[0].ndim)
    return remap(info, _except(info, dim, shift_after=1))


def _join(info: OpInfo, dim_map: dict[int, int]) -> list[AxisOption]:
    n_in = len(info.inputs)
    options = [AxisOption((Shard(d),) * n_in, (Shard(o),)) for d, o in dim_map.items()]
    options.append(AxisOption((Partial(),) * n_in, (Partial(),)))
    return options


@register(aten.cat.default)
def cat(info: OpInfo) -> list[AxisOption]:
    n = info.outputs[0].ndim
    if any(m.ndim != n for m in info.inputs):  # legacy empty 1-D inputs: keep it simple
        return []
    dim = norm(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), n)
    return _join(info, {d: d for d in range(n) if d != dim})


@register(aten.stack.default)
def stack(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    dim = norm(info.args[1] if len(info.args) > 1 else info.kwargs.get("dim", 0), n + 1)
    return _join(info, {d: (d if d < dim else d + 1) for d in range(n)})


@register(aten.repeat.default)
def repeat(info: OpInfo) -> list[AxisOption]:
    """A dim repeated once keeps its split; new leading dims (``repeats`` longer than
    the input's rank) shift the output dims. Tiling is linear: a pending sum stays one."""
    x = info.inputs[0]
    repeats = list(info.args[1])
    shift = len(repeats) - x.ndim
    return remap(info, {d: d + shift for d in range(x.ndim) if repeats[d + shift] == 1})


def _dims_arg(info: OpInfo, index: int, name: str) -> list[int]:
    dims = info.args[index] if len(info.args) > index else info.kwargs.get(name, [])
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return [norm(d, info.inputs[0].ndim) for d in dims]


@register(aten.roll.default)
def roll(info: OpInfo) -> list[AxisOption]:
    """Dims not rolled keep their split; ``roll`` with no dims rolls the flattened tensor."""
    rolled = _dims_arg(info, 2, "dims")
    n = info.inputs[0].ndim
    return remap(info, {d: d for d in range(n) if d not in rolled} if rolled else {})


@register(aten.flip.default)
def flip(info: OpInfo) -> list[AxisOption]:
    flipped = _dims_arg(info, 1, "dims")
    return remap(info, {d: d for d in range(info.inputs[0].ndim) if d not in flipped})


def _repeat_interleave_localize(info, strategy, args, kwargs, ctx):
    """``output_size`` is the repeated dim's length: this shard's."""
    if kwargs.get("output_size") is None:
        return args, kwargs
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    local = local_out_shape(info, strategy, ctx)
    return args, {**kwargs, "output_size": local[0 if dim is None else norm(dim, info.inputs[0].ndim)]}


@register(aten.repeat_interleave.self_int, localize=_repeat_interleave_localize)
def repeat_interleave(info: OpInfo) -> list[AxisOption]:
    """Each element repeated ``repeats`` times in place: a block of rows becomes the block
    of their copies, so even the repeated dim keeps its split (the flattened tensor's
    first dim, with no ``dim``)."""
    x = info.inputs[0]
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    if dim is None:
        return remap(info, {0: 0} if x.ndim else {})
    return remap(info, {d: d for d in range(x.ndim)})


@register(aten.repeat_interleave.self_Tensor)
def repeat_interleave_counts(info: OpInfo) -> list[AxisOption]:
    """Per-row repeat counts (a tensor, replicated): every dim but the repeated one splits."""
    x = info.inputs[0]
    dim = info.args[2] if len(info.args) > 2 else info.kwargs.get("dim")
    if dim is None:
        return []
    return remap(info, {d: d for d in range(x.ndim) if d != norm(dim, x.ndim)})


@register(aten.diagonal.default)
def diagonal(info: OpInfo) -> list[AxisOption]:
    """The other dims keep their order; the diagonal is appended last."""
    n = info.inputs[0].ndim
    d1 = norm(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim1", 0), n)
    d2 = norm(info.args[3] if len(info.args) > 3 else info.kwargs.get("dim2", 1), n)
    rest = [d for d in range(n) if d not in (d1, d2)]
    return remap(info, {d: i for i, d in enumerate(rest)})


def _scatter_view(info: OpInfo, dim: int, src_dims: dict[int, int]) -> list[AxisOption]:
    """``self`` with ``src`` written into a view of it: S(d) of ``self`` with ``src``'s dim
    ``src_dims[d]``; two pending sums stay one."""
    options = [AxisOption((Shard(d), Shard(k)), (Shard(d),)) for d, k in src_dims.items() if d != dim]
    options.append(AxisOption((Partial(), Partial()), (Partial(),)))
    return options


@register(aten.slice_scatter.default)
def slice_scatter(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    dim = norm(info.args[2] if len(info.args) > 2 else info.kwargs.get("dim", 0), n)
    return _scatter_view(info, dim, {d: d for d in range(n)})


@register(aten.select_scatter.default)
def select_scatter(info: OpInfo) -> list[AxisOption]:
    n = info.inputs[0].ndim
    dim = norm(info.args[2], n)
    return _scatter_view(info, dim, {d: d - (d > dim) for d in range(n)})
