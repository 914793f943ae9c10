"""Gradient clipping's counting (autopar.runtime.clipping): every element once, whatever the layout.

The shares of simulated ranks (each shard cut from the whole gradient as its placement
says) add up to torch's norm; on one real gloo rank, clipping scales the gradients
exactly as ``torch.nn.utils.clip_grad_norm_`` does. The multi-rank runs are the
``clip:`` cases of tests/test_train_distributed.py.
"""

import itertools
import math

import pytest
import torch

from autopar.runtime.clipping import clip_grad_norm_, norm_share, replicas
from autopar.passes.placements import P, R, S, local_slice, parse_spec

NORM_TYPES = (2.0, 1.0, 3.0, math.inf, -math.inf)


def test_replicas_counts_the_axes_that_hold_the_same_shard():
    assert replicas((R, R), (2, 3)) == 6
    assert replicas((S(0), R), (2, 3)) == 3
    assert replicas((R, S(1)), (2, 3)) == 2
    assert replicas((S(0), S(0)), (2, 3)) == 1
    assert replicas(None, (2, 3)) == 6  # held whole on every rank
    assert replicas(None, ()) == 1  # a pipeline stage without intra-op axes


def test_a_partial_gradient_is_refused():
    with pytest.raises(ValueError, match=r"^autopar: clipping found a gradient placed as S\(0\)P"):
        replicas((S(0), P), (2, 2))


def _simulated_total(grads, specs, mesh_shape, norm_type, count=replicas):
    """What the all-reduce over every rank gives: each virtual rank's share, summed (max, min)."""
    shares = []
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        local = [local_slice(g, s, mesh_shape, coord) for g, s in zip(grads, specs)]
        shares.append(norm_share(local, [count(s, mesh_shape) for s in specs], norm_type))
    stacked = torch.stack(shares)
    if norm_type == math.inf:
        return stacked.max()
    if norm_type == -math.inf:
        return stacked.min()
    return stacked.sum() ** (1 / norm_type)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 3)])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_shares_of_all_ranks_add_up_to_torchs_norm(mesh_shape, norm_type):
    gen = torch.Generator().manual_seed(0)
    placements = ["R", "S(0)", "S(1)"]
    specs = [parse_spec("".join(p)) for p in itertools.product(placements, repeat=len(mesh_shape))]
    grads = [torch.randn(12, 12, dtype=torch.float64, generator=gen) * (i + 1) for i in range(len(specs))]
    expected = torch.nn.utils.get_total_norm(grads, norm_type)
    total = _simulated_total(grads, specs, mesh_shape, norm_type)
    assert torch.allclose(total, expected, rtol=1e-13, atol=0), (total.item(), expected.item())
    # the check can fail: counting each replica as a gradient of its own gives another norm
    if norm_type not in (math.inf, -math.inf):
        recounted = _simulated_total(grads, specs, mesh_shape, norm_type, count=lambda spec, shape: 1)
        assert not torch.allclose(recounted, expected, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clipping_on_one_rank_is_torchs(one_rank, dtype, norm_type):
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(8, 5, dtype=dtype, generator=gen)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype, generator=gen)
    params[1].grad = None  # a parameter without a gradient is left out, as torch leaves it
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        t.grad = None if p.grad is None else p.grad.clone()
    max_norm = 0.5
    expected = torch.nn.utils.clip_grad_norm_(twins, max_norm, norm_type)
    total = clip_grad_norm_(params, [1] * len(params), one_rank, max_norm, norm_type, torch.device("cpu"))
    assert total.dtype == expected.dtype == dtype
    rtol = 1e-15 if dtype == torch.float64 else 1e-6
    assert torch.allclose(total, expected, rtol=rtol, atol=0)
    assert expected > max_norm or norm_type == -math.inf  # the gradients were clipped
    for p, t in zip(params, twins):
        assert (p.grad is None) == (t.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, t.grad, rtol=rtol, atol=0)


def test_a_norm_type_torch_does_not_clip_by_is_refused(one_rank):
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="^autopar: clip_grad_norm_ got norm_type=0.0"):
        clip_grad_norm_([p], [1], one_rank, 1.0, 0, torch.device("cpu"))
