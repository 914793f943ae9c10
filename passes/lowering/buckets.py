"""Sharded parameters gathered a bucket at a time, as FSDP gathers a ``fully_shard`` unit.

A bucket is the set of parameters stored split over some mesh axes and used whole
there by the ops of one segment of the graph (a repeated layer, or the stretch
between layers). :class:`GatherBucket` gathers all of them with one all-gather of one
flat buffer per axis, and in backward sums their gradients back with one
reduce-scatter per axis (or takes this rank's slice, where every rank computed the
whole gradient). It is the dual pair FSDP runs, bucketed as FSDP buckets it.

ZeRO-3 buckets are freed after their last use in forward and gathered again in
backward (FSDP's ``reshard_after_forward``): a gathered weight saved for backward is
stored as a reference (:func:`pack`) and gathered again, once per bucket, when
backward first needs it (:func:`unpack`); the copy is dropped once the bucket's
gradients are reduced. Tensors are saved this way only inside :func:`saving`, which
the runtime wraps around each program call. ZeRO-1/2 buckets (``keep``) are kept for
backward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.passes.lowering.collectives import Axis


@dataclass(frozen=True)
class Gather:
    """One axis of a bucket's gather: the tensor dim each parameter is split along there,
    and whether the gradients come back as this rank's shares (reduce-scattered) or whole."""

    axis_number: int
    axis: Axis
    dims: tuple[int, ...]  # per parameter of the bucket
    reduce: bool


def _gather_axis(pieces: list[torch.Tensor], step: Gather) -> list[torch.Tensor]:
    flat = torch.cat([p.reshape(-1) for p in pieces])
    out = flat.new_empty(step.axis.size * flat.numel())
    dist.all_gather_single(out, flat, group=step.axis.group)
    out = out.view(step.axis.size, flat.numel())
    wholes, offset = [], 0
    for p, dim in zip(pieces, step.dims):
        part = out[:, offset : offset + p.numel()].view(step.axis.size, *p.shape)
        whole = part.movedim(0, dim).flatten(dim, dim + 1)
        wholes.append(torch.empty(whole.shape, dtype=whole.dtype, device=whole.device).copy_(whole))  # own storage
        offset += p.numel()
    return wholes


def _scatter_axis(grads: list[torch.Tensor], step: Gather) -> list[torch.Tensor]:
    n = step.axis.size
    split = [g.unflatten(d, (n, g.shape[d] // n)).movedim(d, 0) for g, d in zip(grads, step.dims)]
    if not step.reduce:  # every rank holds the whole gradient: keep this rank's piece
        return [s[step.axis.index] for s in split]
    flat = torch.cat([s.reshape(n, -1) for s in split], dim=1)
    out = flat.new_empty(flat.shape[1])
    dist.reduce_scatter_single(out, flat.view(-1), group=step.axis.group)
    pieces, offset = [], 0
    for s in split:
        numel = math.prod(s.shape[1:])
        pieces.append(out[offset : offset + numel].view(s.shape[1:]))
        offset += numel
    return pieces


class _Gathered:
    """One forward call's gather of a bucket: the shards it read, and (in backward) the
    wholes gathered again for the tensors that were saved as references."""

    def __init__(self, bucket: "GatherBucket", shards: Sequence[torch.Tensor]):
        self.bucket = bucket
        self.shards = [s.detach() for s in shards]
        self.again: list[torch.Tensor] | None = None

    def wholes(self) -> list[torch.Tensor]:
        if self.again is None:
            self.again = self.bucket.gather(self.shards)
        return self.again


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _Gathered, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        wholes = state.bucket.gather(shards)
        for i, w in enumerate(wholes):
            w._autopar_gathered = (state, i)
        return tuple(wholes)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        state = ctx.state
        state.again = None  # every use's backward has run: the copy gathered again can go
        return (None, *state.bucket.scatter(list(grads)))


class GatherBucket(nn.Module):
    """Gather a bucket of parameter shards whole; gradients summed back to the shards."""

    def __init__(self, names: Sequence[str], steps: Sequence[Gather], keep: bool):
        super().__init__()
        self.names = list(names)
        self.steps = sorted(steps, key=lambda s: -s.axis_number)  # innermost axis first
        self.keep = keep

    def gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            pieces = [s.detach() for s in shards]
            for step in self.steps:
                pieces = _gather_axis(pieces, step)
        return pieces

    def scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for step in reversed(self.steps):  # outermost axis first: the dual of gather
            grads = _scatter_axis(grads, step)
        return grads

    def forward(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _GatherFn.apply(_Gathered(self, shards), *shards)

    def axis_calls(self) -> list[tuple[int | None, str]]:
        """The collectives it calls, each with its mesh axis (``autopar.passes.lowering.agreement``)."""
        return [(s.axis_number, f"gather of {', '.join(self.names)}") for s in self.steps]

    def extra_repr(self) -> str:
        moves = ", ".join(f"all_gather{s.axis_number}" + (" + reduce_scatter" if s.reduce else "")
                          for s in self.steps)
        kept = "kept for backward" if self.keep else "freed after use, gathered again in backward"
        return f"{len(self.names)} parameters: {moves}; {kept}: {', '.join(self.names)}"


@dataclass(frozen=True)
class _Reference:
    state: _Gathered
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def gathered(t: torch.Tensor) -> tuple[_Gathered, int] | None:
    """(the gather, index) when ``t`` is (a view of) a gathered weight."""
    base = t._base if t._base is not None else t
    return getattr(base, "_autopar_gathered", None)


def pack(t: torch.Tensor):
    """A gathered weight of a freed bucket saved for backward becomes a reference to it."""
    tag = gathered(t)
    if tag is None or tag[0].bucket.keep:
        return t
    state, index = tag
    return _Reference(state, index, t.size(), t.stride(), t.storage_offset())


def unpack(saved) -> torch.Tensor:
    if not isinstance(saved, _Reference):
        return saved
    whole = saved.state.wholes()[saved.index]
    return whole.as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def saving(observe: Callable[[torch.Tensor, bool], None] | None = None) -> Iterator[None]:
    """Save tensors for backward as :func:`pack` says; ``observe(tensor, is_weight)`` sees
    every tensor that is really kept (not the references), ``is_weight`` when it is a
    gathered weight kept for backward (ZeRO-1/2), e.g. to measure memory."""
    if observe is None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    else:
        def pack_observed(t: torch.Tensor):
            saved = pack(t)
            if saved is t:
                observe(t, gathered(t) is not None)
            return saved

        hooks = torch.autograd.graph.saved_tensors_hooks(pack_observed, unpack)
    with hooks:
        yield
