"""``autopar.bench``: the quick run end to end (one 4-rank gloo launch, tens of seconds),
and the names it accepts."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import bench, costmodels
from autopar.bench import report
from autopar.bench.report import COLUMNS, SUMMARY_COLUMNS
from autopar.bench.run import dry_run_row
from autopar.bench.workloads import Workload, build, lm_loss
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.runtime.loss import WithLoss


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return bench.run(quick=True, out_dir=str(out), progress=False), out


def _header(lines: list[str], first: str) -> list[str]:
    line = next(line for line in lines if line.startswith(f"| {first} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_quick_run_writes_table_results_and_charts(quick_run):
    table, out = quick_run
    assert table == out / "table.md" and table.is_file()
    lines = table.read_text().splitlines()
    assert _header(lines, "model") == list(SUMMARY_COLUMNS)
    assert list(COLUMNS) in [_header([line], "model") for line in lines if line.startswith("| model |")]
    for name in ("step_gloo-4.png", "memory_gloo-4.png", "step_h100-8.png", "predicted_vs_measured.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["mesh"] for r in rows} == {"gloo-4", "h100-8"}


def test_quick_run_auto_is_never_predicted_slower_than_a_manual_layout(quick_run):
    _, out = quick_run
    rows = json.loads((out / "results.json").read_text())["rows"]
    for mesh in ("gloo-4", "h100-8"):
        auto = next(r for r in rows if r["mesh"] == mesh and r["layout"] == "auto")
        assert auto["vs_best_manual_predicted"] <= 1.0 + 1e-9, auto
    table = (out / "table.md").read_text().splitlines()
    summary = [dict(zip(SUMMARY_COLUMNS, (c.strip() for c in line.strip("|").split("|"))))
               for line in table if line.startswith("| wide-mlp |")][:2]
    assert [float(s["auto ÷ best manual (pred)"]) <= 1.0 for s in summary] == [True, True]


def test_quick_run_measures_every_gloo_plan(quick_run):
    _, out = quick_run
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"] if r["mesh"] == "gloo-4"]
    assert {r["layout"] for r in rows} == {"auto", *bench.QUICK_LAYOUTS}
    for r in rows:  # a failure would be a row with its reason: here every plan must run
        assert r["status"] == "measured", r
        assert r["measured_step"] > 0 and r["measured_memory_total"] > 0
        assert r["measured_memory"]["parameters"] > 0 and r["measured_memory"]["activations"] > 0
        assert r["reshards"] >= 0
    losses = [r["first_loss"] for r in rows]  # same weights, same batch: the same first loss
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])


def test_names_are_checked():
    assert set(bench.MODELS) == {"gpt2", "llama", "moe", "big-vocab", "wide-mlp"}
    assert {"gloo-4", "gloo-8", "h100-8", "h100-64", "h100-512"} <= set(bench.MESHES)
    with pytest.raises(ValueError, match="autopar: unknown benchmark model 'bert'.*gpt2, llama"):
        bench.run(["bert"], ["gloo-4"])
    with pytest.raises(ValueError, match="autopar: unknown benchmark mesh 'tpu-8'.*gloo-4"):
        bench.run(["gpt2"], ["tpu-8"])


def test_layout_plans_share_costs_and_match_autopar_plan():
    """bench.layout_plans costs every layout on one cost table: the same plans as
    autopar.plan(..., layout=name), which builds them one at a time."""


    work = build("wide-mlp", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(WithLoss(work.model, work.loss_fn), (*work.inputs, work.target))
    profile = costmodels.preset("h100", (2, 2), ("dp", "tp"))
    shared = bench.layout_plans(captured, profile, ("dp", "fsdp", "tp+dp"), ("dp", "tp"))
    for name, (plan, seconds, error) in shared.items():
        alone = autopar.plan(work.model, (2, 2), work.inputs, hardware="h100", loss_fn=work.loss_fn,
                             target=work.target, layout=name, axis_names=("dp", "tp"))
        assert error is None and seconds >= 0
        assert plan.strategies == alone.strategies and plan.zero == alone.zero
        assert plan.predicted.step_time == pytest.approx(alone.predicted.step_time, rel=1e-9)
        assert plan.predicted.memory == pytest.approx(alone.predicted.memory, rel=1e-9)


@pytest.fixture(scope="module")
def tiny_h100():
    """A 2-layer GPT (dim 64) as a bench workload on the meta device, and its TP+DP plan for
    an h100-8 mesh (2x4), planned alone as the bench plans preset meshes (a layout: quicker
    to plan than the search, and dry-run alike)."""



    with torch.device("meta"):
        model = GPT(GPTConfig())
    ids = torch.zeros(16, 64, dtype=torch.long, device="meta")
    work = Workload(model, (ids,), torch.zeros(16, 64, dtype=torch.long, device="meta"), lm_loss, "tiny GPT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2, 4), work.inputs, hardware="h100", layout="tp+dp", axis_names=("dp", "tp"))
    return work, plan


def test_dry_run_row_gives_the_verdict_peak_ratio_and_seconds(tiny_h100):
    work, plan = tiny_h100
    row = dry_run_row(plan, work, 80e9)
    assert row["status"] == "ok" and not row["over_memory"], row
    assert row["peak"] > 0 and row["seconds"] > 0 and row["ranks"] == 2  # the first rank and the last
    assert row["ratio"] == pytest.approx(sum(plan.predicted.memory.values()) / row["peak"])
    assert row["rank_ratios"][0] <= row["rank_ratios"][1] and min(row["rank_ratios"]) <= row["ratio"]
    assert row["plan"].startswith("mesh 2x4, ZeRO ")


def test_a_failing_dry_run_is_a_row_with_its_autopar_message(tiny_h100, tmp_path):

    work, plan = tiny_h100
    broken = copy.deepcopy(plan)
    node = next(n for n, s in broken.strategies.items() if "S(" in s)
    broken.strategies[node] = "(S(5)S(5)) -> S(5)S(5)"  # a dim the tensor does not have
    row = dry_run_row(broken, work, 80e9)
    assert row["status"] == "failed" and "autopar:" in row["error"], row
    assert row["error"].startswith("rank 0 (coordinate (0, 0)): autopar:")
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:  # autopar.dry_run raises here (it starts its own process group): still a row
        refused = dry_run_row(plan, work, 80e9)
    finally:
        dist.destroy_process_group()
    assert refused["status"] == "failed" and refused["error"].startswith("autopar: dry_run starts"), refused
    over = {"status": "ok", "peak": 77 * 2**30, "ratio": 0.76, "seconds": 1.0, "plan": "mesh 2x4, ZeRO 0",
            "over_memory": True, "memory_limit": 80e9, "rank_ratios": [0.76, 0.9]}  # a plan whose peak the device cannot hold
    rows = [{"mesh": "h100-8", "model": "gpt", "layout": "auto", "label": "tiny GPT", "dry_run": row},
            {"mesh": "h100-8", "model": "big", "layout": "auto", "label": "big GPT", "dry_run": over}]
    text = report.markdown(rows, {"date": "today", "seconds": 1.0, "meshes": ["h100-8"], "time_limit_s": 2.0,
                                  "steps": 3, "warmup": 0, "quick": False, "load": "0", "dry_run": True,
                                  "models": ["gpt"], "mesh_shapes": {"h100-8": (2, 4)}}, [])
    dry = [line for line in text.splitlines() if line.startswith("| h100-8 | gpt |")]
    assert dry and "**failed**: rank 0 (coordinate (0, 0)): autopar:" in dry[0]
    assert "| ok, **peak over the device's 74.5 GiB** | 77 GiB | 0.76 (per rank 0.76–0.90) |" in text
    assert _header(text.splitlines(), "mesh") == list(report.DRY_RUN_COLUMNS)
