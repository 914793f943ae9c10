"""Random calls of every op family, for the SPMD property test.

Each sampler takes a ``random.Random`` and returns ``(op, args, kwargs)`` with real
tensors of random shapes. Sizes are drawn from values that divide by 2, 4 and 8 and
from ones that do not, so both kept and excluded strategies are exercised.
"""

from __future__ import annotations

import random

import torch
from torch.ops import aten

SIZES = [2, 4, 6, 8, 12, 16]


def _t(rng: random.Random, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(shape, generator=gen)


def _ints(rng: random.Random, high: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randint(0, high, shape, generator=gen)


def _shape(rng: random.Random, ndim: int) -> list[int]:
    return [rng.choice(SIZES) for _ in range(ndim)]


def _broadcast_partner(rng: random.Random, shape: list[int]) -> list[int]:
    """A shape that broadcasts against ``shape``: some dims 1, maybe fewer dims."""
    partner = [1 if rng.random() < 0.3 else s for s in shape]
    return partner[rng.randrange(len(partner)) :] if rng.random() < 0.3 else partner


def unary(op):
    return lambda rng: (op, (_t(rng, *_shape(rng, rng.randint(1, 4))),), {})


def binary(op):
    def sample(rng):
        shape = _shape(rng, rng.randint(1, 4))
        other = _broadcast_partner(rng, shape)
        a, b = _t(rng, *shape), _t(rng, *other)
        if rng.random() < 0.5:
            a, b = b, a
        if op in (aten.div.Tensor,):
            b = b.abs() + 1
        return op, (a, b), {}

    return sample


def scalar_op(op, *values):
    return lambda rng: (op, (_t(rng, *_shape(rng, rng.randint(1, 3))),) + values, {})


def reshape_sample(rng):
    b, s, h, d = _shape(rng, 4)
    x = _t(rng, b, s, h * d)
    target = rng.choice([[b, s, h, d], [b * s, h * d], [b, s * h * d], [b, s, -1, d]])
    return aten.view.default, (x.contiguous(), target), {}


def merge_sample(rng):
    b, s, h, d = _shape(rng, 4)
    x = _t(rng, b, s, h, d)
    return aten.reshape.default, (x, rng.choice([[b, s, h * d], [b * s, h * d], [b * s * h, d]])), {}


def transpose_sample(rng):
    n = rng.randint(2, 4)
    return aten.transpose.int, (_t(rng, *_shape(rng, n)), rng.randrange(n), -1), {}


def permute_sample(rng):
    n = rng.randint(2, 4)
    perm = list(range(n))
    rng.shuffle(perm)
    return aten.permute.default, (_t(rng, *_shape(rng, n)), perm), {}


def unsqueeze_sample(rng):
    n = rng.randint(1, 3)
    return aten.unsqueeze.default, (_t(rng, *_shape(rng, n)), rng.randint(-n - 1, n)), {}


def expand_sample(rng):
    shape = _shape(rng, 3)
    src = [1 if rng.random() < 0.5 else s for s in shape]
    return aten.expand.default, (_t(rng, *src), [rng.choice(SIZES)] + shape), {}


def slice_sample(rng):
    shape = _shape(rng, 3)
    dim = rng.randrange(3)
    start = rng.randrange(shape[dim] // 2 + 1)
    return aten.slice.Tensor, (_t(rng, *shape), dim, start, shape[dim]), {}


def select_sample(rng):
    shape = _shape(rng, 3)
    dim = rng.randrange(3)
    return aten.select.int, (_t(rng, *shape), dim, rng.randrange(shape[dim])), {}


def split_sample(rng):
    shape = _shape(rng, 3)
    dim = rng.randrange(3)
    return aten.split.Tensor, (_t(rng, *shape), max(1, shape[dim] // 2), dim), {}


def chunk_sample(rng):
    shape = _shape(rng, 3)
    return aten.chunk.default, (_t(rng, *shape), 2, rng.randrange(3)), {}


def cat_sample(rng):
    shape = _shape(rng, 3)
    dim = rng.randrange(3)
    other = list(shape)
    other[dim] = rng.choice(SIZES)
    return aten.cat.default, ([_t(rng, *shape), _t(rng, *other)], dim), {}


def broadcast_tensors_sample(rng):
    shape = _shape(rng, rng.randint(1, 4))
    tensors = [_t(rng, *shape), _t(rng, *_broadcast_partner(rng, shape))]
    return aten.broadcast_tensors.default, (tensors[::-1] if rng.random() < 0.5 else tensors,), {}


def stack_sample(rng):
    shape = _shape(rng, 2)
    return aten.stack.default, ([_t(rng, *shape), _t(rng, *shape)], rng.randrange(3)), {}


def mm_sample(rng):
    m, k, n = _shape(rng, 3)
    return aten.mm.default, (_t(rng, m, k), _t(rng, k, n)), {}


def bmm_sample(rng):
    b, m, k, n = _shape(rng, 4)
    return aten.bmm.default, (_t(rng, b, m, k), _t(rng, b, k, n)), {}


def addmm_sample(rng):
    m, k, n = _shape(rng, 3)
    bias = _t(rng, n) if rng.random() < 0.5 else _t(rng, m, n)
    return aten.addmm.default, (bias, _t(rng, m, k), _t(rng, k, n)), {}


def linear_sample(rng):
    b, s, k, n = _shape(rng, 4)
    args = (_t(rng, b, s, k), _t(rng, n, k)) + ((_t(rng, n),) if rng.random() < 0.5 else ())
    return aten.linear.default, args, {}


def matmul_sample(rng):
    b, m, k, n = _shape(rng, 4)
    rhs = _t(rng, k, n) if rng.random() < 0.5 else _t(rng, b, k, n)
    return aten.matmul.default, (_t(rng, b, m, k), rhs), {}


def einsum_sample(rng):
    b, h, s, d = _shape(rng, 4)
    return aten.einsum.default, ("bhsd,bhtd->bhst", [_t(rng, b, h, s, d), _t(rng, b, h, s, d)]), {}


def embedding_sample(rng):
    v, h = _shape(rng, 2)
    return aten.embedding.default, (_t(rng, v, h), _ints(rng, v, *_shape(rng, 2))), {}


def layer_norm_sample(rng):
    b, s, h = _shape(rng, 3)
    return aten.layer_norm.default, (_t(rng, b, s, h), [h], _t(rng, h), _t(rng, h)), {}


def rms_norm_sample(rng):
    b, s, h = _shape(rng, 3)
    return aten.rms_norm.default, (_t(rng, b, s, h), [h], _t(rng, h), 1e-6), {}


def sdpa_sample(rng):
    b, s, d = _shape(rng, 3)
    h_kv = rng.choice([2, 4])
    h_q = h_kv * rng.choice([1, 2])
    q, k, v = _t(rng, b, h_q, s, d), _t(rng, b, h_kv, s, d), _t(rng, b, h_kv, s, d)
    kwargs = {"enable_gqa": h_q != h_kv}
    if rng.random() < 0.5:
        kwargs["is_causal"] = True
        return aten.scaled_dot_product_attention.default, (q, k, v), kwargs
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s).contiguous()
    return aten.scaled_dot_product_attention.default, (q, k, v, mask), kwargs


def reduce_sample(op, keepdim=True):
    def sample(rng):
        n = rng.randint(1, 4)
        dims = sorted(rng.sample(range(n), rng.randint(1, n)))
        return op, (_t(rng, *_shape(rng, n)), dims, keepdim and rng.random() < 0.5), {}

    return sample


def along_sample(op, *extra):
    def sample(rng):
        n = rng.randint(1, 3)
        return op, (_t(rng, *_shape(rng, n)), rng.randrange(n)) + extra, {}

    return sample


def topk_sample(rng):
    shape = _shape(rng, 2)
    return aten.topk.default, (_t(rng, *shape), 2, rng.randrange(2)), {}


def sort_sample(rng):
    return aten.sort.default, (_t(rng, *_shape(rng, 2)), rng.randrange(2)), {}


def histc_sample(rng):
    return aten.histc.default, (_ints(rng, 4, *_shape(rng, 2)).float(), 4, 0, 3), {}


def cross_entropy_sample(rng):
    n, c = _shape(rng, 2)
    return aten.cross_entropy_loss.default, (_t(rng, n, c), _ints(rng, c, n), None, rng.choice([0, 2])), {}


def mse_sample(rng):
    shape = _shape(rng, 2)
    return aten.mse_loss.default, (_t(rng, *shape), _t(rng, *shape), rng.choice([0, 1, 2])), {}


def index_sample(rng):
    t, h = _shape(rng, 2)
    return aten.index.Tensor, (_t(rng, t, h), [_ints(rng, t, rng.choice(SIZES))]), {}


def index_put_sample(rng):
    t, h = _shape(rng, 2)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return aten.index_put_.default, (_t(rng, t, h), [perm], _t(rng, t, h)), {}


def index_copy_sample(rng):
    """A static key-value cache's write: new positions' rows copied in along dim 2."""
    b, h, d = _shape(rng, 3)
    slots = torch.randperm(8, generator=torch.Generator().manual_seed(rng.randrange(2**31)))[:2]
    return aten.index_copy_.default, (_t(rng, b, h, 8, d), 2, slots, _t(rng, b, h, 2, d)), {}


def gather_sample(rng):
    a, b = _shape(rng, 2)
    return aten.gather.default, (_t(rng, a, b), 1, _ints(rng, b, a, rng.choice(SIZES))), {}


def empty_like_sample(rng):
    return aten.empty_like.default, (_t(rng, *_shape(rng, 2)),), {}


def new_ones_sample(rng):
    return aten.new_ones.default, (_t(rng, 2), _shape(rng, 2)), {}


def grouped_mm_sample(rng):
    from transformers.integrations import moe  # noqa: F401  (registers the custom op)

    e, k, n = rng.choice([2, 4, 8]), rng.choice(SIZES), rng.choice(SIZES)
    counts = torch.tensor([rng.randrange(4) for _ in range(e)])
    x = _t(rng, int(counts.sum()) or 1, k)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    if int(counts.sum()) == 0:
        offsets[-1] = 1
    return torch.ops.transformers.grouped_mm_fallback.default, (x, _t(rng, e, k, n), offsets), {}



CONV_OPS = {1: aten.conv1d.default, 2: aten.conv2d.default, 3: aten.conv3d.default}
CONV_TRANSPOSE_OPS = {
    1: aten.conv_transpose1d.default, 2: aten.conv_transpose2d.input, 3: aten.conv_transpose3d.input,
}


CHANNELS = [2, 4, 6, 8]  # image ops run on every device of the mesh: kept small


def _spatial(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([3, 4, 5]) for _ in range(n)]


def _conv_groups(rng: random.Random, grouped: bool) -> tuple[int, int, int]:
    """(groups, input channels, output channels): depthwise, coprime per-group sizes
    (whole groups split) or a common factor (they must not)."""
    if not grouped:
        return 1, rng.choice(CHANNELS), rng.choice(CHANNELS)
    g = rng.choice([2, 4, 8])
    k, m = rng.choice([(1, 1), (1, 2), (1, 3), (2, 1), (2, 3), (3, 2), (2, 2), (2, 1)])
    return g, g * k, g * m


def conv_sample(grouped: bool = False, transposed: bool = False, generic: bool = False):
    """``convNd`` / ``conv_transposeNd`` / ``convolution``: 1-3 spatial dims, batched or
    not (the plain forms), with or without bias, strides and padding."""

    def sample(rng):
        n = rng.randint(1, 3)
        g, c_in, c_out = _conv_groups(rng, grouped)
        kernel = [rng.choice([1, 2, 3]) for _ in range(n)]
        weight_shape = [c_in, c_out // g] if transposed else [c_out, c_in // g]
        batched = generic or transposed or rng.random() < 0.7
        x = _t(rng, *([rng.choice(CHANNELS)] if batched else []), c_in, *_spatial(rng, n))
        w = _t(rng, *weight_shape, *kernel)
        bias = _t(rng, c_out) if rng.random() < 0.6 else None
        stride, padding = [rng.choice([1, 2])] * n, [rng.choice([0, 1])] * n
        if generic:
            args = (x, w, bias, stride, padding, [1] * n, transposed, [0] * n, g)
            return aten.convolution.default, args, {}
        if transposed:
            return CONV_TRANSPOSE_OPS[n], (x, w, bias, stride, padding, [0] * n, g), {}
        return CONV_OPS[n], (x, w, bias, stride, padding, [1] * n, g), {}

    return sample


POOLS = {
    "max_pool": {1: aten.max_pool1d.default, 2: aten.max_pool2d.default, 3: aten.max_pool3d.default},
    "max_pool_with_indices": {
        1: aten.max_pool1d_with_indices.default, 2: aten.max_pool2d_with_indices.default,
        3: aten.max_pool3d_with_indices.default,
    },
    "avg_pool": {1: aten.avg_pool1d.default, 2: aten.avg_pool2d.default, 3: aten.avg_pool3d.default},
}
ADAPTIVE_POOLS = {
    "adaptive_avg_pool": {
        1: aten.adaptive_avg_pool1d.default, 2: aten.adaptive_avg_pool2d.default,
        3: aten.adaptive_avg_pool3d.default,
    },
    "adaptive_max_pool": {
        1: aten.adaptive_max_pool1d.default, 2: aten.adaptive_max_pool2d.default,
        3: aten.adaptive_max_pool3d.default,
    },
}


def _image(rng: random.Random, n_spatial: int) -> torch.Tensor:
    """``[N, C, *spatial]``, or unbatched ``[C, *spatial]`` now and then."""
    leading = [rng.choice(CHANNELS) for _ in range(2 if rng.random() < 0.8 else 1)]
    return _t(rng, *leading, *_spatial(rng, n_spatial))


def pool_sample(kind: str):
    def sample(rng):
        n = rng.randint(1, 3)
        kernel = [rng.choice([2, 3])] * n
        return POOLS[kind][n], (_image(rng, n), kernel, [rng.choice([1, 2])] * n, [1] * n), {}

    return sample


def adaptive_pool_sample(kind: str):
    def sample(rng):
        n = rng.randint(1, 3)
        return ADAPTIVE_POOLS[kind][n], (_image(rng, n), [rng.choice([1, 2, 3])] * n), {}

    return sample


def upsample_sample(rng):
    x = _t(rng, *_shape(rng, 2), *_spatial(rng, 2))
    if rng.random() < 0.5:
        return aten.upsample_nearest2d.vec, (x, None, [2.0, 1.5]), {}
    return aten.upsample_bilinear2d.vec, (x, [7, 9], rng.random() < 0.5, None), {}


BATCH_NORMS = [
    aten.batch_norm.default, aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit.no_stats,
]


def batch_norm_sample(rng):
    """Any batch-norm form, training (batch statistics) or eval (running statistics)."""
    op = rng.choice(BATCH_NORMS)
    n, c = rng.choice(SIZES), rng.choice(SIZES)
    x = _t(rng, n, c, *_spatial(rng, rng.randint(0, 2)))
    affine = rng.random() < 0.7
    weight, bias = (_t(rng, c), _t(rng, c)) if affine else (None, None)
    running = (_t(rng, c), _t(rng, c).abs() + 0.5)
    training = rng.random() < 0.5
    if op == aten._native_batch_norm_legit.no_stats:
        return op, (x, weight, bias, True, 0.1, 1e-5), {}
    if op == aten._native_batch_norm_legit_no_training.default:
        return op, (x, weight, bias, *running, 0.1, 1e-5), {}
    if op == aten.batch_norm.default:
        return op, (x, weight, bias, *running, training, 0.1, 1e-5, False), {}
    return op, (x, weight, bias, *running, training, 0.1, 1e-5), {}


def group_norm_sample(rng):
    groups = rng.choice([1, 2, 4])
    c = groups * rng.choice([1, 1, 2, 3])
    x = _t(rng, rng.choice(SIZES), c, *_spatial(rng, rng.randint(0, 2)))
    weight, bias = _t(rng, c), _t(rng, c)
    if rng.random() < 0.5:
        return aten.group_norm.default, (x, groups, weight, bias, 1e-5, False), {}
    hw = x[0, 0].numel()
    return aten.native_group_norm.default, (x, weight, bias, x.shape[0], c, hw, groups, 1e-5), {}


def pad_sample(rng):
    x = _t(rng, *_shape(rng, rng.randint(1, 4)))
    widths = [rng.choice([0, 0, 1, 2]) for _ in range(2 * rng.randint(1, x.ndim))]
    if rng.random() < 0.5:
        return aten.constant_pad_nd.default, (x, widths, rng.choice([0.0, -100.0])), {}
    if rng.random() < 0.5:
        mode = rng.choice(["reflect", "replicate", "circular"])
        x = _t(rng, *_shape(rng, 2), rng.choice([4, 5]))  # these modes pad a 3-D input's last dim
        return aten.pad.default, (x, [rng.choice([0, 1, 2]), rng.choice([0, 1, 2])], mode), {}
    return aten.pad.default, (x, widths, "constant", rng.choice([None, 0.0, -100.0])), {}


def repeat_sample(rng):
    x = _t(rng, *_shape(rng, rng.randint(1, 3)))
    repeats = [rng.choice([1, 1, 2]) for _ in range(x.ndim + rng.randint(0, 1))]
    return aten.repeat.default, (x, repeats), {}


def copy_sample(rng):
    """``copy_`` into a tensor from a broadcast source, as ``shifted[:, 1:] = ...`` does."""
    shape = _shape(rng, rng.randint(1, 3))
    return aten.copy_.default, (_t(rng, *shape), _t(rng, *_broadcast_partner(rng, shape))), {}


def fill_sample(rng):
    x = _t(rng, *_shape(rng, rng.randint(1, 3)))
    if rng.random() < 0.5:
        return aten.fill_.Tensor, (x, torch.tensor(rng.random())), {}
    return aten.fill_.Scalar, (x, rng.random()), {}


def arange_sample(rng):
    if rng.random() < 0.5:
        return aten.arange.default, (rng.choice(SIZES),), {}
    return aten.arange.start_step, (1, rng.choice(SIZES) * 2, 2), {}


def scalar_tensor_sample(rng):
    return aten.scalar_tensor.default, (rng.random(),), {"dtype": torch.float32}

def weight_norm_sample(rng):
    """Wav2Vec2's positional conv: ``g`` is 1 in every dim but ``dim``."""
    v = _t(rng, *_shape(rng, 3))
    dim = rng.choice([0, 2])
    g = _t(rng, *[s if d == dim else 1 for d, s in enumerate(v.shape)])
    return aten._weight_norm.default, (v, g, dim), {}


def scatter_sample(op, value=None):
    """DeepSeek-V3's group mask: ``zeros.scatter_(1, top_groups, 1)``; or rows of ``src``."""

    def sample(rng):
        a, b = _shape(rng, 2)
        index = _ints(rng, b, a, rng.choice([1, 2]))
        if value is not None:
            return op, (_t(rng, a, b), 1, index, rng.choice([value, 0.0])), {}
        return op, (_t(rng, a, b), 1, index, _t(rng, a, index.shape[1])), {}

    return sample


def index_add_sample(rng):
    t, h = _shape(rng, 2)
    return aten.index_add_.default, (_t(rng, t, h), 0, _ints(rng, t, 3), _t(rng, 3, h)), {}


def reflection_pad_sample(rng):
    return aten.reflection_pad2d.default, (_t(rng, rng.choice(SIZES), 4, 5), [1, 2, 0, 1]), {}


def drawn(op, *values, **kwargs):
    """A random op making a tensor of a random shape (``rand``, ``randint``)."""
    return lambda rng: (op, (*values, _shape(rng, rng.randint(1, 3))), dict(kwargs))


def bernoulli_sample(rng):
    """Probabilities in [0, 1]."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return aten.bernoulli.default, (torch.rand(_shape(rng, rng.randint(1, 3)), generator=gen),), {}


SAMPLERS = {
    "add": binary(aten.add.Tensor), "sub": binary(aten.sub.Tensor), "mul": binary(aten.mul.Tensor),
    "div": binary(aten.div.Tensor), "eq": binary(aten.eq.Tensor), "maximum": binary(aten.maximum.default),
    "neg": unary(aten.neg.default), "gelu": unary(aten.gelu.default), "silu": unary(aten.silu.default),
    "tanh": unary(aten.tanh.default), "rsqrt": scalar_op(aten.add.Tensor, 3.0),
    "pow": scalar_op(aten.pow.Tensor_Scalar, 2), "dropout_eval": scalar_op(aten.dropout.default, 0.0, True),
    # random ops: every rank's shard drawn from the run's key (autopar.passes.randomness)
    "dropout": scalar_op(aten.dropout.default, 0.3, True),
    "native_dropout": scalar_op(aten.native_dropout.default, 0.3, True),
    "rand_like": unary(aten.rand_like.default), "randn_like": unary(aten.randn_like.default),
    "randint_like": scalar_op(aten.randint_like.default, 9), "bernoulli_p": scalar_op(aten.bernoulli.p, 0.3),
    "bernoulli": bernoulli_sample, "rand": drawn(aten.rand.default), "randn": drawn(aten.randn.default),
    "randint": drawn(aten.randint.low, 2, 11),
    "to": scalar_op(aten.to.dtype, torch.float64), "clone": unary(aten.clone.default),
    "view": reshape_sample, "reshape": merge_sample, "transpose": transpose_sample,
    "permute": permute_sample, "unsqueeze": unsqueeze_sample, "expand": expand_sample,
    "slice": slice_sample, "select": select_sample, "split": split_sample, "chunk": chunk_sample,
    "cat": cat_sample, "stack": stack_sample, "broadcast_tensors": broadcast_tensors_sample,
    "mm": mm_sample, "bmm": bmm_sample, "addmm": addmm_sample, "linear": linear_sample,
    "matmul": matmul_sample, "einsum": einsum_sample,
    "embedding": embedding_sample, "layer_norm": layer_norm_sample, "rms_norm": rms_norm_sample,
    "sdpa": sdpa_sample,
    "sum": reduce_sample(aten.sum.dim_IntList), "mean": reduce_sample(aten.mean.dim),
    "amax": reduce_sample(aten.amax.default), "softmax": along_sample(aten.softmax.int),
    "log_softmax": along_sample(aten.log_softmax.int), "cumsum": along_sample(aten.cumsum.default),
    "topk": topk_sample, "sort": sort_sample, "histc": histc_sample,
    "cross_entropy": cross_entropy_sample, "mse_loss": mse_sample,
    "index": index_sample, "index_put_": index_put_sample, "index_copy_": index_copy_sample,
    "gather": gather_sample,
    "empty_like": empty_like_sample, "new_ones": new_ones_sample, "grouped_mm": grouped_mm_sample,
    "min_other": binary(aten.min.other), "max_other": binary(aten.max.other),
    "minimum": binary(aten.minimum.default), "numpy_T": unary(aten.numpy_T.default),
    "conv": conv_sample(), "conv_grouped": conv_sample(grouped=True),
    "conv_transpose": conv_sample(transposed=True),
    "conv_transpose_grouped": conv_sample(grouped=True, transposed=True),
    "convolution": conv_sample(grouped=True, generic=True),
    "max_pool": pool_sample("max_pool"), "max_pool_with_indices": pool_sample("max_pool_with_indices"),
    "avg_pool": pool_sample("avg_pool"), "adaptive_avg_pool": adaptive_pool_sample("adaptive_avg_pool"),
    "adaptive_max_pool": adaptive_pool_sample("adaptive_max_pool"), "upsample": upsample_sample,
    "batch_norm": batch_norm_sample, "group_norm": group_norm_sample, "pad": pad_sample,
    "repeat": repeat_sample, "copy_": copy_sample, "fill_": fill_sample,
    "arange": arange_sample, "scalar_tensor": scalar_tensor_sample,
    "weight_norm": weight_norm_sample, "scatter_value": scatter_sample(aten.scatter.value, 1.0),
    "scatter_add_": scatter_sample(aten.scatter_add_.default), "index_add_": index_add_sample,
    "reflection_pad": reflection_pad_sample,
}
