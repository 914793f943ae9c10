"""Communication costs: one collective, and resharding a tensor between placements.

Pure functions of shapes, placements and a ``HardwareProfile``. A placement spec is a
tuple with one ``Shard(dim)`` / ``Replicate()`` / ``Partial()`` per mesh axis, axis 0
outermost (DTensor's convention). ``reshard_plan`` follows the greedy plan of DTensor's
``redistribute`` (torch/distributed/tensor/_redistribute.py): first, when the source
shards anything, from the innermost axis out, every axis changes to its target, except that an axis whose target shards a
dim that is sharded differently on the axes outside it is first replicated; then, from
the outermost axis in, what is left. Each step is priced on the local shard it moves.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.costmodels.formulas import compiled
from autopar.costmodels.profile import COLLECTIVES, HardwareProfile

Spec = tuple[Placement, ...]


class Step(NamedTuple):
    """One collective of a resharding: which, on which mesh axis, on a buffer of X bytes;
    ``in_step``: a step waits for it right after compute (an activation's move), priced
    by the profile's fits after compute, rather than one of the bucketed parameter
    collectives (gradient all-reduces, ZeRO gathers), priced as timed back to back."""

    collective: str
    axis: int
    bytes: int
    in_step: bool = False


# DDP's default bucket sizes, which the runtime's gradient buckets use too
# (``autopar.runtime.gradsync`` imports these): a small first bucket that starts early
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, checked in tests/test_costing.py), then
# bucket_cap_mb=25 (torch.nn.parallel.DistributedDataParallel's default).
FIRST_GRADIENT_BUCKET_BYTES = 2**20
GRADIENT_BUCKET_BYTES = 25 * 2**20


def collective_time(collective: str, nbytes: float, axis: int | str, profile: HardwareProfile,
                    latency_share: float = 1.0, *, in_step: bool = False) -> float:
    """Seconds for ``collective`` over mesh ``axis`` on a buffer of ``nbytes`` (see
    ``formulas.COLLECTIVE_BUFFER`` for which buffer). Zero on an axis of size 1.

    ``latency_share``: the part of one call's latency (alpha) this buffer pays when it
    travels packed with others in one call (bucketed gradients, per-layer gathers of
    parameters): its bytes' part of the bucket, so a bucket's buffers pay alpha once.
    ``in_step``: as a training step calls it, right after compute (``AxisProfile.in_step``,
    where the profile has that collective's fit); else as timed back to back."""
    ax = profile.axis(axis)
    if ax.size == 1 or nbytes == 0:
        return 0.0
    measured_in_step = ax.in_step.get(collective) if in_step else None
    fit = measured_in_step or ax.collectives.get(collective)
    if fit is None:
        raise KeyError(f"autopar: unknown collective {collective!r}; expected one of {list(COLLECTIVES)}.")
    time = _collective_fn(collective)(fit.alpha_s * latency_share, fit.beta_bytes_per_s, ax.size, nbytes)
    # The library picks the faster protocol for the size; a fit measured in the step already
    # holds whichever protocol it picked there.
    small = None if measured_in_step else ax.low_latency.get(collective)
    if small is not None:
        time = min(time, _collective_fn(collective)(small.alpha_s * latency_share, small.beta_bytes_per_s, ax.size,
                                                    nbytes))
    return time


def bucket_copy_bytes(collective: str, nbytes: float, size: int) -> float:
    """Bytes read plus written by the copies around one parameter's part of a bucketed
    all-gather or reduce-scatter (``passes/buckets.py``) of X = ``nbytes`` over ``size``
    ranks. An all-gather packs the local shard into the flat input (``torch.cat``: X/size
    read, X/size written) and copies the parameter out of the gathered buffer into storage
    of its own (X read, X written); a reduce-scatter packs the gradient into the flat input
    (X read, X written; a lower bound: a gradient split along a dim other than 0 is also
    made contiguous first). Other collectives, and an axis of one rank: no copies."""
    if size <= 1:
        return 0.0
    if collective == "all_gather":
        return 2.0 * nbytes / size + 2.0 * nbytes
    if collective == "reduce_scatter":
        return 2.0 * nbytes
    return 0.0


def gradient_buckets(total_bytes: float) -> int:
    """How many all-reduce calls DDP-style buckets make of ``total_bytes`` of gradients."""
    rest = max(0.0, total_bytes - FIRST_GRADIENT_BUCKET_BYTES)
    return 1 + math.ceil(rest / GRADIENT_BUCKET_BYTES)


@lru_cache(maxsize=None)
def _collective_fn(collective: str):
    return compiled(f"collective.{collective}")


_BASES: dict[type, type | None] = {}  # a placement's type -> its base, worked out once per type


def _kind(placement: Placement) -> type | None:
    """Shard, Replicate or Partial: the base ``placement`` moves as (subclasses, DTensor's
    MaskPartial..., move as their base); None for anything else. By type, as torch's
    placements check ``isinstance`` in Python, and a reshard plan asks it many times."""
    kind = type(placement)
    if kind not in _BASES:
        _BASES[kind] = next((base for base in (Shard, Replicate, Partial) if isinstance(placement, base)), None)
    return _BASES[kind]


def _base(placement: Placement) -> type:
    base = _kind(placement)
    if base is None:
        raise TypeError(
            f"autopar: expected a placement Shard(dim), Replicate() or Partial(); found {placement!r}."
        )
    return base


def short(placement: Placement) -> str:
    """``S(0)``, ``R``, ``P`` (a pending sum), ``P(max)``: the printed short form, the one
    place it is defined (``autopar.passes.placements`` prints with it too)."""
    base = _base(placement)
    if base is Shard:
        return f"S({placement.dim})"
    if base is Replicate:
        return "R"
    return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"


def _check(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], what: str) -> None:
    if len(spec) != len(mesh_shape):
        raise ValueError(
            f"autopar: {what} placement {tuple(map(short, spec))} has {len(spec)} entries but the "
            f"mesh {tuple(mesh_shape)} has {len(mesh_shape)} axes; give one placement per axis."
        )
    for pl in spec:
        if _base(pl) is Shard and not -len(shape) <= pl.dim < len(shape):
            raise ValueError(
                f"autopar: {what} placement {short(pl)} shards dim {pl.dim} of a tensor of shape "
                f"{tuple(shape)}; the dim must be in [0, {len(shape)})."
            )


def _norm(spec: Spec, ndim: int) -> Spec:
    """``spec`` with each shard a plain ``Shard`` of a dim counted from 0 (made only where it
    is not one already: making placements is slow)."""
    return tuple(Shard(pl.dim % ndim) if _kind(pl) is Shard and not (type(pl) is Shard and 0 <= pl.dim < ndim)
                 else pl for pl in spec)


def local_numel(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> int:
    """Elements of the largest local shard (uneven splits round up, as DTensor pads)."""
    local = list(shape)
    for pl, n in zip(spec, mesh_shape):
        if _kind(pl) is Shard:
            local[pl.dim] = -(-local[pl.dim] // n)
    return math.prod(local)


# What takes one mesh axis from one placement to another, by their types: a collective,
# or a local move that sends nothing. The one table of it: the cost model prices the
# collectives, and codegen names each Reshard by these words (``passes/lowering/codegen.py``).
_AXIS_MOVES = {
    (Shard, Replicate): "all_gather",
    (Shard, Shard): "all_to_all",
    (Partial, Replicate): "all_reduce",
    (Partial, Shard): "reduce_scatter",
    (Partial, Partial): "all_reduce",  # another reduce op: reduce, then keep one copy
    (Replicate, Shard): "slice",
    (Replicate, Partial): "zero_others",  # keep one copy, zeros elsewhere
    (Shard, Partial): "pad_shard",  # keep the shard, zeros elsewhere
}
LOCAL_MOVES = frozenset({"slice", "zero_others", "pad_shard"})


def axis_move(src: Placement, dst: Placement) -> str | None:
    """What takes one mesh axis from ``src`` to ``dst``: a collective, or a local move
    (one of ``LOCAL_MOVES``); None when they are the same."""
    return None if src == dst else _AXIS_MOVES[_base(src), _base(dst)]


def reshard_plan(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
) -> tuple[Step, ...]:
    """The collectives that take a tensor from placement ``src`` to ``dst`` on the mesh.

    Local moves (R->S slice, R->P, S->P) are free and not listed. ``bytes`` is each
    collective's buffer X (per rank, as in ``formulas.COLLECTIVE_BUFFER``). Cached.
    """
    return _reshard_plan(tuple(shape), itemsize, tuple(src), tuple(dst), tuple(mesh_shape))


@lru_cache(maxsize=1 << 16)
def _reshard_plan(
    shape: tuple[int, ...], itemsize: int, src: Spec, dst: Spec, mesh_shape: tuple[int, ...]
) -> tuple[Step, ...]:
    _check(shape, src, mesh_shape, "source")
    _check(shape, dst, mesh_shape, "target")
    ndim = len(shape)
    cur, tgt = list(_norm(src, ndim)), list(_norm(dst, ndim))
    steps: list[Step] = []

    def move(axis: int, to: Placement) -> None:
        kind = axis_move(cur[axis], to)
        if kind not in LOCAL_MOVES and mesh_shape[axis] > 1:
            before = local_numel(shape, tuple(cur), mesh_shape)
            # an all-gather's buffer is its output: N padded input shards
            buffer = before * mesh_shape[axis] if kind == "all_gather" else before
            steps.append(Step(kind, axis, buffer * itemsize))
        cur[axis] = to

    if any(_kind(pl) is Shard for pl in cur):
        for axis in reversed(range(len(cur))):
            to = tgt[axis]
            if _kind(to) is Shard:  # a plain Shard (``_norm``)
                outer_cur = [i for i in range(axis) if cur[i] == to]
                outer_tgt = [i for i in range(axis) if tgt[i] == to]
                if outer_cur != outer_tgt:
                    to = Replicate()
            if cur[axis] != to:
                move(axis, to)
    for axis in range(len(cur)):
        if cur[axis] != tgt[axis]:
            move(axis, tgt[axis])
    return tuple(steps)


def reshard_time(
    shape: tuple[int, ...],
    itemsize: int,
    src: Spec,
    dst: Spec,
    profile: HardwareProfile,
) -> float:
    """Seconds to reshard a tensor from ``src`` to ``dst`` on ``profile``'s mesh."""
    plan = _reshard_plan(tuple(shape), itemsize, tuple(src), tuple(dst), profile.mesh_shape)
    return sum(collective_time(s.collective, s.bytes, s.axis, profile) for s in plan)


def grad_target(src: Spec, grad: Spec) -> Spec:
    """The placement a forward input's gradient is brought to in backward: the input's
    own placement, except that a Partial input gets a Replicate gradient unless the
    gradient arrives Partial (DTensor's ``_redistribute_backward``)."""
    return tuple(
        Replicate() if _kind(t) is Partial and _kind(g) is not Partial else t for g, t in zip(grad, src)
    )


def backward_reshard_plan(
    shape: tuple[int, ...],
    itemsize: int,
    src: Spec,
    dst: Spec,
    mesh_shape: tuple[int, ...],
    grad: Spec | None = None,
) -> tuple[Step, ...]:
    """The collectives of the gradient's resharding in backward, for a forward resharding
    ``src -> dst``. ``grad`` is the placement the output gradient arrives in: by default
    ``dst`` (consumers computed redundantly); Partial where the consumer contracted over a
    sharded dim or each rank saw different data. So an all-gather of a parameter used by
    data-parallel compute (grad Partial) has a reduce-scatter as its dual, a P -> R
    all-reduce has a free dual, and a free R -> S slice has an all-gather as its dual."""
    grad = tuple(dst) if grad is None else tuple(grad)
    return reshard_plan(tuple(shape), itemsize, grad, grad_target(tuple(src), grad), tuple(mesh_shape))
