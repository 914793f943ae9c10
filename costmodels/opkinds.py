"""Which rate prices an op, and which ops autograd runs for it in backward.

An op is named by its ATen name (``"aten.gelu.default"``, as ``str(OpOverload)`` and
the planner's graph print it) or directly by a kind. ``op_kind(name)`` says which
measured rate prices it:

- ``"matmul"``: the profile's matmul rate (FLOP/s), roofline against memory bandwidth;
- ``"attention"`` / ``"attention_backward"``: fused scaled-dot-product attention, its
  own measured FLOP/s (FLOPs as ``torch.utils.flop_counter`` counts them);
- ``"view"``: no data moved; pays the fixed per-op cost only;
- a pointwise kind (``POINTWISE_KINDS``): the profile's effective bytes/s for that
  kind, where bytes are every input and output tensor read or written once. On CPUs
  transcendental kinds (gelu/erf, exp, tanh, silu, softmax) are compute-bound and run
  several times slower per byte than an add; on GPUs all of them run at memory
  bandwidth. Ops not listed are ``"memory"``, the bandwidth-bound kind (an add).

``backward_ops(op)`` lists the ops autograd runs for a forward op (``BACKWARD``), each
derived from the op's derivative (``tools/autograd/derivatives.yaml``) with its bytes as
a multiple of the forward op's: a unary ``y = f(x)`` moves x and y (2 tensors) and its
backward reads the gradient and x (or y) and writes the input gradient (3 tensors, so
1.5x). A matmul's backward is two matmuls of its FLOPs (input and weight gradients,
Kaplan et al. 2020's 2x), plus, for one with a bias (addmm), the bias gradient: a sum of
the output gradient over its rows. Ops not in the table keep the 2x approximation.
Not modelled: the adds that sum the gradients of a tensor used twice (a residual
stream's fork), about 1% of this CPU's GPT backward.
"""

from __future__ import annotations

from typing import NamedTuple

POINTWISE_KINDS = (
    "memory",  # bandwidth-bound: add, mul, copy, where, reductions, ... (timed: add)
    "gelu",  # erf-based gelu and erf (timed: gelu)
    "gelu_backward",  # (timed: aten.gelu_backward)
    "exp",  # exp, log and friends (timed: exp)
    "tanh",  # tanh, tanh-approximated gelu (timed: tanh)
    "silu",  # silu, sigmoid and silu's backward (timed: silu)
    "softmax",  # softmax and log_softmax over the last dim (timed: softmax, rows of 512)
    "layer_norm",  # layer norm and RMS norm (timed: layer_norm, rows of 512)
    "layer_norm_backward",  # (timed: aten.native_layer_norm_backward)
)
ATTENTION_DIRECTIONS = ("forward", "backward")
KINDS = ("matmul", "attention", "attention_backward", "view") + POINTWISE_KINDS

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "addmv", "mv", "dot",
           "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "_grouped_mm", "grouped_mm_fallback"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"}
_VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
          "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "chunk", "unflatten",
          "flatten", "as_strided", "narrow", "unbind", "view_as", "expand_as", "_reshape_alias", "lift_fresh"}
_POINTWISE = {
    **dict.fromkeys(("gelu", "erf", "erfc", "erfinv"), "gelu"),
    "gelu_backward": "gelu_backward",
    **dict.fromkeys(("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "pow", "sin", "cos"), "exp"),
    **dict.fromkeys(("tanh",), "tanh"),
    **dict.fromkeys(("silu", "silu_backward", "sigmoid", "mish", "softplus"), "silu"),
    **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp"), "softmax"),
    **dict.fromkeys(("native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm",
                     "native_batch_norm"), "layer_norm"),
    **dict.fromkeys(("native_layer_norm_backward", "_fused_rms_norm_backward", "native_group_norm_backward",
                     "native_batch_norm_backward"), "layer_norm_backward"),
}


def base_name(name: str) -> str:
    """``"aten.mul_.Tensor"`` -> ``"mul"``: the op without namespace, overload or in-place mark."""
    parts = name.split(".")  # a custom op is namespace.op.overload too (transformers.grouped_mm_fallback.default)
    base = parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") or len(parts) >= 3 else parts[0]
    return base[:-1] if base.endswith("_") and not base.startswith("_") else base


def op_kind(name: str) -> str:
    """The kind whose measured rate prices ``name`` (an ATen op name, or a kind)."""
    if name in KINDS:
        return name
    base = base_name(name)
    if base in _MATMUL:
        return "matmul"
    if base in _ATTENTION:
        return "attention"
    if base.endswith("_backward") and base[: -len("_backward")] in _ATTENTION:
        return "attention_backward"
    if base in _VIEWS:
        return "view"
    return _POINTWISE.get(base, "memory")


class Op(NamedTuple):
    """One op: its FLOPs, bytes moved (inputs and outputs), dtype, name (ATen name or
    kind; "" = memory), the bytes of its outputs alone (0: not known), and for fused
    attention its independent heads, batch x heads (0: not known or not attention)."""

    flops: float
    bytes: float
    dtype: str = "fp32"
    name: str = ""
    out_bytes: float = 0.0
    heads: float = 0.0


# Backward of a forward op: per op autograd runs, (kind, x forward FLOPs, x forward bytes)
# and optionally x the forward's output bytes.
_TWO_MATMULS = (("matmul", 1.0, 1.0), ("matmul", 1.0, 1.0))  # dX = dY W^T, dW = X^T dY
# with a bias, its gradient too: a sum of dY over the rows (reads the output's size)
_TWO_MATMULS_AND_BIAS = _TWO_MATMULS + (("memory", 0.0, 0.0, 1.0),)
_UNARY = {  # y = f(x): the backward op reads dy and x (or y), writes dx: 3 tensors vs 2
    "gelu": "gelu_backward",  # gelu_backward recomputes erf and exp
    "erf": "exp",  # 2/sqrt(pi) exp(-x^2) dy
    "exp": "memory",  # dy * y
    "tanh": "memory",  # tanh_backward: dy (1 - y^2)
    "sigmoid": "memory",  # sigmoid_backward: dy y (1 - y)
    "silu": "silu",  # silu_backward recomputes sigmoid
    "log": "memory",  # dy / x
    "sqrt": "memory",
    "rsqrt": "memory",
    "neg": "memory",
    "_softmax": "memory",  # _softmax_backward_data: y (dy - sum(dy y)), no exp
    "softmax": "memory",
    "_log_softmax": "memory",  # dy - exp(y) sum(dy): measured at memory speed here
    "log_softmax": "memory",
    "native_layer_norm": "layer_norm_backward",
    "layer_norm": "layer_norm_backward",
    "_fused_rms_norm": "layer_norm_backward",
    "rms_norm": "layer_norm_backward",
}
BACKWARD: dict[str, tuple[tuple, ...]] = {  # (kind, x FLOPs, x bytes[, x output bytes]) per op
    **dict.fromkeys(_MATMUL, _TWO_MATMULS),
    **dict.fromkeys(("addmm", "baddbmm", "addmv"), _TWO_MATMULS_AND_BIAS),
    # flop_counter's sdpa_backward_flop_count: 5 batched products (scores recomputed, dV,
    # dP, dQ, dK) against forward's 2; reads q, k, v, out, dout, writes dq, dk, dv
    **dict.fromkeys(_ATTENTION | {"attention"}, (("attention_backward", 2.5, 2.0),)),
    **{u: ((kind, 0.0, 1.5),) for u, kind in _UNARY.items()},
    "add": (),  # the gradient passes through to both operands unchanged
    "sub": (("memory", 0.0, 2 / 3),),  # -dy for the second operand: 2 of forward's 3 tensors
    "mul": (("memory", 0.0, 1.0), ("memory", 0.0, 1.0)),  # dy * b and dy * a
    "div": (("memory", 0.0, 1.0), ("memory", 0.0, 2.0)),  # dy / b; -dy a / b^2 (two ops)
    "mul.Scalar": (("memory", 0.0, 1.0),),  # by a number: dy * s only
    "div.Scalar": (("memory", 0.0, 1.0),),
    "sub.Scalar": (),
    "embedding": (("memory", 0.0, 1.0),),  # embedding_dense_backward: an index_add of dy
    "nll_loss_forward": (("memory", 0.0, 1.0),),
    "nll_loss": (("memory", 0.0, 1.0),),
    **dict.fromkeys(("_to_copy", "clone", "copy", "contiguous", "where", "masked_fill", "native_dropout",
                     "dropout", "mean"), (("memory", 0.0, 1.0),)),
    # no gradient, or one made of views: concatenation's backward slices, a sum's expands
    **dict.fromkeys(("cat", "sum", "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
                     "empty_like", "scalar_tensor", "_local_scalar_dense", "randint", "rand", "randn",
                     "eq", "ne", "lt", "gt", "le", "ge", "argmax", "triu", "tril"), ()),
    **dict.fromkeys(_VIEWS, ()),
}
DEFAULT_BACKWARD: tuple = ((None, 1.0, 1.0), (None, 1.0, 1.0))  # twice the op itself (Kaplan et al. 2020)


def backward_ops(op: Op) -> list[Op]:
    """The ops autograd runs in backward for the forward ``op`` (see ``BACKWARD``)."""
    if op.name in KINDS:
        rule = BACKWARD.get(op.name, DEFAULT_BACKWARD)
    else:
        parts = op.name.split(".")
        overload = f"{base_name(op.name)}.{parts[-1]}" if len(parts) >= 3 else ""
        rule = BACKWARD.get(overload, BACKWARD.get(base_name(op.name), DEFAULT_BACKWARD))
    # attention's backward kernel works on the same heads
    return [Op(op.flops * f, op.bytes * b + op.out_bytes * (o[0] if o else 0.0), op.dtype, kind or op.name,
               heads=op.heads if kind == "attention_backward" else 0.0)
            for kind, f, b, *o in rule]
