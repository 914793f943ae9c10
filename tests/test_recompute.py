"""Recomputed layers run under checkpointing: same outputs and gradients, fewer bytes saved."""

import warnings
from typing import Any

import pytest
import torch

from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.lowering.codegen import lower
from autopar.passes.layers import find_layers
from autopar.passes.lowering.recompute import Recomputed, layers_to_recompute, recompute_layers
from autopar.passes.strategy_graph import build_strategy_graph


def saved_tensor_bytes(fn, *args: Any) -> tuple[Any, int]:
    """Run ``fn(*args)`` and count the bytes autograd saves for backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, dim=32, n_heads=4, n_layers=3)).double()
    tokens = torch.randint(0, 64, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, ())
    lowered = lower(graph, {n: 0 for n in graph.nodes}, None)
    layer_of, _ = find_layers(graph, {n: i for i, n in enumerate(graph.nodes)}, {})
    values = cap.state_values(model)
    values[cap.user_inputs[0]] = tokens
    return cap, lowered.gm, {n.name: k for n, k in layer_of.items()}, values


def run(gm, cap, values):
    leaves = {k: (v.detach().clone().requires_grad_() if v.is_floating_point() else v) for k, v in values.items()}
    out, saved = saved_tensor_bytes(lambda: gm(*[leaves[n] for n in cap.placeholders]))
    loss = sum(o.double().pow(2).sum() for o in torch.utils._pytree.tree_leaves(out) if o.is_floating_point())
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.grad is not None}, saved


def test_same_values_and_gradients_with_fewer_bytes_saved(program):
    cap, gm, layer_of, values = program
    assert sorted(set(layer_of.values())) == [0, 1, 2]
    base_loss, base_grads, base_saved = run(gm, cap, values)
    checkpointed = recompute_layers(gm, layer_of, layers_to_recompute(["layer 0", "layer 2"]))
    wrapped = [m for m in checkpointed.modules() if isinstance(m, Recomputed)]
    assert sorted(m.layer for m in wrapped) == [0, 2]
    loss, grads, saved = run(checkpointed, cap, values)
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], base_grads[name], rtol=0, atol=1e-12)
    assert saved < 0.7 * base_saved, (saved, base_saved)
    # every layer recomputed saves less still
    all_three = recompute_layers(gm, layer_of, {0, 1, 2})
    assert run(all_three, cap, values)[2] < saved


def test_bad_recompute_entries(program):
    cap, gm, layer_of, _ = program
    with pytest.raises(ValueError, match="^autopar: expected recompute entries like 'layer 3'"):
        layers_to_recompute(["block 1"])
    with pytest.raises(ValueError, match=r"^autopar: the plan recomputes layers \[7\]"):
        recompute_layers(gm, layer_of, {7})
    assert recompute_layers(gm, layer_of, set()) is gm
