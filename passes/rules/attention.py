"""Scaled dot-product attention ``q[B, Hq, L, E], k[B, Hkv, S, E], v[B, Hkv, S, Ev]``.

- batch or heads split across devices (heads: Megatron's attention; with grouped-query
  attention the query heads of one key/value head stay together on one device);
- the query sequence split (each device attends its queries to all keys), unless the
  mask is implied by ``is_causal``, which assumes queries start at position 0;
- a Partial value gives a Partial output (attention is linear in v).
The mask broadcasts like a pointwise operand. With dropout the weights are dropped by
the keyed stream of ``autopar.passes.randomness`` (``keyed_attention``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes import randomness
from autopar.passes.rules.registry import kernel, register
from autopar.passes.op_strategies import AxisOption, OpInfo, TensorMeta

R = Replicate()

KEYED_ATTENTION = "keyed_attention"  # the local kernel of attention with dropout
_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arg(info: OpInfo, name: str, default):
    i = _SIGNATURE.index(name)
    return info.args[i] if len(info.args) > i else info.kwargs.get(name, default)


def _mask_placement(mask: TensorMeta, out: TensorMeta, d: int):
    k = d - (out.ndim - mask.ndim)
    return Shard(k) if k >= 0 and mask.shape[k] == out.shape[d] and out.shape[d] > 1 else R


def dropout_p(args: tuple, kwargs: dict) -> float:
    """The attention-weight dropout of an SDPA call (0: none)."""
    i = _SIGNATURE.index("dropout_p")
    return float(args[i] if len(args) > i else kwargs.get("dropout_p", 0.0))


@kernel(KEYED_ATTENTION)
def keyed_attention(info: OpInfo, strategy, args: tuple, kwargs: dict, ctx) -> torch.Tensor:
    """Attention whose weights are dropped by the keyed stream (``autopar.passes.randomness``):
    the weights ``[B, Hq, L, S]`` lie as the query does (batch, heads, queries split or not;
    keys never split), so each device drops what one device would drop there. Computed in
    full (``L x S`` weights kept for backward), as torch's math attention does."""
    named = dict(zip(_SIGNATURE, args)) | kwargs
    q, k, v = named["query"], named["key"], named["value"]
    mask, causal, scale = named.get("attn_mask"), named.get("is_causal", False), named.get("scale")
    if q.shape[-3] != k.shape[-3]:  # grouped-query attention: each key/value head serves a group
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    whole = (*info.inputs[0].shape[:-1], info.inputs[1].shape[-2])
    weights = randomness.dropout(weights, dropout_p(args, kwargs), whole, strategy.inputs[0], ctx.mesh_shape, ctx.coord)
    return weights @ v


@register(aten.scaled_dot_product_attention.default)
def sdpa(info: OpInfo) -> list[AxisOption]:
    """The options below; with dropout, every one runs ``keyed_attention``."""
    options = _options(info)
    if dropout_p(info.args, info.kwargs) > 0:
        options = [AxisOption(o.inputs, o.outputs, KEYED_ATTENTION) for o in options]
    return options


def _options(info: OpInfo) -> list[AxisOption]:
    q, k, v = info.inputs[:3]
    mask = _arg(info, "attn_mask", None)
    out = info.outputs[0]
    has_mask = isinstance(mask, TensorMeta)

    def option(qkv, d):
        extra = (_mask_placement(mask, out, d),) if has_mask else ()
        return AxisOption(tuple(qkv) + extra, (Shard(d),))

    options = []
    for d in range(q.ndim - 2):  # batch and head dims
        if q.shape[d] % k.shape[d] == 0 and k.shape[d] == v.shape[d]:
            options.append(option((Shard(d),) * 3, d))
    if not _arg(info, "is_causal", False):
        options.append(option((Shard(q.ndim - 2), R, R), q.ndim - 2))
    extra = (R,) if has_mask else ()
    options.append(AxisOption((R, R, Partial()) + extra, (Partial(),)))
    return options
