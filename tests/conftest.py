import contextlib
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.passes.capture import capture
from tests.models import MODELS


@pytest.fixture(scope="session")
def captured_models():
    """name -> (model, example_inputs, Captured), captured once per test session."""

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, factory in MODELS.items():
            model, inputs = factory()
            out[name] = (model, inputs, capture(model, inputs))
    return out


@contextlib.contextmanager
def _one_rank_group(tmp_path, backend: str, device: str, axis: str):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh(device, (1,), mesh_dim_names=(axis,))
    finally:
        dist.destroy_process_group()
        gc.collect()


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group in this process and its one-device mesh (axis "dp").
    Afterwards the group is destroyed and collected here: a destroyed gloo group left for
    later collection would be finalised in a forked dry-run worker, which does not have its
    threads, and hang there (``autopar.dryrun``)."""
    with _one_rank_group(tmp_path, "gloo", "cpu", "dp") as mesh:
        yield mesh


@pytest.fixture
def one_gpu(tmp_path):
    """A one-rank nccl process group and its one-GPU mesh (axis "tp"); needs CUDA."""
    torch.cuda.set_device(0)
    with _one_rank_group(tmp_path, "nccl", "cuda", "tp") as mesh:
        yield mesh
