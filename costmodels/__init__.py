"""autopar's cost model: hardware profiles and pure cost functions.

Imports only torch, numpy, sympy and the standard library, plus tqdm inside the
profiler for its progress bar; never ``passes`` or ``autopar``. The planner calls:

- ``preset(name, mesh_shape)`` / ``h100(...)`` / ``a100(...)``, or a measured profile
  from ``profile_mesh(...)`` (under torchrun) or ``load_profile(path, ...)``;
- ``compute_time(flops, bytes_moved, dtype, profile, op)`` (``op``: the ATen op name or
  kind, ``op_kind`` says which measured rate prices it) and ``backward_ops(op)``;
- ``collective_time(collective, nbytes, axis, profile, latency_share, in_step=...)`` (``in_step``:
  as a training step calls it, after compute, where the profile measured that) and
  ``gradient_buckets(total_bytes)`` (how many calls bucketed gradients make);
- ``kind_of``, ``hidden_share``, ``WINDOW`` and ``excess``: communication run beside compute
  and what of it stays on the critical path (``autopar.costmodels.overlap``);
- ``pipelined_times(Pipelined(...), profile)``: a matmul pipelined with its collective in
  chunks, its critical path (``autopar.costmodels.pipelined``);
- ``reshard_plan(shape, itemsize, src, dst, mesh_shape)`` and
  ``reshard_time(shape, itemsize, src, dst, profile)``;
- ``model_state_bytes(n_params, zero, n_shards, precision)``,
  ``layer_activation_bytes(...)``, ``activation_bytes(...)``, ``bubble_fraction(...)``,
  ``pipeline_time(...)``, and the pipeline schedules themselves (``Schedule``: names and
  mathematics);
- ``step_time(forward_ops, profile, forward_comm=..., backward_extra=..., optimizer_ops=...)``.

The formulas themselves are sympy expressions in ``autopar.costmodels.formulas``.
"""

from autopar.costmodels.cache import check_profile, default_cache_dir, load_profile
from autopar.costmodels.comm import (
    Step,
    backward_reshard_plan,
    bucket_copy_bytes,
    collective_time,
    grad_target,
    gradient_buckets,
    local_numel,
    reshard_plan,
    reshard_time,
    short,
)
from autopar.costmodels.compute import compute_time, matmul_flops, matmul_time, pointwise_time
from autopar.costmodels.opkinds import POINTWISE_KINDS, Op, backward_ops, op_kind
from autopar.costmodels.memory import (
    activation_bytes,
    bubble_fraction,
    layer_activation_bytes,
    micro_batches_in_flight,
    model_state_bytes,
    pipeline_time,
)
from autopar.costmodels.overlap import WINDOW, excess, hidden_share, kind_of
from autopar.costmodels.pipelined import Pipelined, PipelinedTimes, pipelined_time, pipelined_times
from autopar.costmodels.presets import PRESETS, a100, h100, preset
from autopar.costmodels.schedules import Schedule
from autopar.costmodels.profile import (
    COLLECTIVES,
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    MissingRates,
    ProfileError,
    Rate,
)
from autopar.costmodels.step import StepCost, adamw_ops, backward_time, step_time

__all__ = [
    "COLLECTIVES",
    "POINTWISE_KINDS",
    "PRESETS",
    "AxisProfile",
    "CollectiveFit",
    "DeviceProfile",
    "HardwareProfile",
    "Op",
    "MissingRates",
    "Pipelined",
    "PipelinedTimes",
    "ProfileError",
    "Rate",
    "Schedule",
    "Step",
    "StepCost",
    "WINDOW",
    "a100",
    "activation_bytes",
    "adamw_ops",
    "backward_ops",
    "backward_reshard_plan",
    "backward_time",
    "bucket_copy_bytes",
    "bubble_fraction",
    "check_profile",
    "collective_time",
    "compute_time",
    "default_cache_dir",
    "excess",
    "grad_target",
    "gradient_buckets",
    "h100",
    "hidden_share",
    "kind_of",
    "layer_activation_bytes",
    "load_profile",
    "local_numel",
    "matmul_flops",
    "matmul_time",
    "micro_batches_in_flight",
    "model_state_bytes",
    "op_kind",
    "pipeline_time",
    "pipelined_time",
    "pipelined_times",
    "pointwise_time",
    "preset",
    "reshard_plan",
    "reshard_time",
    "short",
    "step_time",
]
