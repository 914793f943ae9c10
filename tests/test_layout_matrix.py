"""Every layout on every model trains like one process (issue #18): a listed subset of the
model x layout matrix in one 4-rank gloo launch (a 2x2 mesh, 3 AdamW steps; every model
twice, every layout at least once). The whole matrix is ``python -m benchmarks.layout_matrix``."""

from __future__ import annotations

from tests.distributed.layout_matrix_check import LAYOUTS
from tests.layout_models import LAYOUT_MODELS
from tests.test_train_distributed import launch

SUBSET = {
    "resnet": ("dp", "tp+dp"),
    "convnext": ("tp", "fsdp"),
    "clip": ("zero2", "fsdp+tp"),  # return_loss=True, a bool keyword input: a setting of the program
    "mixtral": ("tp+dp", "zero1"),
    "vit": ("tp+sp", "auto"),
    # Their labels are shifted into decoder inputs by in-place writes (``shift_tokens_right``:
    # ``new_zeros``, then ``copy_`` into a slice of it), which the planner keeps where the
    # written value lies (``StrategyGraph.in_place``); BART's tp also runs its shared
    # vocabulary-parallel embedding with a padding row.
    "whisper": ("auto", "dp"),
    "bart": ("tp", "auto"),
}
# Mixture-of-experts layouts (issue #18, item 2), in the same launch: experts split by expert
# over the tp axis, each layer's experts op (autopar.passes.capture_moe) on this rank's experts
# only; ep's axis splits the batch too, so tokens travel to their experts all-to-all, tp+ep's
# keeps it whole for Megatron's attention (allgather dispatch); tests/test_layouts_apply.py: which
MOE = {"mixtral:ep": "all-to-all", "mixtral:tp+ep": "allgather"}
# (loss, parameters) after 3 steps. float64 models: rounding only. Hugging Face's losses
# (labels=) run cross-entropy on logits.float(): float32 loss values. Mixtral runs in float32
# (its grouped matmul takes no float64), which AdamW's division by small second moments
# amplifies in the parameters.
TOLERANCE = {"mixtral": (1e-5, 1e-3)}
FLOAT64 = (1e-5, 1e-9)


def test_the_subset_covers_every_model_twice_and_every_layout():
    cases = [f"{m}:{lay}" for m, lays in SUBSET.items() for lay in lays]
    assert {c.split(":")[0] for c in cases} == set(LAYOUT_MODELS)
    assert len(cases) == 2 * len(LAYOUT_MODELS) == len(set(cases))
    assert {lay for v in SUBSET.values() for lay in v} == set(LAYOUTS)


def test_the_subset_trains_like_one_process():
    cases = [f"{model}:{layout}" for model, layouts in SUBSET.items() for layout in layouts]
    results = launch(4, cases + list(MOE), module="tests.distributed.layout_matrix_check")
    failed = {case: r["error"] for case, r in results.items() if "error" in r}
    assert not failed, failed
    for case, r in results.items():
        loss_tol, param_tol = TOLERANCE.get(case.split(":")[0], FLOAT64)
        assert r["loss_err"] < loss_tol and r["param_err"] < param_tol, (case, r)
    # Megatron keeps the router whole, so both MoE layers are laid out alike: no tie split
    # (tests/test_layouts_apply.py splits one on a model whose layers Megatron lays out apart)
    assert not results["mixtral:tp+dp"]["reasons"], results["mixtral:tp+dp"]["reasons"]
    for case, dispatch in MOE.items():  # both layers' experts, the weights used where they lie
        assert results[case]["expert_parallel"] == 2, (case, results[case])
        assert f"2 expert layers: {dispatch} dispatch over tp" in results[case]["dispatch"], (case, results[case])
