import warnings

import pytest

from tests.models import MODELS


@pytest.fixture(scope="session")
def captured_models():
    """name -> (model, example_inputs, Captured), captured once per test session."""
    from autopar.passes.capture import capture

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, factory in MODELS.items():
            model, inputs = factory()
            out[name] = (model, inputs, capture(model, inputs))
    return out
