"""Run under torchrun: zero-bubble pipelines (torch's ``ScheduleInterleavedZeroBubble``, each
stage's backward split into its input-gradient and weight-gradient parts, the latter run
later) train for a few AdamW steps like the same model in one process. Prints one JSON line
per case on rank 0, as ``tests/distributed/train_check.py`` (whose helpers it runs) does.

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.zero_bubble_check zb:2x2:gpt:4:1:fsdp ...

A case is ``zb:<mesh>:<model>:<micro-batches>:<chunks per rank>[:<intra-op layout>][:norms-whole][:recompute]``
(``zbv:`` and ``dpv:`` the same under torch's V-shaped ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, 2 chunks per rank, rank r holding stages r and 2P - 1 - r): the pipeline over mesh axis 0, on the other axes data parallel or the layout
``autopar.layouts`` builds (``fsdp``: ZeRO-3, ``zero1``, ``zero2``, ``tp``...); ``norms-whole``:
the norms' parameters kept whole on every rank (ZeRO 0) beside the layout's (ZeRO-3 buckets of
the other weights then tie a layer's matmuls across its norm, as an auto plan may); ``recompute``:
every layer recomputed in backward inside its stage (rebuilt for each part of the split backward).
Any other case is train_check's (``accum:...:pp:InterleavedZeroBubble:...``), run by its loop.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.passes.lowering.recompute import Recomputed, plan_layers
from autopar.passes.plan import Plan
from tests.distributed import train_check
from tests.distributed.plans import pipeline_plan


SCHEDULES = {"zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dpv": "DualPipeV"}  # a case's prefix -> Plan's name


def zero_bubble_case(spec: str) -> dict:
    prefix, mesh_text, model_name, m, v, *rest = spec.split(":")
    recompute, norms_whole = "recompute" in rest, "norms-whole" in rest
    intra_layout = [x for x in rest if x not in ("recompute", "norms-whole")]
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = train_check.MODELS[model_name]()
    reference = copy.deepcopy(model)
    plan = copy.deepcopy(pipeline_plan(model, batches[0][0], mesh_shape, SCHEDULES[prefix], int(m), int(v),
                                       *intra_layout))
    if norms_whole:
        for name in plan.params:
            if ".ln" in name or name.startswith("ln"):
                plan.params[name], plan.zero[name] = "R" * (len(mesh_shape) - 1), 0
        plan = Plan.from_json(plan.to_json())
    if recompute:
        plan.recompute = [f"layer {layer}" for layer in sorted(set(plan_layers(plan).values()))]
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=train_check.adamw, plan=plan)
    forward_err = []

    def step(k, inputs, target):
        if k == 1 and prefix != "zb":  # a forward in train mode between steps: the V's order rebuilt around it
            with torch.no_grad():
                forward_err.append((pm(inputs) - reference(inputs)).abs().max().item())
        return pm.train_step((inputs,), target)

    losses, loss_err, param_err, _ = train_check.train_against_reference(pm, reference, loss_fn, batches, step)
    kinds = [a.computation_type.value for a in pm.schedule.pipeline_order[pm.pp_rank] if a is not None]
    output_err = None
    if prefix != "zb":  # eval stages of the V: forward only, torch's breadth-first order over its placement
        pm.eval()
        with torch.no_grad():
            output_err = (pm(batches[0][0]) - reference.eval()(batches[0][0])).abs().max().item()
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "output_err": output_err,
            "train_forward_err": forward_err[0] if forward_err else None, "losses": losses,
            "schedule": type(pm.schedule).__name__, "stages": len(pm.stages),
            "stage_indices": [stage.stage_index for stage in pm.stages], "pp_rank": pm.pp_rank,
            "forward_actions": kinds.count("F") + kinds.count("OVERLAP_F_B"),
            "whole_backward_actions": kinds.count("B") + kinds.count("OVERLAP_F_B"),
            "weight_actions": kinds.count("W"), "input_actions": kinds.count("I"),
            "zero_levels": sorted(set(plan.zero.values())), "recompute": plan.recompute,
            "recomputed_here": sum(isinstance(mod, Recomputed) for p in pm.programs for mod in p.gm.modules())}


def run_case(spec: str) -> dict:
    return zero_bubble_case(spec)


if __name__ == "__main__":
    # train_check's launch loop (the process group, one RESULT line per case, the launch ended
    # at an error) runs a case whose prefix it does not know by its module's ``run_case``
    train_check.run_case = run_case
    train_check.main(sys.argv[1:])
