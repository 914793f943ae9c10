"""An axis of the mesh split so the pinned degrees lie on whole axes (``tp=2, dp=2`` on a mesh of 4).

Pinned roles lie on whole mesh axes (``constraints.mesh_roles``): a degree is the product of some
axes' sizes. A user with a flat mesh pins degrees whose product is one axis; ``split_mesh`` then
splits that axis in two, as the pipeline search splits the outermost axis into pipeline x rest
(``autopar.passes.planner.search.factorisations``): an axis of n devices becomes (n / f, f), the
same ranks row-major, so the inner factor pairs neighbouring ranks (the fast links) and takes the
tensor-parallel degree. The plan records the split mesh (``Plan.mesh_shape``), which
``autopar.compile`` builds from the user's mesh (``autopar.runtime.meshes.plan_mesh``) and the
export writes (``init_device_mesh``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Sequence

from autopar.passes.planner.constraints import MEGATRON_ROLES, OUTPUT_ROLES, Constraints, mesh_roles
from autopar.passes.planner.request import PlanningError, PlanRequest

MOST_SPLITS = 2  # three pinned roles (pp, dp, tp) on one axis split it twice at most


def split_mesh(pins: Constraints, shape: tuple[int, ...], depths: Callable[[tuple[int, ...]], list[int]]
               ) -> tuple[int, ...]:
    """``shape``, or, where the pinned degrees lie on none of its depths (``depths(shape)``: the
    pipeline depths the search tries, 1 for none), the first split of its axes in two on which
    they lie at some depth: the innermost axes first, the tensor-parallel degree as the inner
    factor (``_splits``). Pins of roles or placements per axis as given (``axes``, ``S(0)R``)
    keep the mesh as given."""
    def fits(candidate: tuple[int, ...]) -> bool:
        return any(not isinstance(mesh_roles(pins, candidate, p), str) for p in depths(candidate))

    per_axis = pins.axes is not None or any(placement not in MEGATRON_ROLES + OUTPUT_ROLES
                                            for _, placement in pins.params + pins.outputs)
    if (pins.tp is None and pins.dp is None) or per_axis or fits(shape):
        return shape
    frontier = [tuple(shape)]
    for _ in range(MOST_SPLITS):
        frontier = [split for candidate in frontier for split in _splits(candidate, pins)]
        if found := next((candidate for candidate in frontier if fits(candidate)), None):
            return found
    return shape  # nothing fits: the search says why, on the mesh as given


def _splits(shape: tuple[int, ...], pins: Constraints) -> Iterator[tuple[int, ...]]:
    """``shape`` with one axis of n split into (n / f, f), preferred first: the innermost axis
    first; as inner factor the tensor-parallel degree, then what leaves the data-parallel degree
    outside, then every other divisor, smallest first."""
    for axis in reversed(range(len(shape))):
        n = shape[axis]
        preferred = [f for f in (pins.tp, n // pins.dp if pins.dp else None) if f and 1 < f < n and n % f == 0]
        for f in dict.fromkeys(preferred + [f for f in range(2, n) if n % f == 0]):
            yield shape[:axis] + (n // f, f) + shape[axis + 1:]


def split_request(request: PlanRequest, depths: Callable[[tuple[int, ...]], list[int]]) -> PlanRequest:
    """``request`` on the mesh its pins need (``split_mesh``), a split axis's names ``name_0``
    (outer) and ``name_1`` (inner); ``request`` itself where none is split. A measured profile
    prices only the mesh it measured: an ``autopar:`` error where a split is needed."""
    shape = request.mesh_shape
    split = split_mesh(request.constraints, shape, depths)
    if split == shape:
        return request
    if request.preset is None:
        raise PlanningError(f"autopar: pins {request.constraints} need the mesh {shape} split into {split}, which "
                            f"the measured profile (of mesh {tuple(request.profile.mesh_shape)}) cannot price; "
                            f"plan with a preset (hardware=\"h100\"), or build and measure the mesh {split}")
    names = None if request.axis_names is None else split_names(request.axis_names, shape, split)
    return replace(request, mesh_shape=split, axis_names=names)


def split_names(names: Sequence[str], shape: Sequence[int], split: Sequence[int]) -> tuple[str, ...]:
    """The axis names of ``split`` (``shape`` with axes split in consecutive factors,
    ``refinement``): an axis kept whole keeps its name, a split one's parts are ``name_0``, ``name_1``, ..."""
    out: list[str] = []
    for name, parts in zip(names, refinement(shape, split)):
        out += [name] if len(parts) == 1 else [f"{name}_{k}" for k in range(len(parts))]
    return tuple(out)


def refinement(shape: Sequence[int], split: Sequence[int]) -> list[list[int]]:
    """Per axis of ``shape``, the consecutive axes of ``split`` whose sizes multiply to it (axes of
    size 1 go with the axis before them); a ``ValueError`` where ``split`` does not split ``shape`` so."""
    out: list[list[int]] = []
    k = 0
    for n in shape:
        parts, size = [], 1
        while k < len(split) and (size < n or split[k] == 1):
            parts.append(split[k])
            size *= split[k]
            k += 1
        if size != n or not parts:
            break
        out.append(parts)
    if len(out) != len(shape) or k != len(split):
        raise ValueError(f"autopar: the plan is for a mesh of shape {tuple(split)}, found {tuple(shape)}, whose "
                         "axes it does not split into consecutive factors; re-plan for this mesh, or run on the "
                         "mesh the plan was made for")
    return out
