"""Linear strategies that run their tensor-parallel collective inside, pipelined with the
matmul (async TP; the kernels: ``autopar.passes.collective_matmul``).

On one mesh axis, beside ``linear``'s einsum options:

- ``gather_linear``: the input split by rows (the dim next to the features: a sequence),
  the weight and bias by output feature; the rows are gathered chunk by chunk inside the
  op, so the output holds every row and this rank's columns — sequence parallelism's
  all-gather edge and column-parallel linear as one op;
- ``linear_scatter``: the input and weight split by input feature, the bias whole; the
  partial sums are reduce-scattered by rows chunk by chunk inside the op — a row-parallel
  linear and its reduce-scatter edge as one op, whose output is split by rows, not Partial.

Each runs over one axis alone, no axis inside it may split the same rows (a gather over an
outer axis would interleave an inner axis's blocks), and no value is a pending sum
(``_fits``). Their work is the chunks' matmuls and collectives (``costmodels.pipelined``),
priced by the critical path, so the solver takes them only where that is shorter than the
collective and the matmul apart. Each linear gathers for itself: linears reading one
value (attention's q, k and v) share one gather edge instead, so there the plain
strategies usually win.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar import costmodels
from autopar.costmodels.comm import Step
from autopar.costmodels.pipelined import Pipelined
from autopar.passes.collective_matmul import AxisLink, chunk_count, gather_linear, linear_scatter
from autopar.passes.placements import is_partial, local_shape
from autopar.passes.op_strategies import AxisOption, OpInfo, ShardingStrategy
from autopar.passes.rules.registry import LocalContext, OpWork, kernel

GATHER, SCATTER = "gather_linear", "linear_scatter"
KERNELS = (GATHER, SCATTER)
LINEAR = "aten.linear.default"


def options(info: OpInfo) -> list[AxisOption]:
    """The two kernels' options for a ``linear`` of input [..., rows, K], weight [N, K], bias
    [N]: the rows next to the features (a sequence, as sequence parallelism splits it; the
    tokens of a flattened input), the one dim a tensor-parallel axis splits activations by."""
    x = info.inputs[0]
    if x.ndim < 2:
        return []
    bias = len(info.inputs) == 3
    rows, last = x.ndim - 2, x.ndim - 1
    return [AxisOption((Shard(rows), Shard(0)) + ((Shard(0),) if bias else ()), (Shard(last),), kernel=GATHER),
            AxisOption((Shard(last), Shard(1)) + ((Replicate(),) if bias else ()), (Shard(rows),), kernel=SCATTER)]


def _axes(strategy: ShardingStrategy) -> list[tuple[int, int]]:
    """(mesh axis, rows dim) of every axis whose option is the kernel's: it splits the weight
    as the kernel reads it and moves the rows (gathers the input's, or scatters the output's)."""
    x, w = strategy.inputs[0], strategy.inputs[1]
    out = []
    for a, (px, pw, po) in enumerate(zip(x, w, strategy.output)):
        if strategy.kernel == GATHER and pw == Shard(0) and isinstance(px, Shard) and px != po:
            out.append((a, px.dim))
        if strategy.kernel == SCATTER and pw == Shard(1) and isinstance(po, Shard) and px != po:
            out.append((a, po.dim))
    return out


def _fits(strategy: ShardingStrategy) -> bool:
    """One axis runs the kernel, no axis inside it splits the rows it moves, and no value is a
    pending sum (the plain options cover those; fewer strategies keep the solver quick)."""
    axes = _axes(strategy)
    if len(axes) != 1 or any(is_partial(s) for s in strategy.inputs + strategy.outputs):
        return False
    axis, dim = axes[0]
    rows = strategy.inputs[0] if strategy.kernel == GATHER else strategy.output
    return all(p != Shard(dim) for p in rows[axis + 1:])


def _axis(strategy: ShardingStrategy) -> tuple[int, int]:
    """(mesh axis, rows dim) the kernel runs over."""
    if not _fits(strategy):
        raise ValueError(f"autopar: strategy {strategy} cannot run {strategy.kernel}; expected one axis that splits "
                         f"the weight and moves rows no inner axis splits")
    return _axes(strategy)[0]


def _run(info: OpInfo, strategy: ShardingStrategy, args: tuple, kwargs: dict, ctx: LocalContext):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    axis, dim = _axis(strategy)
    link = AxisLink(ctx.exchange, axis, ctx.mesh_shape[axis])
    fused = gather_linear if strategy.kernel == GATHER else linear_scatter
    return fused(x, w, b, link, dim)


def _work(info: OpInfo, strategy: ShardingStrategy, mesh_shape: Sequence[int], dtype: str) -> OpWork:
    """One device's chunks: each a matmul of its rows, an all-gather and a reduce-scatter of
    a chunk of the rows the axis moves (the input's, or the output's gradient's)."""
    axis, dim = _axis(strategy)
    n = mesh_shape[axis]
    x = local_shape(info.inputs[0].shape, strategy.inputs[0], mesh_shape)
    w = local_shape(info.inputs[1].shape, strategy.inputs[1], mesh_shape)
    y = local_shape(info.outputs[0].shape, strategy.output, mesh_shape)
    itemsize = info.outputs[0].dtype.itemsize
    gathered = strategy.kernel == GATHER
    chunks = chunk_count(x[dim] if gathered else y[dim], n)
    rows = math.prod(y[:-1]) * (1 if gathered else n) // chunks  # one chunk's rows, every rank's piece
    moved = rows * (x[-1] if gathered else y[-1]) * itemsize  # the gathered rows, or the summed ones
    name = "aten.addmm.default" if len(info.inputs) == 3 else LINEAR  # a bias's gradient in backward

    def matmul(rows: int) -> costmodels.Op:  # reads its rows and the weight, writes its rows
        return costmodels.Op(2.0 * rows * w[0] * w[1], (rows * (w[1] + w[0]) + math.prod(w)) * itemsize, dtype,
                             name, rows * w[0] * itemsize)

    pipelined = Pipelined(chunks, matmul(rows), Step("all_gather", axis, moved, in_step=True),
                          Step("reduce_scatter", axis, moved, in_step=True), gathered, matmul(rows * chunks))
    return OpWork((pipelined.matmul,) * chunks, pipelined=pipelined)


kernel(GATHER, communicates=True, work=_work, fits=_fits)(_run)
kernel(SCATTER, communicates=True, work=_work, fits=_fits)(_run)
