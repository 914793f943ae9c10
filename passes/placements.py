"""Placements of one tensor on an N-axis mesh, and their short printed form.

A *spec* is a tuple of N placements, one per mesh axis (``torch.distributed.tensor``'s
``Shard(dim)``, ``Replicate()``, ``Partial(op)``). Axis 0 is outermost: under
``(S(0), S(0))`` dim 0 is split by axis 0 first, then each piece by axis 1, which is
DTensor's convention. Short form: ``S(0)R``, ``P`` for a sum, ``P(max)`` for a max.
"""

from __future__ import annotations

import re
from typing import Collection, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.costmodels.comm import short

Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def spec_str(spec: Spec | None) -> str:
    """``(S(0), R)`` prints as ``S(0)R``; None (an input whose value is not read) as ``_``."""
    return "_" if spec is None else "".join(short(p) for p in spec)


_TOKEN = re.compile(r"S\((\d+)\)|R|P(?:\((sum|avg|max|min)\))?")


def parse_spec(text: str) -> Spec:
    """Inverse of :func:`spec_str`: ``"S(0)R"`` -> ``(Shard(0), Replicate())``."""
    out: list[Placement] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(
                f"autopar: cannot parse placement spec {text!r} at position {pos}; "
                "expected a run of S(dim), R, P or P(max|min|avg|sum), e.g. 'S(0)R'"
            )
        if m.group(0).startswith("S"):
            out.append(Shard(int(m.group(1))))
        elif m.group(0) == "R":
            out.append(Replicate())
        else:
            out.append(Partial(m.group(2) or "sum"))
        pos = m.end()
    return tuple(out)


def replicated(ndim: int) -> Spec:
    return (R,) * ndim


def shard_counts(spec: Spec, mesh_shape: Sequence[int], tensor_ndim: int) -> list[int]:
    """How many pieces each tensor dim is cut into."""
    counts = [1] * tensor_ndim
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            counts[p.dim] *= mesh_shape[axis]
    return counts


def fits(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim divides evenly (uneven shards are excluded, not guessed)."""
    if any(isinstance(p, Shard) and not 0 <= p.dim < len(shape) for p in spec):
        return False
    counts = shard_counts(spec, mesh_shape, len(shape))
    return all(size % c == 0 and (c == 1 or size >= c) for size, c in zip(shape, counts))


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    counts = shard_counts(spec, mesh_shape, len(shape))
    return tuple(size // c for size, c in zip(shape, counts))


def shard_offset(
    shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int], dim: int
) -> tuple[int, int]:
    """[start, stop) of the slice of tensor dim ``dim`` held at mesh coordinate ``coord``."""
    start, size = 0, shape[dim]
    for axis, p in enumerate(spec):
        if isinstance(p, Shard) and p.dim == dim:
            size //= mesh_shape[axis]
            start += coord[axis] * size
    return start, start + size


def local_slice(value, spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]):
    """This coordinate's shard of a whole tensor (specs of Shard and Replicate only)."""
    if is_partial(spec):
        raise ValueError(f"autopar: cannot cut a whole tensor into a Partial ({spec}); expected Shard/Replicate")
    for dim in sorted({p.dim for p in spec if isinstance(p, Shard)}):
        start, stop = shard_offset(value.shape, spec, mesh_shape, coord, dim)
        value = value.narrow(dim, start, stop - start)
    return value


def is_partial(spec: Spec | None) -> bool:
    return spec is not None and any(isinstance(p, Partial) for p in spec)


def gradient_spec(needed: Spec, outputs: Sequence[Spec], shared: Collection[int] = ()) -> Spec:
    """Placement of the local gradient an op hands back for an input laid out as ``needed``.

    ``shared``: mesh axes on which the op's output gradient itself arrives as this
    device's share (``gradient_shares``); an op replicated there hands back shares too.
    """
    grad = []
    for axis, p in enumerate(needed):
        if isinstance(p, Shard):
            grad.append(p)
        elif isinstance(p, Partial):
            grad.append(Replicate())  # each part of a sum gets the whole gradient
        elif all(isinstance(out[axis], Replicate) for out in outputs) and axis not in shared:
            grad.append(Replicate())  # every device computed the same thing
        else:
            grad.append(Partial())  # this device's share of the gradient
    return tuple(grad)
