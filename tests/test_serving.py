"""Serving plans in one process: the workload, one plan laying out many captures, the joint
problem of prefill and decode, serving plans as data, explained and dry-run, and the
pricing decode needs. Generation on real processes: tests/test_serving_distributed.py."""

import itertools
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

import autopar
from autopar import costmodels
from autopar.cli import main
from autopar.passes.capture import capture
from autopar.passes.generation import capture_programs, capture_prompt_logits
from autopar.passes.node_keys import node_keys
from autopar.passes.planner import serving, serving_layout
from autopar.passes.planner.request import PlanningError
from autopar.passes.planner.relayout import relayout
from autopar.passes.solve import Follower, SolveProblem, evaluate_memory, evaluate_time, solve
from autopar.passes.solve.joint import join
from autopar.passes.strategy_graph import build_strategy_graph
from tests.models import llama

WORKLOAD = autopar.Inference(batch=4, prompt_len=6, max_len=16)


@pytest.fixture(scope="module")
def tiny_llama():
    model, (tokens,) = llama()
    return model, tokens


@pytest.fixture(scope="module")
def serving_plans(tiny_llama):
    """The tiny Llama's serving plans on a 2x2 mesh: the planner's and tp+dp's."""
    model, _ = tiny_llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {layout: autopar.plan(model, (2, 2), inference=WORKLOAD, hardware="h100", time_limit_s=2,
                                     layout=None if layout == "auto" else layout)
                for layout in ("auto", "tp+dp")}


@pytest.mark.parametrize("kwargs, match", [
    (dict(objective="speed"), "objective=\\) expected one of"),
    (dict(batch=None), "only the throughput objective"),
    (dict(prompt_len=16, max_len=16), "above prompt_len"),
    (dict(batch=0), "batch=\\) expected a positive int"),
    (dict(max_len=2.5), "max_len=\\) expected a positive int"),
])
def test_the_workload_is_checked_when_made(kwargs, match):
    with pytest.raises(ValueError, match=f"^autopar: .*{match}"):
        autopar.Inference(**kwargs)


def test_an_encoder_decoder_model_is_refused_before_capture():
    """T5 and BART have a static cache too, but generation also runs their encoder: one clear
    error, not export's broadcast failure inside the attention."""
    import transformers

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    with pytest.raises(TypeError, match="^autopar: inference expected a decoder-only causal LM; found "
                                        "T5ForConditionalGeneration, an encoder-decoder"):
        autopar.plan(t5, (2,), inference=autopar.Inference(batch=1, prompt_len=4, max_len=8), hardware="h100")


def test_prefill_keeps_the_last_positions_logits_and_the_prompt_logits_program_every_one(tiny_llama):
    """Generation needs the next token's logits only: the prompt's over the vocabulary would be a
    step's largest tensor (Llama-3-8B, 1,076 prompts of 128: 33 GiB), priced and held for nothing."""
    model, _ = tiny_llama
    work = WORKLOAD
    programs = capture_programs(model, work.batch, work.prompt_len, work.max_len)
    vocab = model.config.vocab_size

    def logits_shape(captured):
        out = next(n for n in captured.nodes("output")).args[0]
        return tuple(pytree.tree_leaves(out)[captured.user_outputs[0]].meta["val"].shape)

    assert logits_shape(programs.prefill) == logits_shape(programs.decode) == (work.batch, 1, vocab)
    every = capture_prompt_logits(model, work.batch, work.prompt_len, work.max_len)
    assert logits_shape(every) == (work.batch, work.prompt_len, vocab)


def test_a_node_keeps_its_identity_across_no_grad_eval_and_batch_size(tiny_llama):
    """Export renumbers ``to`` under no_grad (a no-grad region inlined, not wrapped): the
    identities do not move; at batch 1 one expand is not made, and only it is missing."""
    model, tokens = tiny_llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = capture(model, (tokens,))
        with torch.no_grad():
            evaluated = capture(model, (tokens,), train=False)
        one = capture(model, (tokens[:1],))
    names = {n.name for n in train.nodes()} ^ {n.name for n in evaluated.nodes()}
    assert names, "the names differ under no_grad (the reason identities exist)"
    keys = set(node_keys(train).values())
    assert keys == set(node_keys(evaluated).values())
    assert len(keys - set(node_keys(one).values())) == 1


def test_a_plan_lays_out_other_captures_with_its_weights_where_it_keeps_them(tiny_llama, serving_plans):
    """tp+dp for training, laid out on an eval capture (every node found) and on a batch of
    one (the batch cannot split: those nodes re-solved), the weights where the plan keeps them."""
    model, tokens = tiny_llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.layouts.build("tp+dp", model, (2, 2), (tokens,), hardware="h100")
        with torch.no_grad():
            evaluated = build_strategy_graph(capture(model, (tokens,), train=False), (2, 2))
        one = build_strategy_graph(capture(model, (tokens[:1],)), (2, 2))
    assert relayout(evaluated, plan).derived == []
    laid = relayout(one, plan)
    assert laid.derived and "input_ids" in laid.derived
    for node, i in laid.choice.items():
        if node.name in one.captured.params:
            assert str(one.nodes[node].strategies[i]) == plan.strategies[node.name]


def test_joint_problem_is_the_weighted_sum_with_shared_values_one_decision():
    """Two made-up programs of two nodes each, node 0 of each the same value (the second
    run 7 times): the solve of the joint problem finds the brute-force optimum of the
    weighted sum over assignments that give the shared value one strategy; it is held once."""
    rng = np.random.default_rng(0)

    def program():
        return SolveProblem(node_time=[rng.random(3), rng.random(2)], node_memory=[np.array([4.0, 2.0, 1.0]),
                            rng.random(2)], edges=[(0, 1, rng.random((3, 2)))])

    a, b = program(), program()
    joint, offsets = join([(a, 1.0), (b, 7.0)], [((0, 0), (1, 0))])
    assert offsets == [0, 2] and Follower(2, 0, (0, 1, 2)) in joint.followers
    best = min((x for x in itertools.product(range(3), range(2), range(3), range(2)) if x[2] == x[0]),
               key=lambda x: evaluate_time(a, x[:2]) + 7.0 * evaluate_time(b, x[2:]))
    found = solve(joint)
    assert math.isclose(found.objective, evaluate_time(a, best[:2]) + 7.0 * evaluate_time(b, best[2:]))
    assert found.assignment[2] == found.assignment[0]
    held = evaluate_memory(joint, found.assignment)
    x = found.assignment
    assert held == pytest.approx(float(a.node_memory[0][x[0]] + a.node_memory[1][x[1]] + b.node_memory[1][x[3]]))


def test_a_serving_plan_is_data_explained_and_never_slower_than_its_layouts(serving_plans):
    plan = serving_plans["auto"]
    assert autopar.Plan.from_json(plan.to_json()) == plan
    assert set(plan.programs) == {"decode"} and plan.inference["batch"] == 4
    p = plan.predicted
    steps = WORKLOAD.new_tokens - 1
    assert p.step_time == pytest.approx(p.time_to_first_token + steps * p.time_per_output_token)
    assert p.tokens_per_second_per_device == pytest.approx(4 * WORKLOAD.new_tokens / p.step_time / 4)
    assert set(p.memory) == {"parameters", "kv_cache", "activations"}
    assert {"replicated", "dp", "tp", "tp+dp"} <= set(plan.candidates)
    assert p.step_time <= min(plan.candidates.values()) * (1 + 1e-9)
    text = plan.explain()
    for words in ("serving plan", "time to first token", "per output token", "tokens/s per device", "kv_cache",
                  "key-value cache laid out as"):
        assert words in text, words
    pinned = serving_plans["tp+dp"]
    assert pinned.kind == "tp+dp" and pinned.predicted.step_time >= p.step_time * (1 - 1e-9)


def test_where_the_solver_finds_no_layout_the_fastest_manual_one_that_fits_is_the_plan(tiny_llama, monkeypatch):
    """The solver's rounds of room for activations can end with nothing (injected here): a
    manual layout that fits is still a plan, not a failure."""
    monkeypatch.setattr(serving_layout, "_solve", lambda *args: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(tiny_llama[0], (2, 2), inference=WORKLOAD, hardware="h100", time_limit_s=2)
    fastest = min(plan.candidates, key=plan.candidates.get)
    assert plan.kind == fastest and plan.predicted.step_time == pytest.approx(plan.candidates[fastest])


def test_a_serving_plan_dry_runs_holding_the_weights_and_cache_it_predicts(tiny_llama, serving_plans):
    """Every distinct rank builds and runs its prefill and a decode step on the fake
    backend; the weights and cache it holds are the prediction's to the byte."""
    model, _ = tiny_llama
    result = autopar.dry_run(serving_plans["tp+dp"], model)
    assert result.ok, result.table()
    for r in result.ranks:
        for kind in ("parameters", "kv_cache"):
            assert r.memory[kind] == r.predicted[kind], (kind, r)
    assert "kv_cache" in result.table()


def test_the_throughput_batch_is_searched_down_from_the_largest_that_fits(tiny_llama):
    """Without a batch the throughput plan tries the largest batch the memory holds, then
    halves it while the halved batch serves more tokens per second per device; the plan is
    the best of the batches tried (one device: each halving reads the weights for fewer
    sequences and serves less, so the search stops after one)."""
    model, _ = tiny_llama
    kwargs = dict(hardware="h100", time_limit_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, (1,), inference=autopar.Inference(
            batch=1, prompt_len=6, max_len=16, objective="throughput"), **kwargs).predicted.memory
        per_sequence = one["kv_cache"] + one["activations"]
        limit = one["parameters"] + 40.5 * per_sequence
        found = autopar.plan(model, (1,), inference=autopar.Inference(
            batch=None, prompt_len=6, max_len=16, objective="throughput"), memory_limit=limit, **kwargs)
    tried = [(int(b), float(t)) for b, t in
             (pair.split(": ") for pair in found.reasons[0].split("(")[1].split(")")[0].split(", "))]
    assert [b for b, _ in tried] == [40, 20], tried  # the largest the memory holds, then its half
    assert tried[1][1] < tried[0][1], "half the sequences read the same weights: fewer tokens per second"
    assert found.inference["batch"] == 40
    assert found.predicted.tokens_per_second_per_device == pytest.approx(tried[0][1], rel=1e-3)
    assert sum(found.predicted.memory.values()) <= limit


def test_the_throughput_search_narrows_the_gap_to_the_smallest_batch_that_did_not_fit(tiny_llama, monkeypatch):
    """Where the batch the memory should hold does not fit (here: no plan above 27 sequences,
    injected), the search halves it, then halves the gap to the smallest refused batch twice,
    and says which batches did not fit and why."""
    model, _ = tiny_llama
    real = serving.plan_serving

    def fits_up_to_27(model, inference, request):
        if inference.batch is not None and inference.batch > 27:
            raise PlanningError(f"autopar: batch {inference.batch} does not fit (injected)")
        return real(model, inference, request)

    monkeypatch.setattr(serving, "plan_serving", fits_up_to_27)
    kwargs = dict(hardware="h100", time_limit_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = autopar.plan(model, (1,), inference=autopar.Inference(
            batch=1, prompt_len=6, max_len=16, objective="throughput"), **kwargs).predicted.memory
        limit = one["parameters"] + 40.5 * (one["kv_cache"] + one["activations"])
        found = autopar.plan(model, (1,), inference=autopar.Inference(
            batch=None, prompt_len=6, max_len=16, objective="throughput"), memory_limit=limit, **kwargs)
    tried = [int(pair.split(": ")[0]) for pair in found.reasons[0].split("(")[1].split(")")[0].split(", ")]
    assert tried == [20, 25, 12], tried  # 40 and 30 refused; 25 fits; its half serves less
    assert found.inference["batch"] == 25
    assert found.reasons[1] == "batches that did not fit: 40, 30; at 30: autopar: batch 30 does not fit (injected)"


def test_a_pipeline_with_micro_batches_in_flight_holds_every_cache_and_dry_runs(tiny_llama):
    """Two stages, two micro-batches of 4 sequences: the programs are captured at 4, each
    stage holds the cache of all 8 (as much as one batch of 8 through the stages in turn)
    and one micro-batch's activations; the plan replays, explains its ticks and dry-runs
    holding what it predicts."""
    model, _ = tiny_llama
    plans = {}
    for m in (1, 2):
        workload = autopar.Inference(batch=8, prompt_len=6, max_len=16, objective="throughput", micro_batches=m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[m] = autopar.plan(model, (2, 1), inference=workload, hardware="h100", time_limit_s=2, layout="pp")
    one, two = plans[1].predicted, plans[2].predicted
    assert plans[2].pipeline.micro_batches == 2 and plans[2].inference["batch"] == 8
    assert autopar.Plan.from_json(plans[2].to_json()) == plans[2]
    assert two.memory["kv_cache"] == one.memory["kv_cache"] > 0
    assert two.memory["activations"] < one.memory["activations"]
    steps = WORKLOAD.new_tokens - 1
    assert two.step_time == pytest.approx(two.time_to_first_token + steps * two.time_per_output_token)
    assert two.tokens_per_second_per_device == pytest.approx(8 * WORKLOAD.new_tokens / two.step_time / 2)
    assert "2 micro-batches of 4 sequence(s) in flight" in plans[2].explain()
    result = autopar.dry_run(plans[2], model)
    assert result.ok, result.table()
    for r in result.ranks:
        for kind in ("parameters", "kv_cache"):
            assert r.memory[kind] == r.predicted[kind], (kind, r)


def test_small_all_reduces_pay_the_low_latency_protocol_and_large_ones_the_bandwidth():
    """A decode step's all-reduce of a few kilobytes over 8 GPUs pays NCCL's LL latency
    (3.6 us + 14 steps of 0.47 us), a large one Simple's bandwidth (the faster of the two)."""
    profile = costmodels.preset("h100", (8,))
    small = costmodels.collective_time("all_reduce", 8192, 0, profile, in_step=True)
    assert small == pytest.approx(3.6e-6 + 14 * 0.47e-6 + 2 * 7 / 8 * 8192 / (370e9 / 4))
    large = costmodels.collective_time("all_reduce", 1 << 30, 0, profile, in_step=True)
    assert large == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * (1 << 30) / 370e9)


def test_cli_plans_serving(tmp_path, capsys):
    out = tmp_path / "serving"
    code = main(["plan", "tests.models:llama", "--mesh", "2x2", "--inference", "--batch", "2", "--prompt", "6",
                 "--max-len", "16", "--time-limit", "2", "--layout", "tp", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "serving plan tp" in printed and "time to first token" in printed
    saved = json.loads((out / "plan.json").read_text())
    assert saved["inference"]["batch"] == 2 and saved["kind"] == "tp"
    assert main(["plan", "tests.models:llama", "--mesh", "2x2", "--inference", "--seq", "8"]) == 2
    assert "--inference plans serving, which takes no --seq" in capsys.readouterr().err
