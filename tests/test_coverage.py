"""Every ATen op in the forward graphs of the reference models, and of the vision and
encoder-decoder models of ``tests/coverage_models``, has a sharding rule."""

import operator

import pytest

from autopar.passes import rules
from tests.coverage_models import COVERAGE_MODELS, captured

# The ops these models' graphs contain (torch 2.13, transformers 5.23), listed so that a
# change in either shows up here as a diff rather than as a silent replicate fallback.
EXPECTED_OPS = {
    "autopar.moe_experts.default",  # Mixtral's experts region, fused after capture (passes/capture_moe.py)
    "aten.__and__.Tensor", "aten.add.Tensor", "aten.addmm.default", "aten.alias.default",
    "aten.arange.default", "aten.arange.start", "aten.cat.default",
    "aten.clone.default",  # a reshape that copies, split into clone + view at capture
    "aten.cos.default", "aten.cumsum.default", "aten.diff.default", "aten.div.Tensor",
    "aten.dropout.default", "aten.embedding.default",
    "aten.eq.Tensor", "aten.expand.default", "aten.gather.default",
    "aten.ge.Scalar", "aten.gelu.default", "aten.index.Tensor",
    "aten.layer_norm.default", "aten.le.Tensor", "aten.linear.default",
    "aten.mean.dim", "aten.mul.Tensor", "aten.ne.Scalar", "aten.neg.default",
    "aten.new_ones.default", "aten.pow.Tensor_Scalar", "aten.reshape.default",
    "aten.rsqrt.default", "aten.scaled_dot_product_attention.default", "aten.select.int",
    "aten.silu.default", "aten.sin.default", "aten.slice.Tensor", "aten.softmax.int",
    "aten.split.Tensor", "aten.sub.Tensor", "aten.sum.dim_IntList", "aten.tanh.default",
    "aten.to.device", "aten.to.dtype", "aten.to.dtype_layout", "aten.topk.default", "aten.transpose.int",
    "aten.unsqueeze.default", "aten.view.default",
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


# The ops of ResNet, ConvNeXt, CLIP, Whisper, BART and Mixtral with labels (train mode).
COVERAGE_MODEL_OPS = {
    "autopar.moe_experts.default",  # Mixtral's experts region, fused after capture (passes/capture_moe.py)
    "aten.__and__.Tensor", "aten.adaptive_avg_pool2d.default", "aten.add.Tensor",
    "aten.alias.default", "aten.arange.default", "aten.arange.start", "aten.argmax.default",
    "aten.batch_norm.default", "aten.cat.default", "aten.clone.default",
    "aten.contiguous.default", "aten.conv1d.default", "aten.conv2d.default", "aten.copy_.default",
    "aten.cos.default", "aten.cross_entropy_loss.default", "aten.cumsum.default",
    "aten.diff.default", "aten.div.Tensor", "aten.dropout.default", "aten.embedding.default",
    "aten.eq.Scalar", "aten.eq.Tensor", "aten.exp.default",
    "aten.expand.default", "aten.fill_.Tensor", "aten.flatten.using_ints",
    "aten.ge.Scalar", "aten.gelu.default",
    "aten.index.Tensor", "aten.layer_norm.default", "aten.le.Tensor",
    "aten.lift_fresh_copy.default", "aten.linear.default", "aten.masked_fill.Scalar",
    "aten.matmul.default", "aten.max_pool2d.default", "aten.mean.dim", "aten.mul.Tensor",
    "aten.ne.Scalar", "aten.neg.default", "aten.new_ones.default", "aten.new_zeros.default",
    "aten.numpy_T.default", "aten.pad.default", "aten.permute.default",
    "aten.pow.Tensor_Scalar", "aten.relu.default", "aten.repeat.default",
    "aten.reshape.default", "aten.rsqrt.default", "aten.scaled_dot_product_attention.default",
    "aten.select.int", "aten.sigmoid.default", "aten.sin.default",
    "aten.slice.Tensor", "aten.softmax.int", "aten.sub.Tensor",
    "aten.sum.default", "aten.sum.dim_IntList", "aten.t.default", "aten.to.device",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.topk.default", "aten.transpose.int",
    "aten.unsqueeze.default", "aten.view.default",
}

# Vision and encoder-decoder ops named in issue #18, whether or not these models use them.
VISION_REQUIRED_OPS = {
    "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
    "aten.convolution.default", "aten.conv_transpose2d.input", "aten.max_pool2d.default",
    "aten.max_pool2d_with_indices.default", "aten.avg_pool2d.default",
    "aten.adaptive_avg_pool2d.default", "aten.max_pool1d.default", "aten.avg_pool3d.default",
    "aten.batch_norm.default", "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit_no_training.default",
    "aten.group_norm.default", "aten.native_group_norm.default", "aten.minimum.default",
    "aten.maximum.default", "aten.min.other", "aten.max.other", "aten.upsample_nearest2d.vec",
    "aten.upsample_bilinear2d.vec", "aten.pad.default", "aten.constant_pad_nd.default",
    "aten.arange.default", "aten.scalar_tensor.default",
}


def coverage_model_ops(name: str) -> set[str]:
    cap = captured(name)[3]
    return {str(n.target) for n in cap.nodes("call_function") if n.target is not operator.getitem}


def test_the_coverage_models_use_the_expected_ops():
    seen = set().union(*(coverage_model_ops(name) for name in COVERAGE_MODELS))
    assert seen == COVERAGE_MODEL_OPS, (
        f"new ops: {sorted(seen - COVERAGE_MODEL_OPS)}; gone: {sorted(COVERAGE_MODEL_OPS - seen)}"
    )


@pytest.mark.parametrize("name", sorted(COVERAGE_MODELS))
def test_every_op_of_the_coverage_model_has_a_rule(name):
    missing = sorted(op for op in coverage_model_ops(name) if rules.rule_for(op) is None)
    assert not missing, f"{name}: ops without a sharding rule: {missing}"


def test_vision_ops_have_rules():
    registered = set(rules.registered_ops())
    assert VISION_REQUIRED_OPS <= registered, sorted(VISION_REQUIRED_OPS - registered)
