"""One training step: forward, backward, their collectives, and the optimizer step.

``formulas.STEP_TIME``: t_f + t_b + t_comm_f + t_comm_b + t_opt, with no overlap of
communication and compute (an upper bound where the runtime overlaps them). Backward
compute is, per forward op, the ops autograd runs for it (``opkinds.backward_ops``):
two matmuls of its FLOPs for a matmul (Kaplan et al. 2020's 2x: the input gradient and
the weight gradient), the attention backward kernel (2.5x the FLOPs), one
``gelu_backward`` for a gelu (1.5x the bytes, at its own measured rate: on this CPU
1.5-2.5x a gelu's time), nothing for an add, and 2x for ops the table does not know. ``backward_factor`` (a number) restores the uniform approximation
``t_b = factor * t_f``. Every forward collective has its dual in backward (all-gather <->
reduce-scatter, all-reduce <-> all-reduce as in Megatron's f/g pair, all-to-all and
send/recv with themselves); collectives with no forward counterpart (data-parallel
gradient reduction, ZeRO-3's re-gather of parameters) are passed as ``backward_extra``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Iterable

import torch

from autopar.costmodels.comm import Step, collective_time
from autopar.costmodels.compute import ITEMSIZE, compute_time, dtype_name
from autopar.costmodels.formulas import compiled
from autopar.costmodels.opkinds import Op, backward_ops
from autopar.costmodels.profile import HardwareProfile

DUAL_COLLECTIVE = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "send_recv": "send_recv",
}

# AdamW's per-tensor update on its single-tensor path (torch/optim/adam.py,
# _single_tensor_adam, not capturable, decoupled weight decay; the path torch takes
# for CPU tensors): the ops it runs on each parameter tensor and the tensors of
# parameter size each reads plus writes (0: a one-element step counter).
ADAMW_OPS = (
    ("aten.add_.Tensor", 0),  # step_t += 1
    ("aten.mul_.Tensor", 2),  # param *= 1 - lr * wd
    ("aten.lerp_.Scalar", 3),  # exp_avg.lerp_(grad, 1 - beta1)
    ("aten.mul_.Tensor", 2),  # exp_avg_sq *= beta2
    ("aten.addcmul_.default", 3),  # exp_avg_sq += (1 - beta2) grad^2
    ("aten._local_scalar_dense.default", 0),  # step = step_t.item()
    ("aten.sqrt.default", 2),  # exp_avg_sq.sqrt()
    ("aten.div.Tensor", 2),  # / bias_correction2_sqrt
    ("aten.add_.Tensor", 2),  # + eps
    ("aten.addcdiv_.default", 4),  # param += -step_size * exp_avg / denom
)


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
    return sum(compute_time(op.flops, op.bytes, op.dtype, profile, op.name, op.heads) for op in ops)


def backward_time(forward_ops: Iterable[Op], profile: HardwareProfile) -> float:
    """Seconds of the backward ops of these forward ops (``opkinds.backward_ops``)."""
    return sum(ops_time(backward_ops(op), profile) for op in forward_ops)


def comm_time(steps: Iterable[Step], profile: HardwareProfile) -> float:
    """Seconds of these collectives, each as ``Step.in_step`` says the step meets it."""
    return sum(collective_time(s.collective, s.bytes, s.axis, profile, in_step=s.in_step) for s in steps)


def dual_steps(steps: Iterable[Step]) -> list[Step]:
    """Backward collectives of forward ones (same axis, same buffer size)."""
    return [Step(DUAL_COLLECTIVE[s.collective], s.axis, s.bytes, s.in_step) for s in steps]


def adamw_ops(param_numels: Iterable[int], dtype: torch.dtype | str = "fp32") -> list[Op]:
    """The pointwise ops of one AdamW step over local parameter tensors of these sizes."""
    d = dtype_name(dtype)
    itemsize = ITEMSIZE[d]
    return [Op(0, n * k * itemsize, d, name) for n in param_numels for name, k in ADAMW_OPS]


def step_time(
    forward_ops: Iterable[Op],
    profile: HardwareProfile,
    *,
    forward_comm: Iterable[Step] = (),
    backward_extra: Iterable[Step] = (),
    optimizer_ops: Iterable[Op] = (),
    backward_factor: float | None = None,
) -> StepCost:
    """Predicted time of one training step on one rank, broken down. Backward compute
    is priced op by op (``backward_time``), or ``backward_factor`` times the forward."""
    forward_comm, forward_ops = list(forward_comm), list(forward_ops)
    t_f = ops_time(forward_ops, profile)
    t_b = backward_time(forward_ops, profile) if backward_factor is None else backward_factor * t_f
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
