"""The planning request: what to plan for, checked once and passed down whole.

``autopar.plan`` builds one ``PlanRequest`` and hands it to ``plan_captured``, which hands it
to ``plan_intra_op`` and ``pipeline_plan`` (a pipeline's intra-op mesh gets a copy for that
mesh, ``PlanRequest.on_mesh``): one checked configuration object instead of a trail of
keywords, as torchtitan's ``parallelize_llama(model, *, parallel_dims, ...)`` takes its
``ParallelDims``.

The hardware is resolved once, here: a preset name is built for the mesh (``profile``) and
kept (``preset``), so the pipeline search can build a preset for each device factorisation;
a measured profile must be of the mesh's shape, and prices only what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from autopar import costmodels
from autopar.passes.planner.constraints import Constraints, MeshRoles


class PlanningError(ValueError):
    """No plan fits, or the request cannot be planned."""


class DoesNotFit(PlanningError):
    """No plan fits in the memory limit."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One planning call's inputs besides the captured model (see the module docstring)."""

    mesh_shape: tuple[int, ...]  # axis 0 outermost (slowest links)
    hardware: costmodels.HardwareProfile | str  # a preset name, or a profile measured on ``mesh_shape``
    memory_limit: float | None = None  # bytes per device; None: the device's memory (``memory_bytes``)
    time_limit_s: float = 60.0  # the whole search's budget after capture
    layouts: tuple[str, ...] = ()  # the manual layouts compared with the search (names ``hint_fn`` knows)
    hint_fn: Callable[[Any, Sequence[str]], list] | None = None  # (strategy graph, layout names) -> Hints
    layout: str | None = None  # cost only this manual layout (one of ``layouts``), no search
    axis_names: tuple[str, ...] | None = None  # None: the profile's names
    pipeline: bool = True  # search pipelines over the outermost axis's factorisations
    outer_axis_only: bool = False  # pipelines only over the whole outermost axis (a given device mesh's shape)
    progress: Callable[[str, int, int | None], None] | None = None  # told each search step as it starts
    constraints: Constraints | None = None  # the user's pins (``autopar.Constraints``); None: none
    # with pins, also search without them to price them (``Plan.pins``); a manual layout given as
    # ``layout=`` alone is planned under its pins, not priced (a second search)
    price_pins: bool = True
    # the pins' roles on this request's mesh (one of ``constraints.mesh_roles``' ways), set by the
    # search for each mesh it plans; None: no axis pinned
    roles: MeshRoles | None = None
    # processes the search's independent plans are made in at once (``workers.ForkedJobs``);
    # None: one per core, 1: this process alone
    workers: int | None = None
    profile: costmodels.HardwareProfile = field(init=False, repr=False, compare=False)  # ``hardware`` resolved

    def __post_init__(self) -> None:
        # a frozen dataclass normalises its own fields here, through object.__setattr__
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in self.mesh_shape))
        object.__setattr__(self, "layouts", tuple(self.layouts))
        if self.axis_names is not None:
            object.__setattr__(self, "axis_names", tuple(self.axis_names))
        self._check()
        object.__setattr__(self, "profile", self._resolved_profile())

    def _check(self) -> None:
        shape = self.mesh_shape
        if not shape or any(s < 1 for s in shape):
            raise PlanningError(f"autopar: expected a mesh shape of positive sizes such as (8, 8), found {shape}")
        if self.axis_names is not None and len(self.axis_names) != len(shape):
            raise PlanningError(
                f"autopar: expected one axis name per mesh axis ({len(shape)} for mesh {shape}), found "
                f"{self.axis_names}; pass {len(shape)} names, or none")
        if self.memory_limit is not None and not self.memory_limit > 0:
            raise PlanningError(f"autopar: expected a positive memory limit in bytes per device, found "
                                f"{self.memory_limit}; pass e.g. memory_limit=80e9, or None for the device's memory")
        if not self.time_limit_s > 0:
            raise PlanningError(f"autopar: expected a positive planning time limit in seconds, found "
                                f"{self.time_limit_s}; pass e.g. time_limit_s=60")
        if self.workers is not None and (type(self.workers) is not int or self.workers < 1):
            raise PlanningError(f"autopar: expected workers= a count of processes of at least 1, found "
                                f"{self.workers!r}; pass workers=1 to plan in this process, or None for one per core")
        if self.layouts and self.hint_fn is None:
            raise PlanningError(f"autopar: manual layouts {self.layouts} need a hint function that builds them; "
                                "found none; pass hint_fn (autopar.passes.planner.layouts.hints)")
        if self.constraints is not None and not isinstance(self.constraints, Constraints):
            raise PlanningError(f"autopar: constraints= expected an autopar.Constraints (e.g. Constraints(tp=8, pp=4)), "
                                f"found {type(self.constraints).__name__}; build one, or Constraints.from_pins([...])")
        if self.roles is not None and len(self.roles.axes) != len(shape):
            raise PlanningError(f"autopar: pinned roles for {len(self.roles.axes)} mesh axes, found mesh {shape}; "
                                "expected one role per axis (constraints.mesh_roles for this mesh)")
        if self.layout is not None and self.layout not in self.layouts:
            raise PlanningError(f"autopar: no layout named {self.layout!r}; expected one of {self.layouts}, "
                                "or layout=None for the automatic plan")

    def _resolved_profile(self) -> costmodels.HardwareProfile:
        if isinstance(self.hardware, str):
            return costmodels.preset(self.hardware, self.mesh_shape, self.axis_names)
        if tuple(self.hardware.mesh_shape) != self.mesh_shape:
            raise PlanningError(
                f"autopar: the hardware profile is for mesh {self.hardware.mesh_shape}, found mesh "
                f"{self.mesh_shape}; measure or build a profile for this mesh shape")
        return self.hardware

    @property
    def preset(self) -> str | None:
        """The preset's name when the hardware is one (built anew for every mesh the search
        tries); None for a measured profile, which prices only its own mesh."""
        return self.hardware if isinstance(self.hardware, str) else None

    @property
    def memory_bytes(self) -> float:
        """The memory every plan must fit in, bytes per device."""
        return self.memory_limit if self.memory_limit is not None else float(self.profile.device.memory_bytes)

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh axes' names: the caller's, else the profile's."""
        return self.axis_names or tuple(self.profile.axis_names)

    def hints(self, graph) -> list:
        """The manual layouts on ``graph`` (fresh Hints: the planner completes copies of them)."""
        return list(self.hint_fn(graph, self.layouts)) if self.hint_fn is not None else []

    @property
    def pinned(self) -> bool:
        """Whether the request carries pins."""
        return self.constraints is not None and not self.constraints.empty

    def on_mesh(self, profile: costmodels.HardwareProfile, *, memory_limit: float,
                axis_names: Sequence[str], roles: MeshRoles | None = None) -> PlanRequest:
        """This request for a part of the mesh priced by ``profile`` (a pipeline's intra-op
        mesh, its pinned ``roles``): every manual layout, no pipeline, no layout alone, no
        progress reports."""
        return replace(self, mesh_shape=tuple(profile.mesh_shape), hardware=profile, memory_limit=memory_limit,
                       axis_names=tuple(axis_names), layout=None, pipeline=False, outer_axis_only=False,
                       progress=None, roles=roles)
