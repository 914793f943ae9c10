"""A plan that recomputes layers under a mixed-precision policy: the policy is applied before
recomputation splits the graph, so ZeRO-3 weights of a recomputed layer are gathered in
``param_dtype`` and their gradients reduced in ``reduce_dtype`` (``MixedGather``), as the
other layers' are, and no cast copy of a shard is kept outside the checkpoint. Fake backend,
one rank of four: seconds."""

import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar import dryrun
from autopar.models import MODELS
from autopar.passes.lowering.buckets import GatherBucket


@pytest.mark.parametrize("recompute", [[], ["layer 1"]])
def test_zero3_buckets_of_a_recomputed_layer_follow_the_policy(recompute, monkeypatch):
    with torch.device("meta"):
        model = MODELS["llama"].build(dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                           num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                                           use_cache=False), 64)
    inputs = (torch.zeros(8, 64, dtype=torch.long, device="meta"),)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (4,), inputs, hardware="h100", layout="fsdp", mp_policy=policy, pipeline=False)
        plan.recompute = recompute
        buckets = []

        class Recorded(dryrun.ParallelModule):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                buckets.extend(type(m).__name__ for m in self.gm.modules() if isinstance(m, GatherBucket))

        monkeypatch.setattr(dryrun, "ParallelModule", Recorded)
        result = autopar.dry_run(plan, model, inputs, ranks=[0], workers=1)
    assert result.ok, result.table()
    assert buckets and set(buckets) == {"MixedGather"}, buckets
