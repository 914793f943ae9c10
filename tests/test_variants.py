"""Programs per input shapes and mode (autopar.runtime.variants.Variants): built once per key, the
compiled one always kept, the others bounded, least recently used dropped first."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.variants import Variants
from tests.distributed.train_check import adamw


def test_each_key_is_built_once_and_the_least_recently_used_is_dropped():
    built = []

    def build(key):
        def make():
            built.append(key)
            return f"program {key}"
        return make

    cache = Variants("compiled", "program compiled", limit=2)
    assert cache.get("compiled", build("compiled")) == "program compiled"
    assert cache.get("a", build("a")) == "program a"
    assert cache.get("b", build("b")) == "program b"
    assert cache.get("a", build("a")) == "program a"  # kept: not built again, now the most recent
    assert cache.get("c", build("c")) == "program c"  # over the limit: "b", the least recent, goes
    assert len(cache) == 3
    cache.get("a", build("a"))
    cache.get("b", build("b"))  # built again
    assert built == ["a", "b", "c", "b"]
    for key in "defgh":  # a loop over ever new shapes never drops the compiled program
        cache.get(key, build(key))
    assert cache.get("compiled", build("compiled")) == "program compiled"
    assert len(cache) == 3 and "compiled" not in built


class Switched(nn.Module):
    """A model with a bool keyword input, as CLIP's ``return_loss``: export bakes its value
    into the graph."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, double: bool = False):
        y = self.linear(x)
        return y * 2.0 if double else y


def test_a_bool_keyword_input_trains_and_another_value_runs_a_variant_of_its_own(tmp_path):
    """One process (gloo, a one-device mesh; about 3 s): steps with ``double=True`` train like
    the model, ``double=False`` runs the program captured with it, and a tensor where the bool
    was compiled is an ``autopar:`` error."""
    torch.manual_seed(0)
    model = Switched().double()
    reference = copy.deepcopy(model)
    x, target = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, mesh, example_kwargs={"x": x, "double": True}, loss_fn=F.mse_loss,
                                 optimizer=adamw, hardware="h100")
            ref_opt = adamw(list(reference.parameters()))
            for _ in range(2):
                loss = pm.train_step({"x": x, "double": True}, target)
                ref_opt.zero_grad()
                ref_loss = F.mse_loss(reference(x, double=True), target)
                ref_loss.backward()
                ref_opt.step()
                torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=1e-12)
            full = pm.full_parameters()
            for name, p in reference.named_parameters():
                torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-12)
            single = pm(x=x, double=False)
        torch.testing.assert_close(single, reference(x, double=False).detach(), rtol=0, atol=1e-12)
        assert len(pm._variants) == 2
        with pytest.raises(ValueError, match=r"^autopar: expected input 1 \(double\) to be a bool"):
            pm(x=x, double=torch.tensor(True))
    finally:
        dist.destroy_process_group()
