"""ZeRO-3 inside pipeline stages: a stage gathers a parameter split for storage where its ops
use it whole, frees the gathered copy after use and gathers it again in backward
(``autopar.runtime.stages`` lowers the plan's ZeRO-3 parameters as ``lower_plan`` does), so
it does not keep a gathered copy of its weights for every micro-batch in flight."""

import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.models import MODELS
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest


def test_zero3_stages_keep_no_gathered_weights_per_micro_batch():
    """A 4-layer bf16 Llama, 2 stages of (2, 2), 1F1B with 4 micro-batches, where a 150 MB
    device makes the search pick ZeRO-3 stages: the first pipeline rank's activations in the
    dry run are what the plan predicts, within 15% (0.38 when each micro-batch's forward kept
    its own gathered weights)."""
    with torch.device("meta"):
        model = MODELS["llama"].build(dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                           use_cache=False), 256).to(torch.bfloat16)
    inputs = (torch.zeros(8, 256, dtype=torch.long, device="meta"),)
    request = PlanRequest(mesh_shape=(2, 2, 2), hardware="h100", memory_limit=150e6, layouts=("fsdp+tp",),
                          hint_fn=layouts.hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, why = pipeline_plan(capture(model, inputs), 2, (2, 2), request, solver_time_s=2, schedules=("1f1b",))
        assert plan is not None, why
        assert 3 in plan.zero.values(), plan.zero  # the stages store some weights split, gathered per use
        result = autopar.dry_run(plan, model, inputs, ranks=[0], workers=1)
    assert result.ok, result.table()
    (first,) = result.ranks
    predicted = plan.predicted.memory_by_rank[first.coordinate[0]]
    assert predicted["activations"] / first.memory["activations"] == pytest.approx(1.0, abs=0.15), result.table()
