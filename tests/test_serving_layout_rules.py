"""Serving's manual layouts compute as their names promise, under the rules training's layouts
keep (``autopar.passes.planner.layout_rules.computing_rules``): over a data-parallel axis each
value of prefill and decode is split by its batch dims only (each rank serves its own
sequences; the rotary table, which has no batch dim, whole), and over a tensor-parallel axis
the batch is never split. The manual rows of the serving tables are priced as these layouts run."""

import warnings

import pytest
import torch

import autopar
from autopar.passes.generation import capture_programs
from autopar.passes.planner.layouts import axis_roles, hints
from autopar.passes.planner.microbatch import batch_dims
from autopar.passes.planner.request import PlanRequest
from autopar.passes.planner.serving_layout import joint_problem, layout_candidates
from autopar.passes.roles import AxisRole
from torch.distributed.tensor import Shard
from tests.models import llama

# a batch no other dim of the tiny Llama equals (its heads are 4): batch dims are found by size
WORKLOAD = autopar.Inference(batch=12, prompt_len=6, max_len=16)


@pytest.fixture(scope="module")
def programs():
    model, _ = llama()
    return capture_programs(model, WORKLOAD.batch, WORKLOAD.prompt_len, WORKLOAD.max_len)


def _split_off(joint, assignment, axis: int, allowed) -> list[str]:
    """Per program, the values whose placement on ``axis`` is a Shard of a dim ``allowed``
    (the output's batch dims, the dim) refuses; parameters and the cache aside."""
    found = []
    for graph, costs, part in zip(joint.graphs, joint.costs, joint.parts(assignment)):
        dims = batch_dims(graph, WORKLOAD.batch)
        state = {**graph.captured.params, **graph.captured.buffers}
        for node, i in costs.choice(part).items():
            if node.name in state or node.op == "placeholder" or graph.nodes[node].follows is not None:
                continue
            held = dims.get(node) or ()
            for k, spec in enumerate(graph.nodes[node].strategies[i].outputs):
                p = spec[axis] if spec is not None else None
                if isinstance(p, Shard) and not allowed(held[k] if k < len(held) else frozenset(), p.dim):
                    found.append(f"{graph.captured.model_name}:{node.name}")
    return found


@pytest.mark.parametrize("name, mesh", [("tp", (4,)), ("tp+dp", (2, 2)), ("dp", (4,))])
def test_serving_layouts_split_by_batch_on_dp_axes_and_never_the_batch_on_tp_axes(programs, name, mesh):
    """Without the rules, ``tp`` on 4 devices split the batch of 242 values over its tp axis."""
    request = PlanRequest(mesh_shape=mesh, hardware="h100", layouts=(name,), layout=name, hint_fn=hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joint = joint_problem(programs, WORKLOAD, request)
        assignment = layout_candidates(joint, request)[name]
    for axis, role in enumerate(axis_roles(name, len(mesh))):
        if role is AxisRole.DP:
            wrong = _split_off(joint, assignment, axis, lambda batch, dim: dim in batch)
            assert not wrong, f"{name} split these values off their batch dims on axis {axis}: {wrong[:8]}"
        if role is AxisRole.TP:
            wrong = _split_off(joint, assignment, axis, lambda batch, dim: dim not in batch)
            assert not wrong, f"{name} split the batch of these values on its tp axis {axis}: {wrong[:8]}"
    # the check saw split values (the batch on dp, heads or features on tp)
    assert _split_off(joint, assignment, 0, lambda batch, dim: False)
