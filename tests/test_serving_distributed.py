"""Serving on real processes: a plan's greedy generation equals Hugging Face's ``generate``
in one process, token for token (float64; Mixtral float32), with left-padded prompts, a
batch smaller than planned and a batch of one, an eos token; its logits equal the model's;
sampling with a seed picks the same tokens on every rank, each rank seeded its own way.

Layouts: dp, tp (4-way on a model with 2 key-value heads: the cache replicated where the
heads do not divide), tp+dp, pipelines of 2 and 4 stages (``pp``: each stage its layers'
weights and cache; GPT-2's tied embedding and head held by the first and last stage),
tp inside a pipeline (``pp+tp``), pipelines keeping several micro-batches in flight (one
per stage: ``<layout>:<micro-batches>``, each stage the cache of every micro-batch) and the
planner's own choice (``auto``), on 2 and 4 gloo
ranks, for GPT-2, Llama (grouped-query attention) and Mixtral
(``tests/distributed/serve_check.py``). ``errors``: bad input is one ``autopar:`` error each.
"""

import pytest

from tests.test_train_distributed import launch

LAUNCHES = {
    2: ["2:llama:tp", "2:gpt2:dp", "2:mixtral:tp", "2x1:gpt2:pp", "2x1:llama:pp:2", "2:llama:auto"],
    4: ["2x2:llama:tp+dp", "4:gpt2:tp", "4:llama:tp", "2x2:mixtral:tp+dp", "2x2:llama:pp+tp", "4x1:llama4:pp", "4x1:llama4:pp:4",
        "2x2:mixtral:pp", "2x2:gpt2:auto", "errors"],
}
# Mixtral runs in float32. Llama's RMSNorm computes in float32 inside the float64 model; under
# tensor parallelism its input is summed across ranks in float64 before that cast (a pending sum
# passes no narrowing cast), as one process computes it. The float64 models to rounding.
LOGITS_TOLERANCE = {"mixtral": 1e-5}


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_generation_matches_one_process(nproc):
    results = launch(nproc, LAUNCHES[nproc], module="tests.distributed.serve_check")
    for case, r in results.items():
        assert "error" not in r, f"{case}: {r['error']}"
        if case == "errors":
            for what, message in r["messages"].items():
                assert message.startswith("autopar:"), f"{what}: {message}"
            continue
        _, model, layout, *micro = case.split(":")
        assert not r["mismatched"], f"{case}: tokens differ from model.generate: {r['mismatched']}"
        assert r["logits_err"] <= LOGITS_TOLERANCE.get(model, 1e-9), f"{case}: logits differ by {r['logits_err']}"
        assert r["sampled_alike"] and r["resampled_alike"], f"{case}: sampling with a seed differs across ranks or calls"
        if layout != "auto":
            assert r["kind"] == layout, f"{case}: planned {r['kind']}"
        assert r["micro_batches"] == int(micro[0]) if micro else 1, f"{case}: {r['micro_batches']} micro-batches"
