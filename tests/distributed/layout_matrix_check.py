"""Run under torchrun (4 ranks, a 2x2 mesh): every model of ``tests.layout_models`` under
every manual layout and the auto plan trains like one process (issue #18, item 4). Each
case is ``model:layout``; rank 0 prints one ``RESULT {json}`` line per case: the largest
loss and parameter differences from the one-process reference after ``STEPS`` AdamW steps,
or the error that stopped it (the launch goes on with the next case).

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.layout_matrix_check vit:tp resnet:auto
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.passes.explain import expert_axes, expert_parallel
from autopar.passes.plan import Plan
from tests.distributed import ending
from tests.distributed.train_check import adamw
from tests.layout_models import LAYOUT_MODELS

STEPS = 3
MESH = (2, 2)
LAYOUTS = ("dp", "zero1", "zero2", "fsdp", "tp", "tp+dp", "tp+sp", "fsdp+tp", "auto")
DTYPE = torch.float64  # AdamW turns float32 rounding into visible parameter differences
# Models whose kernels take no float64 (Mixtral's grouped matmul: float32, bf16, fp16 only)
FLOAT32 = {"mixtral"}


def dtype_of(name: str) -> torch.dtype:
    return torch.float32 if name in FLOAT32 else DTYPE


def _to(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def model_case(name: str):
    """(model in ``dtype_of(name)``, positional inputs, keyword inputs) of ``tests.layout_models``."""
    model, args, kwargs = LAYOUT_MODELS[name]()
    dtype = dtype_of(name)
    return model.to(dtype), tuple(_to(a, dtype) for a in args), {k: _to(v, dtype) for k, v in kwargs.items()}


def rank0_plan(layout: str, model, mesh, args, kwargs) -> Plan | None:
    """The layout's Plan (autopar.layouts, H100 preset), made on rank 0 and given to every
    rank; None for "auto" (compile plans by itself). A planning error is raised on every rank."""
    if layout == "auto":
        return None
    text = [None]
    if dist.get_rank() == 0:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text[0] = autopar.layouts.build(layout, model, mesh, args, example_kwargs=kwargs,
                                                hardware="h100").to_json()
        except Exception as exc:  # told to every rank, which all skip the case alike
            text[0] = "error: " + f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(text)
    if text[0].startswith("error: "):
        raise RuntimeError(text[0].removeprefix("error: "))
    return Plan.from_json(text[0])


def steps_input(args, kwargs):
    """What ``train_step`` takes for a model compiled with these example inputs."""
    if args and kwargs:
        return (args, kwargs)
    return kwargs if kwargs else args


def run_case(spec: str, mesh) -> dict:
    name, layout = spec.split(":")
    model, args, kwargs = model_case(name)
    reference = copy.deepcopy(model)
    plan = rank0_plan(layout, model, mesh, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, mesh, args, example_kwargs=kwargs or None, optimizer=adamw, plan=plan,
                             hardware="h100")
    ref_opt = adamw(list(reference.parameters()))
    losses, ref_losses = [], []
    for _ in range(STEPS):  # the same batch each step: the parameters move, so the losses do
        losses.append(pm.train_step(steps_input(args, kwargs), None).item())
        ref_opt.zero_grad()
        loss = reference(*args, **kwargs).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    full = pm.full_parameters()
    param_err = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return {"loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_err": param_err,
            "dtype": str(dtype_of(name)).removeprefix("torch."),
            "losses": losses, "plan_kind": pm.plan.kind, "reasons": [r for r in pm.plan.reasons if "tied" in r],
            "expert_parallel": len(expert_axes(pm.plan)[0]), "dispatch": expert_parallel(pm.plan)}


def main(cases: list[str]) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    for spec in cases:
        started = time.perf_counter()
        try:
            result = run_case(spec, mesh)
        except Exception as exc:  # the same on every rank (planning errors are shared): go on
            where = traceback.extract_tb(exc.__traceback__)[-1]
            result = {"error": f"{type(exc).__name__}: {str(exc)[:400]} (at {where.filename}:{where.lineno})"}
        dist.barrier()
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"case": spec, "seconds": time.perf_counter() - started, **result}),
                  flush=True)
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
