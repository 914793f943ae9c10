import resource
import time

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar.passes.capture import CaptureError, capture
from tests.models import MODELS


@pytest.mark.parametrize("name", sorted(MODELS))
def test_captured_graph_runs_like_the_model(name, captured_models):
    model, inputs, cap = captured_models[name]
    with torch.no_grad():
        # (an eager Hugging Face call also returns its key-value cache: not a tensor)
        eager = [x for x in pytree.tree_leaves(model(*inputs)) if isinstance(x, torch.Tensor)]
        graph = pytree.tree_leaves(cap.run(model, inputs))
    assert len(eager) == len(graph)
    for a, b in zip(eager, graph):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_node_has_shape_and_dtype(name, captured_models):
    _, _, cap = captured_models[name]
    for node in cap.nodes():
        if node.op in ("placeholder", "call_function"):
            for val in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(val, torch.Tensor):
                    assert all(isinstance(s, int) for s in val.shape) and val.dtype is not None
    ops = {str(n.target) for n in cap.nodes("call_function")}
    assert "aten._assert_tensor_metadata.default" not in ops
    assert not any("wrap_with_set_grad_enabled" in op for op in ops)


def test_parameters_are_known_by_qualified_name(captured_models):
    model, _, cap = captured_models["llama"]
    assert set(cap.params.values()) == {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in cap.params.values()
    assert set(cap.buffers.values()) <= {n for n, _ in model.named_buffers()}


def test_huggingface_outputs_keep_their_type_and_cache_setting(captured_models):
    model, inputs, cap = captured_models["gpt2"]
    out = cap.run(model, inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (4, 8, 128)
    assert model.config.use_cache is True  # switched off only while tracing


def test_rotary_no_grad_region_is_inlined_and_tagged(captured_models):
    _, _, cap = captured_models["llama"]
    tagged = [n for n in cap.nodes() if n.meta.get("autopar_no_grad")]
    assert tagged, "Llama's rotary embedding runs under no_grad; its nodes should be tagged"


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor value
            return self.lin(x)
        return x


def test_untraceable_model_names_the_failing_line():
    with pytest.raises(CaptureError) as err:
        capture(DataDependent(), (torch.randn(2, 4),))
    text = str(err.value)
    assert text.startswith("autopar: could not capture DataDependent")
    assert "test_capture.py" in text and "if x.sum() > 0" in text
    assert "What to do" in text


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="autopar: expected example_inputs as a tuple"):
        capture(torch.nn.Linear(2, 2), torch.randn(2, 2))
    with pytest.raises(TypeError, match="autopar: expected an nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


def test_70b_llama_on_meta_captures_without_allocating():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    cap = capture(model, (tokens,))
    elapsed = time.perf_counter() - start
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    n_params = sum(p.numel() for p in model.parameters())
    assert 69e9 < n_params < 72e9
    assert len(cap.params) == len(list(model.parameters()))
    assert grown_gib < 4, f"capture grew the process by {grown_gib:.1f} GiB; weights were allocated?"
    print(f"70B meta capture: {elapsed:.1f} s, {len(list(cap.nodes()))} nodes, +{grown_gib:.2f} GiB peak")


class _Positions(torch.nn.Module):
    """Makes a tensor on its input's device (as Hugging Face models make positions and masks)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale + torch.arange(x.shape[-1], device=x.device)


def test_a_program_made_on_the_host_runs_where_it_is_retargeted():
    """The runtime runs a program captured on the weights' device (the host) on the mesh's (a GPU
    under nccl): ``retarget_devices`` makes every device the graph names the one given. Checked
    with the meta device standing in for the GPU: the retargeted program makes its positions there."""
    from autopar.passes.capture import retarget_devices

    model = _Positions()
    cap = capture(model, (torch.ones(2, 4),))
    named = {a for n in cap.gm.graph.nodes for a in (*n.args, *n.kwargs.values()) if isinstance(a, torch.device)}
    assert named == {torch.device("cpu")}
    retarget_devices(cap.gm, torch.device("meta"))
    values = {n.name: torch.ones(4, device="meta") for n in cap.nodes("placeholder") if n.name in cap.params}
    values.update({n: torch.ones(2, 4, device="meta") for n in cap.user_inputs})
    out = cap.gm(*[values[n] for n in cap.placeholders])
    assert pytree.tree_leaves(out)[0].device.type == "meta"
