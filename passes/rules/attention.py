"""Scaled dot-product attention ``q[B, Hq, L, E], k[B, Hkv, S, E], v[B, Hkv, S, Ev]``.

- batch or heads split across devices (heads: Megatron's attention; with grouped-query
  attention the query heads of one key/value head stay together on one device);
- the query sequence split (each device attends its queries to all keys), unless the
  mask is implied by ``is_causal``, which assumes queries start at position 0;
- a Partial value gives a Partial output (attention is linear in v).
The mask broadcasts like a pointwise operand.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules.registry import register
from autopar.passes.op_strategies import AxisOption, OpInfo, TensorMeta

R = Replicate()

_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arg(info: OpInfo, name: str, default):
    i = _SIGNATURE.index(name)
    return info.args[i] if len(info.args) > i else info.kwargs.get(name, default)


def _mask_placement(mask: TensorMeta, out: TensorMeta, d: int):
    k = d - (out.ndim - mask.ndim)
    return Shard(k) if k >= 0 and mask.shape[k] == out.shape[d] and out.shape[d] > 1 else R


@register(aten.scaled_dot_product_attention.default)
def sdpa(info: OpInfo) -> list[AxisOption]:
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
