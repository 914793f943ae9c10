"""Gradient clipping by the global norm, as ``torch.nn.utils.clip_grad_norm_`` on one device.

Each rank holds shards of the summed gradients, laid out as its parameters' placements
say. The p-norm of all gradients is ``(sum of |g|^p over every element, once)^(1/p)``:
each rank adds, for each of its shards, ``norm^p`` divided by the number of ranks that
hold the same shard (the product of the mesh axes on which the placement is
``Replicate``), and one all-reduce of that scalar over the mesh counts every element
once. The infinity norm is a max (a min for -inf), which replicas do not change. The
gradients are then scaled in place by torch's own ``clip_grads_with_norm_``, with
torch's coefficient ``min(max_norm / (total + 1e-6), 1)``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate

from autopar.runtime.gradsync import axes_group
from autopar.passes.placements import Spec, spec_str


def replicas(spec: Spec | None, mesh_shape: Sequence[int]) -> int:
    """How many ranks of a mesh hold the same shard of a tensor placed as ``spec``
    (None: a tensor held whole everywhere). Gradients are summed before clipping, so a
    Partial placement means an unsummed gradient."""
    if spec is None:
        return math.prod(mesh_shape)
    if any(isinstance(p, Partial) for p in spec):
        raise ValueError(
            f"autopar: clipping found a gradient placed as {spec_str(spec)}; expected Shard or Replicate on every "
            "axis (gradients summed); clip after backward has finished, outside no_sync()"
        )
    return math.prod(size for size, p in zip(mesh_shape, spec) if isinstance(p, Replicate))


def _reduce_op(norm_type: float) -> dist.ReduceOp:
    if norm_type == math.inf:
        return dist.ReduceOp.MAX
    if norm_type == -math.inf:
        return dist.ReduceOp.MIN
    return dist.ReduceOp.SUM


def norm_share(grads: Sequence[torch.Tensor], copies: Sequence[int], norm_type: float) -> torch.Tensor:
    """This rank's part of the total, in float64: the sum of ``norm^p / copies`` of its
    gradient shards (``copies``: the ranks holding the same shard), or their max (min)
    for the infinity norm (-inf). A rank with no gradients gives the reduction's identity."""
    op = _reduce_op(norm_type)
    if not grads:
        return torch.tensor(math.inf if op == dist.ReduceOp.MIN else 0.0, dtype=torch.float64)
    norms = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(list(grads), norm_type)])
    if op == dist.ReduceOp.MAX:
        return norms.max()
    if op == dist.ReduceOp.MIN:
        return norms.min()
    return (norms.pow(norm_type) / torch.tensor(copies, dtype=torch.float64, device=norms.device)).sum()


def total_norm(grads: Sequence[torch.Tensor], copies: Sequence[int], mesh: DeviceMesh, norm_type: float,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The norm of all gradients of the model, the same on every rank of ``mesh`` (a
    collective: every rank calls it), in ``dtype`` (the parameters', as torch returns it)."""
    share = norm_share(grads, copies, norm_type).to(device)
    op = _reduce_op(norm_type)
    group = axes_group(mesh, tuple(range(mesh.ndim)))
    if group is not None:  # one all-reduce over every rank: the same bits everywhere
        dist.all_reduce(share, op=op, group=group)
    else:
        for axis in range(mesh.ndim):
            dist.all_reduce(share, op=op, group=mesh.get_group(axis))
    total = share if op != dist.ReduceOp.SUM else share.pow(1.0 / norm_type)
    return total.to(dtype)


@torch.no_grad()
def clip_grad_norm_(params: Sequence[torch.Tensor], copies: Sequence[int], mesh: DeviceMesh, max_norm: float,
                    norm_type: float, device: torch.device) -> torch.Tensor:
    """Clip the gradients of this rank's parameter shards ``params`` in place by the norm
    of all of them over ``mesh`` (``copies[i]``: how many ranks hold ``params[i]``'s shard)
    and return that norm. Every rank of the mesh calls it."""
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type == 0 or (norm_type < 0 and norm_type != -math.inf):
        raise ValueError(f"autopar: clip_grad_norm_ got norm_type={norm_type}; expected a positive number, "
                         "inf or -inf")
    if len(params) != len(copies):
        raise ValueError(f"autopar: {len(params)} parameters and {len(copies)} replica counts; expected one each")
    with_grad = [(p, c) for p, c in zip(params, copies) if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params]) if params else torch.float64
    total = total_norm([p.grad for p, _ in with_grad], [c for _, c in with_grad], mesh, norm_type, dtype, device)
    torch.nn.utils.clip_grads_with_norm_([p for p, _ in with_grad], max_norm, total)
    return total
