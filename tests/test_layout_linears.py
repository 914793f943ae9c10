"""Megatron's layouts recognise a linear by its math, not its spelling (issue #32, item 2):
``x @ w.T``, ``torch.matmul(x, w)`` with w stored [in, out], ``mm``, ``bmm`` against an
expanded weight, ``einsum`` and ``F.linear`` are each split column then row, the layout's
plan runs like one process under SPMD simulation, and a layout says how many linears it
split (``explain()``, ``autopar coverage``). Falcon (``FalconLinear``: ``input @ weight.T``)
is split like Llama."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from autopar import costmodels
from autopar.coverage import coverage
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.placements import spec_str
from autopar.passes.plan import choice_from_plan
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.simulate import simulate_graph
from autopar.passes.strategy_graph import build_strategy_graph

MESH = (2, 2)
D, HIDDEN = 16, 32


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[-1] ** 0.5)


class Spellings(nn.Module):
    """Three Megatron pairs (up, GELU, down), each linear written another way."""

    def __init__(self):
        super().__init__()
        p = _weight
        self.up0, self.down0 = p(HIDDEN, D), p(HIDDEN, D)  # x @ w.T; matmul against [in, out]
        self.up1, self.down1, self.bias1 = p(HIDDEN, D), p(D, HIDDEN), nn.Parameter(torch.randn(D))  # einsum; F.linear
        self.up2, self.down2 = p(D, HIDDEN), p(D, HIDDEN)  # mm against [in, out]; bmm against an expanded w.T

    def forward(self, x):
        h = x + torch.matmul(F.gelu(x @ self.up0.T), self.down0)
        h = h + F.linear(F.gelu(torch.einsum("bsk,nk->bsn", h, self.up1)), self.down1, self.bias1)
        b, s, _ = h.shape
        up = torch.mm(h.reshape(b * s, D), self.up2).reshape(b, s, HIDDEN)
        h = h + torch.bmm(F.gelu(up), self.down2.t().expand(b, HIDDEN, D))
        return (h * h).mean()


# weight -> (dim Megatron splits on the tp axis, the layout's placement on a (dp, tp) mesh)
EXPECTED = {"up0": "RS(0)", "down0": "RS(0)", "up1": "RS(0)", "down1": "RS(1)", "up2": "RS(1)", "down2": "RS(1)",
            "bias1": "RR"}


@pytest.fixture(scope="module")
def spellings():
    torch.manual_seed(0)
    model, inputs = Spellings(), (torch.randn(4, 8, D),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, inputs), MESH)
    return model, inputs, graph


def _params(graph, fixed) -> dict[str, str]:
    return {graph.captured.params[n.name]: spec_str(s) for n, s in fixed.items() if n.name in graph.captured.params}


def test_every_spelling_of_a_linear_is_split_column_then_row(spellings):
    _, _, graph = spellings
    assert _params(graph, layouts.hint("tp+dp", graph).fixed) == EXPECTED
    fsdp_tp = _params(graph, layouts.hint("fsdp+tp", graph).fixed)
    assert all(fsdp_tp[w].endswith(spec[1:]) and fsdp_tp[w] != spec for w, spec in EXPECTED.items()
               if w != "bias1"), fsdp_tp  # the same tp split, FSDP on the other axis
    split, whole = layouts.split_linears("tp+dp", graph, layouts.hint("tp+dp", graph).fixed)
    assert sorted(split) == sorted(w for w in EXPECTED if w != "bias1") and whole == []


def test_the_layout_runs_like_one_process_and_says_what_it_split(spellings):
    model, inputs, graph = spellings
    costs = build_costs(graph, costmodels.preset("h100", MESH))
    plan, _ = plan_layout(costs, {"tp+dp": layouts.hint("tp+dp", graph)}, "tp+dp", None, ("dp", "tp"))
    assert "tp+dp splits 6 of 6 linears on its tp axis" in plan.notes
    assert "tp+dp splits 6 of 6 linears on its tp axis" in plan.explain()
    outputs = simulate_graph(graph, choice_from_plan(graph, plan),
                             graph.captured.placeholder_values(model, inputs), random.Random(0))
    with torch.no_grad():
        expected = [x for x in pytree.tree_leaves(model(*inputs)) if isinstance(x, torch.Tensor)]
    for e, g in zip(expected, [outputs[i] for i in graph.captured.user_outputs], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


class Odd(nn.Module):
    """A linear of 5 output features (no split over 2) and a convolution (no linear)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 6, 3), nn.Linear(6, 5)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3))).sum()


def test_a_layout_that_splits_no_linear_says_so():
    torch.manual_seed(0)
    model, inputs = Odd(), (torch.randn(4, 3, 8, 8),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, inputs), MESH)
    assert layouts.linears_line("tp+dp", graph, layouts.hint("tp+dp", graph).fixed) == \
        "tp+dp splits 0 of 1 linears on its tp axis; left whole: head.weight"
    assert layouts.linears_line("dp", graph, layouts.hint("dp", graph).fixed) is None
    found = coverage(model, inputs, mesh_shape=MESH)
    assert found.layouts["tp+dp"] == ("it splits none of the model's 1 linears on its tp axis: no weight's split "
                                      "dim divides evenly over it on mesh 2x2; use a smaller tp axis, or dp or fsdp")
    assert "tp+dp" not in found.applies() and {"dp", "fsdp"} <= set(found.applies())


def test_coverage_counts_the_linears_each_tp_layout_splits(spellings):
    model, inputs, _ = spellings
    found = coverage(model, inputs, mesh_shape=MESH)
    assert found.linears["tp+dp"] == found.linears["fsdp+tp"] == (6, 6) and "dp" not in found.linears
    line = next(line for line in found.table().splitlines() if line.split()[:1] == ["tp+dp"])
    assert line.startswith("  tp+dp      applies") and line.endswith("6 of 6 linears split on its tp axis"), line


def falcon():
    """A 2-layer Falcon (``FalconLinear``: ``input @ weight.T``), random weights, untied head."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       tie_word_embeddings=False)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    return FalconForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}


def test_falcon_linears_are_split_like_llamas():
    model, args, kwargs = falcon()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, args, kwargs), MESH)
    for name in ("tp+dp", "fsdp+tp"):
        params = _params(graph, layouts.hint(name, graph).fixed)
        on_tp = {fqn for fqn, spec in params.items() if spec.endswith(")")}
        assert len(params) == 16 and len(on_tp) == 10, (name, params)  # every weight but the norms'
        for layer in (0, 1):
            h = f"transformer.h.{layer}"
            for fqn, dim in (("self_attention.query_key_value", 0), ("self_attention.dense", 1),
                             ("mlp.dense_h_to_4h", 0), ("mlp.dense_4h_to_h", 1)):
                assert params[f"{h}.{fqn}.weight"].endswith(f"S({dim})"), (name, fqn, params)
        split, whole = layouts.split_linears(name, graph, layouts.hint(name, graph).fixed)
        assert len(split) == 9 and not whole, (split, whole)
