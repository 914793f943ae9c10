"""Manual layouts: the placements each one promises, completed into valid choices and costed Plans."""

import warnings

import pytest

from autopar import layouts
from autopar.passes.capture import capture
from autopar.passes.placements import spec_str
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.strategy_graph import build_strategy_graph
from tests.models import gpt2, small_gpt


@pytest.fixture(scope="module")
def gpt_graph():
    model, inputs = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, inputs)
        return model, inputs, build_strategy_graph(captured, (2, 2))


def _param_specs(graph, hint):
    return {graph.captured.params[n.name]: spec_str(spec) for n, spec in hint.fixed.items()
            if n.name in graph.captured.params}


def test_megatron_splits_columns_then_rows(gpt_graph):
    _, _, graph = gpt_graph
    dims = {graph.captured.params[n.name]: d for n, d in layouts.megatron_dims(graph).items()}
    for layer in (0, 1):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            assert dims[f"blocks.{layer}.{name}.weight"] == 0 and dims[f"blocks.{layer}.{name}.bias"] == 0
        for name in ("attn.o", "mlp.down"):
            assert dims[f"blocks.{layer}.{name}.weight"] == 1
            assert f"blocks.{layer}.{name}.bias" not in dims  # added after the all-reduce: whole
    assert dims["head.weight"] == 0 and dims["tok.weight"] == 0


def test_each_layout_places_parameters_as_it_promises(gpt_graph):
    _, _, graph = gpt_graph
    by_name = {h.name: h for h in layouts.hints(graph)}
    # without experts, ep is dp and tp+ep is tp+dp: dropped as duplicates
    assert set(layouts.LAYOUTS) <= set(by_name) | {"zero1", "zero2", "ep", "tp+ep"}
    dp = _param_specs(graph, by_name["dp"])
    assert set(dp.values()) == {"RR"}
    tokens = next(n for n in graph.nodes if n.name == "tokens")

    assert spec_str(by_name["dp"].fixed[tokens]) == "S(0)S(0)"
    completed = layouts.hint("tp+dp", graph, complete=True)  # by autopar.passes.propagate
    assert len(completed.choice) == len(graph.nodes)
    fsdp = _param_specs(graph, by_name["fsdp"])
    assert fsdp["blocks.0.mlp.up.weight"] == "S(0)S(0)" and fsdp["blocks.0.mlp.down.weight"] == "S(1)S(1)"
    tp_dp = _param_specs(graph, by_name["tp+dp"])
    assert tp_dp["blocks.0.attn.q.weight"] == "RS(0)" and tp_dp["blocks.0.attn.o.weight"] == "RS(1)"
    fsdp_tp = _param_specs(graph, by_name["fsdp+tp"])
    assert fsdp_tp["blocks.0.mlp.up.weight"] == "S(1)S(0)"  # FSDP on a dim the tp axis leaves whole
    zero2 = by_name.get("zero2") or by_name["zero1"]
    assert set(zero2.zero.values()) <= {1, 2} and zero2.zero


def test_layout_plan_is_costed_and_replays(gpt_graph, tmp_path):
    model, inputs, graph = gpt_graph
    p = layouts.build("tp+dp", model, (2, 2), inputs, time_limit_s=2)
    assert p.kind == "tp+dp" and p.pipeline is None
    assert p.params["blocks.1.mlp.up.weight"] == "RS(0)"
    assert p.predicted.step_time > 0 and p.predicted.communication > 0
    path = tmp_path / "tp.json"
    p.save(path)
    q = Plan.load(path)
    assert q == p
    assert len(choice_from_plan(graph, q)) == len(graph.nodes)
    zero2 = layouts.build("zero2", model, (2, 2), inputs, time_limit_s=2)
    assert set(zero2.zero.values()) == {2}
    dp = layouts.build("dp", model, (2, 2), inputs, time_limit_s=2)
    assert zero2.predicted.memory["optimizer"] < dp.predicted.memory["optimizer"]
    assert "param blocks.0.attn.q.weight: RS(0) -> RR" in p.diff(dp)
    assert p.diff(p) == "plans are identical"


@pytest.fixture(scope="module")
def gpt2_graph():
    model, inputs = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, inputs, build_strategy_graph(capture(model, inputs), (2, 2))


def test_megatron_splits_gpt2_conv1d_weights(gpt2_graph):
    """HF GPT-2's Conv1D runs as addmm(bias, x, weight) with the weight stored [in, out]:
    Megatron splits c_attn / c_fc by output features (weight dim 1, bias dim 0) and
    attn.c_proj / mlp.c_proj by input features (weight dim 0, bias whole)."""
    _, _, graph = gpt2_graph
    dims = {graph.captured.params[n.name]: d for n, d in layouts.megatron_dims(graph).items()}
    for layer in (0, 1):
        h = f"transformer.h.{layer}"
        for name in ("attn.c_attn", "mlp.c_fc"):
            assert dims[f"{h}.{name}.weight"] == 1 and dims[f"{h}.{name}.bias"] == 0, name
        for name in ("attn.c_proj", "mlp.c_proj"):
            assert dims[f"{h}.{name}.weight"] == 0 and f"{h}.{name}.bias" not in dims, name
    tp_dp = _param_specs(graph, layouts.hint("tp+dp", graph))
    assert tp_dp["transformer.h.0.mlp.c_fc.weight"] == "RS(1)" and tp_dp["transformer.h.0.mlp.c_proj.weight"] == "RS(0)"


def test_tp_zero1_is_megatrons_distributed_optimizer(gpt2_graph):
    """``tp+zero1``: Megatron on the tp axis, parameters whole over dp, the optimizer state
    (ZeRO-1) split over dp: each rank steps 1/(dp size) of its Megatron shard."""
    model, inputs, graph = gpt2_graph
    h = layouts.hint("tp+zero1", graph)
    assert _param_specs(graph, h) == _param_specs(graph, layouts.hint("tp+dp", graph))
    assert set(h.zero.values()) == {1}
    p = layouts.build("tp+zero1", model, (2, 2), inputs, time_limit_s=2)
    dp = layouts.build("tp+dp", model, (2, 2), inputs, time_limit_s=2)
    # at level 1 where the state can be sliced; a 1-D bias that tp splits on its only dim
    # has none left to split over dp, and runs at level 0 (``state_costs.zero_split_dim``)
    whole = {fqn for fqn, level in p.zero.items() if level == 0}
    assert set(p.zero.values()) <= {0, 1} and len(whole) < len(p.zero)
    assert all(model.get_parameter(fqn).ndim == 1 and p.params[fqn] == "RS(0)" for fqn in whole), whole
    stored = p.params["transformer.h.0.mlp.c_fc.weight"]
    assert stored.startswith("S(") and stored.endswith("S(1)"), stored  # dp slice of the tp shard
    assert p.predicted.memory["optimizer"] == pytest.approx(dp.predicted.memory["optimizer"] / 2, rel=0.05)
