"""A forward that branches on a random draw cannot be planned: Wav2Vec2's LayerDrop
(``config.layerdrop > 0`` in training draws ``torch.rand([])`` per layer and skips the layer
in Python) is one ``autopar:`` error saying to set it to 0; with it at 0, Wav2Vec2 plans on
2x2 with a rule for every op."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.passes.capture import CaptureError, capture
from autopar.passes.strategy_graph import NoRuleWarning

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Wav2Vec2Model"):
    pytest.skip("this transformers has no Wav2Vec2", allow_module_level=True)


def wav2vec2(layerdrop: float, cls=transformers.Wav2Vec2Model, mask_time_prob: float = 0.0):
    """2 layers, hidden 32, random weights; 1,600 samples of audio (159 frames); SpecAugment
    off unless ``mask_time_prob`` (it draws its mask with numpy: tests/test_capture_host_draws.py)."""
    cfg = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, layerdrop=layerdrop, mask_time_prob=mask_time_prob)
    torch.manual_seed(0)
    return cls(cfg), (torch.randn(2, 1600, generator=torch.Generator().manual_seed(0)),)


def test_layerdrop_in_training_is_one_error_saying_to_set_it_to_zero():
    model, inputs = wav2vec2(layerdrop=0.1)
    with pytest.raises(CaptureError) as err:
        autopar.plan(model, (2, 2), inputs)
    text = str(err.value)
    assert text.startswith("autopar: could not capture Wav2Vec2Model with torch.export"), text
    assert "modeling_wav2vec2.py" in text and "skip_the_layer" in text, text  # the branch's line
    assert text.endswith("What to do: set config.layerdrop=0 (found 0.1: LayerDrop draws at random which layers "
                         "run, which a static plan cannot express)."), text


def test_another_data_dependent_branch_of_the_same_model_is_not_blamed_on_layerdrop():
    model, inputs = wav2vec2(layerdrop=0.1, cls=transformers.Wav2Vec2ForCTC)
    labels = torch.randint(1, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CaptureError) as err:  # CTC checks `labels.max() >= vocab_size` in Python first
        capture(model, inputs, {"labels": labels})
    text = str(err.value)
    assert "labels.max()" in text and "layerdrop" not in text.split("What to do:")[1], text
    assert "a random draw that decides which ops run (LayerDrop, stochastic depth) cannot be planned" in text


def test_layerdrop_outside_training_captures():
    model, inputs = wav2vec2(layerdrop=0.1)
    capture(model, inputs, train=False)  # the draw only happens in training


def test_without_layerdrop_wav2vec2_plans_with_a_rule_for_every_op():
    model, inputs = wav2vec2(layerdrop=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, (2, 2), inputs, time_limit_s=5)
    replicated = [str(w.message) for w in caught if issubclass(w.category, NoRuleWarning)]
    assert not replicated, replicated
    assert plan.predicted.step_time > 0
