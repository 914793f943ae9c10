"""Pipeline stages at ZeRO-1/2 in the dry run: the optimizer state of a parameter the plan
stores split over the data-parallel axis is this rank's slice of it, as the plan prices it."""

import copy
import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest

INTRA = 8  # data-parallel ranks inside each stage
STEP_BYTES = 4  # AdamW's float32 step counter per parameter, counted as optimizer state


@pytest.fixture(scope="module")
def staged():
    """GPT (2 layers, dim 64) as the planner's 2-stage pipeline over (2, 8), batch 16."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    inputs = (torch.zeros(16, 64, dtype=torch.long, device="meta"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = PlanRequest(mesh_shape=(2, INTRA), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (INTRA,), request, solver_time_s=2)
    assert plan is not None, why
    return model, inputs, plan


def at_zero(plan, model, level: int):
    """``plan`` with every parameter it replicates stored split over the intra-op axis (along
    its first dim that divides) at ZeRO ``level``; and the bytes of those parameters."""
    out = copy.deepcopy(plan)
    params = dict(model.named_parameters())
    split = 0
    for fqn, spec in plan.params.items():
        dim = next((d for d, size in enumerate(params[fqn].shape) if size % INTRA == 0), None)
        if spec == "R" and dim is not None and plan.zero.get(fqn, 0) == 0:
            out.params[fqn], out.zero[fqn] = f"S({dim})", level
            split += params[fqn].numel() * params[fqn].element_size()
    return out, split


def held_bytes(plan, model) -> dict[str, int]:
    """Each parameter's bytes on one rank of its stage: whole where the plan replicates it
    over the intra-op axis, 1/8 where it shards it."""
    return {fqn: p.numel() * p.element_size() // (INTRA if plan.params[fqn] != "R" else 1)
            for fqn, p in model.named_parameters()}


def optimizer_bytes(result) -> int:
    """AdamW's moments on the ranks of one intra-op coordinate (every stage once)."""
    per_stage = {r.coordinate[0]: r.memory["optimizer"] for r in result.ranks}
    return sum(per_stage.values())


@pytest.mark.parametrize("level", [1, 2])
def test_pipeline_stages_keep_the_optimizer_state_of_their_slices(staged, level):
    model, inputs, plan = staged
    assert not any(plan.zero.values()), "the fixture's plan should store everything as used"
    zeroed, split = at_zero(plan, model, level)
    assert split > 0.9 * sum(p.numel() * p.element_size() for p in model.parameters())
    before = autopar.dry_run(plan, model, inputs, raise_on_failure=True)
    after = autopar.dry_run(zeroed, model, inputs, raise_on_failure=True)
    assert sorted({r.coordinate[0] for r in after.ranks}) == [0, 1]
    counters = STEP_BYTES * len(list(model.parameters()))
    # the two moments of every parameter as the plan holds it before (whole, or a tensor-
    # parallel 1/8); the ones split for ZeRO 1/8 after
    assert optimizer_bytes(before) - counters == 2 * sum(held_bytes(plan, model).values())
    assert optimizer_bytes(before) - optimizer_bytes(after) == 2 * split * (INTRA - 1) // INTRA
