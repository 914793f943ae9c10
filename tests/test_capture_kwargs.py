"""Keyword example inputs (Hugging Face ``input_ids=``, ``labels=``): captured as inputs of
their own, found by name whatever order a call gives them in."""

import warnings

import pytest
import torch

from autopar.passes.capture import capture
from autopar.runtime.variants import settings_key, settings_of
from tests.models import gpt2


def test_keyword_inputs_by_name_and_labels_given_as_the_input_ids():
    model, (tokens,) = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # labels=input_ids, one tensor twice, as Hugging Face examples write it: two inputs all the same
        cap = capture(model, (), {"input_ids": tokens, "labels": tokens})
    assert cap.user_inputs == ["input_ids", "labels"] and cap.keyword_names() == ["input_ids", "labels"]
    labels = tokens.clone()
    labels[0, :3] = -100  # ignored positions: not a valid token id, so labels must not feed the embedding
    out = cap.run(model, (), {"labels": labels, "input_ids": tokens})
    expected = model(input_ids=tokens, labels=labels, use_cache=False).loss
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="^autopar: expected the keyword inputs"):
        cap.flatten_inputs((), {"input_ids": tokens})


def test_a_bool_keyword_input_is_a_setting_captured_with_its_value():
    """CLIP's ``return_loss=True``: export keeps it as an input but bakes its value into the
    graph; ``settings_of`` names it, with that value, so the runtime captures again for another."""

    class Switched(torch.nn.Module):
        def forward(self, x, double=False):
            return x * 2 if double else x

    x = torch.ones(2, 3)
    cap = capture(Switched(), (), {"x": x, "double": True})
    assert cap.user_inputs == ["x", "double"] and settings_of(cap) == {"double": True}
    assert settings_key(settings_of(cap)) != settings_key({"double": 1})  # True == 1, yet another program
    torch.testing.assert_close(cap.run(Switched(), (), {"x": x, "double": True}), x * 2)
