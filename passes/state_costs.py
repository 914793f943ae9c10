"""A parameter's state at a ZeRO level: its bytes by kind as the runtime holds them, the
optimizer step on its shard, and the level's collectives (``autopar.passes.costing`` puts them on
the ZeRO nodes).

Per ZeRO node (i, z): parameter + gradient + AdamW state bytes of the local shard as
the runtime holds them (``state_breakdown``: a bf16 model's AdamW state in bf16; level 2's
whole copy gathered for the step), the AdamW step on the local optimizer shard, and the
all-gather of updated parameters: at level 1 after the step (``autopar.runtime.zero1``: the
gradient is all-reduced whole, as at level 0, and the gathers are bucketed as the
gradients are), at level 2 in forward, where the reduce-scatter that replaces the
gradient all-reduce is also counted, minus that all-reduce (≈ 0 on a ring). Both
levels step the optimizer on 1/N of the state, which is what they buy in time.
"""

from __future__ import annotations

import math

from typing import Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar import costmodels
from autopar.costmodels.compute import dtype_name
from autopar.costmodels.formulas import BYTES_PER_PARAM
from autopar.costmodels.precision import MixedPrecision, plain_zero_bytes
from autopar.passes.edge_costs import UNPACKED, Shares, dtype_kind
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.placements import Spec, fits, local_shape


def zero_split_dim(shape: Sequence[int], spec: Spec, mesh: Sequence[int]) -> int | None:
    """The dim along which ZeRO-1/2 stores a parameter placed as ``spec`` split over the mesh
    axes that replicate it (``Plan.params``), or None where none can be: the largest dim that
    those axes divide evenly and that no inner axis splits already (so that each rank's slice
    of the optimizer state is a slice of the shard it uses: ``autopar.runtime.zero1.slice_axes``).
    Where None, ZeRO-1/2 is level 0: the runtime keeps the whole state."""
    axes = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh[a] > 1]
    if not axes:
        return None
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if any(isinstance(p, Shard) and p.dim == d for p in spec[min(axes) + 1:]):
            continue  # an inner axis splits d: an outer split of it is no slice of the shard used
        if fits(shape, tuple(Shard(d) if a in axes else p for a, p in enumerate(spec)), mesh):
            return d
    return None


def zero_costs(meta: TensorMeta, spec: Spec, level: int, precision: str | MixedPrecision,
               profile: costmodels.HardwareProfile, shares: Shares | None = None,
               runs: int = 1) -> tuple[float, float, float]:
    """(compute seconds, communication seconds, bytes) of one parameter's state at a ZeRO level,
    in a step of ``runs`` accumulated micro-batches: the optimizer step and ZeRO-1's gather
    after it once; ZeRO-2's gather and its gradient's reduce-scatter in every micro-batch's
    program (a bucket gathered from storage, ``autopar.passes.lowering.buckets``), in place of
    the one all-reduce its reader's edge prices."""
    shares = shares or UNPACKED
    mesh = profile.mesh_shape
    numel = math.prod(local_shape(meta.shape, spec, mesh))
    replicated = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh[a] > 1]
    shards = math.prod(mesh[a] for a in replicated)
    if level and shards == 1:  # nothing to shard over: level 0's memory, and never chosen
        return math.inf, 0.0, sum(state_breakdown(numel, 0, 1, precision).values())
    if level and zero_split_dim(meta.shape, spec, mesh) is None:  # runs as level 0 (``zero_split_dim``)
        level, replicated, shards = 0, [], 1
    shards = shards if level else 1
    memory = sum(state_breakdown(numel, level, shards, precision).values())
    mixed = isinstance(precision, MixedPrecision)  # AdamW steps the master; collectives' bytes by dtype
    master = dtype_name(precision.master) if mixed else dtype_kind(meta)
    optimizer = sum(costmodels.compute_time(op.flops, op.bytes, op.dtype, profile)
                    for op in costmodels.adamw_ops([math.ceil(numel / shards)], master))
    comm = 0.0
    size = precision.zero_bytes(numel) if mixed else plain_zero_bytes(numel, meta.dtype.itemsize)
    for a in replicated if level == 1 else ():  # after the step, in the gradients' buckets
        comm += costmodels.collective_time("all_gather", size["step_gather"], a, profile, shares.of("all_reduce"))
    for a in replicated if level == 2 else ():
        ring = sum(costmodels.collective_time(c, size[c], a, profile, shares.of(c))
                   for c in ("all_gather", "reduce_scatter"))
        comm += max(0.0, runs * ring - costmodels.collective_time("all_reduce", size["all_reduce"], a, profile,
                                                           shares.of("all_reduce")))
    return optimizer, comm, memory


def state_breakdown(numel: float, level: int, shards: int, precision: str | MixedPrecision) -> dict[str, float]:
    """Bytes by kind of ``numel`` parameters at a ZeRO level, as the runtime holds them:
    level 1 splits the optimizer state; level 2 the gradients too, and stores the parameter
    split as well, gathering a whole copy once per step in forward that backward keeps
    (``autopar.passes.lowering.codegen`` storage; the dry run counts it with the activations).
    Under a mixed-precision policy: ``MixedPrecision.state_breakdown``."""
    if isinstance(precision, MixedPrecision):
        return precision.state_breakdown(numel, level, shards)
    p, g, o = BYTES_PER_PARAM[precision]
    n = max(shards, 1)
    return {
        "parameters": numel * p / (n if level >= 2 else 1),
        "gradients": numel * g / (n if level >= 2 else 1),
        "optimizer": numel * o / (n if level >= 1 else 1),
        "activations": numel * p if level == 2 and n > 1 else 0.0,
    }


def at_peak(held: dict[str, float]) -> dict[str, float]:
    """Bytes by kind at the peak of a step without a pipeline, from the most each kind
    holds (``held``: parameters, gradients, optimizer, activations, temporary). Two instants
    compete: backward's start, where every kept activation and the loss's backward
    temporaries are alive and no gradient is made yet; and the gradients' sum after
    backward, where the activations are freed and every gradient has a copy in its bucket
    (``autopar.runtime.gradsync`` packs them before the sums are written back). The solver's
    memory constraint adds every kind: an upper bound of both."""
    held = {"gradients": 0.0, "activations": 0.0, "temporary": 0.0, **held}
    start = {**held, "gradients": 0.0}
    summed = {**held, "activations": 0.0, "temporary": held.get("gradients", 0.0)}
    return start if sum(start.values()) >= sum(summed.values()) else summed
