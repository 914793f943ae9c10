"""Small random-config Hugging Face models with vision and encoder-decoder ops, for
the rule coverage tests: ResNet (conv2d, batch_norm, max_pool2d), ConvNeXt (depthwise
conv2d, layer norm over channels), CLIP (vision and text towers), Whisper (conv1d
front, encoder-decoder), BART (encoder-decoder) and Mixtral. No downloads. Each
factory returns (model, example_inputs, example_kwargs)."""

from __future__ import annotations

import functools
import warnings

import torch

from tests.models import _seeded

BATCH = 2
VOCAB = 96
# Dropout draws differ per device: simulations compare with one process only without it.
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def _ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0))


def _pixels(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck",
        num_labels=4,
    )
    return _seeded(lambda: ResNetForImageClassification(cfg)), (_pixels(BATCH, 3, 32, 32),), {
        "labels": _ints(4, BATCH)
    }


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=4, image_size=32)
    return _seeded(lambda: ConvNextForImageClassification(cfg)), (_pixels(BATCH, 3, 32, 32),), {
        "labels": _ints(4, BATCH)
    }


def clip():
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8,
    )
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return _seeded(lambda: CLIPModel(cfg)), (), {
        "input_ids": _ints(VOCAB, BATCH, 8),
        "pixel_values": _pixels(BATCH, 3, 32, 32),
        "return_loss": True,
    }


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, d_model=32, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **NO_DROPOUT,
    )
    return _seeded(lambda: WhisperForConditionalGeneration(cfg)), (), {
        "input_features": _pixels(BATCH, 16, 32),
        "labels": _ints(VOCAB, BATCH, 8),
    }


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, **NO_DROPOUT,
    )
    return _seeded(lambda: BartForConditionalGeneration(cfg)), (), {
        "input_ids": _ints(VOCAB, BATCH, 8),
        "labels": _ints(VOCAB, BATCH, 8),
    }


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=16,
    )
    return _seeded(lambda: MixtralForCausalLM(cfg)), (), {
        "input_ids": _ints(VOCAB, BATCH, 8),
        "labels": _ints(VOCAB, BATCH, 8),
    }


COVERAGE_MODELS = {
    "resnet": resnet,
    "convnext": convnext,
    "clip": clip,
    "whisper": whisper,
    "bart": bart,
    "mixtral": mixtral,
}


@functools.cache
def captured(name: str):
    """(model, args, kwargs, Captured) of one model, captured once per test session (train mode)."""
    from autopar.passes.capture import capture

    model, args, kwargs = COVERAGE_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, args, kwargs, capture(model, args, kwargs)
