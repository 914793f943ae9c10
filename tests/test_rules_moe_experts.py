"""The experts region as one op (``autopar.passes.rules.moe_experts``, fused by
``autopar.passes.capture_moe``): every strategy by SPMD simulation — the all-to-all dispatch
runs its virtual devices side by side, trading rows through the simulator's exchange — with
uneven routing; the simulator catches a dispatch that brings results home in the wrong
order; the fused graph computes what the captured one did, forward and backward, bit for
bit (against the eager model); a region that differs is left alone; the work a strategy is priced by.

Cost: about 8 s idle (three tiny Mixtral captures; 40 strategies simulated, 4 devices each at most)."""

from __future__ import annotations

import random

import pytest
import torch

from autopar.passes import rules
from autopar.passes import capture as capture_module
from autopar.passes.capture import capture
from autopar.passes.capture_moe import fuse_moe_experts
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules import moe_experts
from autopar.passes.rules.moe_experts import MOE_EXPERTS, OP_NAME, axis_kinds, experts_work
from autopar.passes.simulate import SimulationMismatch, check_strategy
from tests.models import mixtral

GROUPED_MM = "aten._grouped_mm.default"  # float32 on CPU wants 16-byte strides: shards of H, I of 4 floats or more


def _call(experts: int, tokens: int = 16, top_k: int = 2, skewed: bool = False, seed: int = 0):
    """Inputs of one experts op: hidden [T, H], top-k ids and weights, both expert weights.
    ``skewed``: most tokens pick expert 0 (an all-to-all's counts as uneven as they get)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inner = 32, 16
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if skewed:
        ids[: tokens * 3 // 4, 0] = 0
        ids[: tokens * 3 // 4, 1] = 1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    w_gate_up = torch.randn(experts, hidden, 2 * inner, generator=g) / 4
    w_down = torch.randn(experts, inner, hidden, generator=g) / 4
    return [torch.randn(tokens, hidden, generator=g), ids, weights, w_gate_up, w_down]


def _info(inputs):
    return OpInfo.from_call(MOE_EXPERTS, (*inputs, GROUPED_MM))


# (2, 2): 25 strategies, among them all-to-all over both axes (rows sent along one, then the other)
@pytest.mark.parametrize("mesh, skewed", [((2,), False), ((4,), False), ((4,), True), ((2, 2), True)])
def test_every_strategy_reproduces_the_op(mesh, skewed):
    inputs = _call(4, skewed=skewed)
    info = _info(inputs)
    strategies = rules.strategies_for(info, mesh)
    dispatches = 0
    for strategy in strategies:
        check_strategy(info, strategy, inputs, mesh, random.Random(0))
        dispatches += bool(axis_kinds(strategy)["all_to_all"])
    assert dispatches > 0, "expected all-to-all strategies (tokens and experts split on one axis)"


def test_the_all_to_all_strategy_on_one_axis():
    info = _info(_call(4))
    texts = {str(s) for s in rules.strategies_for(info, (4,))}
    assert "(S(0), S(0), S(0), S(0), S(0)) -> S(0) [moe_experts]" in texts  # all-to-all dispatch
    assert "(R, R, R, S(0), S(0)) -> P [moe_experts]" in texts  # allgather dispatch
    assert "(R, R, R, S(2), S(1)) -> P [moe_experts]" in texts  # experts tensor-parallel
    assert "(S(0), S(0), S(0), R, R) -> S(0)" in texts  # data parallel


def test_the_simulator_catches_results_sent_home_out_of_order(monkeypatch):
    inputs = _call(4)
    info = _info(inputs)
    a2a = next(s for s in rules.strategies_for(info, (2,)) if axis_kinds(s)["all_to_all"])
    check_strategy(info, a2a, inputs, (2,), random.Random(0))

    def unsorted(out, route, exchange):  # the reverse exchange without undoing the sort by destination
        order, send, recv, axis = route
        return exchange.rows(out, send, recv, axis)

    monkeypatch.setattr(moe_experts, "_combine", unsorted)
    with pytest.raises(SimulationMismatch, match="differs"):
        check_strategy(info, a2a, inputs, (2,), random.Random(0))


def _run(forward, model):
    model.zero_grad()
    logits = forward().logits
    logits.pow(2).sum().backward()
    return logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _unfused(model, args, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(capture_module, "fuse_moe_experts", lambda gm: 0)
        return capture(model, args)


def test_capture_fuses_each_layer_and_computes_what_the_model_does():
    model, args = mixtral()
    fused = capture(model, args)
    ops = [n for n in fused.gm.graph.nodes if n.op == "call_function"]
    assert sum(str(n.target) == OP_NAME for n in ops) == 2  # one region per layer
    assert not any(str(n.target) in ("aten.sort.default", "aten.histc.default") for n in ops)
    logits, grads = _run(lambda: model(*args), model)
    fused_logits, fused_grads = _run(lambda: fused.run(model, args), model)
    assert torch.equal(logits, fused_logits)
    assert all(torch.equal(grads[k], fused_grads[k]) for k in grads)


def test_a_region_that_differs_is_left_alone(monkeypatch):
    model, args = mixtral()
    captured = _unfused(model, args, monkeypatch)
    silu = next(n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.silu.default)
    silu.target = torch.ops.aten.gelu.default  # another activation: not the pattern
    assert fuse_moe_experts(captured.gm) == 1  # the other layer's region only


def test_work_prices_the_dispatch_and_splits_the_rows():
    inputs = _call(4, tokens=64)
    info = _info(inputs)
    by_text = {str(s): experts_work(info, s, (4,)) for s in rules.strategies_for(info, (4,))}
    whole = by_text["(R, R, R, R, R) -> R"]
    a2a = by_text["(S(0), S(0), S(0), S(0), S(0)) -> S(0) [moe_experts]"]
    gather = by_text["(R, R, R, S(0), S(0)) -> P [moe_experts]"]
    tp = by_text["(R, R, R, S(2), S(1)) -> P [moe_experts]"]
    assert whole.forward == () and whole.flops > 0
    assert {s.collective for s in a2a.forward} == {"all_to_all"}
    assert a2a.flops == pytest.approx(whole.flops / 4) == pytest.approx(gather.flops) == pytest.approx(tp.flops)
    assert {s.collective for s in tp.forward} == {"all_gather"} and gather.forward == ()
    # all-to-all moves this device's rows out and back: less than the allgather of the tokens would
    rows_out = max(s.bytes for s in a2a.forward)
    assert rows_out == 64 // 4 * 2 * 32 * 4
