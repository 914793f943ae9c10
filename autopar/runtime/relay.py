"""Where a serving rank runs its programs, and how a pipeline's stages hand values on.

Without a pipeline a rank lays its programs out on the whole mesh. With one (the plan's
``Pipeline``), the mesh's pipeline axis holds the stages in order and the other axes are
each stage's intra-op mesh (``grid``): a rank runs its stage's part of every program,
receives from the rank of the stage before with its own intra-op coordinate what crosses
that boundary (each value a shard as the producer laid it out), starts sending on what
crosses the next (``send`` returns at once: a stage goes on to its next micro-batch), and
the last stage's logits are broadcast along the pipeline so that every rank picks the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.passes.placements import Spec, local_shape
from autopar.passes.plan import Plan


@dataclass(frozen=True)
class Relay:
    """This rank's place (the module docstring): the intra-op mesh and its shape and this
    rank's coordinate there; its stage of ``stages``; the pipeline's process group and, per
    stage, the global rank with this rank's intra-op coordinate."""

    grid: DeviceMesh | None
    shape: tuple[int, ...]
    coord: tuple[int, ...]
    stage: int = 0
    stages: int = 1
    group: Any = None
    ranks: tuple[int, ...] = ()
    # a dry run (one process holds one rank): receive fake values of the shapes sent, send nothing
    dry: bool = False

    @staticmethod
    def of(mesh: DeviceMesh, plan: Plan) -> "Relay":
        pp = plan.pipeline
        if pp is None:
            return Relay(mesh, tuple(mesh.shape), tuple(mesh.get_coordinate()))
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("autopar: a pipeline plan needs a mesh with axis names "
                             "(init_device_mesh(..., mesh_dim_names=...))")
        intra = tuple(n for i, n in enumerate(names) if i != pp.axis)
        grid = mesh[intra] if intra else None
        group = mesh.get_group(pp.axis)
        ranks = tuple(dist.get_global_rank(group, s) for s in range(pp.stages))
        return Relay(grid, tuple(grid.shape) if grid is not None else (), tuple(grid.get_coordinate()) if grid is not None
                     else (), mesh.get_coordinate()[pp.axis], pp.stages, group, ranks)

    def local(self, shape: tuple[int, ...], spec: Spec | None) -> tuple[int, ...]:
        """This rank's shape of a value of whole ``shape`` placed as ``spec`` (None: whole)."""
        return shape if spec is None else local_shape(shape, spec, self.shape)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A value the stage before sends (in the order it sends them)."""
        value = torch.empty(shape, dtype=dtype, device=device)
        if not self.dry:
            dist.recv(value, src=self.ranks[self.stage - 1])
        return value

    def send(self, value: torch.Tensor) -> Any:
        """Start sending ``value`` to the next stage; the send's handle (None in a dry run): the
        caller keeps ``value`` until it completes."""
        return None if self.dry else dist.isend(value, dst=self.ranks[self.stage + 1])

    def from_last(self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        """The last stage's ``value`` (whole ``shape``), on every stage."""
        if value is None:
            value = torch.empty(shape, dtype=dtype, device=device)
        if not self.dry:
            dist.broadcast(value, src=self.ranks[-1], group=self.group)
        return value
