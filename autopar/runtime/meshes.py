"""Small helpers for tensors on a device mesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar.passes.placements import Spec


def whole(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    if all(isinstance(p, Replicate) for p in spec):
        return local
    return DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives run on: this rank's GPU under nccl, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)

