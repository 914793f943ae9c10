"""One-axis placement moves as direct torch.distributed collectives, differentiable.

Most resharding edges change a single mesh axis: an all-gather (``S(d) -> R``), an
all-reduce (``P -> R``), a reduce-scatter (``P -> S(d)``), an all-to-all
(``S(i) -> S(j)``), a local slice (``R -> S(d)``), a zeroing of all but one part
(``R -> P``) or a shard padded with zeros where it lies (``S(d) -> P``: no data moves, as the
cost model prices it); a gradient-only edge (``R -> R`` whose consumer hands back a share)
all-reduces in backward alone. DTensor's
``redistribute`` runs the same collectives but spends more Python time per call than
a small tensor's collective takes, so :class:`AxisMove` calls them directly on the
axis's process group. Backward is the same vocabulary in the other direction: the
consumer's local gradient, laid out as the edge declares (``grad``), is moved to the
producer's layout, where a Partial is read as Replicate (every part of a sum gets the
whole gradient) — DTensor's rule. So ``P -> R`` is Megatron's "g" (all-reduce forward,
identity backward) and ``R -> R`` with a shared gradient is its "f". A move on several
axes runs as a chain of one-axis moves (:meth:`AxisMove.chain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.passes.placements import Spec


def _sum(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"


def movable(a: Placement, b: Placement) -> bool:
    """Whether one axis's move from ``a`` to ``b`` is a single collective (or none) here."""
    if a == b:
        return isinstance(a, (Shard, Replicate)) or _sum(a)
    if isinstance(b, Replicate):
        return isinstance(a, Shard) or _sum(a)
    if isinstance(b, Shard):
        return isinstance(a, (Replicate, Shard)) or _sum(a)
    return isinstance(a, (Replicate, Shard)) and _sum(b)  # no data moves: zeros where the value is not kept


def grad_side(p: Placement) -> Placement:
    """How a gradient arriving for a value laid out as ``p`` is laid out (a Partial's parts
    each get the whole gradient)."""
    return Replicate() if isinstance(p, Partial) else p


@dataclass(frozen=True)
class Axis:
    """One mesh axis as this rank sees it: its process group, size and our index on it."""

    group: dist.ProcessGroup
    size: int
    index: int

    @staticmethod
    def of(mesh: DeviceMesh, axis: int) -> "Axis":
        return Axis(mesh.get_group(axis), mesh.shape[axis], mesh.get_coordinate()[axis])


def gather(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """The whole of ``x`` along ``dim`` from every rank of the axis (rank order)."""
    x = x.contiguous()
    out = x.new_empty(axis.size * x.numel())
    dist.all_gather_single(out, x.view(-1), group=axis.group)
    out = out.view(axis.size, *x.shape)
    return out.movedim(0, dim).flatten(dim, dim + 1) if dim else out.flatten(0, 1)


def reduce_scatter(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """This rank's piece along ``dim`` of the sum of ``x`` over the axis."""
    pieces = x.unflatten(dim, (axis.size, x.shape[dim] // axis.size)).movedim(dim, 0).contiguous()
    out = x.new_empty(pieces.shape[1:])
    dist.reduce_scatter_single(out.view(-1), pieces.view(-1), group=axis.group)
    return out


def all_to_all(x: torch.Tensor, src: int, dst: int, axis: Axis) -> torch.Tensor:
    """``x`` split along ``src`` over the axis, split along ``dst`` instead: piece k of this
    rank's ``dst`` dim goes to rank k, and the pieces that arrive are joined along ``src``
    in rank order. One ``all_to_all_single``, as the cost model prices an ``S(i) -> S(j)``
    move (DTensor's redistribute gathers the whole tensor where the backend has no
    all-to-all of its own, gloo among them)."""
    send = x.unflatten(dst, (axis.size, x.shape[dst] // axis.size)).movedim(dst, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=axis.group)
    return recv.movedim(0, src).flatten(src, src + 1)


def all_reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=axis.group)
    return out


def move(x: torch.Tensor, a: Placement, b: Placement, axis: Axis) -> torch.Tensor:
    """``x`` laid out as ``a`` on one axis, laid out as ``b`` (see :func:`movable`)."""
    if a == b:
        return x
    if isinstance(b, Replicate):
        return gather(x, a.dim, axis) if isinstance(a, Shard) else all_reduce(x, axis)
    if isinstance(b, Shard):
        if isinstance(a, Replicate):
            return x.chunk(axis.size, b.dim)[axis.index]
        if isinstance(a, Shard):
            return all_to_all(x, a.dim, b.dim, axis)
        return reduce_scatter(x, b.dim, axis)
    if isinstance(a, Shard):  # S -> P: each rank's shard where it lies, zeros elsewhere (the parts sum to it)
        return padded(x, a.dim, axis)
    return x if axis.index == 0 else torch.zeros_like(x)  # R -> P: one copy keeps the value


def padded(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """This rank's piece ``x`` of dim ``dim`` in a tensor of the whole dim, zeros elsewhere."""
    whole = list(x.shape)
    whole[dim] *= axis.size
    out = x.new_zeros(whole)
    out.narrow(dim, axis.index * x.shape[dim], x.shape[dim]).copy_(x)
    return out


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, step: "AxisMove") -> torch.Tensor:
        ctx.step = step
        return move(x, step.src, step.dst, step.axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        step = ctx.step
        return move(grad, step.grad, grad_side(step.src), step.axis), None


@dataclass(frozen=True)
class AxisMove:
    """A placement change on one mesh axis, with the gradient's layout declared (``grad``);
    every other axis is left as it is."""

    axis_number: int
    axis: Axis
    src: Placement
    dst: Placement
    grad: Placement

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Move.apply(x, self)

    @staticmethod
    def chain(mesh: DeviceMesh, src: Spec, dst: Spec, grad: Spec) -> "list[AxisMove] | None":
        """A move as one-axis moves, one after another (one step when it touches one axis);
        None when no order of them works (DTensor handles those). Shards come off the innermost axis first
        and go onto the outermost first, as DTensor orders them; both orders are tried."""
        active = [a for a, (s, d, g) in enumerate(zip(src, dst, grad)) if s != d or g != grad_side(s)]
        for order in (active[::-1], active):
            steps = _chain(mesh, src, dst, grad, order)
            if steps is not None:
                return steps
        return None


def _chain(mesh: DeviceMesh, src: Spec, dst: Spec, grad: Spec, order: list[int]) -> "list[AxisMove] | None":
    """The one-axis moves of ``src -> dst`` taken axis by axis in ``order``, or None when a
    step is not one collective each way or would split a dim that an inner axis splits.
    Between steps the value is laid out as ``dst`` on the axes moved so far and ``src`` on
    the rest; its gradient as ``grad`` on those moved so far, as ``src`` reads it on the rest."""
    cur, steps = list(src), []
    for k, a in enumerate(order):
        s, d, g = src[a], dst[a], grad[a]
        if not (movable(s, d) and movable(g, grad_side(s))):
            return None
        nxt = cur[:a] + [d] + cur[a + 1:]
        later = set(order[k + 1:])
        g_out = [grad_side(src[b]) if b in later else grad[b] for b in range(len(src))]
        g_in = g_out[:a] + [grad_side(s)] + g_out[a + 1:]
        dims = {p.dim for p in (s, d, g) if isinstance(p, Shard)}
        if any(isinstance(p, Shard) and p.dim in dims for spec in (cur, nxt, g_out, g_in) for p in spec[a + 1:]):
            return None
        steps.append(AxisMove(a, Axis.of(mesh, a), s, d, g))
        cur = nxt
    return steps
