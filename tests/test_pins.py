"""Pins (``autopar.Constraints``): the plan honours each kind, read off the plan itself; the
search without the pins is never slower; a pin the unpinned plan honours returns that plan;
a pin that cannot hold is one ``autopar:`` error naming it; ``explain()`` prices the pins.

A GPT of two layers on the meta device (batch 8, so no dim is the batch's size by
chance) on a 2 x 2 mesh: about 150 s in all on two loaded cores."""

import json
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import Constraints
from autopar.cli import main
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.planner.constraints import mesh_roles, micro_batch_roles
from autopar.passes.strategy_graph import build_strategy_graph, tensor_inputs

MESH = (2, 2)
LIMIT = 5.0  # seconds of search per plan: its safety net (3 x in CPU seconds) never cuts it here
LINEARS = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "mlp.up.weight", "mlp.down.weight")


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=128, max_seq_len=16, dim=64, n_heads=4, n_layers=2))
    return gpt, (torch.randint(0, 128, (8, 16)),)


@pytest.fixture(scope="module")
def planned(model):
    """pins (as the command line writes them) and pipeline -> the plan; () the unpinned plan."""
    made: dict[tuple, Plan] = {}

    def plan(*pins: str, pipeline: bool = False, **options) -> Plan:
        key = (pins, pipeline, tuple(sorted(options.items())))
        if key not in made:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made[key] = autopar.plan(model[0], MESH, model[1], time_limit_s=LIMIT, pipeline=pipeline,
                                         constraints=Constraints.from_pins(pins) if pins else None, **options)
        return made[key]
    return plan


@pytest.fixture(scope="module")
def captured(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(*model)


def reads(captured, plan: Plan):
    """(parameter name, its stored placement, the placement an op reads it in) for every op
    reading a parameter, and the placements of the user inputs, from the plan's strategies."""
    mesh = tuple(plan.mesh_shape[1:]) if plan.pipeline else tuple(plan.mesh_shape)
    graph = build_strategy_graph(captured, mesh)
    choice = choice_from_plan(graph, plan)
    out = []
    for ph in (n for n in graph.nodes if n.name in captured.params):
        stored = graph.nodes[ph].strategies[choice[ph]].output
        for user in ph.users:
            strategy = graph.nodes[user].strategies[choice[user]]
            out += [(captured.params[ph.name], stored, need) for src, need in zip(tensor_inputs(user), strategy.inputs)
                    if src is ph]
    inputs = [graph.nodes[n].strategies[choice[n]].output for n in graph.nodes if n.name in captured.user_inputs]
    return out, inputs


def assert_priced(plan: Plan, free: Plan) -> None:
    """The pinned plan records the unpinned one, which is never slower."""
    assert plan.pins["unpinned"]["step_time"] == pytest.approx(free.predicted.step_time)
    assert free.predicted.step_time <= plan.predicted.step_time * (1 + 1e-9)


# --- the Constraints type ----------------------------------------------------------------


def test_pins_read_as_written_and_round_trip():
    pins = Constraints.from_pins(["tp=8", "pp=4", "microbatches=16", "zero=1", "zero:layers.*.mlp=3", "dp=*",
                                  "recompute=0,2-3", "schedule=interleaved_1f1b", "chunks=2", "axes=pp,*,tp"])
    assert (pins.tp, pins.pp, pins.dp, pins.micro_batches, pins.chunks) == (8, 4, None, 16, 2)
    assert pins.zero_by_name == (("layers.*.mlp", 3),) and pins.recompute == (0, 2, 3)
    assert pins.axes == ("pp", None, "tp") and pins.schedule is autopar.costmodels.Schedule.INTERLEAVED_1F1B
    assert Constraints.from_dict(pins.to_dict()) == pins
    assert Constraints.from_pins(pins.pins()) == pins
    assert pins.zero_of("model.layers.3.mlp.up_proj.weight") == 3 and pins.zero_of("model.embed_tokens.weight") == 1
    assert Constraints().empty and str(Constraints()) == "no pins"


@pytest.mark.parametrize("pins, match", [
    (["tp=0"], "pin tp expected a positive whole number"),
    (["tp=x"], "pin 'tp=x' expected a whole number"),
    (["zero=4"], "pin zero expected a ZeRO level"),
    (["schedule=zigzag"], "pin schedule='zigzag' names no schedule"),
    (["chunks=2", "schedule=1f1b"], "1f1b runs one chunk per rank, and chunks=2 says otherwise; pin chunks=1"),
    (["chunks=1", "schedule=zbv_zero_bubble"], "places exactly 2 chunks per rank, and chunks=1 says otherwise; pin chunks=2"),
    (["chunks=4", "schedule=dualpipe_v"], "places exactly 2 chunks per rank, and chunks=4 says otherwise; pin chunks=2"),
    (["pp=1", "micro_batches=4"], "pp=1 says none"),
    (["axes=dp,pp"], "puts the pipeline on an inner axis"),
    (["recompute=some"], "recompute=none, all or layer numbers"),
    (["sp=2"], "names nothing autopar pins"),
])
def test_bad_pins_are_refused_where_they_are_written(pins, match):
    with pytest.raises(ValueError, match=match) as raised:
        Constraints.from_pins(pins)
    assert str(raised.value).startswith("autopar:")


def test_roles_are_laid_tensor_parallel_inside_data_parallel_outside():
    tp_inner, tp_outer = mesh_roles(Constraints(tp=8), (8, 8), 1)
    assert (tp_inner.axes[1].weights, tp_inner.axes[1].batch) == ("stored", "whole")
    assert (tp_inner.axes[0].weights, tp_outer.axes[0].weights) == ("whole", "stored")
    dp_outer = mesh_roles(Constraints(dp=2, tp=4), (2, 4), 1)[0]
    assert [a.batch for a in dp_outer.axes] == ["split", "whole"]
    assert "cannot be laid" in mesh_roles(Constraints(tp=4, dp=4), (8, 8), 4)  # the intra-op mesh is (2, 8)
    assert "pp=2 pinned" in mesh_roles(Constraints(pp=2), (8, 8), 4)
    # 4 micro-batches of 32 sequences: 8 of them per micro-batch fit the outer axis's 8, not 8 more inside
    fitted = micro_batch_roles(None, (8, 8), 32, 4)
    assert [a.batch for a in fitted.axes] == [None, "unsplit"]
    assert "cannot split a batch of 32" in micro_batch_roles(None, (8,), 32, 5)


# --- plans that honour their pins --------------------------------------------------------


def test_tensor_parallel_pin_splits_every_linear_and_keeps_the_batch_whole(planned, captured):
    free, plan = planned(), planned("tp=2")
    assert plan.pipeline is None
    read, inputs = reads(captured, plan)
    tp = 1  # the inner axis (the fast links); the other then reads weights whole
    for name, stored, need in read:
        if name.endswith(LINEARS):
            assert isinstance(stored[tp], Shard), name
        if isinstance(stored[tp], Shard):
            assert need[tp] == stored[tp], f"{name} moved on the tensor-parallel axis"
        assert isinstance(need[0], Replicate), f"{name} read split on the other axis"
    assert all(not isinstance(spec[tp], Shard) for spec in inputs)
    assert_priced(plan, free)


def test_data_parallel_pin_splits_the_inputs_and_reads_weights_whole(planned, captured):
    plan = planned("dp=2", "tp=2")
    read, inputs = reads(captured, plan)
    assert all(isinstance(spec[0], Shard) and not isinstance(spec[1], Shard) for spec in inputs)
    assert all(isinstance(need[0], Replicate) for _, _, need in read)
    assert_priced(plan, planned())


def test_axes_pin_puts_tensor_parallel_on_the_axis_named(planned, captured):
    plan = planned("axes=tp,dp")
    read, inputs = reads(captured, plan)
    assert all(isinstance(stored[0], Shard) for name, stored, _ in read if name.endswith(LINEARS))
    assert all(isinstance(spec[1], Shard) and not isinstance(spec[0], Shard) for spec in inputs)
    assert_priced(plan, planned())


def test_pipeline_pins_fix_stages_micro_batches_and_schedule(planned):
    plan = planned("pp=2", "micro_batches=4", "schedule=1f1b", pipeline=True)
    assert (plan.pipeline.stages, plan.pipeline.micro_batches, plan.pipeline.schedule) == (2, 4, "1F1B")
    assert_priced(plan, planned(pipeline=True))


def test_zero_pins_by_level_and_by_name(planned):
    three = planned("zero=3")
    assert set(three.zero.values()) == {3}
    by_name = planned("zero=1", "zero:blocks.*.mlp=3")
    assert {level for fqn, level in by_name.zero.items() if ".mlp." in fqn} == {3}
    assert {level for fqn, level in by_name.zero.items() if ".mlp." not in fqn} == {1}
    for plan in (three, by_name):
        assert_priced(plan, planned())


@pytest.mark.parametrize("pin, recomputed", [("recompute=all", ["layer 0", "layer 1"]), ("recompute=1", ["layer 1"])])
def test_recompute_pins(planned, pin, recomputed):
    plan = planned(pin)
    assert plan.recompute == recomputed
    assert_priced(plan, planned())


def test_placement_pins_by_name_and_by_megatron_role(planned):
    spec = planned("blocks.*.attn.q.weight=S(0)S(1)")
    assert {spec.params[f"blocks.{k}.attn.q.weight"] for k in (0, 1)} == {"S(0)S(1)"}
    role = planned("tp=2", "blocks.*.mlp.up=rowwise")  # Megatron would split it by column
    assert {role.params[f"blocks.{k}.mlp.up.weight"] for k in (0, 1)} == {"RS(1)"}
    assert {role.params[f"blocks.{k}.mlp.up.bias"] for k in (0, 1)} == {"RR"}
    for plan in (spec, role):
        assert_priced(plan, planned())


def test_pins_the_unpinned_plan_honours_return_it(planned):
    free = planned()
    assert free.pipeline is None and not free.recompute  # the setting the pins below agree with
    plan = planned("recompute=none", "pp=1")
    assert plan.pins["broken"] == [] and plan.strategies == free.strategies
    assert plan.predicted == free.predicted
    assert "they cost nothing" in plan.explain()


# --- the price, and pins that cannot hold --------------------------------------------------


def test_explain_prices_the_pins_and_the_record_round_trips(planned):
    plan, free = planned("tp=2"), planned()
    text = plan.explain()
    change = 100 * (plan.predicted.step_time / free.predicted.step_time - 1)
    assert f"pinning tp=2 costs {change:.3g}%" in text
    assert "without them" in text and plan.pins["broken"] == ["tp=2"]
    assert Plan.from_json(plan.to_json()).pins == plan.pins


@pytest.mark.parametrize("pins, match", [
    (["tp=3"], "pin tp=3 cannot hold on mesh"),
    (["pp=4"], "pin pp=4 cannot hold on mesh"),
    (["dp=2", "tp=4"], "pins tp=4, dp=2 multiply to 8 devices"),
    (["zero:nothing.here=1"], "pin zero:nothing.here=1 names no parameter"),
    (["recompute=5"], "pin recompute=5 cannot hold: the model has 2 repeated layers"),
    (["micro_batches=8"], "set a pipeline, and planning was asked for none"),
    (["head=colwise"], "pin head=colwise is a tensor-parallel role"),
    (["head=S(0)"], "pin head=S\\(0\\) gives 1 placements for the 2 axes"),
    (["tp=2", "blocks.*.ln1=colwise"], "which is no linear's weight or bias"),
    (["tok.weight=S(3)R"], "pin tok.weight=S\\(3\\)R cannot hold: it leaves p_tok_weight"),
])
def test_a_pin_that_cannot_hold_is_one_error_naming_it(model, pins, match):
    with pytest.raises(ValueError, match=match) as raised:
        autopar.plan(model[0], MESH, model[1], time_limit_s=LIMIT, pipeline=False,
                     constraints=Constraints.from_pins(pins))
    assert str(raised.value).startswith("autopar:")


def test_pins_that_do_not_fit_in_memory_are_named(planned):
    free = planned()
    limit = 0.7 * sum(free.predicted.memory.values())  # ZeRO fits the unpinned search in it
    assert set(planned(memory_limit=limit).zero.values()) != {0}
    with pytest.raises(ValueError, match="no plan honours the pins zero=0, recompute=none") as raised:
        planned("zero=0", "recompute=none", memory_limit=limit)
    assert "GiB per device" in str(raised.value)


def test_command_line_pins_and_constraints_file(tmp_path, capsys):
    """``autopar plan --constraints FILE --pin ...``: the file's pins with the command line's over them."""
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"zero": 1, "tp": 4}))
    out = tmp_path / "plan"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plan", "gpt-small", "--mesh", "2x2", "--no-pipeline", "--time-limit", str(LIMIT), "--no-progress",
                     "--constraints", str(path), "--pin", "tp=2", "--out", str(out)]) == 0
    saved = Plan.load(out / "plan.json")
    assert saved.pins["pins"] == ["tp=2", "zero=1"] and set(saved.zero.values()) <= {0, 1}
    assert "pinning tp=2, zero=1 costs" in capsys.readouterr().out
    assert main(["plan", "gpt-small", "--mesh", "2x2", "--pin", "tp=two"]) == 1
    assert capsys.readouterr().err.strip() == "autopar: pin 'tp=two' expected a whole number after '=', found 'two'"
