"""Data-parallel gradient shares summed in buckets, while backward runs, as DDP does.

A parameter replicated on a mesh axis over which the batch is split gets only this
device's share of its gradient (``RankProgram.grad_sync`` names the axes). The shares
of all such parameters are summed in flat buckets, one all-reduce each: with
``overlap``, a bucket's all-reduce starts (asynchronously) as soon as backward has
produced all of its gradients (``register_post_accumulate_grad_hook``), so the
communication runs while the rest of backward computes; buckets are launched strictly
in order, so every rank issues the same collectives in the same order. Bucket sizes
are DDP's defaults: a small first bucket that starts early, then 25 MiB.

Shares summed over several mesh axes (data parallel over a 2-D mesh) are summed in one
all-reduce over the ranks of those axes together (:func:`axes_group`: the whole world,
or DeviceMesh's flattened sub-mesh), bucketed and overlapped like one axis. Where no
such group can be had (an unnamed mesh that does not span the world; pipeline stages,
whose axes differ from stage to stage, so that not every rank could join in making one)
they are summed axis after axis after backward.

Mixed precision (``reduce_dtype``): floating gradients are summed in that dtype (FSDP2's
``MixedPrecisionPolicy.reduce_dtype``) and written back in their own (the master's).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh

from autopar.costmodels.comm import FIRST_GRADIENT_BUCKET_BYTES, GRADIENT_BUCKET_BYTES


def axes_group(mesh: DeviceMesh, axes: tuple[int, ...], create: bool = True) -> dist.ProcessGroup | None:
    """One process group over the ranks that differ from this one only on ``axes``: the
    axis's own group for one axis, the whole world when those axes span it, else the
    mesh's flattened sub-mesh (named meshes only). Flattening creates the groups once, by
    the root mesh, a collective of every rank in the world: only with ``create``, and only
    where every rank asks for the same axes at the same point. None where there is no such
    group (the caller sums axis after axis)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    if math.prod(mesh.shape[a] for a in axes) == dist.get_world_size():
        return dist.group.WORLD
    names = mesh.mesh_dim_names
    if not names or not create:
        return None
    return mesh[tuple(names[a] for a in axes)]._flatten().get_group()


@dataclass(frozen=True, eq=False)
class Rider:
    """Another tensor summed in place over ``axes`` along with the gradients (the loss, an
    input check); ``castable``: it may travel in a float32 or float64 bucket."""

    tensor: torch.Tensor
    axes: tuple[int, ...]
    castable: bool = False


@dataclass
class _Bucket:
    axes: tuple[int, ...]
    dtype: torch.dtype  # the gradients' own
    reduce_dtype: torch.dtype  # the dtype they are summed in
    params: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    ready: int = 0


def buckets_of(names: Sequence[str], key: Callable[[str], tuple],
               nbytes: Callable[[str], int]) -> list[tuple[tuple, list[str]]]:
    """DDP's bucketing: ``names`` in order (backward's), grouped by ``key`` (axes summed
    over, dtype); a key's open bucket is closed when the next tensor would take it past
    its cap (DDP's defaults, from the cost model that prices them: the first buckets
    ``FIRST_GRADIENT_BUCKET_BYTES``, then ``GRADIENT_BUCKET_BYTES``). Returns
    (key, names) per bucket, in the order the buckets were opened."""
    buckets: list[tuple[tuple, list[str]]] = []
    open_names: dict[tuple, list[str]] = {}
    open_bytes: dict[tuple, int] = {}
    for name in names:
        k, size = key(name), nbytes(name)
        cap = FIRST_GRADIENT_BUCKET_BYTES if len(buckets) <= 1 else GRADIENT_BUCKET_BYTES
        if k not in open_names or open_bytes[k] + size > cap:
            open_names[k], open_bytes[k] = [], 0
            buckets.append((k, open_names[k]))
        open_names[k].append(name)
        open_bytes[k] += size
    return buckets


class GradientSync:
    """Sum the gradient shares of ``grad_sync``'s parameters (placeholder -> axes).

    ``order``: the parameters in the order backward produces their gradients (the
    reverse of their first use). Call :meth:`begin` before backward and :meth:`finish`
    after it; without ``overlap`` everything is summed in :meth:`finish`. ``flatten``:
    sums over several axes may use a flattened group made for them (:func:`axes_group`;
    every rank must then build its GradientSync at the same point with the same axes, as
    the ranks of one SPMD program do); without it, only groups that exist already.

    Accumulation: backwards without :meth:`begin` (``no_sync``) leave this rank's shares
    summing in ``.grad``; the next synced backward sums them all, once. A gradient that a
    synced backward left summed, unchanged since, is set aside during the next synced
    backward and added back after it, so that it is not summed twice (DDP's average of a
    replicated sum is itself; a sum is not).

    ``reduce_dtype``: the dtype floating gradients are summed in (None: their own).
    """

    def __init__(self, grad_sync: dict[str, tuple[int, ...]], params: dict[str, torch.Tensor],
                 order: Sequence[str], mesh: DeviceMesh, overlap: bool = True, flatten: bool = True,
                 reduce_dtype: torch.dtype | None = None):
        self.mesh = mesh
        self._flatten = flatten
        self.buckets: list[_Bucket] = []
        self._index: dict[int, int] = {}  # id(parameter) -> its bucket
        synced = [name for name in order if name in grad_sync]
        for key, names in buckets_of(synced, lambda n: (grad_sync[n], params[n].dtype),
                                     lambda n: params[n].numel() * params[n].element_size()):
            axes, dtype = key
            bucket = _Bucket(axes, dtype, reduce_dtype if reduce_dtype is not None and dtype.is_floating_point else dtype)
            for p in (params[n] for n in names):
                bucket.params.append(p)
                bucket.nbytes += p.numel() * p.element_size()
                self._index[id(p)] = len(self.buckets)
                if overlap and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._ready)
            self.buckets.append(bucket)
        # the group of every set of axes summed over, made now: on every rank, in the same order
        self._groups = {axes: axes_group(mesh, axes, flatten) for axes in dict.fromkeys([b.axes for b in self.buckets])}
        self._active = False
        self._next = 0
        self._riders: list[Rider] = []
        # id(parameter) -> (its summed gradient, weakly: zero_grad frees it, and that tensor's
        # version) as the last finish left it; and, during a backward, the summed gradients
        # set aside to be added back after it
        self._summed: dict[int, tuple[weakref.ref, int]] = {}
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        # per buffer in flight: its all-reduce (None: summed in finish), the buffer, the
        # parameters whose gradients it holds, the riders' tensors, the axes
        self._inflight: list[tuple[dist.Work | None, torch.Tensor, list[torch.Tensor], list[torch.Tensor],
                                   tuple[int, ...]]] = []

    def begin(self, riders: Sequence[Rider] = ()) -> None:
        """Before backward. ``riders`` are summed with the first bucket over the same axes,
        or, where no bucket sums over those axes, on their own, starting now."""
        for bucket in self.buckets:
            bucket.ready = 0
        # gradients summed by an earlier backward (and not changed since) are not summed
        # again: set aside now, added back in finish, as DDP's average of a replicated sum is itself
        self._held = [(p, p.grad) for p in self._params() if self._still_summed(p)]
        for p, _ in self._held:
            p.grad = None
        self._next = 0
        self._inflight = []
        self._riders = []
        for r in riders:
            if any(b.axes == r.axes and self._carries(b, r) for b in self.buckets):
                self._riders.append(r)
            elif r.axes:
                self._start([], [r.tensor], r.axes)
        self._active = True

    def _params(self) -> list[torch.Tensor]:
        return [p for bucket in self.buckets for p in bucket.params]

    def _still_summed(self, p: torch.Tensor) -> bool:
        """``p.grad`` is the sum the last finish left, unchanged since."""
        left = self._summed.get(id(p))
        return left is not None and p.grad is not None and p.grad is left[0]() and p.grad._version == left[1]

    def check_local(self) -> None:
        """Before a backward that keeps its gradients local (``no_sync``): a gradient still
        holding a sum would mix with local shares and be summed again; a clear error instead."""
        if any(self._still_summed(p) for p in self._params()):
            raise ValueError(
                "autopar: a backward inside no_sync() after one outside it, with no zero_grad() between: the "
                "summed gradients would be mixed with this rank's shares; expected the no_sync() backwards first, "
                "then one outside it (DDP's order), or zero_grad() after the step"
            )

    @staticmethod
    def _carries(bucket: _Bucket, r: Rider) -> bool:
        dtype = bucket.reduce_dtype
        return r.tensor.dtype == dtype or (r.castable and dtype in (torch.float32, torch.float64))

    def _ready(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        self.buckets[self._index[id(p)]].ready += 1
        while self._next < len(self.buckets) and self._complete(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    @staticmethod
    def _complete(bucket: _Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def _launch(self, bucket: _Bucket) -> None:
        params = [p for p in bucket.params if p.grad is not None]
        riding = [r for r in self._riders if r.axes == bucket.axes and self._carries(bucket, r)]
        self._riders = [r for r in self._riders if r not in riding]
        cast = bucket.reduce_dtype if bucket.reduce_dtype != bucket.dtype else None  # None: as before mixed precision
        self._start(params, [r.tensor for r in riding], bucket.axes, cast)

    def _start(self, params: list[torch.Tensor], others: list[torch.Tensor], axes: tuple[int, ...],
               dtype: torch.dtype | None = None) -> None:
        """Start summing the gradients of ``params`` and the tensors ``others`` in one buffer
        of ``dtype`` (None: the first tensor's)."""
        tensors = [p.grad for p in params] + others
        if not tensors:
            return
        dtype = dtype or tensors[0].dtype
        flat = torch.cat([t.reshape(-1) if t.dtype == dtype else t.reshape(-1).to(dtype) for t in tensors])
        if axes not in self._groups:
            self._groups[axes] = axes_group(self.mesh, axes, self._flatten)
        group = self._groups[axes]
        # one group over the axes: asynchronous now; none: summed axis after axis in finish()
        work = dist.all_reduce(flat, group=group, async_op=True) if group is not None else None
        self._inflight.append((work, flat, params, others, axes))

    def finish(self, riders: Sequence[Rider] = ()) -> None:
        """After backward: start what has not started, wait, and write the sums back
        (``riders``: when :meth:`begin` was not called). The summed gradients are views of
        the bucket (no copy back, as DDP's ``gradient_as_bucket_view``); riders are
        written in place."""
        if not self._active:
            self.begin(riders)
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for r in self._riders:
            self._start([], [r.tensor], r.axes)
        for work, flat, params, others, axes in self._inflight:
            if work is not None:
                work.wait()
            else:
                for axis in axes:
                    dist.all_reduce(flat, group=self.mesh.get_group(axis))
            sums = _unflatten_dense_tensors(flat, [p.grad for p in params] + others)
            for p, summed in zip(params, sums):
                p.grad = summed if summed.dtype == p.grad.dtype else summed.to(p.grad.dtype)
            if others:
                torch._foreach_copy_(others, list(sums[len(params):]))
        for p, held in self._held:
            p.grad = held if p.grad is None else p.grad + held
        self._summed = {id(p): (weakref.ref(p.grad), p.grad._version) for p in self._params() if p.grad is not None}
        self._inflight, self._riders, self._held, self._active = [], [], [], False

def sync_gradients(grad_sync: dict[str, tuple[int, ...]], params: dict[str, torch.Tensor], mesh: DeviceMesh,
                   riders: Sequence[Rider] = (), flatten: bool = True) -> None:
    """Sum the gradient shares now (after backward), in buckets, ``riders`` alongside
    (``flatten``: as :class:`GradientSync` says)."""
    GradientSync(grad_sync, params, list(grad_sync), mesh, overlap=False, flatten=flatten).finish(riders)
