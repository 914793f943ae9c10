"""Pins of where pipeline stages start (``stage_starts``, by module name) and of a module's
output placement (``output:PATTERN=PLACEMENT``): the plan honours each, read off the plan's own
nodes; the search without the pin is never slower; a pin the unpinned plan honours returns
that plan; a pin that cannot hold is one ``autopar:`` error naming it; a sequence-pinned plan
computes what one process computes (SPMD simulation).

A GPT of three layers on the meta device (batch 8) on a 2 x 2 mesh, whose unpinned plan is a
pipeline of 2 stages starting the second at ``blocks.1``: about 90 s on two loaded cores."""

import argparse
import json
import random
import warnings

import pytest
import torch

import autopar
from autopar import Constraints
from autopar.cli import _constraints
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.placements import spec_str
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.planner.pin_restrictions import module_outputs
from autopar.passes.planner.stage_starts import layer_modules, plan_stage_starts
from autopar.passes.simulate import simulate_graph
from autopar.passes.strategy_graph import build_strategy_graph

MESH = (2, 2)
LIMIT = 5.0


def meta_gpt(layers: int) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_heads=4, n_layers=layers))


def quietly(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with the capture's warnings kept out of the tests' output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **kwargs)


@pytest.fixture(scope="module")
def model():
    return meta_gpt(3), (torch.randint(0, 128, (8, 16)),)


@pytest.fixture(scope="module")
def captured(model):
    return quietly(capture, *model)


@pytest.fixture(scope="module")
def planned(model):
    """pins (as the command line writes them) and pipeline -> the plan; () the unpinned plan."""
    made: dict[tuple, Plan] = {}

    def plan(*pins: str, pipeline: bool = True) -> Plan:
        if (pins, pipeline) not in made:
            made[pins, pipeline] = quietly(autopar.plan, model[0], MESH, model[1], time_limit_s=LIMIT, pipeline=pipeline,
                                           constraints=Constraints.from_pins(pins) if pins else None)
        return made[pins, pipeline]
    return plan


def first_layers(plan: Plan, captured) -> list[str]:
    """The module names of the layers the plan's stages 2, 3, ... start at."""
    names = layer_modules(captured)
    return [names[k] for k in plan_stage_starts(plan, captured)]


def test_stage_starts_read_as_written_and_round_trip():
    pins = Constraints.from_pins(["stage_starts=model.layers.16,model.layers.32", "micro_batches=8"])
    assert pins.stage_starts == ("model.layers.16", "model.layers.32") and pins.stages == 3
    assert pins.wants_pipeline and pins.pins() == ["micro_batches=8", "stage_starts=model.layers.16,model.layers.32"]
    assert Constraints.from_dict(pins.to_dict()) == pins and Constraints.from_pins(pins.pins()) == pins
    assert Constraints(stage_starts="a.1,a.2") == Constraints(stage_starts=("a.1", "a.2"))
    assert pins.starts_chunks == 1


@pytest.mark.parametrize("pins, ranks, chunks", [
    (["stage_starts=a.1,a.2,a.3", "chunks=2"], 2, 2),
    (["stage_starts=a.1,a.2,a.3", "pp=2"], 2, 2),  # 4 stages on 2 ranks: 2 chunks each
    (["stage_starts=a.1,a.2,a.3", "schedule=zbv_zero_bubble"], 2, 2),  # a V places 2 per rank
    (["stage_starts=a.1,a.2,a.3,a.4,a.5", "schedule=interleaved_1f1b", "pp=2"], 2, 3),
    (["stage_starts=a.1,a.2,a.3"], 4, 1),
])
def test_interleaved_stage_starts_name_every_virtual_stage(pins, ranks, chunks):
    """P ranks of v chunks run P * v stages: as many starts less one."""
    read = Constraints.from_pins(pins)
    assert (read.stages, read.starts_chunks) == (ranks, chunks)
    assert Constraints.from_pins(read.pins()) == read


@pytest.mark.parametrize("pins, match", [
    (["stage_starts=layers.4", "pp=3"], "starts 2 pipeline stages, and pp=3 cannot run them at 1 per rank "
                                        "\\(the default.*expected pp=2"),
    (["stage_starts=layers.4", "pp=1"], "starts 2 pipeline stages, and pp=1 cannot run them"),
    (["stage_starts=a.1,a.2,a.3", "chunks=2", "pp=4"], "starts 4 pipeline stages, and pp=4 cannot run them at 2 per "
                                                       "rank \\(chunks=2\\); expected pp=2"),
    (["stage_starts=layers.4", "chunks=2"], "starts 2 pipeline stages, which 2 per rank \\(chunks=2\\) cannot share "
                                            "among 2 or more pipeline ranks; expected a multiple of 2 stages of at "
                                            "least 4 \\(3, 5, ... stage starts\\)"),
    (["stage_starts=a.1,a.2,a.3,a.4", "chunks=2"], "starts 5 pipeline stages, which 2 per rank"),
    (["stage_starts=layers.4", "schedule=zbv_zero_bubble"], "which 2 per rank \\(schedule=zbv_zero_bubble\\) cannot"),
    (["stage_starts=layers.4", "schedule=interleaved_1f1b"], "runs 2 stages at 1 per rank \\(the default.*and "
                                                             "schedule=interleaved_1f1b cannot: it runs several"),
    (["stage_starts=a.1,a.2,a.3", "pp=2", "schedule=1f1b"], "runs 4 stages at 2 per rank \\(pp=2\\), and "
                                                            "schedule=1f1b cannot: 1f1b runs one chunk per rank"),
    (["stage_starts=layers.4,layers.4"], "expected distinct module names"),
    (["stage_starts=layers.4", "layout=fsdp"], "layout=fsdp has no pipeline, and stage_starts=layers.4"),
    (["stage_starts=layers.4", "layout=pp4+fsdp"], "names 4 pipeline stages, and stage_starts=layers.4 starts 2"),
])
def test_stage_starts_that_contradict_other_pins_are_refused_where_written(pins, match):
    with pytest.raises(ValueError, match=match) as raised:
        Constraints.from_pins(pins)
    assert str(raised.value).startswith("autopar:")


def test_a_pinned_stage_start_is_the_plans_and_the_unpinned_plan_is_never_slower(planned, captured):
    free = planned()
    assert free.pipeline is not None and first_layers(free, captured) == ["blocks.1"]  # what the pin below moves
    plan = planned("stage_starts=blocks.2")
    assert plan.pipeline.stages == 2 and plan.pipeline.chunks_per_rank == 1
    assert first_layers(plan, captured) == ["blocks.2"]
    assert plan.pins["broken"] == ["stage_starts=blocks.2"]
    assert plan.pins["unpinned"]["step_time"] == pytest.approx(free.predicted.step_time)
    assert free.predicted.step_time <= plan.predicted.step_time * (1 + 1e-9)
    text = plan.explain()
    assert "pinning stage_starts=blocks.2 costs" in text and "stages start at: layers 1 -> layers 2" in text


def test_a_stage_start_the_unpinned_plan_has_returns_that_plan(planned, captured):
    free, plan = planned(), planned("stage_starts=blocks.1")
    assert plan.pins["broken"] == [] and plan.strategies == free.strategies
    assert plan.pipeline == free.pipeline and plan.predicted == free.predicted
    assert "they cost nothing" in plan.explain()


def test_stage_starts_hold_with_the_other_pipeline_pins(planned, captured):
    plan = planned("stage_starts=blocks.2", "micro_batches=2", "schedule=1f1b")
    assert (plan.pipeline.micro_batches, plan.pipeline.schedule) == (2, "1F1B")
    assert first_layers(plan, captured) == ["blocks.2"]
    assert planned().predicted.step_time <= plan.predicted.step_time * (1 + 1e-9)


@pytest.mark.parametrize("pins", [("stage_starts=blocks.1,blocks.3,blocks.4", "schedule=interleaved_1f1b", "chunks=2"),
                                  ("stage_starts=blocks.1,blocks.3,blocks.4", "schedule=zbv_zero_bubble")])
def test_interleaved_stages_start_where_pinned(pins):
    """Six layers in 4 stages on 2 pipeline ranks, looped and V-shaped: every virtual stage starts
    at its pinned layer (the unpinned plan cuts otherwise), and the unpinned plan is never slower.
    About 25 s on two loaded cores."""
    model, inputs = meta_gpt(6), (torch.randint(0, 128, (8, 16)),)
    captured = quietly(capture, model, inputs)
    plan = quietly(autopar.plan, model, MESH, inputs, time_limit_s=LIMIT, constraints=Constraints.from_pins(pins))
    assert (plan.pipeline.stages, plan.pipeline.chunks_per_rank) == (2, 2)
    assert plan.pipeline.schedule == autopar.costmodels.Schedule.parse(pins[1].split("=")[1]).display
    assert first_layers(plan, captured) == ["blocks.1", "blocks.3", "blocks.4"]
    assert pins[0] in plan.pins["broken"]
    assert plan.pins["unpinned"]["step_time"] <= plan.predicted.step_time * (1 + 1e-9)


@pytest.mark.parametrize("pins, match", [
    (["stage_starts=nothing.here"], "pin stage_starts=nothing.here: nothing.here names no module of this model"),
    (["stage_starts=blocks.1.mlp"], "blocks.1.mlp names a module that is not a repeated layer; expected the module "
                                    "names of repeated layers where stages start \\(this model's: blocks.0 ... "
                                    "blocks.2\\)"),
    (["stage_starts=head"], "head names a module that is not a repeated layer"),
    (["stage_starts=blocks.0"], "blocks.0 is the first repeated layer"),
    (["stage_starts=blocks.2,blocks.1"], "pin stage_starts=blocks.2,blocks.1 starts 3 pipeline stages, which "
                                         "cannot hold on mesh \\(2, 2\\)"),
    (["output:nothing.here=S(0)R"], "pin output:nothing.here=S\\(0\\)R names no module of this model"),
    (["output:blocks.*.ln1=sequence"], "pin output:blocks.\\*.ln1=sequence is a tensor-parallel role"),
    (["output:blocks.*.ln1=S(0)"], "pin output:blocks.\\*.ln1=S\\(0\\) gives 1 placements for the 2 axes"),
    (["output:blocks.*.ln1=S(3)R"], "pin output:blocks.\\*.ln1=S\\(3\\)R cannot hold: it leaves layer_norm"),
])
def test_a_stage_start_or_output_pin_that_cannot_hold_is_one_error_naming_it(model, pins, match):
    with pytest.raises(ValueError, match=match) as raised:
        autopar.plan(model[0], MESH, model[1], time_limit_s=LIMIT, pipeline=not pins[0].startswith("output:"),
                     constraints=Constraints.from_pins(pins))
    assert str(raised.value).startswith("autopar:")


def test_stage_starts_out_of_order_are_one_error(model):
    pin = "stage_starts=blocks.3,blocks.2,blocks.1"
    with pytest.raises(ValueError, match=f"pin {pin} names layers out of order") as raised:
        autopar.plan(meta_gpt(4), (4,), model[1], time_limit_s=LIMIT, constraints=Constraints.from_pins([pin]))
    assert str(raised.value).startswith("autopar:")


# --- a module's output -------------------------------------------------------------------


def outputs_placed(plan: Plan, captured) -> dict[str, set[str]]:
    """Module name -> the placements (short form) the plan gives what its forward returns."""
    graph = build_strategy_graph(captured, tuple(plan.mesh_shape))
    choice = choice_from_plan(graph, plan)
    out: dict[str, set[str]] = {}
    for module, nodes in module_outputs(captured).items():
        for node in nodes:
            maker, index = graph.nodes[node].follows or (node, 0)
            out.setdefault(module, set()).add(spec_str(graph.nodes[maker].strategies[choice[maker]].outputs[index]))
    return out


def test_output_pins_read_as_written_and_round_trip():
    pins = Constraints.from_pins(["tp=8", "output:layers.*.input_layernorm=sequence", "output:lm_head=S(0)R"])
    assert pins.outputs == (("layers.*.input_layernorm", "sequence"), ("lm_head", "S(0)R"))
    assert pins.output_of("model.layers.3.input_layernorm") == ("layers.*.input_layernorm", "sequence")
    assert pins.output_of("model.layers.3.input_layernorm.weight") is None and pins.output_of("lm_head") is not None
    assert Constraints.from_dict(pins.to_dict()) == pins and Constraints.from_pins(pins.pins()) == pins
    with pytest.raises(ValueError, match="expected a module-name pattern and a placement per mesh axis such as "
                                         "S\\(1\\)R, or one of \\('sequence', 'colwise'\\)") as raised:
        Constraints.from_pins(["output:layers.*.mlp=rowwise"])  # partial sums: no one placement (concepts.md)
    assert str(raised.value).startswith("autopar:")


def test_a_sequence_pinned_norm_output_is_split_along_the_sequence_on_the_tensor_parallel_axis(planned, captured):
    free, plan = planned(pipeline=False), planned("tp=2", "output:blocks.*.ln1=sequence", pipeline=False)
    placed = outputs_placed(plan, captured)
    for k in range(3):
        (spec,) = placed[f"blocks.{k}.ln1"]
        assert spec.endswith("S(1)"), spec  # the tensor-parallel axis is the inner one
    assert "output:blocks.*.ln1=sequence" in plan.pins["broken"]
    assert free.predicted.step_time <= plan.predicted.step_time * (1 + 1e-9)
    assert plan.pins["unpinned"]["step_time"] == pytest.approx(free.predicted.step_time)


def test_explain_shows_where_a_pinned_plan_differs_from_the_unpinned_one_layer_by_layer(planned):
    free, plan = planned(pipeline=False), planned("tp=2", "output:blocks.*.ln1=sequence", pipeline=False)
    up = "blocks.0.mlp.up.weight"
    assert free.params[up] != plan.params[up]  # tensor parallel splits it otherwise
    text = plan.explain()
    assert "where they differ (without them -> pinned), layer by layer:" in text
    assert f"param {up}: {free.params[up]} -> {plan.params[up]} (and the same in 2 more layers: 1-2)" in text
    assert Plan.from_json(plan.to_json()).explain() == text


def test_an_output_pinned_by_placement_is_placed_so(planned, captured):
    free, plan = planned(pipeline=False), planned("output:blocks.*.mlp=S(1)R", pipeline=False)
    placed = outputs_placed(plan, captured)
    assert all(placed[f"blocks.{k}.mlp"] == {"S(1)R"} for k in range(3))
    assert free.predicted.step_time <= plan.predicted.step_time * (1 + 1e-9)
    assert "pinning output:blocks.*.mlp=S(1)R costs" in plan.explain()


def test_an_output_the_unpinned_plan_places_so_returns_that_plan(planned, captured):
    free = planned(pipeline=False)
    (spec,) = outputs_placed(free, captured)["blocks.1"]
    plan = planned(f"output:blocks.1={spec}", pipeline=False)
    assert plan.pins["broken"] == [] and plan.strategies == free.strategies and plan.predicted == free.predicted


def test_a_sequence_pinned_plan_computes_what_one_process_computes():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=2, n_layers=2)).double()
    inputs = (torch.randint(0, 64, (4, 8)),)
    plan = quietly(autopar.plan, gpt, MESH, inputs, time_limit_s=LIMIT, pipeline=False,
                   constraints=Constraints.from_pins(["tp=2", "output:blocks.*.ln1=sequence"]))
    cap = quietly(capture, gpt, inputs)
    graph = build_strategy_graph(cap, MESH)
    assert all(spec.endswith("S(1)") for k in range(2) for spec in outputs_placed(plan, cap)[f"blocks.{k}.ln1"])
    outputs = simulate_graph(graph, choice_from_plan(graph, plan), cap.placeholder_values(gpt, inputs),
                             random.Random(0))
    with torch.no_grad():
        expected = gpt(*inputs)
    torch.testing.assert_close(outputs[cap.user_outputs[0]], expected, rtol=1e-9, atol=1e-12)


def test_command_line_output_and_stage_pins_add_to_a_constraints_file(tmp_path):
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"outputs": {"ln_f": "S(0)R"}, "stage_starts": ["blocks.1"], "tp": 2}))
    pins = _constraints(argparse.Namespace(constraints=str(path), pin=["output:blocks.*.ln1=sequence",
                                                                         "stage_starts=blocks.2"]))
    assert pins.outputs == (("ln_f", "S(0)R"), ("blocks.*.ln1", "sequence"))
    assert pins.stage_starts == ("blocks.2",) and pins.tp == 2
