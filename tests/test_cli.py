"""`autopar plan / explain / diff / bench` in-process, and the plan pictures (autopar.pictures).

Plans come from the command line on meta-device models (gpt-small on 2x2, a few seconds)
or are written by hand (pipelined plans for the schedule picture)."""

from contextlib import redirect_stdout
import inspect
from io import StringIO
import sys
import textwrap
import types

import pytest

from autopar import pictures
import autopar.bench as bench
from autopar.cli import main
from autopar.passes.plan import Pipeline, Plan, Prediction
from autopar.passes.solve.stages import pipeline_step_time

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path) -> bool:
    return path is not None and path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Saved plans of gpt-small on 2x2 (the search's, the dp and the tp layouts), and the plan output."""
    out = tmp_path_factory.mktemp("plans")
    printed = StringIO()
    with redirect_stdout(printed):
        assert main(["plan", "gpt-small", "--mesh", "2x2", "--no-pipeline", "--time-limit", "2",
                     "--out", str(out / "auto"), "--no-progress"]) == 0
        assert main(["plan", "gpt-small", "--mesh", "2x2", "--layout", "dp", "--out", str(out / "dp"),
                     "--no-progress"]) == 0
        assert main(["plan", "gpt-small", "--mesh", "2x2", "--layout", "tp", "--out", str(out / "tp"),
                     "--no-progress"]) == 0
    return out, printed.getvalue()


def test_plan_writes_plan_json_and_pictures(saved):
    out, printed = saved
    plan = Plan.load(out / "auto" / "plan.json")
    assert plan.mesh_shape == (2, 2) and plan.pipeline is None and plan.kind == "auto"
    assert plan.solver["memory_limit"] > 0  # the device memory the pictures draw
    assert "predicted step" in printed and f"plan: {out / 'auto' / 'plan.json'}" in printed
    assert "pipeline schedule: not drawn: the plan has no pipeline" in printed
    for name in ("memory.png", "weights.png"):
        assert is_png(out / "auto" / name) and f"{out / 'auto' / name}" in printed
    assert Plan.load(out / "dp" / "plan.json").kind == "dp"


def test_explain_and_diff_saved_plans(saved, tmp_path, capsys):
    out, _ = saved
    auto, dp = str(out / "auto" / "plan.json"), str(out / "dp" / "plan.json")
    assert main(["explain", auto, "--pictures", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("plan auto for GPT on mesh (2, 2)") and "why:" in text
    assert is_png(tmp_path / "memory.png") and is_png(tmp_path / "weights.png")
    assert main(["diff", dp, str(out / "tp" / "plan.json")]) == 0  # (auto may well be dp on a model this small)
    text = capsys.readouterr().out
    assert "predicted step" in text and "plans are identical" not in text
    assert main(["diff", auto, auto]) == 0
    assert capsys.readouterr().out.strip() == "plans are identical"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, code, match", [
    (["plan", "gpt-7", "--mesh", "2x2"], 2, "unknown model 'gpt-7'; expected one of gpt-small"),
    (["plan", "no_such_module_xyz:build", "--mesh", "2"], 2, "cannot import 'no_such_module_xyz'"),
    (["plan", "gpt-small", "--mesh", "2x2", "--hardware", "tpu"], 2, "--hardware: expected a preset"),
    (["explain", "no/such/plan.json"], 2, "expected a plan JSON file at no/such/plan.json, found nothing"),
    (["diff", "no/such/a.json", "no/such/b.json"], 2, "expected a plan JSON file"),
])
def test_wrong_input_is_one_line(argv, code, match, capsys):
    assert main(argv) == code
    assert match in _one_line_error(capsys)


@pytest.mark.parametrize("argv, match", [
    (["plan", "gpt-small", "--mesh", "2y2"], "expected a mesh shape like 4 or 2x2"),
    (["plan", "gpt-small"], "required: --mesh"),
    (["plan", "gpt-small", "--mesh", "2", "--batch", "0"], "expected a positive whole number"),
    (["plan", "gpt-small", "--mesh", "2", "--layout", "3d"], "invalid choice"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["diff", "a.json"], "required: B.json"),
])
def test_bad_arguments_exit_2_in_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert match in _one_line_error(capsys)


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot read a plan from"),
    ("[1, 2]", "cannot read a plan from"),
    ('{"format": 99}', "plan format 99 is not one this autopar reads (1, 2); re-plan"),
])
def test_corrupt_plan_json_is_one_line(text, match, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert main(["explain", str(path)]) == 1
    assert match in _one_line_error(capsys)


@pytest.mark.parametrize("argv", [[], ["plan"], ["explain"], ["diff"], ["bench"], ["profile"]])
def test_help_exits_0(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: autopar" in capsys.readouterr().out


FACTORIES = """
    import torch
    from autopar.models import WideMLP

    def build(batch=4, seq=8):
        return WideMLP(dim=32, hidden=64, n_layers=2), (torch.zeros(batch, seq, 32),)

    def huge():  # 17e9 float32 parameters: weights, gradients and Adam state need ~137 GB on each of 2 devices
        with torch.device("meta"):
            return WideMLP(dim=8192, hidden=32768, n_layers=32), torch.zeros(2, 8192)

    def not_a_model():
        return 42
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "cli_factories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cli_factories"
    sys.modules.pop("cli_factories", None)


def test_user_factory_gets_batch_and_seq(factories, tmp_path, capsys):
    assert main(["plan", f"{factories}:build", "--mesh", "2", "--batch", "6", "--seq", "3", "--layout", "dp",
                 "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.model == "WideMLP" and plan.kind == "dp"
    assert "weight placement:" in capsys.readouterr().out


def test_plan_for_accumulated_steps(factories, tmp_path, capsys):
    """``--accumulate K``: the plan lays out one micro-batch (1/K of the batch) and says so."""
    assert main(["plan", f"{factories}:build", "--mesh", "2", "--batch", "8", "--seq", "3", "--layout", "dp",
                 "--accumulate", "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert Plan.load(tmp_path / "out" / "plan.json").accumulate == 2
    assert "gradient accumulation: each step runs 2 micro-batches" in capsys.readouterr().out
    assert main(["plan", f"{factories}:build", "--mesh", "2", "--batch", "8", "--seq", "3", "--layout", "dp",
                 "--accumulate", "3", "--out", str(tmp_path / "odd"), "--no-progress"]) != 0
    assert "autopar: accumulate=3 cuts dim 0" in capsys.readouterr().err


@pytest.mark.parametrize("name, code, match", [
    ("not_a_model", 2, "must return (model, example_inputs) with an nn.Module model; found int"),
    ("missing", 2, "module 'cli_factories' has no 'missing'"),
    ("huge", 1, "autopar: no plan fits in"),
])
def test_user_factory_errors_are_one_line(factories, name, code, match, tmp_path, capsys):
    argv = ["plan", f"{factories}:{name}", "--mesh", "2", "--no-pipeline", "--time-limit", "2",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == code
    assert match in _one_line_error(capsys)


def test_bench_calls_autopar_bench_and_prints_the_table(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        table = tmp_path / "table.md"
        table.write_text("| model | mesh |\n| --- | --- |\n| gpt2 | gloo-4 |\n")
        return table

    try:

        signature = inspect.signature(bench.run)
        monkeypatch.setattr(bench, "run", fake_run)
    except ImportError:  # not written yet: a stand-in module with the agreed signature
        signature = None
        monkeypatch.setitem(sys.modules, "autopar.bench", types.SimpleNamespace(run=fake_run))
    assert main(["bench", "--models", "gpt2,llama", "--meshes", "gloo-4", "--out", str(tmp_path), "--quick",
                 "--no-progress"]) == 0
    assert calls == [{"models": ["gpt2", "llama"], "meshes": ["gloo-4"], "out_dir": str(tmp_path), "quick": True,
                      "progress": False, "time_limit_s": 20.0, "dry_run": False}]
    if signature is not None:
        signature.bind(**calls[0])
    printed = capsys.readouterr().out
    assert "| gpt2 | gloo-4 |" in printed and f"table: {tmp_path / 'table.md'}" in printed


# --- pictures --------------------------------------------------------------------------


def hand_plan(schedule=None, stages=2, micro_batches=4, chunks=1) -> Plan:
    """A plan written by hand: two repeated layers placed alike, one outside; optionally pipelined."""
    params = {"emb.weight": "S(0)R", "layers.0.w": "RS(1)", "layers.0.b": "RR", "layers.1.w": "RS(1)",
              "layers.1.b": "RR", "head.weight": "S(0)S(1)"}
    pipeline = None
    mesh, names = (2, 4), ("dp", "tp")
    if schedule:
        n = stages * chunks
        stage_of = {f"op{s}_{k}": s for s in range(n) for k in range(2)}
        pipeline = Pipeline(axis=0, stages=stages, micro_batches=micro_batches, schedule=schedule,
                            stage_of=stage_of, chunks_per_rank=chunks)
        mesh, names = (stages, 2, 4), ("pp", "dp", "tp")
    return Plan(model="Hand", mesh_shape=mesh, axis_names=names, strategies={}, params=params,
                zero={k: (3 if k == "head.weight" else 1) for k in params}, pipeline=pipeline,
                param_layers={"layers.0.w": 0, "layers.0.b": 0, "layers.1.w": 1, "layers.1.b": 1},
                predicted=Prediction(step_time=1.0, memory={"parameters": 20e9, "gradients": 20e9,
                                                             "optimizer": 40e9 / 3, "activations": 8e9}),
                solver={"memory_limit": 80e9})


@pytest.mark.parametrize("schedule, stages, micro_batches, chunks", [
    ("GPipe", 2, 4, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 4, 8, 2), ("ZBVZeroBubble", 2, 4, 2),
    ("DualPipeV", 2, 4, 2),
])
def test_pipeline_schedule_picture(schedule, stages, micro_batches, chunks, tmp_path):
    plan = hand_plan(schedule, stages, micro_batches, chunks)
    assert is_png(pictures.pipeline_schedule(plan, tmp_path / "pipeline.png"))
    assert pictures.pipeline_schedule(hand_plan(), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_the_schedule_picture_draws_torchs_order_of_every_action(schedule, tmp_path, monkeypatch):
    """The picture draws one box per action torch's schedule runs (a split backward as its two
    parts) from the replay of that order, which for equal stages lasts what the planner's
    formula says."""
    stages, micro_batches = 2, 4
    plan = hand_plan(schedule, stages, micro_batches, chunks=2 if schedule.startswith("Interleaved") else 1)
    drawn = []
    real = pictures.replay
    monkeypatch.setattr(pictures, "replay", lambda *a: drawn.extend(real(*a)) or drawn)
    assert is_png(pictures.pipeline_schedule(plan, tmp_path / "pipeline.png"))
    kinds = sorted({a.kind for a in drawn})
    assert kinds == (["F", "I", "W"] if schedule == "InterleavedZeroBubble" else ["B", "F"]), kinds
    v = plan.pipeline.chunks_per_rank
    assert sum(a.kind == "F" for a in drawn) == stages * v * micro_batches
    forward, backward, _ = pictures.stage_times(plan, v)
    assert max(a.end for a in drawn) == pytest.approx(
        pipeline_step_time([f + b for f, b in zip(forward, backward)], micro_batches, schedule, v))


@pytest.mark.parametrize("pipelined", [False, True])
def test_memory_and_weight_pictures(pipelined, tmp_path):
    plan = hand_plan("1F1B", 2, 4) if pipelined else hand_plan()
    assert is_png(pictures.memory_per_device(plan, tmp_path / "memory.png"))
    assert is_png(pictures.weight_placement(plan, tmp_path / "weights.png"))
    written = pictures.write_all(Plan.from_json(plan.to_json()), tmp_path / "all")  # a saved plan draws alike
    assert all(is_png(p) for p in written.values() if not isinstance(p, str))
    assert isinstance(written["pipeline schedule"], str) != pipelined


def test_identical_layers_fold_into_one_group():
    groups = pictures.placement_groups(hand_plan())
    assert [g[0] for g in groups] == ["outside repeated layers", "layers 0\u20131 (each)"]
    assert groups[1][1] == [("b", "RR", 1), ("w", "RS(1)", 1)]
    plan = hand_plan()
    plan.params["layers.1.w"] = "S(0)S(1)"
    assert [g[0] for g in pictures.placement_groups(plan)][1:] == ["layer 0", "layer 1"]

