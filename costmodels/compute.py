"""Compute costs: FLOPs and bytes of an op, priced by a roofline on measured rates.

``compute_time(flops, bytes_moved, dtype, profile, op)`` is ``formulas.COMPUTE_TIME``:
the op is bound by its FLOP rate or its byte rate, whichever takes longer, and pays
the fixed cost (launch, dispatch) measured for that bound. Which rates, by the op's
kind (``opkinds.op_kind``): a matmul's FLOPs at the matmul rate (less for a small or
skinny one, where the profile says how much: ``matmul_efficiency``) against memory
bandwidth; fused attention head by head (``formulas.ATTENTION_TIME``: each of its
batch x heads heads at the measured per-head rate of its size, between the measured
head sizes), against memory bandwidth; a pointwise op's bytes at its kind's measured
rate (on a CPU a gelu moves
bytes several times slower than an add; on a GPU both run at memory bandwidth),
against the matmul rate for any FLOPs it counts. Unknown ops are priced as ``"memory"``.
Where a byte rate keeps its measured points, the bytes are priced on the straight piece
between the two measured sizes around them (``Rate.segment``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from autopar.costmodels.formulas import compiled
from autopar.costmodels.opkinds import op_kind
from autopar.costmodels.profile import DTYPES, HardwareProfile, Rate

_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"`` for a torch dtype or one of those names."""
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return dtype
    elif dtype in _TORCH_DTYPES:
        return _TORCH_DTYPES[dtype]
    raise ValueError(
        f"autopar: expected a floating dtype among {list(DTYPES)} (or torch.float32/bfloat16/"
        f"float16); found {dtype!r}. Integer ops are priced as fp32 pointwise ops: pass 'fp32'."
    )


@lru_cache(maxsize=1)
def _compute_fn():
    return compiled("compute")


@lru_cache(maxsize=1)
def _attention_fn():
    return compiled("attention")


def rates(op: str, dtype: str, profile: HardwareProfile) -> tuple[Rate, Rate]:
    """(FLOP rate, byte rate) that price ``op`` (an ATen op name or a kind) in ``dtype``."""
    dev = profile.device
    dev.require(dtype)
    kind = op_kind(op)
    if kind in ("attention", "attention_backward"):
        direction = "forward" if kind == "attention" else "backward"
        return dev.attention[direction][dtype], dev.bandwidth(dtype)
    if kind in ("matmul", "view"):
        return dev.matmul[dtype], dev.bandwidth(dtype)
    return dev.matmul[dtype], dev.pointwise[kind][dtype]


def matmul_size(flops: float, bytes_moved: float, itemsize: int) -> float:
    """A matmul's size d = 3 / (1/m + 1/n + 1/k), read off its FLOPs (2mnk per product) and
    the bytes it moves (mk + kn + mn elements per product): m for an m-cube, about 3m for
    a skinny one with m much below n and k. The same for the two backward matmuls, whose
    m, n, k are the forward's permuted; infinite where no bytes are known."""
    return 3.0 * itemsize * flops / (2.0 * bytes_moved) if bytes_moved > 0 else math.inf


def matmul_efficiency(rate: Rate, flops: float, bytes_moved: float, itemsize: int) -> float:
    """Fraction of ``rate.rate`` a matmul of ``flops`` FLOPs moving ``bytes_moved`` bytes
    reaches: the lower of w / (1 + w), with w = (flops / work_half)^(2/3), and d / (d +
    dim_half). For an n-cube the first is n^2 / (n^2 + n_half^2): its n^2 / tile-area output
    tiles against what fills every SM once (wave quantization); the second is the share of
    its tiles' rows a short dimension d fills (tile quantization). The lower, not the
    product: a tiny matmul's few tiles are its short dimensions' partly empty ones, one
    loss counted once (and the time still shrinks with the work). 1 where the profile has
    no shape fit (``work_half``, ``dim_half`` 0). Continuous and non-decreasing in size."""
    fill = 1.0
    if rate.work_half > 0 and flops > 0:
        w = (flops / rate.work_half) ** (2.0 / 3.0)
        fill = w / (1.0 + w)
    d = matmul_size(flops, bytes_moved, itemsize)
    if rate.dim_half > 0 and d != math.inf:
        fill = min(fill, d / (d + rate.dim_half))
    return fill


def compute_time(
    flops: float, bytes_moved: float, dtype: torch.dtype | str, profile: HardwareProfile, op: str = "",
    heads: float = 0.0,
) -> float:
    """Seconds for one op doing ``flops`` FLOPs and moving ``bytes_moved`` bytes. ``op``
    is its ATen name (``"aten.gelu.default"``) or kind (``"gelu"``); "" prices it as a
    bandwidth-bound ("memory") op, or a matmul where it has FLOPs. ``heads``: for fused
    attention, its independent heads (batch x heads), each priced by its FLOPs between
    the measured head sizes (``Rate.points`` of the attention rates: per head); 0 prices
    the whole op at the fitted rate."""
    d = dtype_name(dtype)
    fr, br = rates(op, d, profile)
    t_w, w = br.segment(bytes_moved)  # between measured sizes, their straight piece
    if op_kind(op) in ("attention", "attention_backward"):
        t_h, r = fr.segment(flops / heads, start=0.0) if heads > 0 and fr.points else (0.0, fr.rate)
        return _attention_fn()(flops, bytes_moved, r, w, fr.latency_s, t_w, heads, t_h)
    r = fr.rate
    if flops > 0 and op_kind(op) == "matmul":  # named matmuls only: "" may be an optimizer's FLOPs
        r *= matmul_efficiency(fr, flops, bytes_moved, ITEMSIZE[d])
    return _compute_fn()(flops, bytes_moved, r, w, fr.latency_s, t_w)


def matmul_flops(m: int, k: int, n: int, batch: int = 1) -> int:
    """FLOPs of ``batch`` products of an (m, k) by a (k, n) matrix: 2mkn each."""
    return 2 * batch * m * k * n


def matmul_bytes(m: int, k: int, n: int, itemsize: int, batch: int = 1) -> int:
    """Bytes a matmul reads and writes at least once: both inputs and the output."""
    return batch * (m * k + k * n + m * n) * itemsize


def matmul_time(
    m: int, k: int, n: int, dtype: torch.dtype | str, profile: HardwareProfile, batch: int = 1
) -> float:
    itemsize = ITEMSIZE[dtype_name(dtype)]
    return compute_time(
        matmul_flops(m, k, n, batch), matmul_bytes(m, k, n, itemsize, batch), dtype, profile, "matmul"
    )


def pointwise_time(
    numel: int, n_tensors: int, dtype: torch.dtype | str, profile: HardwareProfile, op: str = "memory"
) -> float:
    """A pointwise op of kind or name ``op`` over ``numel`` elements touching ``n_tensors``
    tensors of that size (inputs + output)."""
    return compute_time(0, numel * n_tensors * ITEMSIZE[dtype_name(dtype)], dtype, profile, op)
