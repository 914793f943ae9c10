"""The planner's choices make sense: Megatron on a fast axis, DP on a slow one, ZeRO-3 when
parameters do not fit otherwise, a pipeline across the slow axis, micro-batches against the
bubble, and a clear error when nothing fits. Models are on the meta device: nothing is
allocated, the cost model reads shapes only."""

import warnings

import pytest
import torch
from torch import nn

import costmodels
from autopar.models import Attention, GPTConfig, WideMLP
from autopar.planning import plan
from passes.capture import capture
from passes.placements import parse_spec
from passes.plan import Plan, choice_from_plan
from passes.planner import PlanningError
from passes.strategies import build_strategy_graph
from tests.models import small_gpt

LIMIT = 4.0  # seconds of solver time per plan in these tests


def slow_axis(size: int) -> costmodels.HardwareProfile:
    """A 1-axis mesh of ``size`` devices on inter-node links (one per node)."""
    wide = costmodels.preset("h100", (size, 8))
    return costmodels.HardwareProfile(machine=wide.machine, backend=wide.backend, mesh_shape=(size,),
                                      device=wide.device, axes=[wide.axes[0]], source="test: inter-node axis")


def meta(build):
    with torch.device("meta"):
        return build()


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, inputs, plan(model, (2, 2), inputs, time_limit_s=LIMIT)


def test_plan_round_trips_and_replays(gpt_plan, tmp_path):
    model, inputs, p = gpt_plan
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    assert p.predicted.step_time > 0 and p.predicted.compute > 0
    assert set(p.predicted.memory) == {"parameters", "gradients", "optimizer", "activations"}
    assert p.solver["status"] in ("optimal", "feasible") and 0.0 <= p.solver["gap"] <= 1.0
    assert p.solver["planning_seconds"] < 3 * LIMIT  # the wall-clock limit holds (with slack for costing)
    if p.pipeline is None:
        graph = build_strategy_graph(capture(model, inputs), p.mesh_shape)
        assert len(choice_from_plan(graph, p)) == len(graph.nodes)


def test_auto_never_predicted_slower_than_a_manual_layout(gpt_plan):
    _, _, p = gpt_plan
    assert {"dp", "fsdp", "tp", "tp+dp", "zero1"} <= set(p.candidates)
    assert all(p.predicted.step_time <= t * (1 + 1e-9) for t in p.candidates.values())


def test_megatron_column_row_pattern_emerges_on_a_fast_axis():
    """Big weights, few tokens, NVLink: split the weights, not the batch."""
    model = meta(lambda: WideMLP(dim=4096, hidden=16384, n_layers=2))
    x = torch.zeros(4, 128, 4096, device="meta")
    p = plan(model, (8,), (x,), time_limit_s=LIMIT, pipeline=False)
    assert p.params["layers.0.0.weight"] == "S(0)"  # column: output features
    assert p.params["layers.0.2.weight"] == "S(1)"  # row: input features
    assert p.params["layers.1.0.weight"] == "S(0)" and p.params["layers.1.2.weight"] == "S(1)"


def test_megatron_pattern_in_attention():
    cfg = GPTConfig(dim=4096, n_heads=32)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(cfg)

        def forward(self, x):
            return x + self.attn(x)

    x = torch.zeros(2, 128, 4096, device="meta")
    p = plan(meta(Block), (8,), (x,), time_limit_s=LIMIT, pipeline=False)
    assert [p.params[f"attn.{n}.weight"] for n in "qkvo"] == ["S(0)", "S(0)", "S(0)", "S(1)"]


def test_pure_data_parallel_for_a_small_model_on_a_slow_link():
    model = meta(lambda: WideMLP(dim=256, hidden=1024, n_layers=2))
    x = torch.zeros(64, 1024, 256, device="meta")
    p = plan(model, (8,), (x,), hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False)
    assert set(p.params.values()) == {"R"}
    assert p.strategies["linear"].endswith("-> S(0)")  # the batch is split (sliced for free if x is whole)
    assert "as dp" in p.explain()
    assert 3 not in p.zero.values()  # ZeRO 1/2 may shard optimizer state; parameters stay whole


def test_parameters_sharded_when_they_do_not_fit_replicated():
    """Squeeze the free plan's memory: parameters must be split (ZeRO-3 or tensor parallel)
    and the plan is predicted no faster than the unconstrained one."""
    model = meta(lambda: WideMLP(dim=4096, hidden=4096, n_layers=2))
    x = torch.zeros(16, 1024, 4096, device="meta")
    free = plan(model, (8,), (x,), hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False)
    need = sum(free.predicted.memory.values())
    limit = need - 0.8 * free.predicted.memory["parameters"]
    tight = plan(model, (8,), (x,), hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False, memory_limit=limit)
    assert sum(tight.predicted.memory.values()) <= limit * (1 + 1e-9)
    assert tight.predicted.step_time >= free.predicted.step_time * (1 - 1e-9)
    assert sum(tight.predicted.memory.values()) < need
    assert any("S" in spec for spec in tight.params.values())


def test_impossible_memory_limit_says_what_would_fit():
    model = meta(lambda: WideMLP(dim=1024, hidden=4096, n_layers=2))
    x = torch.zeros(8, 128, 1024, device="meta")
    with pytest.raises(PlanningError, match=r"^autopar: no plan fits in .*smallest predicted memory .*parameters"
                                            r".*optimizer .*activations .*To fit"):
        plan(model, (8,), (x,), time_limit_s=LIMIT, memory_limit=1e6, pipeline=False)


def test_pipeline_across_the_slow_axis_with_micro_batches():
    """Deep, wide, few tokens: syncing 8 layers' weights over the slow axis costs more than
    sending one activation between two stages; M > 1 micro-batches shrink the bubble."""
    model = meta(lambda: WideMLP(dim=8192, hidden=32768, n_layers=8))
    x = torch.zeros(16, 256, 8192, device="meta")
    p = plan(model, (2, 8), (x,), time_limit_s=2 * LIMIT)
    assert p.pipeline is not None and p.pipeline.axis == 0 and p.pipeline.stages == 2
    assert p.axis_names[0] == "pp"
    assert p.pipeline.micro_batches > 1
    assert p.predicted.bubble < p.predicted.step_time / 2
    assert all(len(parse_spec(spec)) == 1 for spec in p.params.values())  # placements on the intra-op axis
    graph = build_strategy_graph(capture(model, (x,)), p.mesh_shape[1:])  # the runtime's view: stages' mesh
    assert len(choice_from_plan(graph, p)) == len(graph.nodes)
    assert set(p.pipeline.stage_of.values()) == set(range(p.pipeline.stages * p.pipeline.chunks_per_rank))


def test_explain_says_what_and_why(gpt_plan):
    _, _, p = gpt_plan
    text = p.explain()
    assert "predicted step" in text and "predicted memory per device" in text
    assert "layers 0-1" in text or "layer 0" in text  # the per-layer table
    assert "axes: axis0" in text
    assert "best manual layout" in text and "auto / best = " in text
    loaded = Plan.from_json(p.to_json())
    assert loaded.explain() == text  # a saved plan explains itself


def test_diff_names_what_changed(gpt_plan):
    _, _, p = gpt_plan
    other = Plan.from_json(p.to_json())
    first = sorted(other.params)[0]
    other.params[first] = "S(0)R"
    other.zero[first] = 3
    other.predicted.step_time *= 2
    text = p.diff(other)
    assert f"param {first}: {p.params[first]} -> S(0)R" in text
    assert f"zero {first}: {p.zero[first]} -> 3" in text
    assert "predicted step" in text and "(2.000x)" in text
    assert p.diff(p) == "plans are identical"


def test_plan_with_the_loss():
    """The loss can be planned with the model: a mean cross-entropy splits with the batch."""
    import torch.nn.functional as F

    import autopar
    from autopar.models import WideMLP

    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=1)
    x, target = torch.randn(8, 16), torch.randint(0, 16, (8,))
    with pytest.raises(ValueError, match="autopar: plan\\(loss_fn=...\\) expected a target"):
        autopar.plan(model, (2,), (x,), loss_fn=F.cross_entropy)
    plan = autopar.plan(model, (2,), (x,), loss_fn=F.cross_entropy, target=target, time_limit_s=10, pipeline=False)
    assert any("cross_entropy_loss" in name for name in plan.strategies)
    assert plan.predicted.step_time > 0
