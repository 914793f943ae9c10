"""Every ATen op in the forward graphs of the five reference models has a sharding rule."""

import operator

import pytest

from passes import rules

# The ops these models' graphs contain (torch 2.13, transformers 5.23), listed so that a
# change in either shows up here as a diff rather than as a silent replicate fallback.
EXPECTED_OPS = {
    "aten.__and__.Tensor", "aten.add.Tensor", "aten.addmm.default", "aten.alias.default",
    "aten.arange.default", "aten.arange.start", "aten.cat.default", "aten.chunk.default",
    "aten.cos.default", "aten.cumsum.default", "aten.diff.default", "aten.div.Tensor",
    "aten.dropout.default", "aten.embedding.default", "aten.empty_like.default",
    "aten.eq.Tensor", "aten.expand.default", "aten.floor_divide.default", "aten.gather.default",
    "aten.ge.Scalar", "aten.gelu.default", "aten.histc.default", "aten.index.Tensor",
    "aten.index_put.default", "aten.layer_norm.default", "aten.le.Tensor", "aten.linear.default",
    "aten.mean.dim", "aten.mul.Tensor", "aten.ne.Scalar", "aten.neg.default",
    "aten.new_ones.default", "aten.pow.Tensor_Scalar", "aten.reshape.default",
    "aten.rsqrt.default", "aten.scaled_dot_product_attention.default", "aten.select.int",
    "aten.silu.default", "aten.sin.default", "aten.slice.Tensor", "aten.softmax.int", "aten.sort.default",
    "aten.split.Tensor", "aten.sub.Tensor", "aten.sum.dim_IntList", "aten.tanh.default",
    "aten.to.device", "aten.to.dtype", "aten.to.dtype_layout", "aten.topk.default", "aten.transpose.int",
    "aten.unsqueeze.default", "aten.view.default", "transformers.grouped_mm_fallback.default",
}

# Named in the issue as a floor, whether or not these models use them.
REQUIRED_OPS = {
    "aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default",
    "aten.matmul.default", "aten.embedding.default", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.layer_norm.default", "aten.rms_norm.default", "aten.softmax.int",
    "aten.scaled_dot_product_attention.default", "aten.view.default", "aten.reshape.default",
    "aten.transpose.int", "aten.permute.default", "aten.expand.default", "aten.split.Tensor",
    "aten.cat.default", "aten.slice.Tensor", "aten.index.Tensor", "aten.unsqueeze.default",
    "aten.sum.dim_IntList", "aten.mean.dim", "aten.cumsum.default", "aten.dropout.default",
    "aten.cross_entropy_loss.default", "aten.topk.default", "aten.sort.default",
    "aten.histc.default", "aten.index_put_.default", "transformers.grouped_mm_fallback.default",
}


def model_ops(captured_models) -> dict[str, set[str]]:
    return {
        name: {str(n.target) for n in cap.nodes("call_function") if n.target is not operator.getitem}
        for name, (_, _, cap) in captured_models.items()
    }


def test_the_models_use_the_expected_ops(captured_models):
    seen = set().union(*model_ops(captured_models).values())
    assert seen == EXPECTED_OPS, (
        f"new ops: {sorted(seen - EXPECTED_OPS)}; gone: {sorted(EXPECTED_OPS - seen)}"
    )


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "bert", "torch_transformer"])
def test_every_op_of_the_model_has_a_rule(name, captured_models):
    missing = sorted(op for op in model_ops(captured_models)[name] if rules.rule_for(op) is None)
    assert not missing, f"{name}: ops without a sharding rule: {missing}"


def test_required_ops_have_rules():
    registered = set(rules.registered_ops())
    assert REQUIRED_OPS <= registered, sorted(REQUIRED_OPS - registered)
