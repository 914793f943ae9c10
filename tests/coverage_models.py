"""Small random-config Hugging Face models with vision and encoder-decoder ops, for
the rule coverage tests: ResNet (conv2d, batch_norm, max_pool2d), ConvNeXt (depthwise
conv2d, layer norm over channels), CLIP (vision and text towers), Whisper (conv1d
front, encoder-decoder), BART (encoder-decoder) and Mixtral: the registry's families
(``autopar.models.MODELS``) at their "tiny" sizes, and Mixtral at a test-only config
given its labels. No downloads. Each factory returns (model, example_inputs,
example_kwargs), its inputs drawn from one generator seeded 0."""

from __future__ import annotations

import functools
import warnings

import torch

from autopar.models import MODELS as REGISTRY
from autopar.passes.capture import capture
from tests.models import _seeded

TINY_MIXTRAL = dict(
    num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=96, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
)


def _tiny(family: str):
    entry = REGISTRY[family]
    args, kwargs = entry.inputs("tiny", generator=torch.Generator().manual_seed(0))
    return _seeded(lambda: entry.build("tiny")), args, kwargs


def mixtral():
    """Mixtral given its labels (its output carries the loss): token ids and labels as keywords."""
    entry, gen = REGISTRY["mixtral"], torch.Generator().manual_seed(0)
    (ids,), _ = entry.inputs(TINY_MIXTRAL, 2, 8, generator=gen)
    (labels,), _ = entry.inputs(TINY_MIXTRAL, 2, 8, generator=gen)
    return _seeded(lambda: entry.build(TINY_MIXTRAL)), (), {"input_ids": ids, "labels": labels}


COVERAGE_MODELS = {
    **{name: functools.partial(_tiny, name) for name in ("resnet", "convnext", "clip", "whisper", "bart")},
    "mixtral": mixtral,
}


@functools.cache
def captured(name: str):
    """(model, args, kwargs, Captured) of one model, captured once per test session (train mode)."""
    model, args, kwargs = COVERAGE_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, args, kwargs, capture(model, args, kwargs)
