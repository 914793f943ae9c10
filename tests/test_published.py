"""benchmarks/published.py's core on small shapes: the published-rate conversion, pinned
layouts (intra-op with the fewest recomputed layers, pipelined) and one scaled-down row."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
import warnings

import pytest
import torch

import autopar
from benchmarks import published
from autopar import layouts
from autopar.costmodels import Schedule
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.plan import Pipeline, Plan
from autopar.passes.planner.pinned import BREAKDOWN_PARTS, Pinned, price_pinned


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_heads=4, n_layers=4))


@pytest.fixture(scope="module")
def captured():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(tiny_gpt(), (torch.zeros(16, 64, dtype=torch.long),))


def test_megatron_7b_published_rate_by_hand():
    row = next(r for r in published.published_rows() if r.key == "mlm-7.1b")
    with torch.device("meta"):
        model = row.build()
    params, layers, hidden = published.model_shape(model)
    assert (params, layers, hidden) == (7_131_922_432, 30, 4096)  # the README's "7.1B"
    # by hand: 6 * 7,131,922,432 + 12 * 30 * 4096 * 4096 = 42,791,534,592 + 6,039,797,760
    per_token = published.flops_per_token(params, layers, hidden, row.seq)
    assert per_token == 48_831_332_352
    # Megatron-LM's own count, which its published 465.9 TFLOP/s/GPU divides by: 12 L h^2 (1 + 1 +
    # s/h + 4 + V/(2 L h)) = 72 L h^2 + 12 L h s + 6 V h = 36,238,786,560 + 6,039,797,760 + 3,221,225,472
    counted = published.publisher_flops_per_token(row, model, per_token)
    assert counted == 45_499_809_792
    assert published.published_tokens(row, counted) == pytest.approx(10239.6, abs=0.5)  # 465.9e12 / counted
    # a row whose publisher's count is not known converts with ours
    assert published.publisher_flops_per_token(replace(row, counted=None), model, per_token) == per_token


def test_fewest_recomputed_layers_that_fit(captured):
    def price(limit: float):
        return price_pinned(captured, (8,), "h100", lambda g: layouts.hint("dp", g), Pinned(layout="dp"),
                            memory_limit=limit)

    none = price(math.inf)
    assert none.fits and none.recomputed == 0 and none.layers == 4
    between = price(none.memory * 0.9)
    assert between.fits and 0 < between.recomputed < 4 and between.memory <= none.memory * 0.9
    assert between.step_time > none.step_time  # recomputing runs forwards again
    assert price(between.memory).recomputed == between.recomputed  # the fewest that fit ...
    tighter = price(between.memory * 0.999)  # ... and one byte less needs more, or nothing fits
    assert not tighter.fits or tighter.recomputed > between.recomputed
    nothing = price(1.0)
    assert not nothing.fits and math.isinf(nothing.step_time)


def test_pinned_pipeline_and_bad_requests(captured):
    pinned = Pinned(layout="tp+dp", stages=2, micro_batches=4, schedule="1f1b")
    cost = price_pinned(captured, (4, 2), "h100", lambda g: layouts.hint("tp+dp", g), pinned, memory_limit=80e9)
    assert cost.fits and cost.step_time > 0 and cost.layers == 4 and cost.recomputed == 0
    with pytest.raises(ValueError, match="autopar: 3 pipeline stages must divide"):
        price_pinned(captured, (4, 2), "h100", lambda g: layouts.hint("tp+dp", g),
                     Pinned(layout="tp+dp", stages=3, micro_batches=4), memory_limit=80e9)
    with pytest.raises(ValueError, match="autopar: no pipeline schedule"):
        Pinned(layout="tp+dp", stages=2, schedule="zigzag")
    # a layout that accumulates is priced on the capture of one micro-batch, marked so
    with pytest.raises(ValueError, match=r"autopar: a layout pinned with accumulate=2 is priced on the capture of one "
                                         r"micro-batch marked so; found a capture of accumulate=1"):
        price_pinned(captured, (4, 2), "h100", lambda g: layouts.hint("tp+dp", g),
                     Pinned(layout="tp+dp", accumulate=2), memory_limit=80e9)
    with pytest.raises(ValueError, match="autopar: expected accumulate to be a positive int"):
        Pinned(layout="dp", accumulate=0)


def test_scaled_down_row_numbers():
    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(4, 2),
                        pinned=Pinned(layout="tp+dp", stages=2, micro_batches=4), layout_text="TP 2, PP 2, DP 2",
                        tflops_per_gpu=1.0, memory_gib=1.0)
    r = published.evaluate(row, time_limit_s=3.0, dry_run=False)
    params = sum(p.numel() for p in tiny_gpt().parameters())
    per_token = 6 * params + 12 * 4 * 64 * 64
    assert r["flops_per_token"] == per_token
    assert r["published"] == pytest.approx(1e12 / per_token)
    assert r["predicted"] == pytest.approx(16 * 64 / r["pinned"].step_time / 8)
    assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
    assert r["auto_mfu"] == pytest.approx(r["auto_tokens"] * per_token / 989e12)
    mesh = r["auto_line"].split(",")[0].removeprefix("mesh ")  # e.g. "8" or "4x2" (a pipeline's split)
    assert math.prod(int(n) for n in mesh.split("x")) == 8 and r["dry_run"] == "not run"
    text = published.table([r])
    assert text.splitlines()[0] == published.HEADER and "| tiny | 8 | TP 2, PP 2, DP 2 |" in text


def test_a_dry_run_row_saves_its_plan_and_sets_each_rank_beside_its_prediction(tmp_path, capsys):
    """``--dry-run --plans DIR``: the auto plan saved as <row>.json (the plan the table's line
    describes), and the verdict: ok with the peak against the prediction, every rank's table
    printed (each distinct rank's own predicted / dry run)."""
    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(4, 2),
                        pinned=Pinned(layout="tp+dp", stages=2, micro_batches=4), layout_text="TP 2, PP 2, DP 2",
                        tflops_per_gpu=1.0)
    r = published.evaluate(row, time_limit_s=3.0, dry_run=True, plans=tmp_path)
    saved = Plan.load(tmp_path / "tiny.json")
    assert published.one_line(saved) == r["auto_line"]
    assert r["dry_run"].startswith("ok: peak ") and "predicted / dry run" in r["dry_run"], r["dry_run"]
    assert "over the device" not in r["dry_run"]  # a tiny GPT on an 80 GB card
    printed = capsys.readouterr().err
    assert printed.count("predicted / dry run") >= 2  # a line per rank, and the whole plan's


def test_counterfactuals_replan_without_overlap_and_without_zero_bubble():
    """``--counterfactuals``: the auto plan again with the preset's overlap off (nothing hidden), and
    where it runs a zero-bubble schedule the fastest plan without one; each beside the auto plan."""
    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(4, 2),
                        pinned=Pinned(layout="tp+dp", stages=2, micro_batches=4), layout_text="TP 2, PP 2, DP 2",
                        tflops_per_gpu=1.0)
    r = published.evaluate(row, time_limit_s=3.0, dry_run=False, what_changed=True)
    plan = r["auto_plan"]
    other, tokens = r["without_overlap"]
    assert other.predicted.hidden_communication == 0.0 and other.hardware == "h100-no-overlap"
    assert "h100-no-overlap" not in autopar.costmodels.PRESETS  # registered only while it plans
    assert tokens == pytest.approx(published.tokens_per_gpu(row, other.predicted.step_time))
    zero_bubble = plan.pipeline is not None and Schedule.parse(plan.pipeline.schedule).split_backward
    assert (r["without_zero_bubble"] is None) == (not zero_bubble)
    # a plan running a zero-bubble schedule: the fastest plan without one is found
    forced = replace(plan, pipeline=Pipeline(axis=0, stages=2, micro_batches=4, schedule="ZBVZeroBubble",
                                             chunks_per_rank=2))
    model, inputs = published._model_and_inputs(row)
    best, _ = published.counterfactuals(row, model, inputs, forced, time_limit_s=3.0)["without_zero_bubble"]
    assert best is not None and (best.pipeline is None or not Schedule.parse(best.pipeline.schedule).split_backward)
    line = published.counterfactual_row(r)
    assert line.startswith("| tiny | ") and line.count(" | ") == published.COUNTERFACTUAL_HEADER.count(" | ")
    assert published.COUNTERFACTUAL_HEADER in published.table([r])
    # a plan laid out otherwise is told apart
    assert not published.same_layout(plan, replace(plan, recompute=plan.recompute + ["layer 0"]))


@pytest.mark.parametrize("shape, pinned", [
    ((8,), Pinned(layout="dp")),
    ((4, 2), Pinned(layout="tp+dp", stages=2, micro_batches=4)),
    ((4, 2), Pinned(layout="tp+dp", stages=2, micro_batches=4, schedule="interleaved_1f1b")),
], ids=["intra-op", "1f1b", "interleaved"])
def test_the_breakdown_of_a_pinned_step_sums_to_its_time(captured, shape, pinned):
    cost = price_pinned(captured, shape, "h100", lambda g: layouts.hint(pinned.layout, g), pinned, memory_limit=80e9)
    assert set(cost.parts) == set(BREAKDOWN_PARTS)
    assert sum(cost.parts.values()) == pytest.approx(cost.step_time, rel=1e-9)
    assert cost.parts["compute"] > 0 and all(v >= 0 for v in cost.parts.values())
    assert (cost.parts["bubble"] > 0) == (pinned.stages > 1)  # M + P - 1 slots for M micro-batches' work
    assert cost.parts["parameter comm"] > 0  # every layout here syncs gradients over a data-parallel axis


def test_recomputation_shows_in_the_breakdown_and_not_in_compute(captured):
    def price(limit: float):
        return price_pinned(captured, (8,), "h100", lambda g: layouts.hint("dp", g), Pinned(layout="dp"),
                            memory_limit=limit)

    none = price(math.inf)
    some = price(none.memory * 0.9)
    assert none.parts["recompute"] == 0 and some.parts["recompute"] > 0
    assert some.parts["compute"] == pytest.approx(none.parts["compute"])
    assert some.step_time - none.step_time == pytest.approx(some.parts["recompute"])


def test_a_row_plans_for_its_own_machine_and_can_skip_the_auto_plan():
    rows = {r.key: r for r in published.published_rows()}
    assert rows["tt-8b"].device_memory == 96e9 and rows["mlm-7.1b"].device_memory == 80e9
    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(8,),
                        pinned=Pinned(layout="dp"), layout_text="DP 8", tflops_per_gpu=1.0,
                        hardware=published.GRAND_TETON)
    r = published.evaluate(row, time_limit_s=3.0, dry_run=False, auto_plan=False)
    assert r["auto_line"].startswith("skipped") and r["predicted"] > 0
    on_sxm = published.evaluate(replace(row, hardware="h100"), time_limit_s=3.0, dry_run=False,
                                auto_plan=False)
    assert on_sxm["predicted"] > r["predicted"]  # the 500 W board is the slower one
    assert published.breakdown_row(r).startswith("| tiny | ")


@pytest.mark.parametrize("shape, stages", [((8,), 1), ((4, 2), 2)], ids=["intra-op", "pipelined"])
def test_a_run_that_states_its_recomputation_is_priced_with_it(captured, shape, stages):
    def price(policy: str, limit: float = 80e9):
        pinned = Pinned(layout="tp+dp" if stages > 1 else "dp", stages=stages, micro_batches=4 if stages > 1 else 1,
                        recompute=policy)
        return price_pinned(captured, shape, "h100", lambda g: layouts.hint(pinned.layout, g), pinned,
                            memory_limit=limit)

    none, full, fit = price("none"), price("full"), price("fit")
    assert none.recomputed == 0 == fit.recomputed and full.recomputed == full.layers == 4
    assert full.step_time > none.step_time == pytest.approx(fit.step_time)
    assert full.memory < none.memory
    added = full.step_time - none.step_time  # in a pipeline, the bubble grows with the slowest stage too
    assert full.parts["recompute"] == pytest.approx(added) if stages == 1 else 0 < full.parts["recompute"] < added
    squeezed = price("none", none.memory / 2)  # the run was made so: priced, with a note
    assert squeezed.fits and squeezed.step_time == none.step_time and "over the device" in squeezed.notes[-1]
    with pytest.raises(ValueError, match="autopar: no recomputation policy"):
        Pinned(layout="dp", recompute="selective")


def test_a_pinned_interleave_depth_is_priced_as_given(captured):
    def price(chunks: int):
        pinned = Pinned(layout="tp+dp", stages=2, micro_batches=4, schedule="interleaved_1f1b", chunks=chunks)
        return price_pinned(captured, (4, 2), "h100", lambda g: layouts.hint("tp+dp", g), pinned,
                            memory_limit=80e9)

    one, two = price(1), price(2)
    assert Pinned(layout="dp").chunks == 2  # the planner's own depth where a run does not say
    assert 0 < two.parts["bubble"] < one.parts["bubble"]  # (P - 1) / (v M) of the work idle
    assert two.parts["p2p"] > one.parts["p2p"]  # every chunk boundary sends
    with pytest.raises(ValueError, match="autopar: a pinned layout expects positive stages"):
        Pinned(layout="tp+dp", stages=2, schedule="interleaved_1f1b", chunks=0)


def test_a_row_is_priced_under_its_runs_mixed_precision():
    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(8,),
                        pinned=Pinned(layout="fsdp"), layout_text="FSDP 8", tflops_per_gpu=1.0,
                        mp_policy=published.BF16_FP32_REDUCE)
    mixed = published.evaluate(row, time_limit_s=3.0, dry_run=False, auto_plan=False)
    float32 = published.evaluate(replace(row, mp_policy=None), time_limit_s=3.0, dry_run=False, auto_plan=False)
    # bf16 compute on float32 masters: the model's ops at bf16 rates
    assert mixed["pinned"].parts["compute"] < float32["pinned"].parts["compute"]
    rows = {r.key: r for r in published.published_rows()}
    assert rows["tt-8b"].mp_policy == published.BF16_FP32_REDUCE and rows["mlm-7.1b"].mp_policy is None


@dataclass(frozen=True, kw_only=True)
class OnACard(published.Row):
    """A row whose card holds ``card`` bytes (the presets' cards are all larger than a tiny GPT needs)."""

    card: float

    @property
    def device_memory(self) -> float:
        return self.card


def test_a_layout_over_the_card_is_compared_within_it(monkeypatch):
    """Build 2: the auto plan (which must fit) is compared with the published layout's fewest
    recomputed layers that fit, where the run's own recomputation does not; the prediction
    check (ratio to published) stays on the run's own, and the table says both. (~3 s)"""
    pinned = Pinned(layout="dp", stages=2, micro_batches=4, recompute="none")
    row = OnACard(key="tiny", source="test", build=tiny_gpt, gpus=2, batch=16, seq=64, mesh=(2,), pinned=pinned,
                  layout_text="PP 2", tflops_per_gpu=1.0, card=80e9)
    cache: dict = {}  # one capture for every card

    def on(card: float) -> dict:
        return published.evaluate(replace(row, card=card), time_limit_s=3.0, dry_run=False, auto_plan=False,
                                  cache=cache)

    roomy = on(80e9)
    assert roomy["fitting"] is None and roomy["compared"] == roomy["predicted"]
    assert "| as run |" in published.table_row(roomy) and "over the card" not in published.table_row(roomy)

    r = on(roomy["pinned"].memory * 0.9)  # the run's own no longer fits; a recomputed layer does
    assert r["pinned"].step_time == roomy["pinned"].step_time and r["ratio"] == roomy["ratio"]  # priced as run
    fitting = r["fitting"]
    assert fitting.fits and 0 < fitting.recomputed < fitting.layers and fitting.memory <= r["row"].card
    assert fitting.step_time > r["pinned"].step_time
    assert r["compared"] == published.tokens_per_gpu(row, fitting.step_time)
    r.update(auto_tokens=r["compared"] * 1.1)  # an auto plan 10% faster than the layout within the card
    line = published.table_row(r)
    assert "(**over the card's" in line and f"| {fitting.recomputed}/{fitting.layers} recomputed: " in line
    assert f"| 1.10 (÷ as run, over the card: {r['auto_tokens'] / r['predicted']:.2f}) |" in line
    assert "| tiny within the card |" in published.table([r])  # its step broken down too

    full = published.price_published(*cache[next(iter(cache))], row, 4, memory_limit=published.AS_RUN_MEMORY,
                                     time_limit_s=3.0,
                                     recompute="full")
    assert full.recomputed == full.layers == 4
    r = on(full.memory * 1.05)  # the planner's stage search recomputes every layer itself here
    assert r["fitting"].fits and r["fitting"].recomputed == r["fitting"].layers
    assert "found none" not in published.table([r])

    searched = published.price_published

    def search_finds_none(*args, recompute=None, **kwargs):
        if recompute != "fit":
            return searched(*args, recompute=recompute, **kwargs)
        return published.PinnedCost(step_time=math.inf, memory=math.inf, recomputed=0, layers=4, fits=False,
                                    notes=["no stage cut fits"])

    with monkeypatch.context() as patch:  # where the search finds none: every layer recomputed, said so
        patch.setattr(published, "price_published", search_finds_none)
        r = on(full.memory * 1.05)
    assert r["fitting"].fits and r["fitting"].recomputed == r["fitting"].layers
    assert "found none" in r["fitting"].notes[0] and "no stage cut fits" in r["fitting"].notes[0]
    assert "found none" in published.table([r])

    r = on(1.0)  # nothing fits: said so, and nothing to compare with
    assert not r["fitting"].fits and r["compared"] == 0.0
    assert "| none found (" in published.table_row(r) and "| — | 0 | not run |" in published.table_row(r)
    r.update(auto_tokens=1.0)
    assert "| — (÷ as run, over the card: " in published.table_row(r)
