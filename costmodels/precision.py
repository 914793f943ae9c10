"""Mixed precision priced as the runtime runs it (FSDP2's ``MixedPrecisionPolicy``).

A model planned under a policy is captured as it computes (parameters, activations and
their gradients in the compute dtype), so compute, activations, activation moves and
parameter gathers are priced in the compute dtype by the ordinary cost functions. What
the graph does not show is here, per parameter element:

- master copy: ``master`` bytes (float32: 4), stored as the plan says (ZeRO-2 and the
  ZeRO-3 placements split it);
- gradients: accumulated in the master dtype (4 B), split at ZeRO-2;
- AdamW state: ``ADAMW_STATES`` (m and v) in the master dtype: 8 B per optimizer element,
  split at ZeRO-1/2;
- working copy (``working_copy_bytes``): ``compute`` bytes (bf16: 2) of the parameter as a
  consumer reads it where it lies and its backward saves it: the cast (ZeRO-0/1, tensor
  parallel) or the whole gathered copy (ZeRO-2), alive from forward until backward is done
  with it; counted with the activations (freed before the gradients are summed). A ZeRO-3
  placement, split where its consumer reads it whole, keeps none: the runtime casts the
  shard into the gather and frees the gathered copy, gathering again in backward; nor does
  a read whose backward does not save it (a linear's bias, an embedding). So what stays
  depends on the placement and on what the consumer reads: the edge between them holds it
  (``autopar.passes.edge_costs``; ``SolveProblem.edge_memory``), not the parameter's state.
  A pipeline stage casts once per call, so each micro-batch in flight keeps its own copy
  until its backward, and a recomputed layer none (``passes.planner.layer_numbers.LayerNumbers.copies``);
- gradient reductions (all-reduce, reduce-scatter): ``reduce`` bytes; the all-gather of a
  ZeRO-2 bucket: ``compute`` bytes; the all-gather of ZeRO-1's updated slices: ``master``
  bytes; the AdamW step: on ``master`` elements;
- the casts (``MixedPrecision.cast_bytes``, priced by ``cast_time`` as the op the runtime
  runs, ``CAST_OP``, through the op-kind table: its kind's byte rate, each cast reading one
  dtype and writing the other; compute on the
  parameter's placeholder, per placement, so a pipeline stage pays them per micro-batch, as
  it casts once per call): the working copy made in forward and the gradient cast back to
  the master dtype in backward, of the elements as placed (ZeRO-0/1, tensor parallel; a
  ZeRO-3 placement moves the same bytes: its shard cast before the gather in forward and
  again in backward). At ZeRO-2 the runtime casts the stored slice before the gather and the
  gathered gradient to ``reduce`` before its reduce-scatter (and the summed slice back where
  ``reduce`` is not ``master``): bytes of the same order, not the same count. Not priced: a
  ZeRO-3 gradient's cast to ``reduce`` before its reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.costmodels.compute import dtype_name, rates
from autopar.costmodels.opkinds import Op, backward_ops
from autopar.costmodels.profile import HardwareProfile

META_KEY = "autopar_precision"  # fx node meta of a parameter placeholder captured under a policy
# fx node meta of the first user output under a policy's ``output_dtype``: the loss reads it cast
OUTPUT_DTYPE_KEY = "autopar_output_dtype"
ADAMW_STATES = 2  # exp_avg, exp_avg_sq: each the size and dtype of the master parameter
# the working copy's cast, ``x.to(param_dtype)`` (``autopar.runtime.precision.to_compute``, and
# ``MixedGather``'s shards); autograd's backward of it casts the gradient back: the same op
CAST_OP = "aten._to_copy.default"

@dataclass(frozen=True)
class MixedPrecision:
    """A policy in the cost model's terms: the dtypes of the master copy, of compute and of
    gradient reductions (FSDP2's rule: reduce None reduces in the compute dtype)."""

    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype

    @property
    def master_bytes(self) -> int:
        return self.master.itemsize

    @property
    def compute_bytes(self) -> int:
        return self.compute.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.reduce.itemsize

    def describe(self) -> str:
        """E.g. "bf16 compute, fp32 master, fp32 reduce" (``explain()``)."""
        return (f"{dtype_name(self.compute)} compute, {dtype_name(self.master)} master, "
                f"{dtype_name(self.reduce)} reduce")

    def state_breakdown(self, numel: float, level: int, shards: int) -> dict[str, float]:
        """Bytes by kind of ``numel`` local parameter elements at a ZeRO level over ``shards``
        ranks (the module docstring): the master and its gradient split at level 2, AdamW's
        state at level 1 and 2; the kinds of ``state_costs.state_breakdown``."""
        n = max(shards, 1)
        stored = n if level >= 2 else 1
        return {
            "parameters": numel * self.master_bytes / stored,
            "gradients": numel * self.master_bytes / stored,
            "optimizer": numel * ADAMW_STATES * self.master_bytes / (n if level >= 1 else 1),
            "activations": 0.0,  # the working copy stays where it is read (``working_copy_bytes``)
        }

    def working_copy_bytes(self, numel: float) -> float:
        """Bytes of the working copy of ``numel`` elements a consumer reads where they lie (the
        module docstring), kept from forward until backward is done with it."""
        return numel * self.compute_bytes

    def cast_bytes(self, numel: float) -> list[float]:
        """Bytes each cast kernel of one step moves (read + write) for a parameter of ``numel``
        elements as placed (the module docstring): the working copy, and its gradient cast back."""
        m, c = self.master_bytes, self.compute_bytes
        return [numel * (m + c), numel * (c + m)]

    def cast_time(self, numel: float, profile: HardwareProfile) -> float:
        """Seconds of one step's casts of a parameter (``cast_bytes``): the working copy, a
        ``CAST_OP`` kernel, and the gradient's cast back, the op autograd runs for its backward
        (``costmodels.opkinds.backward_ops``), each at its kind's byte rate in the master dtype
        (``rates``). Each kernel's launch latency is left out (the runtime launches two per
        parameter, FSDP2 one per bucket): small parameters' casts are priced below what they
        take. With it (2 x the profile's 5 us per parameter) a model as small as the tests'
        GPT of dim 64 would compute slower in mixed precision than in float32 (37 parameters:
        0.37 ms of casts against 0.16 ms saved by bf16 compute)."""
        forward, _ = self.cast_bytes(numel)
        cast = Op(0.0, forward, dtype_name(self.master), CAST_OP)
        return sum(op.bytes / rates(op.name, op.dtype, profile)[1].rate for op in (cast, *backward_ops(cast)))

    def zero_bytes(self, numel: float) -> dict[str, float]:
        """Bytes one ZeRO collective of ``numel`` elements moves: ``"step_gather"`` (ZeRO-1's
        updated master slices), ``"all_gather"`` (a ZeRO-2 bucket, in the compute dtype),
        ``"reduce_scatter"`` and ``"all_reduce"`` (gradients, in the reduce dtype)."""
        return {"step_gather": numel * self.master_bytes, "all_gather": numel * self.compute_bytes,
                "reduce_scatter": numel * self.reduce_bytes, "all_reduce": numel * self.reduce_bytes}


def plain_zero_bytes(numel: float, itemsize: int) -> dict[str, float]:
    """``MixedPrecision.zero_bytes`` without a policy: every collective in the parameter's dtype."""
    size = numel * itemsize
    return {"step_gather": size, "all_gather": size, "reduce_scatter": size, "all_reduce": size}
