"""Small helpers for tensors on a device mesh, and the checks that a mesh can run here."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar.passes.placements import Spec
from autopar.passes.planner.mesh_split import refinement


def whole(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    if all(isinstance(p, Replicate) for p in spec):
        return local
    return DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives run on: this rank's GPU under nccl, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)



def plan_mesh(mesh: DeviceMesh, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` as a plan for a mesh of ``shape`` runs on it: ``mesh`` itself where the shapes
    agree; where ``shape`` splits its axes into consecutive factors (a pipeline taken out of the
    outermost axis, an axis split for pinned degrees: ``autopar.passes.planner.mesh_split``), the
    same ranks reshaped row-major, its axes named ``names``; else ``mesh`` itself, which the
    plan's own check refuses (``autopar.passes.plan.check_mesh``). Every rank of the world builds
    it (its axes' process groups)."""
    if tuple(mesh.shape) == tuple(shape):
        return mesh
    try:
        refinement(tuple(mesh.shape), shape)
    except ValueError:
        return mesh
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=tuple(names))


def require_usable(mesh: DeviceMesh) -> None:
    """A clear error for a mesh this process cannot run on: one it is not a rank of (a mesh
    smaller than the world), or a ``"cuda"`` mesh on a machine without CUDA."""
    require_live()
    if mesh.device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"autopar: expected CUDA devices for a \"cuda\" DeviceMesh; found none on this machine (torch "
            f"{torch.__version__}, CUDA {'built' if torch.backends.cuda.is_built() else 'not built'}); build the mesh "
            f"on the CPU with gloo: init_device_mesh(\"cpu\", {tuple(mesh.shape)})"
        )
    if mesh.get_coordinate() is None:
        ranks = mesh.mesh.flatten().tolist()
        raise ValueError(
            f"autopar: expected this process (rank {dist.get_rank()} of {dist.get_world_size()}) to be a rank of "
            f"the DeviceMesh; found a mesh of ranks {ranks}; call autopar.compile only on the mesh's ranks "
            f"(if dist.get_rank() in {ranks}: ...), or build the mesh over all {dist.get_world_size()} ranks"
        )


def require_live() -> None:
    """A clear error for a step after ``destroy_process_group()``: its collectives cannot run."""
    if not dist.is_initialized():
        raise RuntimeError(
            "autopar: expected an initialised process group to train or run on; found none (was "
            "torch.distributed.destroy_process_group() called?); call the compiled module before destroying "
            "the process group, or init_process_group and compile again"
        )
