"""A model planned or run inside ``torch.autocast``: autopar prices the dtypes it captures, not
autocast's casts, so it says so (``AutocastWarning``, an ``autopar:`` message naming the
supported path, ``mp_policy``) rather than predicting silently for another run.
Cost: about 3 s (one plan and one compile of a tiny GPT on one gloo rank)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.precision import AutocastWarning, autocast_in_effect

MESSAGE = r"^autopar: {} inside torch.autocast \(cpu: bfloat16\).*mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy"


def tiny_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=1))
    tokens = torch.randint(0, 32, (4, 8))
    return model, tokens


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def autopar_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, AutocastWarning)]


def test_autocast_in_effect_names_the_region():
    assert autocast_in_effect() == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_in_effect() == {"cpu": torch.bfloat16}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert autocast_in_effect() == {}


def test_planning_under_autocast_warns_and_names_the_policy():
    model, tokens = tiny_gpt()
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        autopar.plan(model, (2,), (tokens,), hardware="h100", layout="dp")
    assert autopar_warnings(outside) == []  # no autocast: no warning
    with pytest.warns(AutocastWarning, match=MESSAGE.format("planning")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autopar.plan(model, (2,), (tokens,), hardware="h100", layout="dp")


def test_compiling_and_running_under_autocast_warn(one_rank):
    model, tokens = tiny_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (1,), (tokens,), hardware="h100", layout="dp")
    with pytest.warns(AutocastWarning, match=MESSAGE.format("compiling a plan")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pm = autopar.compile(model, one_rank, (tokens,), loss_fn=lm_loss, plan=plan,
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        pm.train_step((tokens,), tokens)
    assert autopar_warnings(outside) == []
    with pytest.warns(AutocastWarning, match=MESSAGE.format("running the compiled model")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pm.train_step((tokens,), tokens)
