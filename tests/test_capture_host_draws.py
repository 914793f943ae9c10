"""A model that draws random numbers on the host (``numpy.random``, Python's ``random``)
while it is traced would have each draw baked into the program as a constant, every step
reusing the same values: capture refuses it with one ``autopar:`` error naming the draw and
its line. Wav2Vec2's SpecAugment (``mask_time_prob > 0`` in training) is such a model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from autopar.passes.capture import CaptureError, capture


class NumpyNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5)
        return self.lin(x) * keep


class PythonCoin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) if random.random() < 0.5 else x


@pytest.mark.parametrize("model, draw", [(NumpyNoise(), "numpy.random.rand"), (PythonCoin(), "random.random")])
def test_a_host_draw_while_captured_is_one_error_naming_it(model, draw):
    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randn(2, 4),))
    text = str(err.value)
    assert text.startswith(f"autopar: {type(model).__name__} drew random numbers on the host"), text
    assert f"{draw} at {__file__}:" in text and "every step would reuse the same values" in text, text


def test_host_generators_are_left_as_they_were():
    before = (np.random.rand, random.random)
    with pytest.raises(CaptureError):
        capture(NumpyNoise(), (torch.randn(2, 4),))
    assert (np.random.rand, random.random) == before


def test_wav2vec2_spec_augment_in_training_is_refused():
    pytest.importorskip("transformers")
    from tests.test_capture_layerdrop import wav2vec2

    model, inputs = wav2vec2(layerdrop=0.0, mask_time_prob=0.05)
    with pytest.raises(CaptureError, match=r"numpy\.random\.\w+ at .*modeling_wav2vec2\.py:\d+.*mask_time_prob=0"):
        capture(model, inputs)
    capture(model, inputs, train=False)  # no mask outside training
