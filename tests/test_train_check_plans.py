"""The distributed checks' plan sharing (tests/distributed/plans.py): cases of one launch
that ask for the same plan share one capture and one planning, each getting its own copy;
anything a plan depends on (model structure, dtype, input shape, layout, mesh) asks anew.
One process, no process group (about 2 s: two captures of a small MLP)."""

import copy

import torch

from autopar.models import WideMLP
from tests.distributed import plans, train_check


def test_the_same_request_is_planned_once_and_copied(monkeypatch):
    captures = []
    real = plans.capture
    monkeypatch.setattr(plans, "capture", lambda *a, **k: captures.append(1) or real(*a, **k))
    monkeypatch.setattr(plans, "_CAPTURED", {})
    model, _, batches = train_check.mlp_case()
    tokens = batches[0][0]
    first = plans.layout_plan(model, (tokens,), "fsdp", (2,))
    again = plans.layout_plan(copy.deepcopy(model), (tokens,), "fsdp", (2,))
    assert again is not first and again.to_json() == first.to_json()
    again.zero.clear()  # a caller's change stays its own
    assert plans.layout_plan(model, (tokens,), "fsdp", (2,)).zero == first.zero
    other_layout = plans.layout_plan(model, (tokens,), "dp", (2,))  # the same capture, planned anew
    assert other_layout.to_json() != first.to_json() and len(captures) == 1
    plans.layout_plan(model, (tokens[:4],), "fsdp", (2,))  # another batch: captured anew
    assert len(captures) == 2


def test_what_a_plan_depends_on_is_in_its_key():
    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=2)
    key = plans.request_key
    assert key(model) == key(copy.deepcopy(model))  # values do not matter, structure does
    assert key(model) != key(WideMLP(dim=16, hidden=32, n_layers=2))
    assert key(model) != key(copy.deepcopy(model).double())
    assert key(model) != key(copy.deepcopy(model).eval())
    assert key(torch.zeros(8, 16)) != key(torch.zeros(4, 16))
    assert key({"labels": torch.zeros(2)}) != key({"input_ids": torch.zeros(2)})
