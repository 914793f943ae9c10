"""Plans exported as plain PyTorch (``Plan.export``, ``autopar export``: ``autopar.passes.export``).

One torchrun of 4 gloo ranks (``tests/distributed/export_check.py``) trains the written modules of
dp, fsdp, tp+dp, tp+sp, fsdp+tp, a 2-stage 1F1B pipeline and the auto plan, on Hugging Face GPT-2
and Llama (and Llama's tp+dp with sequence-parallel norms, two with layer 0 recomputed), with a plain loop (AdamW, the models' cross-entropy on
their logits), beside the same model trained in one process. Bound: 1e-9 on losses and on every
parameter after 4 steps. The models run in float64 (Llama's RMSNorm in float32); tensor
parallelism and DTensor's reductions sum in other orders than one process, so the two differ by
float64 rounding (3e-13 at most, measured), which gloo reproduces run to run.

The single-process tests check the written text: it imports no autopar, compiles, names the
layout's styles; and a plan choice torch cannot express is reported, in the file and the result.
"""

from __future__ import annotations

import warnings

import pytest

import autopar
from autopar.cli import main as cli_main
from autopar.passes.capture import capture
from autopar.passes.plan import Pipeline, Plan
from tests.distributed.export_check import imported_modules
from tests.models import gpt2, llama
from tests.test_train_distributed import launch

CASES = ["gpt2:dp", "gpt2:fsdp", "gpt2:tp+dp", "gpt2:tp+sp", "gpt2:fsdp+tp", "gpt2:pp", "gpt2:auto",
         "llama:dp", "llama:fsdp", "llama:tp+dp", "llama:tp+sp", "llama:fsdp+tp", "llama:pp", "llama:auto",
         "llama:sp", "gpt2:fsdp:recompute", "llama:pp:recompute"]
BOUND = 1e-9
# what each layout's written module must call (a style missing means the layout was not expressed)
STYLES = {"dp": {"DistributedDataParallel("}, "fsdp": {"fully_shard("}, "pp": {"PipelineStage(", "fully_shard("},
          "tp+dp": {"ColwiseParallel(", "RowwiseParallel(", "fully_shard("}, "fsdp+tp": {"ColwiseParallel(",
          "RowwiseParallel(", "fully_shard("}}
STYLES["tp+sp"] = STYLES["tp+dp"]
STYLES["sp"] = STYLES["tp+dp"] | {"SequenceParallel(", "PrepareModuleOutput("}


def test_exported_modules_train_like_one_process():
    results = launch(4, CASES, module="tests.distributed.export_check")
    for case, r in results.items():
        assert "error" not in r, f"{case}: {r['error']}"
        assert not any(m.split(".")[0] == "autopar" for m in r["imports"]), f"{case} imports {r['imports']}"
        assert r["loss_err"] <= BOUND, f"{case}: losses differ by {r['loss_err']:.3g}: {r['losses']}"
        assert r["param_err"] <= BOUND, f"{case}: parameters differ by {r['param_err']:.3g}"
        family, layout, *options = case.split(":")
        assert r["compared"] >= (58 if family == "gpt2" else 42), f"{case}: only {r['compared']} parameters compared"
        assert STYLES.get(layout, set()) <= set(r["styles"]), f"{case}: {r['styles']}"
        if options:
            assert "checkpoint_wrapper(" in r["styles"], r["styles"]
        if "tp" in layout:  # Megatron's head: logits split by vocabulary, the loss under loss_parallel
            assert r["loss_parallel"], case
        if family == "gpt2" and "tp" in layout:  # Conv1D is no nn.Linear: said, and laid out by distribute_module
            assert "distribute_module(" in r["styles"] and any("Conv1D" in n for n in r["notes"]), r["notes"]


@pytest.fixture(scope="module")
def plans():
    """Tiny Llama and GPT-2 (``tests.models``) and their plans, made once for this module."""
    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family, factory, layouts in (("llama", llama, ("tp+dp", "fsdp", "zero1")), ("gpt2", gpt2, ("tp+dp",))):
            model, inputs = factory()
            for layout in layouts:
                made[family, layout] = (model, inputs, autopar.layouts.build(layout, model, (2, 2), inputs,
                                                                             hardware="h100"))
    return made


def test_written_module_is_torch_only_and_names_megatron_styles(plans, tmp_path):
    model, inputs, plan = plans["llama", "tp+dp"]
    exported = plan.export(model, tmp_path / "parallelize.py", example_inputs=inputs)
    source = (tmp_path / "parallelize.py").read_text()
    assert source == exported.source
    compile(source, "parallelize.py", "exec")
    imported = imported_modules(source)
    assert not any(m.split(".")[0] == "autopar" for m in imported), imported
    assert all(m.split(".")[0] in ("torch", "__future__", "copy") for m in imported), imported
    namespace: dict = {}
    exec(compile(source, "parallelize.py", "exec"), namespace)  # defines; builds nothing
    assert callable(namespace["parallelize"]) and callable(namespace["local_batch"])
    assert namespace["MESH_SHAPE"] == (2, 2) and namespace["BATCH_AXES"] == ("axis0",) and namespace["LOSS_PARALLEL"]
    # Megatron: column then row parallel linears, the embedding by vocabulary, the head's logits left split
    for name, style in (("self_attn.q_proj", "ColwiseParallel("), ("self_attn.o_proj", "RowwiseParallel("),
                        ("mlp.gate_proj", "ColwiseParallel("), ("mlp.down_proj", "RowwiseParallel("),
                        ("model.embed_tokens", "RowwiseParallel(input_layouts=Replicate())"),
                        ("lm_head", "ColwiseParallel(use_local_output=False)")):
        assert f'"{name}": {style}' in source, name
    assert 'tensor_parallel(model, mesh["axis1"])' in source
    assert 'data_parallel(model, mesh["axis0"], root)' in source


def test_zero_levels_become_fsdp_resharding(plans, tmp_path):
    model, inputs, plan = plans["llama", "fsdp"]
    source = plan.export(model, tmp_path / "fsdp.py", example_inputs=inputs).source
    assert "reshard_after_forward=True" in source and "reshard_after_forward=False" not in source  # ZeRO-3
    assert 'mesh["axis0", "axis1"]._flatten("batch")' in source  # sharded over both axes, as S(0)S(0)
    split_dim_1 = [fqn for fqn, spec in plan.params.items() if spec.startswith("S(1)")]
    assert split_dim_1 and all(f'"{fqn}": 1,' in source for fqn in split_dim_1)  # FSDP2 splits the plan's dim
    model, inputs, plan = plans["llama", "zero1"]
    exported = plan.export(model, tmp_path / "zero1.py", example_inputs=inputs)
    assert "reshard_after_forward=False" in exported.source
    assert any("ZeRO-1 in the plan" in note for note in exported.notes), exported.notes  # torch has no ZeRO-1


def test_choices_torch_cannot_express_are_reported(plans, tmp_path):
    model, inputs, plan = plans["gpt2", "tp+dp"]
    exported = plan.export(model, tmp_path / "gpt2.py", example_inputs=inputs)
    conv = [n for n in exported.notes if "Conv1D" in n]
    assert conv and all("distribute_module" in n for n in conv), exported.notes
    assert "# Not as planned: Conv1D modules" in exported.source
    # the fused q, k, v leave c_attn whole: the model's own split into q, k and v reads them whole
    c_attn = exported.source.index('distribute_as_planned(layer.get_submodule("attn.c_attn")')
    assert "leaves=Replicate())" in exported.source[c_attn:].split("\n")[1]
    assert "lm_head.weight is tied to transformer.wte.weight" in exported.source
    assert f"{len(exported.notes)} choices of the plan torch's APIs cannot express" in exported.summary()


def test_the_written_layout_is_priced_beside_the_plan(plans, tmp_path):
    """``Exported.cost``: where torch expresses a choice otherwise (ZeRO-1 as FSDP2 without
    resharding, the nearest), the written layout is priced by the same cost model, and differs;
    where it expresses every choice (DDP of a dp plan), the written module is the plan, priced the same."""
    model, inputs, plan = plans["llama", "zero1"]
    exported = plan.export(model, tmp_path / "zero1.py", example_inputs=inputs)
    cost, memory = exported.cost, sum(plan.predicted.memory.values())
    assert exported.notes and cost.step_time is not None and cost.memory is not None, cost
    assert (cost.plan_step_time, cost.plan_memory) == (plan.predicted.step_time, memory)
    assert (cost.step_time, cost.memory) != (plan.predicted.step_time, memory)
    assert cost.line() in exported.summary() and "the written module" in cost.line()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # dp as pins (every parameter whole, the inputs split by rows): every op runs on the rank's rows
        exact_plan = autopar.plan(model, (2,), inputs, hardware="h100", pipeline=False,
                                  constraints=autopar.Constraints(layout="dp"))
    exact = exact_plan.export(model, tmp_path / "dp.py", example_inputs=inputs)
    assert not exact.notes
    assert (exact.cost.step_time, exact.cost.memory) == (exact_plan.predicted.step_time,
                                                         sum(exact_plan.predicted.memory.values()))
    assert "+0% step time: torch expresses every choice" in exact.summary()


def test_a_pipeline_cut_inside_a_layer_is_said(plans, tmp_path):
    model, inputs, _ = plans["llama", "tp+dp"]
    micro = inputs[0].chunk(2)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.layouts.build("dp", model, (2,), (micro,), hardware="h100", pipeline=False)
        ops = [n.name for n in capture(model, (micro,)).nodes("call_function")]
    cut = next(i for i, name in enumerate(ops) if plan.node_keys[name].startswith("model.layers.0.mlp"))
    plan.mesh_shape, plan.axis_names = (2, 2), ("pp", "dp")
    plan.pipeline = Pipeline(axis=0, stages=2, micro_batches=2, schedule="GPipe",
                             stage_of={name: int(i >= cut) for i, name in enumerate(ops)})
    plan = Plan.from_json(plan.to_json())
    exported = plan.export(model, tmp_path / "pp.py", example_inputs=inputs)
    said = [n for n in exported.notes if n.startswith("model.layers.0:")]
    assert said and "cuts this layer between stages [0, 1]" in said[0], exported.notes
    assert "STAGE_LAYERS = ((0, 1), (1, 2))" in exported.source and "ScheduleGPipe(" in exported.source


def test_export_errors_say_what_to_do(plans, tmp_path):
    model, inputs, plan = plans["llama", "tp+dp"]
    with pytest.raises(ValueError, match="^autopar: export expected example_inputs"):
        plan.export(model, tmp_path / "x.py")
    with pytest.raises(ValueError, match="^autopar: export expected an nn.Module"):
        plan.export("no_factory_here", tmp_path / "x.py")
    serving = Plan.from_json(plan.to_json())
    serving.inference = {"batch": 1}
    with pytest.raises(ValueError, match="^autopar: export writes training layouts"):
        serving.export(model, tmp_path / "x.py", example_inputs=inputs)


def test_cli_export(plans, tmp_path, capsys):
    _, _, plan = plans["llama", "tp+dp"]
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "parallelize.py"
    toml = tmp_path / "job.toml"
    assert cli_main(["export", str(tmp_path / "plan.json"), "tests.models:llama", "--out", str(out),
                     "--torchtitan", str(toml)]) == 0
    assert "def parallelize(" in out.read_text() and f"wrote {out}" in capsys.readouterr().out
    assert "[parallelism]" in toml.read_text() and "tensor_parallel_degree = 2" in toml.read_text()
    assert cli_main(["export", str(tmp_path / "missing.json"), "tests.models:llama"]) == 2
    assert capsys.readouterr().err.startswith("autopar: expected a plan JSON file")

