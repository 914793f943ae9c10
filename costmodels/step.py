"""One training step: forward, backward, their collectives, and the optimizer step.

``formulas.STEP_TIME``: t_f + t_b + t_comm_f + t_comm_b + t_opt, with no overlap of
communication and compute (an upper bound where the runtime overlaps them). Backward
compute is ``backward_factor`` (2, Kaplan et al. 2020: the backward pass does twice the
forward FLOPs: one product for the input gradient, one for the weight gradient) times
each forward op. Every forward collective has its dual in backward (all-gather <->
reduce-scatter, all-reduce <-> all-reduce as in Megatron's f/g pair, all-to-all and
send/recv with themselves); collectives with no forward counterpart (data-parallel
gradient reduction, ZeRO-3's re-gather of parameters) are passed as ``backward_extra``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Iterable, NamedTuple

import torch

from costmodels.comm import Step, collective_time
from costmodels.compute import ITEMSIZE, compute_time, dtype_name
from costmodels.formulas import compiled
from costmodels.profile import HardwareProfile

DUAL_COLLECTIVE = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "send_recv": "send_recv",
}

# AdamW's per-tensor update on its single-tensor path (torch/optim/adam.py,
# _single_tensor_adam, not capturable, decoupled weight decay): the ops it runs on each
# parameter tensor and the tensors of parameter size each reads plus writes.
ADAMW_OPS = (
    ("mul_", 2),  # param *= 1 - lr * wd
    ("lerp_", 3),  # exp_avg.lerp_(grad, 1 - beta1)
    ("mul_", 2),  # exp_avg_sq *= beta2
    ("addcmul_", 3),  # exp_avg_sq += (1 - beta2) grad^2
    ("sqrt", 2),  # exp_avg_sq.sqrt()
    ("div", 2),  # / (bias_correction2_sqrt * step_size_neg)
    ("add_", 2),  # + eps / step_size_neg
    ("addcdiv_", 4),  # param += exp_avg / denom
)


class Op(NamedTuple):
    """One op of the forward pass: its FLOPs, bytes moved and dtype."""

    flops: float
    bytes: float
    dtype: str = "fp32"


@dataclass(kw_only=True)
class StepCost:
    forward: float
    backward: float
    forward_comm: float
    backward_comm: float
    optimizer: float
    total: float

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=1)
def _step_fn():
    return compiled("step")


def ops_time(ops: Iterable[Op], profile: HardwareProfile) -> float:
    return sum(compute_time(op.flops, op.bytes, op.dtype, profile) for op in ops)


def comm_time(steps: Iterable[Step], profile: HardwareProfile) -> float:
    return sum(collective_time(s.collective, s.bytes, s.axis, profile) for s in steps)


def dual_steps(steps: Iterable[Step]) -> list[Step]:
    """Backward collectives of forward ones (same axis, same buffer size)."""
    return [Step(DUAL_COLLECTIVE[s.collective], s.axis, s.bytes) for s in steps]


def adamw_ops(param_numels: Iterable[int], dtype: torch.dtype | str = "fp32") -> list[Op]:
    """The pointwise ops of one AdamW step over local parameter tensors of these sizes."""
    d = dtype_name(dtype)
    itemsize = ITEMSIZE[d]
    return [Op(0, n * k * itemsize, d) for n in param_numels for _, k in ADAMW_OPS]


def step_time(
    forward_ops: Iterable[Op],
    profile: HardwareProfile,
    *,
    forward_comm: Iterable[Step] = (),
    backward_extra: Iterable[Step] = (),
    optimizer_ops: Iterable[Op] = (),
    backward_factor: float = 2.0,
) -> StepCost:
    """Predicted time of one training step on one rank, broken down."""
    forward_comm = list(forward_comm)
    t_f = ops_time(forward_ops, profile)
    t_b = backward_factor * t_f
    t_cf = comm_time(forward_comm, profile)
    t_cb = comm_time(dual_steps(forward_comm), profile) + comm_time(backward_extra, profile)
    t_o = ops_time(optimizer_ops, profile)
    return StepCost(
        forward=t_f,
        backward=t_b,
        forward_comm=t_cf,
        backward_comm=t_cb,
        optimizer=t_o,
        total=_step_fn()(t_f, t_b, t_cf, t_cb, t_o),
    )
