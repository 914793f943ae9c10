"""autopar.dry_run: a plan's training step on every distinct rank of its full mesh, in this
process, on torch's fake process group and fake tensors (a meta-device model, nothing
allocated), with peak memory per rank from torch's MemTracker."""

from contextlib import redirect_stdout
import copy
from io import StringIO
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import dryrun, layouts
from autopar.dryrun import tracker
from autopar.cli import main
from autopar.dryrun import DryRunError, distinct_ranks
from autopar.models import GPT, MODELS, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest

KINDS = ("parameters", "gradients", "optimizer", "activations")


def _gpt(batch: int):
    with torch.device("meta"):
        model = GPT(GPTConfig())
    return model, (torch.zeros(batch, 64, dtype=torch.long, device="meta"),)


@pytest.fixture(scope="module")
def planned():
    """GPT (2 layers, dim 64) planned by the search for 64 H100s as an (8, 8) mesh, batch 64."""
    model, inputs = _gpt(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (8, 8), inputs, hardware="h100", time_limit_s=2, pipeline=False)
    return model, inputs, plan


@pytest.fixture(scope="module")
def staged():
    """The same GPT as a 2-stage pipeline over (2, 8) (16 ranks), batch 16, as the planner's
    pipeline search makes it."""
    model, inputs = _gpt(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = PlanRequest(mesh_shape=(2, 8), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (8,), request, solver_time_s=2)
    assert plan is not None, why
    return model, inputs, plan


def test_a_plan_for_64_ranks_dry_runs_in_one_process_with_memory_by_kind(planned):
    model, inputs, plan = planned
    result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    assert [r.rank for r in result.ranks] == [0, 63] and result.world_size == 64
    assert result.ranks[1].coordinate == (7, 7)
    for r in result.ranks:
        assert r.peak > 0 and all(r.memory[k] > 0 for k in KINDS), r
        assert sum(r.memory.values()) == r.peak  # the kinds are the peak's own breakdown
    assert result.peak == max(r.peak for r in result.ranks)
    assert result.ratio == pytest.approx(sum(plan.predicted.memory.values()) / result.peak)
    assert "predicted / dry run" in result.table()
    assert not dist.is_initialized()  # the fake process group is gone again


def test_measured_state_is_the_plans_shards():
    """Data parallel keeps every parameter whole on every rank, with AdamW's two moments:
    the dry run's parameter and optimizer bytes are exactly those (the step counters aside)."""
    model, inputs = _gpt(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (8, 8), inputs, hardware="h100", layout="dp")
    result = autopar.dry_run(plan, model, inputs, raise_on_failure=True)
    params = list(model.parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    for r in result.ranks:
        assert r.memory["parameters"] == whole
        assert r.memory["optimizer"] == 2 * whole + 4 * len(params)  # exp_avg, exp_avg_sq; a float32 step each


def test_a_tampered_strategy_fails_with_an_autopar_error_naming_the_rank(planned):
    model, inputs, plan = planned
    broken = copy.deepcopy(plan)
    node = next(n for n, s in broken.strategies.items() if "S(" in s)
    broken.strategies[node] = "(S(5)S(5)) -> S(5)S(5)"  # a dim the tensor does not have
    result = autopar.dry_run(broken, model, inputs, ranks=[5])
    assert not result.ok and result.failures[0].error.startswith("autopar:")
    with pytest.raises(DryRunError, match=r"^autopar: .* fails its dry run on rank 5 \(coordinate \(0, 5\)\)"):
        result.raise_if_failed()
    assert not dist.is_initialized()


def test_more_micro_batches_than_the_batch_allows_fail_on_every_rank(staged):
    model, inputs, plan = staged
    broken = copy.deepcopy(plan)
    broken.pipeline.micro_batches = 32  # 16 sequences
    with pytest.raises(DryRunError, match=r"^autopar: .* on rank 0 .*micro-batches"):
        autopar.dry_run(broken, model, inputs, raise_on_failure=True)


def test_a_pipeline_plan_dry_runs_every_stage(staged):
    model, inputs, plan = staged
    pp = plan.pipeline
    result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    assert [r.coordinate[pp.axis] for r in result.ranks] == list(range(pp.stages))
    stages = sorted(s for r in result.ranks for s in r.stages)
    assert stages == list(range(pp.stages * pp.chunks_per_rank))
    assert all(r.peak > 0 and r.memory["activations"] > 0 for r in result.ranks)
    assert distinct_ranks(plan) == [r.rank for r in result.ranks]
    # each rank is set beside its own pipeline rank's prediction, not the fullest rank's
    assert [r.predicted for r in result.ranks] == plan.predicted.memory_by_rank
    assert result.rank_ratios == [sum(p.values()) / r.peak for r, p in zip(result.ranks, plan.predicted.memory_by_rank)]
    assert "predicted / dry run" in result.table().splitlines()[2]


def test_dry_run_refuses_to_replace_a_live_process_group(planned):
    model, inputs, plan = planned
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        with pytest.raises(ValueError, match="^autopar: dry_run starts torch's fake process group"):
            autopar.dry_run(plan, model, inputs)
        assert dist.get_world_size() == 4  # left as it was
    finally:
        dist.destroy_process_group()


def test_cli_plan_dry_run(tmp_path):
    printed = StringIO()
    with redirect_stdout(printed):
        code = main(["plan", "gpt-small", "--mesh", "2x2", "--layout", "fsdp", "--dry-run",
                     "--out", str(tmp_path), "--no-progress"])
    text = printed.getvalue()
    assert code == 0, text
    assert "dry run of the fsdp plan on mesh (2, 2) (4 ranks, 2 distinct run)" in text
    assert "rank 3 (coordinate (1, 1)): ok, peak" in text and "predicted / dry run = " in text
    ratio = float(text.split("predicted / dry run = ")[1].split()[0])
    assert math.isfinite(ratio) and ratio > 0


def test_the_trackers_peak_is_torchs_memtracker_peak(staged, monkeypatch):
    """The dry run's tracker keeps only the whole rank's peak (MemTracker's per-module
    peaks, updated after every op over every module seen, made a 70B dry run quadratic in
    its depth): the peak and its kinds are what torch's own MemTracker measures."""
    model, inputs, plan = staged
    fast = autopar.dry_run(plan, model, inputs, raise_on_failure=True)
    monkeypatch.setattr(tracker.PeakTracker, "_update_peak_stats", MemTracker._update_peak_stats)
    torchs = autopar.dry_run(plan, model, inputs, raise_on_failure=True)
    assert [(r.rank, r.peak, r.memory) for r in fast.ranks] == [(r.rank, r.peak, r.memory) for r in torchs.ranks]
    assert all(r.peak > 0 for r in fast.ranks)


def test_ranks_in_worker_processes_give_what_one_process_gives(staged):
    model, inputs, plan = staged
    forked = autopar.dry_run(plan, model, inputs, workers=2, raise_on_failure=True)
    here = autopar.dry_run(plan, model, inputs, workers=1, raise_on_failure=True)
    assert len(forked.ranks) == 2
    assert [(r.rank, r.stages, r.peak, r.memory) for r in forked.ranks] == [
        (r.rank, r.stages, r.peak, r.memory) for r in here.ranks]


def test_a_worker_that_dies_fails_its_ranks_with_an_autopar_error(staged, monkeypatch):
    model, inputs, plan = staged
    monkeypatch.setattr(dryrun, "_run_rank", lambda *args: os._exit(3))
    result = autopar.dry_run(plan, model, inputs, workers=2)
    assert not result.ok and len(result.failures) == 2
    assert all(r.error.startswith("autopar: the dry run's worker process for rank(s)") and "status 3" in r.error
               for r in result.failures)
    with pytest.raises(ValueError, match=r"^autopar: dry_run\(workers=...\) expected at least 1"):
        autopar.dry_run(plan, model, inputs, workers=0)


def test_a_plan_made_with_its_loss_searches_no_pipeline(monkeypatch):
    """Found by ``autopar bench --dry-run``: ``autopar.plan(..., loss_fn=, target=)`` on a preset
    searched pipelines over the model-and-loss graph, and its pipeline plans (wide-mlp on h100-8:
    PP2 GPipe M=128) failed every dry run ("this pipeline plan was made for the model and its loss
    together"): a pipeline trains the model alone, its loss laid out on the last stage."""
    seen = {}

    class Stop(Exception):
        pass

    def record(captured, request):
        seen["pipeline"] = request.pipeline
        raise Stop

    monkeypatch.setattr(autopar.planning, "plan_captured", record)
    model, inputs = _gpt(16)
    target = torch.zeros(16, 64, dtype=torch.long, device="meta")
    for loss_fn, searched in ((None, True), (lambda out, t: out.flatten(0, 1).float().logsumexp(-1).mean(), False)):
        with pytest.raises(Stop), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autopar.plan(model, (2, 8), inputs, hardware="h100", loss_fn=loss_fn,
                         target=target if loss_fn else None)
        assert seen.pop("pipeline") is searched


def test_a_pipeline_never_parts_tied_weights():
    """Found by ``autopar bench --dry-run``: GPT-2's auto plan on h100-8 was PP2 (interleaved,
    4 virtual stages) with the tied token embedding in stage 0 and the output head in stage 3;
    its dry run failed on rank 0 ("parameter transformer.wte.weight is used by stages [0, 3]").
    A parameter read in two layers can go to no stage cut: the pipeline search says so."""

    family = MODELS["gpt2"]
    with torch.device("meta"):
        model = family.build("bench-cpu")
        (ids,), _ = family.inputs("bench-cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, (ids,))
        request = PlanRequest(mesh_shape=(2, 2), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(captured, 2, (2,), request, solver_time_s=2)
    assert plan is None and "transformer.wte.weight is read in layers 0 and 1 (tied)" in why, why


class _CountsExperts(torch.nn.Module):
    """Routes each row to its top expert and counts rows per expert with ``histc`` of integers,
    as Hugging Face's grouped-matmul Mixtral does on CUDA (and, captured on the meta device, here)."""

    def __init__(self, dim: int = 8, experts: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        counts = torch.histc(logits.argmax(-1).int(), bins=self.experts, min=0, max=self.experts - 1)
        return logits * counts.to(logits.dtype)


def test_integer_histc_dry_runs_as_on_the_device():
    """Found by ``autopar bench --dry-run``: the MoE auto plan on h100-8 failed on rank 0 with
    ``"histogram_cpu" not implemented for 'torch.int32'``: captured on the meta device, Mixtral
    takes CUDA's integer ``histc``, which the CPU fake tensors refused."""
    with torch.device("meta"):
        model = _CountsExperts()
    inputs = (torch.zeros(16, 8, device="meta"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2,), inputs, hardware="h100", layout="dp")
    result = autopar.dry_run(plan, model, inputs, workers=1)
    assert result.ok, result.table()


def test_autopars_warnings_reach_each_ranks_result(staged, monkeypatch):
    """A rank's runtime warns where it holds more than the plan says (a parameter's optimizer
    state kept whole, ``autopar.runtime.pipeline``); the dry run keeps autopar's warnings in
    the rank's result and its table, each once, and drops others."""
    model, inputs, plan = staged
    made = dryrun.create_optimizer_state

    def warning(optimizer):
        for _ in range(2):
            warnings.warn("autopar: the optimizer state of w is kept whole", stacklevel=2)
        warnings.warn("some library's warning", stacklevel=2)
        made(optimizer)

    monkeypatch.setattr(dryrun, "create_optimizer_state", warning)
    result = autopar.dry_run(plan, model, inputs, workers=1, raise_on_failure=True)
    assert all(r.warnings == ["autopar: the optimizer state of w is kept whole"] for r in result.ranks)
    assert "    warning: autopar: the optimizer state of w is kept whole" in result.table()
