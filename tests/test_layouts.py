"""Manual layouts: the placements each one promises, completed into valid choices and costed Plans."""

import warnings

import pytest

from autopar import layouts
from passes.capture import capture
from passes.plan import Plan, choice_from_plan
from passes.strategies import build_strategy_graph
from tests.models import small_gpt


@pytest.fixture(scope="module")
def gpt_graph():
    model, inputs = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, inputs)
        return model, inputs, build_strategy_graph(captured, (2, 2))


def _param_specs(graph, hint):
    from passes.placements import spec_str

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
    assert set(layouts.LAYOUTS) <= set(by_name) | {"zero1", "zero2"}
    dp = _param_specs(graph, by_name["dp"])
    assert set(dp.values()) == {"RR"}
    tokens = next(n for n in graph.nodes if n.name == "tokens")
    from passes.placements import spec_str

    assert spec_str(by_name["dp"].fixed[tokens]) == "S(0)S(0)"
    completed = layouts.hint("tp+dp", graph, complete=True)  # by passes.propagate
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
