"""The models every manual layout must apply to and train like one process on (issue #18):
the rule coverage models (``tests.coverage_models``: the registry's "tiny" ResNet,
ConvNeXt, CLIP, Whisper, BART, and Mixtral) and a ViT (a ``conv2d`` patch embedding and a
class token before repeated layers), each with two of every repeated layer, so that the
solver ties them and a layout may place them differently. No downloads. Each factory
returns (model, example_inputs, example_kwargs); the loss is the model's output's."""

from __future__ import annotations

import torch

from autopar.models import MODELS as REGISTRY
from tests.coverage_models import TINY_MIXTRAL
from tests.models import _seeded

LAYERS = 2


def _registry(family: str, **overrides):
    entry = REGISTRY[family]
    args, kwargs = entry.inputs("tiny", generator=torch.Generator().manual_seed(0))
    return _seeded(lambda: entry.build("tiny", **overrides)), args, kwargs


def _towers(**keywords) -> dict:
    """CLIP's tower configs with ``keywords`` changed in both."""
    tiny = REGISTRY["clip"].size("tiny").config
    return {tower: {**tiny[tower], **keywords} for tower in ("text_config", "vision_config")}


def clip():
    """The registry's CLIP as given: its contrastive loss asked for by a bool keyword input
    (``return_loss=True``), which the runtime takes as a setting of the captured program."""
    return _registry("clip", **_towers(num_hidden_layers=LAYERS))


def mixtral():
    entry, gen = REGISTRY["mixtral"], torch.Generator().manual_seed(0)
    cfg = {**TINY_MIXTRAL, "num_hidden_layers": LAYERS}
    (ids,), _ = entry.inputs(cfg, 2, 8, generator=gen)
    (labels,), _ = entry.inputs(cfg, 2, 8, generator=gen)
    return _seeded(lambda: entry.build(cfg)), (), {"input_ids": ids, "labels": labels}


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                    image_size=32, patch_size=8, num_labels=4, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(2, 3, 32, 32, generator=gen)
    return _seeded(lambda: ViTForImageClassification(cfg)), (pixels,), {
        "labels": torch.randint(0, 4, (2,), generator=gen)}


LAYOUT_MODELS = {
    "resnet": lambda: _registry("resnet", depths=[LAYERS, LAYERS]),
    "convnext": lambda: _registry("convnext", depths=[LAYERS, LAYERS]),
    "clip": clip,
    "whisper": lambda: _registry("whisper", encoder_layers=LAYERS, decoder_layers=LAYERS),
    "bart": lambda: _registry("bart", encoder_layers=LAYERS, decoder_layers=LAYERS),
    "mixtral": mixtral,
    "vit": vit,
}
