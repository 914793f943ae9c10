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

Communication overlaps compute as in FSDP2 (``torch/distributed/fsdp/_fully_shard``),
inside :meth:`Overlap.forward`, which the runtime also wraps around each program call:

- forward prefetch: when a bucket is gathered, the all-gather of the bucket that
  forward gathers next is started (asynchronously), and waited for when that bucket is
  needed. The next one is the one the program's previous call gathered next (forward
  order is recorded each call, as FSDP1's ``forward_prefetch`` records it); a prefetch
  is used only when that bucket reads the very tensors it was started on, unchanged;
- in backward, where the caller asks for it (``backward``: a ``backward()`` that leaves
  gradients in ``.grad``, whose memory at its peak allows one bucket more):

  - backward prefetch: when backward first gathers a freed bucket again, the one gathered
    before it in forward (which backward needs next) is started;
  - reduce-scatters later: a bucket's gradients are reduce-scattered asynchronously while
    backward goes on, and added to its parameters' ``.grad`` when the next bucket's starts
    or when backward ends (:meth:`Overlap.wait_for_gradients`, queued on autograd's
    engine), not on the spot.

At most one bucket is gathered ahead and one reduce-scatter is in flight, as in FSDP2.
Every rank runs the same program, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Sequence

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


class InFlight:
    """A collective started asynchronously (``work``; None: nothing to wait for) and what
    its output becomes once it is done (``finish``); ``busy``: its input, kept until then."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], list[torch.Tensor]],
                 busy: torch.Tensor | None = None):
        self.work, self.finish, self.busy = work, finish, busy

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        with torch.no_grad():
            return self.finish()


def _gather_axis(pieces: list[torch.Tensor], step: Gather) -> InFlight:
    flat = torch.cat([p.reshape(-1) for p in pieces])
    out = flat.new_empty(step.axis.size * flat.numel())
    work = dist.all_gather_single(out, flat, group=step.axis.group, async_op=True)
    shapes = [p.shape for p in pieces]  # not the pieces: a cast copy is freed while the gather runs

    def wholes() -> list[torch.Tensor]:
        rows, result, offset = out.view(step.axis.size, flat.numel()), [], 0
        for shape, dim in zip(shapes, step.dims):
            numel = math.prod(shape)
            part = rows[:, offset : offset + numel].view(step.axis.size, *shape)
            whole = part.movedim(0, dim).flatten(dim, dim + 1)
            result.append(torch.empty(whole.shape, dtype=whole.dtype, device=whole.device).copy_(whole))  # own storage
            offset += numel
        return result

    return InFlight(work, wholes, flat)


def _scatter_axis(grads: list[torch.Tensor], step: Gather) -> InFlight:
    n = step.axis.size
    split = [g.unflatten(d, (n, g.shape[d] // n)).movedim(d, 0) for g, d in zip(grads, step.dims)]
    if not step.reduce:  # every rank holds the whole gradient: keep this rank's piece
        return InFlight(None, lambda: [s[step.axis.index] for s in split])
    # each gradient's n pieces copied into their columns of one flat buffer: a gradient split
    # along a later dim has pieces that are not contiguous, and reshaping them for a cat
    # would copy every such gradient at once beside the buffer
    widths = [s[0].numel() for s in split]
    flat = split[0].new_empty(n, sum(widths))
    offset = 0
    for s, width in zip(split, widths):
        flat[:, offset : offset + width].view(s.shape).copy_(s)
        offset += width
    out = flat.new_empty(flat.shape[1])
    work = dist.reduce_scatter_single(out, flat.view(-1), group=step.axis.group, async_op=True)
    shapes = [s.shape[1:] for s in split]  # not the views: the whole gradients are freed while it runs

    def pieces() -> list[torch.Tensor]:
        result, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            result.append(out[offset : offset + numel].view(shape))
            offset += numel
        return result

    return InFlight(work, pieces, flat)


class _Gathered:
    """One forward call's gather of a bucket: the shards it read, and (in backward) the
    wholes gathered again for the tensors that were saved as references. ``previous``:
    the gather before it in the same call's forward (backward's next, to prefetch)."""

    def __init__(self, bucket: "GatherBucket", shards: Sequence[torch.Tensor], run: "_Forward | None"):
        self.bucket = bucket
        self.shards = [s.detach() for s in shards]
        self.previous = run.last if run is not None and run.backward else None
        self.overlap = run.overlap if run is not None else None
        self.defer = run is not None and run.defers(bucket, shards)
        self.params = list(shards) if self.defer else []  # where gradients reduced later go
        self.references = 0  # tensors saved as references to it (pack)
        self.again: list[torch.Tensor] | None = None
        self.regathering: InFlight | None = None  # prefetched by the bucket after it, in backward
        self.reduced = False

    def wholes(self) -> list[torch.Tensor]:
        if self.again is None:
            ahead, self.regathering = self.regathering, None
            self.again = ahead.wait() if ahead is not None else self.bucket.gather(self.shards)
            self._prefetch_previous()
        return self.again

    def _prefetch_previous(self) -> None:
        before = self.previous
        while before is not None and before.references == 0:  # kept buckets are not gathered again
            before = before.previous
        if before is not None and not before.reduced and before.again is None and before.regathering is None:
            before.regathering = before.bucket.start(before.shards)

    def release(self) -> None:
        """Every use's backward has run: the copy gathered again can go (a prefetch never used, once done)."""
        if self.regathering is not None:
            self.regathering.wait()
        self.again, self.regathering, self.reduced = None, None, True


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _Gathered, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        run = _RUN.get()
        wholes = run.gather(state.bucket, shards) if run is not None else state.bucket.gather(shards)
        for i, w in enumerate(wholes):
            w._autopar_gathered = (state, i)
        if run is not None:
            run.last = state
        return tuple(wholes)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        state = ctx.state
        state.release()
        if state.defer:
            state.overlap.reduce_later(state.bucket, list(grads), state.params)
            return (None,) * (1 + len(grads))
        return (None, *state.bucket.scatter(list(grads)))


class GatherBucket(nn.Module):
    """Gather a bucket of parameter shards whole; gradients summed back to the shards."""

    param_dtype: torch.dtype | None = None  # the dtype shards are gathered in (None: their own)
    reduce_dtype: torch.dtype | None = None  # the dtype gradients are reduced in (None: their own)

    def __init__(self, names: Sequence[str], steps: Sequence[Gather], keep: bool):
        super().__init__()
        self.names = list(names)
        self.steps = sorted(steps, key=lambda s: -s.axis_number)  # innermost axis first
        self.keep = keep

    def start(self, shards: Sequence[torch.Tensor]) -> InFlight:
        """Start gathering: the innermost axis's all-gather now, the others when waited for."""
        with torch.no_grad():
            pieces = [s.detach() if self.param_dtype is None else s.detach().to(self.param_dtype) for s in shards]
            first = _gather_axis(pieces, self.steps[0])

        def rest() -> list[torch.Tensor]:
            wholes = first.wait()
            for step in self.steps[1:]:
                wholes = _gather_axis(wholes, step).wait()
            return wholes

        return InFlight(None, rest)

    def gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.start(shards).wait()

    def start_scatter(self, grads: list[torch.Tensor]) -> InFlight:
        """Start summing the gradients back: outermost axis first (the dual of gather), the
        innermost one's reduce-scatter left in flight."""
        if self.reduce_dtype is not None:
            grads = [g.to(self.reduce_dtype) for g in grads]
        steps = self.steps[::-1]
        for step in steps[:-1]:
            grads = _scatter_axis(grads, step).wait()
        return _scatter_axis(grads, steps[-1])

    def scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_scatter(grads).wait()

    def reduces(self) -> bool:
        return any(s.reduce for s in self.steps)

    def forward(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _GatherFn.apply(_Gathered(self, shards, _RUN.get()), *shards)

    def axis_calls(self) -> list[tuple[int | None, str]]:
        """The collectives it calls, each with its mesh axis (``autopar.passes.lowering.agreement``)."""
        return [(s.axis_number, f"gather of {', '.join(self.names)}") for s in self.steps]

    def extra_repr(self) -> str:
        moves = ", ".join(f"all_gather{s.axis_number}" + (" + reduce_scatter" if s.reduce else "")
                          for s in self.steps)
        kept = "kept for backward" if self.keep else "freed after use, gathered again in backward"
        return f"{len(self.names)} parameters: {moves}; {kept}: {', '.join(self.names)}"


class Overlap:
    """What one program's buckets overlap with compute: the order its last call gathered
    them in (to prefetch by), and the gradient reduce-scatters still in flight."""

    def __init__(self) -> None:
        self.order: list[tuple[GatherBucket, list[torch.Tensor] | None]] = []
        self._reducing: tuple[InFlight, list[torch.Tensor]] | None = None

    @contextlib.contextmanager
    def forward(self, backward: bool = False, summed: Collection[str] = ()) -> Iterator[None]:
        """One call's forward. ``backward``: its backward overlaps too: re-gathers prefetched,
        gradients reduce-scattered later (only where they land in ``.grad``: a ``backward()``,
        not ``autograd.grad``), except for the parameters in ``summed`` (their ``.grad``
        hooks sum them further, as backward makes them)."""
        run = _Forward(self, backward, frozenset(summed))
        token = _RUN.set(run)
        try:
            yield
        finally:
            _RUN.reset(token)
            run.close()

    def reduce_later(self, bucket: GatherBucket, grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        """In backward: start reduce-scattering ``grads``, to be added to ``params``' ``.grad``
        when the next one starts (one in flight, as FSDP2 keeps: its buffers are freed
        before the next are taken) or when this backward ends."""
        self.wait_for_gradients()
        self._reducing = (bucket.start_scatter(grads), params)
        torch.autograd.Variable._execution_engine.queue_callback(self.wait_for_gradients)

    def wait_for_gradients(self) -> None:
        """Wait for the reduce-scatter in flight and add each gradient to its parameter's
        ``.grad`` as autograd's accumulation does, its post-accumulate-grad hooks run after
        (a user's, a memory tracker's: they see the gradient land where autograd would have)."""
        if self._reducing is None:
            return
        (inflight, params), self._reducing = self._reducing, None
        for p, grad in zip(params, inflight.wait()):
            if not p.requires_grad:
                continue
            grad = grad.to(p.dtype)
            with torch.no_grad():
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
            # (torch keeps a tensor's post-accumulate-grad hooks here; no public call runs them)
            for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)


class _Forward:
    """One program call's forward (inside :meth:`Overlap.forward`): buckets gathered one
    ahead in the order the last call gathered them."""

    def __init__(self, overlap: Overlap, backward: bool, summed: frozenset[str]):
        self.overlap, self.backward, self.summed = overlap, backward, summed
        self.seen: list[tuple[GatherBucket, list[torch.Tensor] | None]] = []
        self.ahead: tuple[GatherBucket, list[torch.Tensor], list[int], InFlight] | None = None
        self.last: _Gathered | None = None

    def defers(self, bucket: GatherBucket, shards: Sequence[torch.Tensor]) -> bool:
        return (self.backward and bucket.reduces() and not self.summed.intersection(bucket.names)
                and all(s.is_leaf for s in shards if s.requires_grad))

    def gather(self, bucket: GatherBucket, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # only leaves (parameters) are the same tensors from call to call: worth prefetching
        self.seen.append((bucket, list(shards) if all(s.is_leaf for s in shards) else None))
        wholes = self._take_ahead(bucket, shards)
        if wholes is None:
            wholes = bucket.gather(shards)
        self._start_ahead(len(self.seen))
        return wholes

    def _take_ahead(self, bucket: GatherBucket, shards: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        if self.ahead is None:
            return None
        started, read, versions, inflight = self.ahead
        self.ahead = None
        wholes = inflight.wait()  # waited for even when not used: its buffers are busy until then
        same = started is bucket and len(read) == len(shards) and all(
            a is b and a._version == v for a, b, v in zip(read, shards, versions))
        return wholes if same else None

    def _start_ahead(self, index: int) -> None:
        order = self.overlap.order
        if index < len(order) and order[index][1] is not None:
            bucket, shards = order[index]
            self.ahead = (bucket, shards, [s._version for s in shards], bucket.start(shards))

    def close(self) -> None:
        if self.ahead is not None:  # the call ended before the bucket it prefetched
            self.ahead[-1].wait()
            self.ahead = None
        self.overlap.order = self.seen


_RUN: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("autopar_bucket_forward", default=None)


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
    state.references += 1
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
