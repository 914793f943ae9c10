"""Random ops draw from a key and each element's place in the whole tensor
(autopar.passes.randomness), so a shard draws exactly what the whole holds there.

Every strategy of every random op is checked by the SPMD simulator on 1-, 2- and 3-axis
meshes against the whole tensor drawn on one device, exactly (attention: up to the rounding
of a pending sum's shares); the draws
do not read torch's generator; other keys and other ops draw otherwise; the values have
the distribution asked for; a random op outside a keyed run, or one autopar does not key,
is an ``autopar:`` error.
"""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ops import aten

from autopar.passes import randomness, simulate
from autopar.passes.capture import capture
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules.random import RANDOM_OPS
from autopar.passes.rules.registry import registered_ops, strategies_for
from autopar.passes.strategy_graph import build_strategy_graph

MESHES = [(2,), (2, 3), (2, 1, 2)]
_INPUTS = torch.Generator().manual_seed(0)  # the same inputs in every run, whatever ran before
X = torch.randn(4, 6, dtype=torch.float64, generator=_INPUTS)
PROBABILITIES = torch.rand(4, 6, dtype=torch.float64, generator=_INPUTS)
Q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=_INPUTS)
KV = torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=_INPUTS)

CALLS = {
    "dropout": (aten.dropout.default, (X, 0.3, True), {}),
    "native_dropout": (aten.native_dropout.default, (X, 0.3, True), {}),
    "rand": (aten.rand.default, ([4, 6],), {"dtype": torch.float64}),
    "randn": (aten.randn.default, ([4, 6],), {"dtype": torch.float32}),
    "randint": (aten.randint.low, (3, 11, [4, 6]), {}),
    "rand_like": (aten.rand_like.default, (X,), {}),
    "randn_like": (aten.randn_like.default, (X,), {}),
    "randint_like": (aten.randint_like.default, (X, 7), {}),
    "bernoulli": (aten.bernoulli.default, (PROBABILITIES,), {}),
    "bernoulli_p": (aten.bernoulli.p, (X, 0.3), {}),
    "attention_dropout": (aten.scaled_dot_product_attention.default, (Q, KV, KV, None, 0.2, True), {"enable_gqa": True}),
}


def _inputs(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_strategy_of_a_random_op_draws_the_whole_tensors_values(name):
    op, args, kwargs = CALLS[name]
    info = OpInfo.from_call(op, args, kwargs)
    atol = 1e-12 if name == "attention_dropout" else 0.0  # a Partial value's shares summed: float rounding
    checked = 0
    with randomness.drawing(randomness.run_key(7, 0)):
        for mesh in MESHES:
            for strategy in strategies_for(info, mesh):
                assert strategy.kernel is not None, f"{name} {strategy}: must run a keyed kernel, not torch's op"
                simulate.check_strategy(info, strategy, _inputs(args), mesh, random.Random(0), rtol=0, atol=atol)
                checked += 1
    assert checked >= 3 * len(MESHES)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_draws_do_not_read_torchs_generator_and_change_with_the_key(name):
    op, args, kwargs = CALLS[name]
    info = OpInfo.from_call(op, args, kwargs)

    def whole(key: int, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with randomness.drawing(key):
            return simulate.reference(info, _inputs(args))[0]

    first = whole(1, 0)
    assert torch.equal(first, whole(1, 99))
    assert not torch.equal(first, whole(2, 0))
    with randomness.op(1):  # another op of the same run: another stream
        assert not torch.equal(whole(1, 0), first)


def test_tensor_hash_is_splitmix64_over_the_index():
    key = randomness.run_key(3, 5)
    index = torch.arange(1000, dtype=torch.int64)
    got = randomness._mix(index ^ randomness._signed(key))
    expected = [randomness._signed(randomness.mix(i ^ key)) for i in range(1000)]
    assert got.tolist() == expected


def test_distributions():
    shape, device = (1000, 1000), torch.device("cpu")
    with randomness.drawing(randomness.run_key(0, 0)):
        u = randomness.uniform(shape, (), (), (), device, torch.float32)
        n = randomness.normal(shape, (), (), (), device, torch.float64)
        kept = randomness.dropout(torch.ones(shape, dtype=torch.float64), 0.1, shape, (), (), ())
        ints = randomness.integers(3, 11, shape, (), (), (), device, torch.int64)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 2e-3 and abs(u.var() - 1 / 12) < 1e-3
    assert abs(n.mean()) < 5e-3 and abs(n.std() - 1.0) < 5e-3
    assert abs((kept == 0).double().mean() - 0.1) < 2e-3 and abs(kept.mean() - 1.0) < 5e-3
    assert ints.min() == 3 and ints.max() == 10 and abs(ints.double().mean() - 6.5) < 1e-2


def test_a_random_op_outside_a_keyed_run_is_an_error():
    with pytest.raises(RuntimeError, match="^autopar: a random op .* ran with no key"):
        simulate.reference(OpInfo.from_call(*CALLS["rand_like"][:2]), [X])


class Shuffles(nn.Module):
    def forward(self, x):
        return x[torch.randperm(x.shape[0])] + F.dropout(x, 0.1)


def test_a_random_op_autopar_does_not_key_is_an_error_not_a_replicated_drift():
    captured = capture(Shuffles(), (torch.randn(4, 3),))
    with pytest.raises(ValueError, match="^autopar: aten.randperm.default .* draws from torch's generator"):
        build_strategy_graph(captured, (2,))


def test_every_op_with_a_rule_that_torch_tags_as_seeded_draws_from_the_key():
    """A rule for a random op that ran torch's own op would draw from each rank's generator."""
    seeded = set()
    for name in registered_ops():
        packet, _, overload = name.removeprefix("aten.").rpartition(".")
        op = getattr(getattr(aten, packet, None), overload, None) if name.startswith("aten.") else None
        if op is not None and torch.Tag.nondeterministic_seeded in op.tags:
            seeded.add(op)
    keyed = set(RANDOM_OPS) | {aten.scaled_dot_product_attention.default}  # its dropout: keyed_attention
    assert seeded == keyed, sorted(map(str, seeded ^ keyed))
