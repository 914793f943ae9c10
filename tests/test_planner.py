"""The planner's choices make sense: Megatron on a fast axis, DP on a slow one, ZeRO-3 when
parameters do not fit otherwise, a pipeline across the slow axis, micro-batches against the
bubble, and a clear error when nothing fits. Models are on the meta device: nothing is
allocated, the cost model reads shapes only."""

import json
import math
import time
import warnings

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import autopar
from autopar import costmodels
from autopar.models import GPT, Attention, GPTConfig, WideMLP
from autopar.passes.capture import capture
from autopar.passes.placements import parse_spec
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.planner import search
from autopar.passes.planner.intra_op import PlanningError
from autopar.passes.planner.search import factorisation_budget, next_factorisation, repeated_layer_count
from autopar.passes.solve import chain_dp
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.planning import plan
from tests.models import small_gpt
from tests.profiles import measured_style

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
    kinds = {"parameters", "gradients", "optimizer", "activations"}
    assert kinds <= set(p.predicted.memory) <= kinds | {"temporary"}  # temporary: the default loss's backward
    assert p.solver["status"] in ("optimal", "feasible") and 0.0 <= p.solver["gap"] <= 1.0
    # the deterministic budget ended the search, not a safety net, whatever the machine's load
    # (how fast that budget runs is benchmarks/plan_llama.py's to report, not a test's)
    assert "clock_cut" not in p.solver and p.solver["planning_cpu_seconds"] > 0
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
    # every linear reads its weight and bias whole and splits the tokens (batch or
    # sequence: for an MLP the same data parallelism), sliced for free as x is whole
    linears = [v for k, v in p.strategies.items() if k.startswith("linear")]
    assert len(linears) == 4 and all(s in ("(S(0), R, R) -> S(0)", "(S(1), R, R) -> S(1)") for s in linears)
    assert "as dp" in p.explain()
    # ZeRO 1/2 may shard the gradients and optimizer state (bucketed, they cost about
    # what the all-reduce does and shrink the optimizer step); every op reads its
    # parameters whole: level 2 stores a shard and gathers the whole copy for the step
    # (priced with the activations, where the dry run finds it), levels 0/1 store them whole
    assert 3 not in p.zero.values()
    stored = sum(math.prod(t.shape) * 4 / (8 if p.zero[name] == 2 else 1) for name, t in model.named_parameters())
    assert p.predicted.memory["parameters"] == stored
    assert all(v == "R" for k, v in p.params.items() if p.zero[k] == 0)


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


def test_pipeline_from_a_measured_profile_takes_the_slow_axis():
    """A measured profile prices only its own axes: the pipeline takes the whole slow outer
    axis (its send/recv fit prices the stage boundaries) over the measured inner axes, and
    a 1-D mesh pipelines over all its devices (an intra-op axis of size 1). Syncing 8 wide
    layers' weights over a 2 GB/s axis costs more than sending activations between stages."""
    model = meta(lambda: WideMLP(dim=4096, hidden=16384, n_layers=8))
    x = torch.zeros(8, 256, 4096, device="meta")
    two = plan(model, (2, 4), (x,), hardware=measured_style((2, 4)), time_limit_s=2 * LIMIT)
    assert two.pipeline is not None and two.pipeline.stages == 2 and two.mesh_shape == (2, 4)
    assert two.axis_names == ("pp", "gpus0")
    graph = build_strategy_graph(capture(model, (x,)), two.mesh_shape[1:])
    assert len(choice_from_plan(graph, two)) == len(graph.nodes)
    one = plan(model, (4,), (x,), hardware=measured_style((4,)), time_limit_s=2 * LIMIT)
    assert one.pipeline is not None and one.pipeline.stages == 4 and one.mesh_shape == (4, 1)
    assert any(note.startswith("no pipeline: ") for note in one.notes)  # the intra-op plan was tried too


def test_explain_says_what_and_why(gpt_plan):
    _, _, p = gpt_plan
    text = p.explain()
    assert "predicted step" in text and "predicted memory per device" in text
    assert "layers 0-1" in text or "layer 0" in text  # the per-layer table
    intra = p.axis_names[1:] if p.pipeline is not None else p.axis_names  # the roles of the intra-op axes
    assert f"axes: {intra[0]} (" in text
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


    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=1)
    x, target = torch.randn(8, 16), torch.randint(0, 16, (8,))
    with pytest.raises(ValueError, match="autopar: plan\\(loss_fn=...\\) expected a target"):
        autopar.plan(model, (2,), (x,), loss_fn=F.cross_entropy)
    plan = autopar.plan(model, (2,), (x,), loss_fn=F.cross_entropy, target=target, time_limit_s=10, pipeline=False)
    assert any("cross_entropy_loss" in name for name in plan.strategies)
    assert plan.predicted.step_time > 0


def test_only_as_many_layers_recomputed_as_memory_demands():
    """Activations of an 8-layer GPT squeezed to 70% / 40% / 10%: the planner recomputes
    the fewest layers that fit (more for a tighter limit), each costing time."""
    cfg = GPTConfig(vocab_size=1024, max_seq_len=1024, dim=512, n_heads=8, n_layers=8)

    model = meta(lambda: GPT(cfg))
    x = torch.zeros(64, 1024, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = plan(model, (8,), (x,), hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False)
        m = free.predicted.memory
        state = m["parameters"] + m["gradients"] + m["optimizer"]
        squeezed = [plan(model, (8,), (x,), hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False,
                         memory_limit=state + f * m["activations"]) for f in (0.7, 0.4)]
    assert free.recompute == []
    counts = [len(p.recompute) for p in squeezed]
    assert 0 < counts[0] < counts[1] < cfg.n_layers, counts
    for f, p in zip((0.7, 0.4), squeezed):
        assert sum(p.predicted.memory.values()) <= (state + f * m["activations"]) * (1 + 1e-9)
    times = [free.predicted.step_time] + [p.predicted.step_time for p in squeezed]
    assert times == sorted(times) and times[0] < times[-1]
    assert f"{counts[0]} of {cfg.n_layers} repeated layers are recomputed" in squeezed[0].explain()


def test_a_manual_layout_recomputes_the_fewest_layers_that_fit():
    """``layout="fsdp"`` given half of its activations' memory recomputes some layers, as an
    auto plan would, instead of reporting that it does not fit; the auto plan lists it as a
    candidate (costed with its recomputation fitted, no search), and is no slower; the search
    under the layout's pins is no slower than that costing."""
    cfg = GPTConfig(vocab_size=1024, max_seq_len=1024, dim=512, n_heads=8, n_layers=8)

    model = meta(lambda: GPT(cfg))
    x = torch.zeros(64, 1024, dtype=torch.long, device="meta")
    kwargs = dict(hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = plan(model, (8,), (x,), layout="fsdp", **kwargs)
        m = free.predicted.memory
        limit = m["parameters"] + m["gradients"] + m["optimizer"] + 0.5 * m["activations"]
        tight = plan(model, (8,), (x,), layout="fsdp", memory_limit=limit, **kwargs)
        auto = plan(model, (8,), (x,), memory_limit=limit, **kwargs)
    assert free.recompute == []
    assert 0 < len(tight.recompute) < cfg.n_layers, tight.recompute
    assert sum(tight.predicted.memory.values()) <= limit * (1 + 1e-9)
    assert tight.params == free.params and tight.predicted.step_time > free.predicted.step_time
    assert "recomputed in backward" in tight.explain()
    assert tight.predicted.step_time <= auto.candidates["fsdp"] * (1 + 1e-9)
    assert auto.predicted.step_time <= min(auto.candidates.values()) * (1 + 1e-9)


def test_zero3_when_parameters_do_not_fit_otherwise():
    """Data parallel on a slow axis, given only the memory of FSDP (+5%): replicated or
    ZeRO-1/2 weights do not fit, Megatron's replicated activations do not either, so every
    weight goes to ZeRO-3 — and only then (the unconstrained plan keeps them whole)."""
    model = meta(lambda: WideMLP(dim=4096, hidden=4096, n_layers=4))
    x = torch.zeros(64, 256, 4096, device="meta")
    kwargs = dict(hardware=slow_axis(8), time_limit_s=LIMIT, pipeline=False)
    free = plan(model, (8,), (x,), **kwargs)
    fsdp = plan(model, (8,), (x,), layout="fsdp", **kwargs)
    limit = 1.05 * sum(fsdp.predicted.memory.values())
    tight = plan(model, (8,), (x,), memory_limit=limit, **kwargs)
    weights = [fqn for fqn in free.zero if fqn.endswith("weight")]
    assert all(free.zero[w] < 3 for w in weights)
    assert sum(free.predicted.memory.values()) > limit
    assert all(tight.zero[w] == 3 for w in weights), tight.zero
    assert sum(tight.predicted.memory.values()) <= limit * (1 + 1e-9)
    assert tight.recompute == []  # sharding the weights was enough


def test_one_device_that_cannot_hold_the_model_is_an_error():
    """On one device ZeRO has nothing to shard over: it must not look like a way to fit."""
    model = meta(lambda: WideMLP(dim=1024, hidden=4096, n_layers=2))
    x = torch.zeros(8, 128, 1024, device="meta")
    # 0.25 GiB of state and, both layers recomputed, their inputs and one layer's activations: 0.3 GiB
    with pytest.raises(PlanningError, match=r"^autopar: no plan fits in 0.0931 GiB per device.*about 4\+ devices"):
        plan(model, (1,), (x,), time_limit_s=LIMIT, memory_limit=1e8, pipeline=False)


def test_an_op_without_a_rule_is_named_once():
    """Every pipeline option lists strategies again; the user hears of the op once."""

    class WholeProduct(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            h = self.linear(x)
            return h * torch.prod(h.sigmoid())  # the product of every element: no rule

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = plan(WholeProduct(), (2, 2), (torch.randn(8, 16, 64),), time_limit_s=LIMIT)
    named = [w for w in seen if "aten.prod.default" in str(w.message)]
    assert len(named) == 1 and str(named[0].message).startswith("autopar: no sharding rule")
    assert p.strategies  # and it still plans, the op replicated


def _without_timings(p: Plan) -> dict:
    out = json.loads(p.to_json())
    for key in ("seconds", "planning_seconds", "planning_cpu_seconds", "capture_seconds"):
        out["solver"].pop(key, None)
    return out


def _wall_clock_running(monkeypatch, speed: float) -> None:
    """The wall clock, as the planner and its solvers read it, running ``speed`` times too fast:
    a machine ``speed`` times more loaded, as far as any wall-clock limit can tell."""


    real, start = time.perf_counter, time.perf_counter()
    fast = lambda: start + speed * (real() - start)  # noqa: E731
    monkeypatch.setattr(time, "perf_counter", fast)
    monkeypatch.setattr(chain_dp, "perf_counter", fast)


def test_the_same_call_gives_the_same_plan(monkeypatch):
    """Planning is deterministic (a seeded, interleaved CP-SAT search with a deterministic
    budget, fixed shares of the time limit): planned twice, a GPT on a 2 x 4 mesh — an
    intra-op ILP (residual skips make it no chain) and a pipeline search — gives one plan,
    the second time with the wall clock running 5 times too fast (a machine under a load that
    takes 5 times longer: the wall clock is only a safety net, never what decides)."""
    cfg = GPTConfig(vocab_size=1024, max_seq_len=512, dim=256, n_heads=8, n_layers=4)

    model = meta(lambda: GPT(cfg))
    x = torch.zeros(32, 512, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = plan(model, (2, 4), (x,), hardware="h100", time_limit_s=60)
        _wall_clock_running(monkeypatch, 5.0)
        second = plan(model, (2, 4), (x,), hardware="h100", time_limit_s=60)
    # the clock ran fast: 5 x the wall clock, and CPU seconds are at most the solver's few threads x it
    assert second.solver["planning_seconds"] > 1.5 * second.solver["planning_cpu_seconds"]
    assert "clock_cut" not in first.solver and "clock_cut" not in second.solver, (first.solver, second.solver)
    assert any(n.startswith("pp2x4: ") and "not tried" not in n for n in first.notes), first.notes
    assert _without_timings(first) == _without_timings(second)


def test_pipeline_depths_tried_spread_first_then_bisect_towards_the_best():
    """The search's order over pipeline depths: the middle and the quarter points first, then
    a bisection between the best found and its tried neighbours, the deepest untried while
    nothing fits. On a valley-shaped step time over 15 depths it reaches the bottom within 7
    plans wherever the bottom lies (trying all would take 15)."""

    options = [(p, (8,)) for p in range(2, 17)]
    results: dict[int, float] = {}
    seen = []
    for _ in range(3):
        i = next_factorisation(options, results)
        seen.append(i)
        results[i] = 1.0
    assert seen == [7, 3, 11]
    assert next_factorisation(options, {7: 2.0, 3: 1.0, 11: 3.0}) == 1  # between 3 and the shallow end
    assert next_factorisation(options, {7: 1.0, 3: 2.0, 11: 3.0}) == 5  # the larger side of 7, the shallower on a tie
    assert next_factorisation(options, {7: math.inf, 3: math.inf, 11: math.inf}) == 14  # nothing fits yet
    assert next_factorisation(options, {i: 1.0 for i in range(15)}) is None
    for bottom in range(15):
        results = {}
        for _ in range(7):
            i = next_factorisation(options, results)
            results[i] = (i - bottom) ** 2 + 0.01 * i
        assert bottom in results, (bottom, sorted(results))


def test_pipelines_deeper_than_the_layers_and_past_the_budget_are_not_planned():
    """Two layers on a 4 x 2 mesh: a 4-stage pipeline would leave stages empty, so only the
    2-stage one is planned, and the notes say why; the budget of depths is a count from the
    graph's size and the time limit, never the clock."""

    model, inputs = small_gpt()
    captured = capture(model, inputs)
    assert repeated_layer_count(captured) == 2
    assert factorisation_budget(captured, 60.0) == factorisation_budget(captured, 60.0) >= 1
    assert factorisation_budget(captured, 1e-6) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, (4, 2), inputs, time_limit_s=60)  # the clock, a safety net, not the limit here
    notes = dict(n.split(": ", 1) for n in p.notes if n.startswith("pp"))
    assert notes["pp4x2"] == "not tried: 4 stages for 2 repeated layers", notes
    assert not notes["pp2x2x2"].startswith("not tried"), notes


def test_the_safety_net_counts_cpu_seconds_and_only_a_runaway_wall_clock(monkeypatch):
    """The pipeline search stops early only past CPU_SAFETY_FACTOR x its limit in this
    process's CPU seconds (which a loaded machine hardly changes), or past WALL_SAFETY_FACTOR x
    it in wall seconds; a wall clock a few times slower than idle, as under load, cuts nothing."""


    wall, cpu = [100.0], [5.0]
    monkeypatch.setattr(time, "perf_counter", lambda: wall[0])
    monkeypatch.setattr(time, "process_time", lambda: cpu[0])
    net = search.SafetyNet.start(10.0)
    wall[0] += 5 * 10.0  # five times the limit on the wall clock: a loaded machine
    cpu[0] += 0.9 * search.CPU_SAFETY_FACTOR * 10.0
    assert net.cut() == ""
    cpu[0] += 0.2 * search.CPU_SAFETY_FACTOR * 10.0
    assert "CPU s used" in net.cut()
    cpu[0] = 5.0
    wall[0] = 100.0 + 1.1 * search.WALL_SAFETY_FACTOR * 10.0
    assert "wall clock" in net.cut()
