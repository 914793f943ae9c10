"""Every cost formula of autopar, in one place, as sympy expressions.

A plan's explanation prints these (``describe(name)``); the solver evaluates them
through ``compiled(name)``, a cached ``lambdify`` of the same expression, so what is
printed is what is computed.

Symbols (all SI units: seconds, bytes, FLOP):

- ``X``     buffer size of a collective in bytes (which buffer: see COLLECTIVE_BUFFER)
- ``N``     number of ranks on the mesh axis the collective runs over
- ``alpha`` fixed latency of the collective on that axis (s)
- ``beta``  bus bandwidth of the collective on that axis (bytes/s, nccl-tests' busbw)
- ``F``, ``B``  FLOPs and bytes moved by an op; ``R``, ``W`` achieved FLOP/s and bytes/s;
  ``t_R``, ``t_W`` fixed costs of a matmul-bound and a bandwidth-bound op
- ``H_a``   fused attention's independent heads (batch x heads); ``t_h`` the fixed cost
  per head of the straight piece that prices a head of its size (``R`` its rate)
- ``Psi``   parameter count; ``p``, ``g``, ``o`` bytes per parameter of parameters,
  gradients and optimizer state; ``N_d`` ranks sharing the ZeRO partition
- ``P``     pipeline stages; ``M`` micro-batches; ``v`` model chunks per rank (interleaved);
  ``r`` a pipeline rank, 0 the first
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import sympy as sp

X, N, alpha, beta = sp.symbols("X N alpha beta", positive=True)
F, B, R, W, t_R, t_W = sp.symbols("F B R W t_R t_W", nonnegative=True)
Psi, p, g, o, N_d = sp.symbols("Psi p g o N_d", positive=True)
P, M, v = sp.symbols("P M v", positive=True)
A, t_f, t_b, t_comm_f, t_comm_b, t_opt = sp.symbols("A t_f t_b t_comm_f t_comm_b t_opt", nonnegative=True)
H_a, t_h = sp.symbols("H_a t_h", nonnegative=True)
r = sp.Symbol("r", nonnegative=True)
# communication beside compute (``costmodels.overlap``): what the tables leave out as hidden,
# the second stream's busy seconds, the window of compute beside it
t_hidden, t_busy, t_window = sp.symbols("t_hidden t_busy t_window", nonnegative=True)
# a matmul pipelined with its collective (``costmodels.pipelined``): chunks, one chunk's
# matmul and collective, the part of the shorter hidden when they run side by side
n_k = sp.Symbol("n_k", positive=True)
t_mm, t_cc, h_o = sp.symbols("t_mm t_cc h_o", nonnegative=True)

# -- collectives (ring algorithms; Thakur et al. 2005, and nccl-tests' PERFORMANCE.md
#    which defines busbw with exactly these factors) -------------------------------------
BUS_FACTOR = {
    "all_reduce": 2 * (N - 1) / N,
    "all_gather": (N - 1) / N,
    "reduce_scatter": (N - 1) / N,
    "all_to_all": (N - 1) / N,
    "send_recv": sp.Integer(1),
}
# Which buffer X is, so that the same number means the same thing everywhere.
COLLECTIVE_BUFFER = {
    "all_reduce": "the tensor reduced, per rank",
    "all_gather": "the gathered output, per rank (N times the input)",
    "reduce_scatter": "the input, per rank (N times the output)",
    "all_to_all": "the send buffer, per rank (equal to the receive buffer)",
    "send_recv": "the message",
}
COLLECTIVE_TIME = {c: alpha + f * X / beta for c, f in BUS_FACTOR.items()}

# -- compute: roofline with measured rates; the bound that binds brings its fixed cost --
COMPUTE_TIME = sp.Piecewise(
    (t_R + F / R, F / R > B / W),
    (t_W + B / W, True),
)
# -- fused attention: H_a independent heads, each priced by its own FLOPs on the straight
#    piece (t_h, R) between the measured head sizes around it (a CPU kernel runs a bigger
#    head at a higher FLOP rate: its blocks fill better); against memory bandwidth -------
ATTENTION_TIME = sp.Piecewise(
    (t_R + H_a * t_h + F / R, H_a * t_h + F / R > B / W),
    (t_W + B / W, True),
)

# -- memory per device of parameters, gradients and optimizer state under ZeRO --------
# Rajbhandari et al. 2020 (ZeRO), Fig. 1: with mixed precision p=2, g=2, o=12 (fp32
# master weights, Adam m and v) this gives 16Psi, 4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N.
ZERO_MEMORY = {
    0: (p + g + o) * Psi,
    1: (p + g) * Psi + o * Psi / N_d,
    2: p * Psi + (g + o) * Psi / N_d,
    3: (p + g + o) * Psi / N_d,
}
BYTES_PER_PARAM = {
    # (p, g, o): mixed precision AdamW keeps bf16/fp16 params and grads, fp32 master
    # copy + m + v (ZeRO paper, K=12); plain fp32 AdamW keeps fp32 params, grads, m, v.
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
    # pure bf16/fp16: a 16-bit model trained as given, AdamW's m and v in its dtype
    "bf16": (2, 2, 4),
}

# -- pipeline schedules, keyed by ``Schedule`` value (``autopar.costmodels.schedules``, whose
#    methods evaluate these) ---------------------------------------------------------------
# Micro-batches whose activations are alive at once on pipeline rank r
# (in units of one micro-batch through the rank's whole stage, all its chunks together)
# GPipe holds all M; 1F1B (PipeDream-flush, Narayanan et al. 2021) at most P - r; the
# interleaved schedule with v chunks warms rank r up with 2 (P - r - 1) + (v - 1) P chunk
# forwards plus one in the steady state (Megatron-LM, schedules.py,
# forward_backward_pipelining_with_interleaving: num_warmup_microbatches), each 1/v of
# the stage: P + (P - 1 - 2r)/v, which on the first rank is Korthikanti et al. 2022
# ("Reducing Activation Recomputation", sec. 4.2.3): a factor 1 + (P-1)/(P v) over 1F1B.
# Zero bubble as torch's ScheduleInterleavedZeroBubble orders it (torch/distributed/pipelining/
# schedules.py, _get_1f1b_rank_ops with enable_zero_bubble): rank r warms up with
# (v - 1) P + P - 1 - r chunk forwards and runs its weight gradients r backwards late, so a chunk
# micro-batch is held from its forward to its weight gradient and (v - 1) P + P - 1 - r + 1 + r
# = v P of them are held on every rank: P whole-stage micro-batches, 1F1B's rank 0 count (Qi et
# al. 2024, sec. 3.1: ZB-H1 keeps 1F1B's peak memory); checked against torch's order by the tests.
# The V-shaped schedules (v = 2, torch's ScheduleZBVZeroBubble and ScheduleDualPipeV, at the
# micro-batch counts ``Schedule.micro_batch_problem`` admits) replayed the same way: ZB-V holds
# P whole-stage micro-batches on every rank (its warm-up runs 2P - 1 - r forwards of the first
# chunk and r of the second before its first weight gradient), DualPipe-V one chunk
# micro-batch more, P + 1/2 (its steady state pairs a forward with a backward of the other chunk).
IN_FLIGHT = {
    "gpipe": M,
    "1f1b": sp.Min(M, P - r),
    "interleaved_1f1b": sp.Min(M, P + (P - 1 - 2 * r) / v),
    "interleaved_zero_bubble": sp.Min(M, P),
    "zbv_zero_bubble": sp.Min(M, P),
    "dualpipe_v": sp.Min(M, P + 1 / v),
}
ACTIVATION_MEMORY = {k: A * n for k, n in IN_FLIGHT.items()}

# Activation bytes one transformer layer keeps for backward, per micro-batch, with 16-bit
# activations and no recomputation (Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models", sec. 4, eqs. 1-3): s sequence, b batch,
# h hidden, a heads, t tensor-parallel ranks.
s_, b_, h_, a_, t_ = sp.symbols("s b h a t", positive=True)
LAYER_ACTIVATIONS = {
    "none": s_ * b_ * h_ * (34 + 5 * a_ * s_ / h_),
    "tensor_parallel": s_ * b_ * h_ * (10 + 24 / t_ + 5 * a_ * s_ / (h_ * t_)),
    "tensor_sequence_parallel": s_ * b_ * h_ / t_ * (34 + 5 * a_ * s_ / h_),
}

# Backward as a multiple of the forward where only the uniform approximation is wanted
# (Kaplan et al. 2020: twice the forward FLOPs), e.g. a pipeline picture's boxes and the
# zero-bubble slot below; the cost model prices backward op by op (``opkinds.backward_ops``,
# whose DEFAULT_BACKWARD is the same 2x as two copies of an op it does not know)
BACKWARD_FACTOR = 2

# Idle fraction of the step (Narayanan et al. 2021, sec. 2.2: bubble time (P-1)/v per
# micro-batch time against M of work). Zero bubble: (P - 1) slots of a chunk's forward
# (Qi et al. 2024, sec. 3.1: ZB-H1's bubble (P - 1)(T_F + T_B - T_W), its input-gradient T_B
# equal to its weight-gradient T_W), the forward 1 / (1 + BACKWARD_FACTOR) of a chunk's time;
# torch's ScheduleInterleavedZeroBubble order, replayed, gives exactly this for equal chunks
# (``costmodels.schedule_replay``, checked by the tests). torch's ZB-V and DualPipe-V orders,
# replayed with a forward, an input-gradient and a weight-gradient part alike, leave the same
# P - 1 chunk forwards idle (ZB-V's "zero" bubble needs the weight gradients to fill its
# warm-up exactly, Qi et al. 2024 sec. 6; DualPipe-V's gain, a forward's communication hidden
# behind the paired backward's compute, is not modelled: compute here runs one action at a time).
_ZERO_BUBBLE_FRACTION = (P - 1) / ((1 + BACKWARD_FACTOR) * v * M + P - 1)
BUBBLE_FRACTION = {
    "gpipe": (P - 1) / (M + P - 1),
    "1f1b": (P - 1) / (M + P - 1),
    "interleaved_1f1b": (P - 1) / (v * M + P - 1),
    "interleaved_zero_bubble": _ZERO_BUBBLE_FRACTION,
    "zbv_zero_bubble": _ZERO_BUBBLE_FRACTION,
    "dualpipe_v": _ZERO_BUBBLE_FRACTION,
}
# Step time of a pipeline whose slowest stage takes t_f + t_b per micro-batch.
PIPELINE_TIME = {
    "gpipe": (M + P - 1) * (t_f + t_b),
    "1f1b": (M + P - 1) * (t_f + t_b),
    "interleaved_1f1b": (M + (P - 1) / v) * (t_f + t_b),
    "interleaved_zero_bubble": M * (t_f + t_b) + (P - 1) * t_f / v,
    "zbv_zero_bubble": M * (t_f + t_b) + (P - 1) * t_f / v,
    "dualpipe_v": M * (t_f + t_b) + (P - 1) * t_f / v,
}

# -- one training step without pipelining: forward, backward (about twice the forward
#    FLOPs, Kaplan et al. 2020 sec. 2.1), the dual collectives, optimizer step ----------
STEP_TIME = t_f + t_b + t_comm_f + t_comm_b + t_opt
BACKWARD_FLOPS = BACKWARD_FACTOR * F
# -- communication hidden behind compute: a second stream busier than its window of compute
#    hides only the window's share of what it would hide (``costmodels.overlap``) -----------
HIDDEN = t_hidden * sp.Min(1, t_window / t_busy)

# -- a matmul and its collective cut into n_k chunks, one chunk's collective beside another
#    chunk's matmul (async tensor parallelism; Wang et al. 2023, "Overlap Communication with
#    Dependent Computation via Decomposition"): the first chunk's collective (or matmul)
#    alone, n_k - 1 steps of a matmul beside a collective, the last matmul (or collective)
#    alone. Side by side the two take t_mm + t_cc less the hidden part h_o of the shorter
#    (``overlap.overlap_from_times`` measures h_o so): max(t_mm, t_cc) at h_o = 1 ------------
PIPELINED = t_mm + t_cc + (n_k - 1) * (t_mm + t_cc - h_o * sp.Min(t_mm, t_cc))

_TABLE: dict[str, tuple[sp.Expr, tuple[sp.Symbol, ...]]] = {
    **{f"collective.{c}": (e, (alpha, beta, N, X)) for c, e in COLLECTIVE_TIME.items()},
    "compute": (COMPUTE_TIME, (F, B, R, W, t_R, t_W)),
    "attention": (ATTENTION_TIME, (F, B, R, W, t_R, t_W, H_a, t_h)),
    **{f"zero{z}": (e, (Psi, p, g, o, N_d)) for z, e in ZERO_MEMORY.items()},
    **{f"in_flight.{s}": (e, (M, P, v, r)) for s, e in IN_FLIGHT.items()},
    **{f"layer_activations.{k}": (e, (s_, b_, h_, a_, t_)) for k, e in LAYER_ACTIVATIONS.items()},
    **{f"bubble.{s}": (e, (M, P, v)) for s, e in BUBBLE_FRACTION.items()},
    **{f"pipeline.{s}": (e, (M, P, v, t_f, t_b)) for s, e in PIPELINE_TIME.items()},
    "step": (STEP_TIME, (t_f, t_b, t_comm_f, t_comm_b, t_opt)),
    "hidden": (HIDDEN, (t_hidden, t_busy, t_window)),
    "pipelined": (PIPELINED, (n_k, t_mm, t_cc, h_o)),
}


def names() -> list[str]:
    """The names of every formula, for ``describe`` and ``compiled``."""
    return list(_TABLE)


def expression(name: str) -> sp.Expr:
    if name not in _TABLE:
        raise KeyError(f"autopar: no cost formula named {name!r}; known: {names()}.")
    return _TABLE[name][0]


def describe(name: str) -> str:
    """``name = <formula>``, e.g. for a plan's explanation."""
    return f"{name} = {sp.sstr(expression(name))}"


@cache
def compiled(name: str) -> Callable[..., float]:
    """A fast plain-Python function of the formula's symbols, in ``signature(name)`` order."""
    expression(name)  # a clear error for unknown names
    expr, args = _TABLE[name]
    return sp.lambdify(args, expr, modules="math")


def signature(name: str) -> tuple[str, ...]:
    expression(name)
    return tuple(s.name for s in _TABLE[name][1])
