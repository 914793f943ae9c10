"""``plan.solver["searched"]`` records what the planner's search really covered (the depths it
planned, the schedules, chunks and micro-batch counts its stage search evaluated, what it left
out and why, what the clock cut), and ``explain()`` says it in words, the intra-op bound for
the plan's own pipeline, never an infinite gap. The small GPT (2 repeated layers) on a preset
mesh plans in seconds; the search's own functions are wrapped to see what it tried."""

import dataclasses
import json
import math
import re
import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.costmodels import Schedule
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner import layouts, pipeline, search
from autopar.passes.planner.constraints import Constraints
from autopar.passes.planner.request import PlanRequest
from autopar.passes.placements import parse_spec
from autopar.passes.planner.searched import merged, stage_search_record
from autopar.passes.solve.pipeline_search import PipelineOption
from autopar.planning import plan
from tests.models import small_gpt

LIMIT = 10.0  # seconds; the CPU safety net is 3 x this, far above what this plan takes


class Seen:
    """What the search really did: the depths it planned (``search.pipeline_plan`` called) and
    every pipeline option its stage searches evaluated (``pipeline.search_pipeline`` returned)."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.depths: list[int] = []
        self.options: list[PipelineOption] = []
        planned, stage_search = search.pipeline_plan, pipeline.search_pipeline

        def pipeline_plan(captured, p, *args, **kwargs):
            self.depths.append(p)
            return planned(captured, p, *args, **kwargs)

        def search_pipeline(*args, **kwargs):
            found = stage_search(*args, **kwargs)
            self.options += found.options
            return found

        patch.setattr(search, "pipeline_plan", pipeline_plan)
        patch.setattr(pipeline, "search_pipeline", search_pipeline)


def _planned(mesh, **kwargs):
    model, inputs = small_gpt()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = Seen(patch)
        # in this process: the depths a forked worker plans are not seen here
        return plan(model, mesh, inputs, hardware="h100", time_limit_s=kwargs.pop("time_limit_s", LIMIT),
                    workers=1, **kwargs), seen


@pytest.fixture(scope="module")
def planned():
    """Two layers on a 4 x 2 mesh: depth 2 is planned, depth 4 would leave a stage empty."""
    return _planned((4, 2))


def test_the_depths_recorded_are_those_the_search_planned(planned):
    p, seen = planned
    depths = p.solver["searched"]["pipeline_depths"]
    assert seen.depths == [2], seen.depths
    assert depths["tried"] == [1] + seen.depths, depths  # 1: the plan without a pipeline
    assert depths["skipped"] == {"4": "4 stages for 2 repeated layers"}, depths
    assert depths["ruled_out"] == {} and p.pipeline is not None and p.pipeline.stages == 2, depths


def test_the_schedules_chunks_and_micro_batches_recorded_are_those_evaluated(planned):
    p, seen = planned
    searched = p.solver["searched"]
    evaluated = list(dict.fromkeys(o.schedule.display for o in seen.options))
    assert searched["schedules"]["tried"] == [s.display for s in Schedule], searched["schedules"]
    assert set(evaluated) == set(searched["schedules"]["tried"]), evaluated
    fitting = {o.schedule.display for o in seen.options if math.isfinite(o.step_time)}
    assert set(searched["schedules"]["ruled_out"]) == set(evaluated) - fitting, (searched["schedules"], fitting)
    assert p.pipeline.schedule in fitting
    # 2 layers on 2 ranks: 2 chunks per rank make 4 stages, so the schedules that need 2 chunks cannot run
    for name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        assert searched["schedules"]["ruled_out"][name] == "4 stages for 2 layers", searched["schedules"]
    assert searched["micro_batches"] == sorted({o.micro_batches for o in seen.options}), searched
    for name, chunks in searched["chunks_per_rank"].items():
        assert chunks == sorted({o.chunks_per_rank for o in seen.options if o.schedule.display == name}), name
    assert searched["clock_cut"] == [] and "clock_cut" not in p.solver, searched


def test_the_record_round_trips_through_json(planned):
    p, _ = planned
    again = autopar.Plan.from_json(p.to_json())
    assert again == p and again.solver["searched"] == p.solver["searched"]
    assert again.explain() == p.explain()  # a saved plan says it alike, its keys sorted by the JSON
    assert json.loads(json.dumps(p.solver["searched"])) == p.solver["searched"]


def test_explain_says_what_was_searched_and_the_bound_for_this_pipeline(planned):
    p, _ = planned
    text = p.explain()
    searched = next(line for line in text.splitlines() if line.startswith("searched: "))
    assert searched.startswith("searched: pipeline depths 1, 2 (4 skipped: 4 stages for 2 repeated layers); "
                               "schedules GPipe, 1F1B, "), searched
    assert "(Interleaved1F1B, ZBVZeroBubble and DualPipeV ruled out: 4 stages for 2 layers)" in searched, searched
    assert "micro-batches " in searched and searched.endswith("; the clock cut nothing"), searched
    solver = next(line for line in text.splitlines() if line.startswith("solver: "))
    assert re.search(r"intra-op layout (proven the best|within [0-9.]+% of the best layout) for this pipeline", solver), solver
    assert not re.search(r"\binf\b", text) and "gap" not in text, text


def test_an_infinite_gap_is_said_in_words_never_as_inf(planned):
    p, _ = planned
    p = autopar.Plan.from_json(p.to_json())
    p.solver.update(gap=math.inf, method="layout fsdp")
    text = autopar.Plan.from_json(p.to_json()).explain()  # JSON writes the gap as Infinity
    assert "no bound was proven, so how far the layout is from the best for this pipeline is unknown" in text, text
    assert not re.search(r"\binf\b", text) and "inf%" not in text and "gap" not in text, text
    p.solver.pop("gap")
    assert "no bound was proven" in p.explain()


def test_a_depth_past_the_budget_is_recorded_as_skipped(monkeypatch):
    """Four layers on an 8-device line: depths 2 and 4 can be planned, 8 cannot; a budget of one
    depth plans the middle one (``next_factorisation``) and records the other as skipped."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_heads=4, n_layers=4))
    x = torch.zeros(8, 64, dtype=torch.long, device="meta")
    monkeypatch.setattr(search, "factorisation_budget", lambda captured, limit: 1)
    seen = Seen(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, (8,), (x,), hardware="h100", time_limit_s=LIMIT, workers=1)  # seen in this process
    depths = p.solver["searched"]["pipeline_depths"]
    assert seen.depths == [4] and depths["tried"] == [1, 4], (seen.depths, depths)
    assert depths["skipped"] == {"2": "beyond the search budget of 1 pipeline depths (next_factorisation's order)",
                                 "8": "8 stages for 4 repeated layers"}, depths
    assert "2 skipped: beyond the search budget of 1 pipeline depths" in p.explain()


def test_the_clock_cut_is_recorded_and_said():
    """A time limit of a millisecond: the CPU safety net (3 x the limit) stops the pipeline
    search before its first depth, and the plan says so."""
    p, seen = _planned((2, 2), time_limit_s=1e-3)
    searched = p.solver["searched"]
    assert seen.depths == [] and p.solver["clock_cut"] and searched["pipeline_depths"]["tried"] == [1], searched
    assert any(cut.startswith("the pipeline search after 0 of 1 depths (") for cut in searched["clock_cut"]), searched
    assert searched["pipeline_depths"]["skipped"]["2"].startswith("out of time ("), searched
    assert "the clock cut the pipeline search after 0 of 1 depths" in p.explain()


def test_pinned_schedules_are_recorded_as_skipped():
    """A pinned schedule: the stage search is handed that one only, and the others are skipped."""
    model, inputs = small_gpt()
    request = PlanRequest(mesh_shape=(2, 2), hardware="h100", layouts=layouts.LAYOUTS, hint_fn=layouts.hints,
                          constraints=Constraints(schedule="1f1b"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found, why = pipeline.pipeline_plan(capture(model, inputs), 2, (2,), request, solver_time_s=2)
    assert found is not None, why
    schedules = found.solver["searched"]["schedules"]
    assert schedules["tried"] == ["1F1B"] and schedules["ruled_out"] == {}, schedules
    assert schedules["skipped"] == {s.display: "the pins leave it out" for s in Schedule if s.display != "1F1B"}
    assert found.pipeline.schedule == "1F1B"


def _option(schedule: Schedule, m: int, t: float, v: int = 1, why: str = "") -> PipelineOption:
    return PipelineOption(2, m, schedule, v, t, None, rejected=why)


def test_depths_merge_a_schedule_ruled_out_at_one_depth_and_fitting_at_another():
    one, interleaved = Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B
    shallow = stage_search_record([_option(one, 1, math.inf, why="1F1B needs M >= P"), _option(one, 2, math.inf,
                                   why="no cut fits in memory"), _option(interleaved, 2, 1.0, v=2)], (one, interleaved),
                                  {"GPipe": "the pins leave it out"})
    assert shallow["schedules"] == {"tried": ["1F1B", "Interleaved1F1B"], "skipped": {"GPipe": "the pins leave it out"},
                                    "ruled_out": {"1F1B": "no cut fits in memory"}}
    assert shallow["chunks_per_rank"] == {"Interleaved1F1B": [2]} and shallow["micro_batches"] == [1, 2]
    deep = stage_search_record([_option(one, 4, 2.0), _option(interleaved, 4, math.inf, v=4, why="a rank needs 9e9 bytes")],
                               (one, interleaved), {})
    both = merged([shallow, deep])
    assert both["schedules"] == {"tried": ["1F1B", "Interleaved1F1B"], "ruled_out": {},
                                 "skipped": {"GPipe": "the pins leave it out"}}, both
    assert both["chunks_per_rank"] == {"Interleaved1F1B": [2, 4]} and both["micro_batches"] == [1, 2, 4]


def test_a_manual_layout_that_wins_inside_the_pipeline_gives_its_own_axes_reason(monkeypatch):
    """Where a manual layout's pipeline beats the solver's choice inside the pipeline, the plan's
    axes reason describes the layout the stages run, not the solver's choice they do not run."""
    searched, original = [], pipeline.search

    def slower_solver_choice(num, *args, **kwargs):
        found = original(num, *args, **kwargs)
        searched.append(num)
        if len(searched) == 1 and found is not None:  # the solver's own choice is searched first
            best, result = found
            return dataclasses.replace(best, step_time=best.step_time * 100), result
        return found

    monkeypatch.setattr(pipeline, "search", slower_solver_choice)
    p, _ = _planned((4, 2))
    assert p.pipeline is not None and any(r.endswith("layout's pipeline beat the solver's intra-op choice inside "
                                                     "the pipeline") for r in p.reasons), p.reasons
    axes = next(r for r in p.reasons if r.startswith("axes: "))
    roles = re.findall(r"\) as ([^,]+)", axes)
    assert len(roles) == len(p.mesh_shape) - 1, axes  # the axes inside the pipeline
    for axis, role in enumerate(roles):
        split = any(isinstance(parse_spec(spec)[axis], Shard) for spec in p.params.values())
        assert ("weights" in role) == split, (axis, role, p.params)
