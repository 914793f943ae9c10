"""ZeRO-1 (Rajbhandari et al. 2020, stage 1): parameters whole, the optimizer on a slice.

The program uses a level-1 parameter as its ops need it, and its gradient is summed
whole over the data-parallel axes while backward runs (``autopar.runtime.gradsync``), exactly
as for plain data parallelism. The optimizer holds only this rank's slice of the
parameter, where the plan stores it: a view into the whole parameter, so the slice costs
no memory of its own, stepped with the same slice of the summed gradient. After the
step, the updated slices are all-gathered into every rank's whole parameter, a bucket
at a time, by the gather ZeRO-2/3 use (``autopar.passes.lowering.buckets``); buckets are sized as the
gradients' are, so that one all-gather follows each gradient all-reduce.
(``ZeroRedundancyOptimizer`` broadcasts each parameter from the rank that owns it.)

ZeRO-2 where parameters are held whole (pipeline stages, as Megatron's distributed
optimizer runs with pipelines): the whole gradient accumulates over the step's
micro-batches unsummed on the slice axes, and taking the slices reduce-scatters it once
(``reduced``: the same buckets, each ``Gather`` step reducing), after which only the
summed slice is kept and the whole gradient is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from autopar.runtime.gradsync import buckets_of
from autopar.passes.lowering.buckets import Gather, GatherBucket
from autopar.passes.lowering.codegen import gathered_axes
from autopar.passes.lowering.collectives import Axis, grad_side
from autopar.passes.placements import Spec, spec_str


class OptimizerSlices:
    """The slices the optimizer steps for ``wholes`` (placeholder -> the whole parameter as
    the program uses it, laid out as ``used`` says), stored as ``stored`` says: split
    further over data-parallel axes on which ``used`` is Replicate. ``order``: the
    placeholders in backward order (bucketed as the gradients are). ``reduced``: the
    ZeRO-2 ones among them, each with the slice axes on which its whole gradient is still
    this rank's share (summed by the reduce-scatter of :meth:`take_gradients`, in
    ``reduce_dtype`` for floating gradients: a mixed-precision policy's; None: their own)."""

    def __init__(self, wholes: dict[str, nn.Parameter], used: dict[str, Spec], stored: dict[str, Spec],
                 mesh: DeviceMesh, order: Sequence[str], reduced: Mapping[str, tuple[int, ...]] | None = None,
                 reduce_dtype: torch.dtype | None = None):
        self.wholes = wholes
        self.slices: dict[str, nn.Parameter] = {}
        self.reduced = dict(reduced or {})
        self.reduce_dtype = reduce_dtype
        # per bucket: its gather (slices as views, after-step gathers), its names, and (ZeRO-2)
        # the same bucket whose steps reduce-scatter the gradients over the axes they are shares on
        self._buckets: list[tuple[GatherBucket, list[str], GatherBucket | None]] = []
        # buckets as GradientSync makes them: by axes and dtype, in backward order, DDP's sizes
        axes_of = {n: self._axes(n, w.shape, used[n], stored[n], mesh) for n, w in wholes.items()}
        ordered = [n for n in order if n in wholes] + sorted(set(wholes) - set(order))

        def key(n: str) -> tuple:  # ZeRO-1 and ZeRO-2 (by the axes reduce-scattered) in buckets of their own
            return axes_of[n], self.reduced.get(n), wholes[n].dtype

        for (axes, summed, _), names in buckets_of(ordered, key,
                                                   lambda n: wholes[n].numel() * wholes[n].element_size()):
            steps = [Gather(a, Axis.of(mesh, a), tuple(stored[n][a].dim for n in names), reduce=False) for a in axes]
            bucket = GatherBucket(names, steps, keep=True)
            views = bucket.scatter([wholes[n].detach() for n in names])  # this rank's slices, as views
            for n, view in zip(names, views):
                self.slices[n] = nn.Parameter(view, requires_grad=wholes[n].requires_grad)
            reducing = None if summed is None else GatherBucket(
                names, [dataclasses.replace(step, reduce=step.axis_number in summed) for step in steps], keep=True)
            self._buckets.append((bucket, names, reducing))

    @staticmethod
    def _axes(name: str, shape: Sequence[int], used: Spec, stored: Spec, mesh: DeviceMesh) -> tuple[int, ...]:
        axes = slice_axes(shape, used, stored, tuple(mesh.shape))
        if axes is None:
            raise ValueError(
                f"autopar: ZeRO-1 stores {name} (local shape {tuple(shape)}) as {spec_str(stored)} and uses it "
                f"as {spec_str(used)}; expected the stored layout to split evenly, further, only axes the used "
                "one replicates; store it as used (ZeRO level 0) or at level 2"
            )
        return axes

    def zero_grad(self) -> None:
        """Before backward: the whole parameters' gradients from the last step are dropped
        (the optimizer drops its slices')."""
        for whole in self.wholes.values():
            whole.grad = None

    def take_gradients(self) -> None:
        """After the gradients are summed: each slice's gradient is its part of the whole's
        (a view: no copy, no collective, taken again by each call); a parameter no op used
        gets none. ZeRO-2 (``reduced``): the whole gradients reduce-scattered into the
        slices' (added to what an earlier call left there), then dropped; a call that finds
        them dropped already does nothing."""
        for bucket, names, reducing in self._buckets:
            grads = [self.wholes[n].grad for n in names]
            if reducing is not None:
                self._reduce(reducing, names, grads)
                continue
            parts = bucket.scatter([g if g is not None else torch.zeros_like(self.wholes[n])
                                    for n, g in zip(names, grads)])
            for n, g, part in zip(names, grads, parts):
                self.slices[n].grad = part if g is not None else None

    def _reduce(self, bucket: GatherBucket, names: list[str], grads: list[torch.Tensor | None]) -> None:
        if all(g is None for g in grads):  # taken already (the same on every rank of the bucket's axes)
            return
        wholes = [g if g is not None else torch.zeros_like(self.wholes[n]) for n, g in zip(names, grads)]
        parts = bucket.scatter([self._to_reduce(g) for g in wholes])
        if not bucket.steps[0].reduce:  # the innermost step took views: own storage, so that the wholes can go
            parts = [p.clone() if p.dtype == w.dtype else p for p, w in zip(parts, wholes)]  # (a cast copies)
        parts = [p.to(w.dtype) for p, w in zip(parts, wholes)]  # summed, back in the gradients' own dtype
        for n, g, part in zip(names, grads, parts):
            if g is None:
                continue
            piece = self.slices[n]
            piece.grad = part if piece.grad is None else piece.grad + part
            self.wholes[n].grad = None

    def _to_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """A floating gradient in ``reduce_dtype`` (the policy's) for its reduce-scatter."""
        if self.reduce_dtype is None or not grad.is_floating_point():
            return grad
        return grad.to(self.reduce_dtype)

    def all_reduced(self, grad_sync: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``grad_sync`` (placeholder -> axes its gradient is summed over) without the axes
        that :meth:`take_gradients` sums by its reduce-scatter: what is left to all-reduce."""
        left = {n: tuple(a for a in axes if a not in self.reduced.get(n, ())) for n, axes in grad_sync.items()}
        return {n: axes for n, axes in left.items() if axes}

    @torch.no_grad()
    def gather(self) -> None:
        """After the optimizer has stepped the slices: every rank's whole parameters updated."""
        for bucket, names, _ in self._buckets:
            updated = bucket.gather([self.slices[n] for n in names])
            torch._foreach_copy_([self.wholes[n] for n in names], updated)


def slice_axes(shape: Sequence[int], used: Spec, stored: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The mesh axes over which ``stored`` splits a tensor held as ``used`` (of local shape
    ``shape``) further, each evenly along one dim, so that this rank's slice is a view
    of the tensor; None where it is not such a split."""
    axes = gathered_axes(stored, used, tuple(grad_side(p) for p in used))
    if axes is None or any(not isinstance(stored[a], Shard) or shape[stored[a].dim] % mesh_shape[a] for a in axes):
        return None
    return axes

