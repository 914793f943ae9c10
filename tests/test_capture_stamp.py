"""Capture by stamping (autopar.passes.capture_stamp): a meta model of many identical layers,
exported with a few and the rest copied, is captured exactly as the whole export captures it;
a model whose layers differ, in shape or in what the code does at one index, falls back to the
whole export."""

import pytest
import torch
from torch import nn

import autopar.passes.capture as capture_module
from autopar.models import MODELS
from autopar.passes import capture_stamp
from autopar.passes.capture import capture


def _captures(monkeypatch, model, inputs, train):
    """(capture as it is, whether it was stamped, capture with stamping switched off)."""
    stamped = []

    def noting(m, export):
        found = capture_stamp.stamped_export(m, export)
        stamped.append(found is not None)
        return found

    monkeypatch.setattr(capture_module, "stamped_export", noting)
    first = capture(model, inputs, train=train)
    monkeypatch.setattr(capture_module, "stamped_export", lambda m, export: None)
    whole = capture(model, inputs, train=train)
    return first, stamped == [True], whole


def _described(cap):
    """Everything a Captured holds that passes read: each node (name, op, target, arguments,
    the shape, dtype, strides and gradient of its value, its other meta) and the maps."""
    nodes = []
    for n in cap.gm.graph.nodes:
        v = n.meta.get("val")
        value = (tuple(v.shape), v.dtype, v.stride(), v.requires_grad) if isinstance(v, torch.Tensor) else repr(v)
        nodes.append((n.op, n.name, str(n.target), str(n.args), str(n.kwargs), value,
                      {k: m for k, m in n.meta.items() if k != "val"}))
    fields = (cap.placeholders, cap.params, cap.buffers, cap.constants, sorted(cap.constant_values), cap.user_inputs,
              cap.user_outputs, str(cap.out_spec), str(cap.in_spec), cap.model_name)
    return nodes, fields, cap.gm.code


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(config), 16


MODELS_TO_STAMP = {
    "autopar-llama": lambda: (MODELS["llama"].build("bench-cpu", 16, num_hidden_layers=7), 16),
    "autopar-gpt": lambda: (MODELS["gpt"].build("small", 16, n_layers=8), 16),
    "hf-llama": _hf_llama,
}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS_TO_STAMP))
def test_a_stamped_capture_is_the_whole_capture(monkeypatch, name, train):
    with torch.device("meta"):
        model, seq = MODELS_TO_STAMP[name]()
    inputs = (torch.zeros(2, seq, dtype=torch.long, device="meta"),)
    first, stamped, whole = _captures(monkeypatch, model, inputs, train)
    assert stamped, f"{name}: expected its identical layers to be stamped"
    a, b = _described(first), _described(whole)
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        assert x == y
    assert a[1:] == b[1:]


class Block(nn.Module):
    def __init__(self, dim, hidden, index, odd_at=None):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.index, self.odd_at = index, odd_at

    def forward(self, x, scale=1.0):
        h = torch.relu(self.up(x))
        if self.index == self.odd_at:  # one layer does something of its own
            h = torch.tanh(h)
        return x + self.down(h) * scale


class Stack(nn.Module):
    """Eight residual blocks; ``odd`` makes one differ: wider (``width``), with its own op
    inside (``inside``), an op of the loop's after it (``loop``), or its own argument (``argument``)."""

    def __init__(self, odd=None, at=5, dim=16):
        super().__init__()
        self.odd, self.at = odd, at
        self.blocks = nn.ModuleList(
            Block(dim, 4 * dim if not (odd == "width" and i == at) else 8 * dim, i, at if odd == "inside" else None)
            for i in range(8))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x, scale=2.0 if self.odd == "argument" and i == self.at else 1.0)
            if self.odd == "loop" and i == self.at:
                x = x * 2
        return x.sum()


def test_identical_blocks_are_stamped(monkeypatch):
    with torch.device("meta"):
        model = Stack()
    first, stamped, whole = _captures(monkeypatch, model, (torch.zeros(4, 16, device="meta"),), True)
    assert stamped and _described(first) == _described(whole)


@pytest.mark.parametrize("odd", ["width", "inside", "loop", "argument"])
@pytest.mark.parametrize("at", [2, 5])
def test_a_layer_that_differs_falls_back_to_the_whole_export(monkeypatch, odd, at):
    with torch.device("meta"):
        model = Stack(odd, at)
    first, stamped, whole = _captures(monkeypatch, model, (torch.zeros(4, 16, device="meta"),), True)
    assert not stamped
    assert _described(first) == _described(whole)
    names = [n.name for n in first.gm.graph.nodes]
    if odd == "inside":  # the odd op is there, once
        assert sum(name.startswith("tanh") for name in names) == 1
    if odd == "loop":  # one scaling per block, and the loop's
        assert sum(name.startswith("mul") for name in names) == 9


def test_a_model_with_weights_is_exported_whole():
    model = Stack()  # on the host: checking its layers would mean running them
    assert capture_stamp.stamped_export(model, lambda m: pytest.fail("not exported")) is None


def test_hugging_face_layers_of_two_attention_kinds_fall_back(monkeypatch):
    """Qwen3 with a sliding window on its last layers: same weights, other attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                                      use_cache=False, use_sliding_window=True, sliding_window=8, max_window_layers=4)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    assert len(set(config.layer_types)) == 2
    first, stamped, whole = _captures(monkeypatch, model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),), True)
    assert not stamped
    assert _described(first) == _described(whole)


def test_a_capture_keeps_the_names_export_gives_its_inputs():
    """Copying the graph node by node must not rename what export named: fx would rename an
    input that shadows a Python builtin (``nn.Linear``'s ``input``)."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    captured = capture(model, (torch.zeros(2, 8, device="meta"),))
    names = [n.name for n in captured.nodes("placeholder")]
    assert captured.user_inputs == ["input"] and "input" in names
