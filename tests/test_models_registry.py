"""The model registry (``autopar.models.MODELS``): the names the CLI and the benchmark give
resolve to its sizes, its small sizes train a step on their own example inputs, and the
sizes it documents have the shapes it says. About 20 s of CPU time (meta-device builds and
a few small float32 models at batch 2)."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar.bench import workloads
from autopar.cli import BUILTINS
from autopar.models import GPTConfig, MODELS, megatron_gpt

SMALL = [("gpt", "small"), ("gpt", "demo"), ("wide-mlp", "bench-cpu"), ("gpt2", "bench-cpu"),
         ("llama", "bench-cpu"), ("mixtral", "bench-cpu"), ("resnet", "tiny"), ("convnext", "tiny"),
         ("clip", "tiny"), ("whisper", "tiny"), ("bart", "tiny")]


def test_cli_and_benchmark_names_are_registry_sizes():
    for family, size in BUILTINS.values():
        assert MODELS[family].size(size).batch > 0
    for name, bench in workloads.MODELS.items():
        for scale in ("cpu", 8, 64, 512):
            assert MODELS[bench.family].size(f"{bench.prefix}-{scale}").batch > 0, (name, scale)


@pytest.mark.parametrize("family,size", SMALL)
def test_small_sizes_run_a_backward_on_their_example_inputs(family, size):
    torch.manual_seed(0)
    model = MODELS[family].build(size)
    args, kwargs = MODELS[family].inputs(size, batch=2, generator=torch.Generator().manual_seed(0))
    out = model(*args, **kwargs)
    loss = getattr(out, "loss", None)
    if loss is None:  # the first floating output's mean square stands for a loss
        loss = next(t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()).square().mean()
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters())


def test_inputs_have_the_shapes_the_size_names():
    tokens, = MODELS["llama"].inputs("bench-cpu", generator=torch.Generator().manual_seed(0))[0]
    assert tokens.shape == (16, 64) and tokens.dtype == torch.long and int(tokens.max()) < 2048
    features, = MODELS["wide-mlp"].inputs("bench-cpu")[0]
    assert features.shape == (32, 256) and not features.any()  # no generator: zeros
    features, = MODELS["wide-mlp"].inputs("plan", batch=2)[0]
    assert features.shape == (2, 256, 4096)
    with pytest.raises(ValueError, match="^autopar: example inputs of .* need batch="):
        MODELS["gpt"].inputs({"dim": 32})


def test_position_tables_grow_to_the_sequence_but_not_below_the_size():
    with torch.device("meta"):
        assert MODELS["gpt"].build("small", seq=128).cfg.max_seq_len == 128
        assert MODELS["gpt"].build("small", seq=16).cfg.max_seq_len == GPTConfig.max_seq_len
        assert MODELS["llama"].build("bench-8", seq=8192).config.max_position_embeddings == 8192


def test_documented_sizes_have_their_parameter_counts():
    with torch.device("meta"):
        models = [megatron_gpt(size) for size in ("7.1b", "177b", "462b")]
    assert [round(sum(p.numel() for p in m.parameters()) / 1e9, 1) for m in models] == [7.1, 177.2, 461.5]
    assert all(p.dtype == torch.bfloat16 for m in models for p in m.parameters())
    with pytest.raises(ValueError, match="^autopar: no size 'huge' of"):
        MODELS["llama"].build("huge")

