"""Mixed precision (``autopar.compile(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32, output_dtype=fp32))``) on gloo, every layout (pipelines too), against one
process applying the same policy and (``fsdp2:``) against FSDP2 ``fully_shard``.

Tolerances. bf16 keeps 8 significant bits (unit roundoff 2^-9): a layout that splits a
reduction (a tensor-parallel matmul's partial sums all-reduced in bf16, a weight gradient
summed per rank then across ranks) rounds at other places than one process does. Measured
here: losses within 7.5e-4 of the reference (of ~4.3) over 3 AdamW steps, and the
parameter updates within 8% (relative L2 norm of the difference) — the same size as the
gap between the bf16 reference and plain float32 training (7%): at this scale bf16 noise
and order noise are alike, so the checks that tell bf16 compute from float32 are exact
ones: a layout that splits no reduction (dp, zero3 = FSDP2's layout) computes the first
forward bit-for-bit as the reference (float32 differs by 1e-2 in the logits) and trains
bit-for-bit as FSDP2 with the same policy; and the collectives run in the policy's dtypes.
Asserted: losses within 2e-3, updates within 15%; dp/zero3 exact as stated.
Pipelines (``pp:``): a 2-stage GPipe and 2 stages x 2-way data parallel 1F1B, against the
same one-process reference; and 2 stages x 2-way ZeRO-2 with gradients reduced in bf16
(``reduce_dtype``): the once-per-step reduce-scatter into the slices runs in it (3 s wall). ``replay:``: a plan made under the policy, compiled from its JSON
without ``mp_policy``, runs under the policy it records.
The checks of each result: ``tests.distributed.mp_check.check_precision`` (shared with the
8-rank cases batched into tests/test_train_distributed.py's launch as ``mp:<case>``).
Cost: two launches, 2 ranks (9 cases) and 4 ranks (8 cases): 120 CPU-seconds before the
pipeline and replay cases (about 60-70 s wall on an idle 2-core machine; measured 6.6 min
wall under a load average of ~18); those three add about 15 CPU-seconds (pp:2x2 ran 12 s wall
under a load average of ~17).
"""

import pytest

from tests.distributed.mp_check import check_precision
from tests.test_train_distributed import launch

LAUNCHES = {
    2: ["fsdp2:2:gpt:dp", "2:gpt:zero1", "2:gpt:zero2", "2:gpt:fsdp", "2:gpt:tp", "2:mlp:dp", "pp:2:gpt:GPipe:2:1",
        "replay:2:gpt:dp", "errors"],
    4: ["recompute:2x2:gpt:tp+dp", "2x2:gpt:tp+sp", "2x2:gpt:fsdp+tp", "2x2:gpt:auto", "fsdp2:4:gpt:zero3",
        "bf16-reduce:4:gpt:zero3", "accum:4:gpt:zero3", "pp:2x2:gpt:1F1B:2:1", "pp:2x2:gpt:1F1B:2:1:zero2:bfloat16"],
}


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_mixed_precision_matches_one_process(nproc):
    results = launch(nproc, LAUNCHES[nproc], module="tests.distributed.mp_check")
    for case, r in results.items():
        assert "error" not in r, f"{case}: {r['error']}"
        if case == "errors":
            for what, message in r["messages"].items():
                assert message.startswith("autopar:"), f"{what}: {message}"
            continue
        check_precision(case, r)
