"""Mixed precision's pieces in one process (the distributed numerics:
tests/test_mixed_precision_distributed.py). Cost: about 2 s (two captures of a small GPT)."""

import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.runtime.precision import Precision, capture_cast

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_no_policy_is_no_precision():
    assert Precision.of(None) is None  # today's behaviour: nothing cast anywhere


@pytest.mark.parametrize("policy", ["bf16", MixedPrecisionPolicy(param_dtype=torch.int8),
                                    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.int32)])
def test_bad_policies_are_autopar_errors(policy):
    with pytest.raises((TypeError, ValueError), match="^autopar: expected mp_policy"):
        Precision.of(policy)


def test_dtypes_follow_fsdp2():
    """FSDP2's rules: reduce_dtype None reduces in the compute dtype; integer parameters are never cast."""
    p = Precision.of(BF16)
    assert p.compute_dtype(torch.float32) == torch.bfloat16 and p.gradient_reduce_dtype(torch.float32) == torch.float32
    assert p.compute_dtype(torch.int64) == torch.int64
    same = Precision.of(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert same.gradient_reduce_dtype(torch.float32) == torch.bfloat16
    assert Precision.of(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)).compute_dtype(torch.float32) == torch.float32


def test_capture_computes_in_param_dtype_and_leaves_the_model_alone():
    """The program is the model's in bf16 (its parameters cast), its nodes named as in
    float32 (the plan finds them), the model's own parameters unchanged."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=1))
    tokens = torch.randint(0, 32, (2, 8))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = capture(model, (tokens,))
        cast = capture_cast(capture, model, Precision.of(BF16))((tokens,))
    assert [n.name for n in cast.gm.graph.nodes] == [n.name for n in plain.gm.graph.nodes]
    vals = {n.name: n.meta["val"] for n in cast.gm.graph.nodes if n.op == "placeholder"}
    assert {vals[ph].dtype for ph in cast.params} == {torch.bfloat16}
    output = next(n for n in cast.gm.graph.nodes if n.op == "output").args[0][cast.user_outputs[0]]
    assert output.meta["val"].dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_the_whole_state_dict_is_the_float32_masters(one_rank):
    """``full_state_dict()`` under a policy: the model's names and order, each the master in
    float32, equal to what the step left in the shards (the capture under a policy is not a
    partial of the model, so the names come from the model itself)."""
    import autopar

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, max_seq_len=8, dim=16, n_heads=2, n_layers=1))
    tokens = torch.randint(0, 32, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (1,), (tokens,), hardware="h100", layout="dp", mp_policy=BF16)
        pm = autopar.compile(model, one_rank, (tokens,), plan=plan, mp_policy=BF16,
                             loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()),
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    pm.train_step((tokens,), tokens)
    state = pm.full_state_dict()
    assert list(state) == list(model.state_dict())
    assert {t.dtype for t in state.values()} == {torch.float32}
    moved = [name for name, p in model.named_parameters() if not torch.equal(state[name], p.detach())]
    assert moved, "one AdamW step at lr 1e-2 moves the masters"
    for name, tensor in pm.full_parameters().items():
        assert torch.equal(state[name], tensor)
