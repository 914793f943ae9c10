"""The grouped matmuls of MoE experts (``passes/rules/moe.py``), by SPMD simulation on
random calls of both ops that compute them (``aten._grouped_mm``, transformers'
``grouped_mm_fallback``), the expert-parallel kernel under fake tensors (a dry run reads
no offsets), and its gradients (rows of other experts give none); the same kernel on blocks
of the expert-sorted rows (rows split), and the FLOPs costing prices."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.costmodels.opkinds import op_kind
from autopar.passes import rules
from autopar.passes.rules.moe import rows_share
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules.registry import LocalContext
from autopar.passes.simulate import check_strategy

importlib.import_module("transformers.integrations.moe")  # registers transformers' grouped_mm_fallback
ATEN = torch.ops.aten._grouped_mm.default
FALLBACK = torch.ops.transformers.grouped_mm_fallback.default
MESHES = [(2,), (4,), (2, 2)]


def _call(rng: random.Random, op, experts: int, empty_expert: bool = True):
    """(x, w, offs) with every row routed (the ops leave rows past offs[-1] unwritten); K and
    N multiples of 32, so that float32 shards keep aten._grouped_mm's 16-byte alignment."""
    k, n = rng.choice([32, 64]), rng.choice([32, 64])
    counts = [rng.randrange(1, 4) for _ in range(experts)]
    if empty_expert:
        counts[rng.randrange(experts)] = 0  # an expert no row goes to
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(sum(counts), k, generator=gen)
    w = torch.randn(experts, k, n, generator=gen)
    return x, w, torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _strategies(op, args, mesh):
    info = OpInfo.from_call(op, args, {})
    return info, rules.strategies_for(info, mesh)


# The fallback shares the rule and kernel; tests/test_rules_property.py samples it on every mesh
# (op_samples.grouped_mm_sample), 3-D ones included; here it runs once with every row routed
CASES = [(ATEN, m) for m in MESHES] + [(FALLBACK, (2,))]


@pytest.mark.parametrize("op, mesh", CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v.name())
def test_every_strategy_reproduces_the_op(op, mesh):
    rng = random.Random(f"{op}{mesh}")
    kernels = 0
    for experts in (4, 8) if len(mesh) == 1 else (4,):  # 2-D: 25 strategies x 4 devices per call
        args = _call(rng, op, experts)
        info, strategies = _strategies(op, args, mesh)
        assert len(strategies) > 1, "expected sharded strategies, found replicate-only"
        for strategy in strategies:
            check_strategy(info, strategy, list(args), mesh, rng)
            kernels += strategy.kernel == "local_experts"
    assert kernels > 0, "expected expert-parallel strategies (local_experts)"


def test_expert_parallel_kernel_runs_on_fake_tensors():
    rng = random.Random(0)
    args = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in _call(rng, ATEN, 4))
    info, strategies = _strategies(ATEN, args, (2,))  # fake aten._grouped_mm takes bf16 only
    ep = next(s for s in strategies if s.kernel == "local_experts")
    with FakeTensorMode() as mode:
        x, w, offs = (mode.from_tensor(t) for t in args)
        out = rules.run_local(info, ep, [x, w[:2], offs], LocalContext((2,), (1,)))
    assert tuple(out.shape) == (args[0].shape[0], args[1].shape[2])


def test_expert_parallel_gradients_reach_only_this_devices_rows():
    rng = random.Random(1)
    x, w, offs = _call(rng, ATEN, 4, empty_expert=False)
    info, strategies = _strategies(ATEN, (x, w, offs), (2,))
    ep = next(s for s in strategies if s.kernel == "local_experts")
    weights = torch.randn(x.shape[0], w.shape[2], generator=torch.Generator().manual_seed(0))
    grads = []
    for device in range(2):
        xs, ws = x.clone().requires_grad_(), w[2 * device:2 * device + 2].clone().requires_grad_()
        rules.run_local(info, ep, [xs, ws, offs], LocalContext((2,), (device,))).mul(weights).sum().backward()
        grads.append((xs.grad, ws.grad))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ATEN(xr, wr, offs).mul(weights).sum().backward()
    torch.testing.assert_close(grads[0][0] + grads[1][0], xr.grad)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]]), wr.grad)
    split = int(offs[1])  # device 0 holds experts 0-1: rows [0, split)
    assert grads[0][0][split:].abs().max() == 0 and grads[1][0][:split].abs().max() == 0


def _rows_split(strategy) -> bool:
    """x split by rows (a block of the expert-sorted rows per device) on some mesh axis."""
    return any(getattr(p, "dim", None) == 0 and p.is_shard() for p in strategy.inputs[0])


@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_rows_split_strategies_reproduce_the_op(mesh):
    """Blocks of rows that start and end inside experts' runs, alone and with the experts or
    the columns split on the other axis: every one equals the whole op."""
    rng = random.Random(f"rows{mesh}")
    checked = set()
    for counts in ([3, 0, 5, 4], [1, 6, 1, 4], [0, 0, 12, 0]):
        gen = torch.Generator().manual_seed(len(checked))
        x, w = torch.randn(sum(counts), 32, generator=gen), torch.randn(4, 32, 64, generator=gen)
        offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        info, strategies = _strategies(ATEN, (x, w, offs), mesh)
        for strategy in (s for s in strategies if _rows_split(s)):
            assert strategy.kernel == "local_experts", strategy
            check_strategy(info, strategy, [x, w, offs], mesh, rng)
            checked.add(str(strategy))
    expected = {"(S(0), R, R) -> S(0) [local_experts]"} if mesh == (4,) else {
        "(S(0)R, RS(0), RR) -> S(0)P [local_experts]", "(S(0)R, RS(2), RR) -> S(0)S(1) [local_experts]"}
    assert expected <= checked, checked


def test_rows_split_gradients_reach_only_this_devices_block():
    rng = random.Random(2)
    x, w, offs = _call(rng, ATEN, 4, empty_expert=False)
    x = torch.cat([x, x])[: 2 * (x.shape[0] // 2)]  # an even number of rows
    offs = torch.cumsum(torch.tensor([x.shape[0] // 4, x.shape[0] // 2, 0, x.shape[0] - 3 * (x.shape[0] // 4)]),
                        0).to(torch.int32)
    info, strategies = _strategies(ATEN, (x, w, offs), (2,))
    rows = next(s for s in strategies if _rows_split(s))
    weights = torch.randn(x.shape[0], w.shape[2], generator=torch.Generator().manual_seed(0))
    half = x.shape[0] // 2
    xg, wg = [], torch.zeros_like(w)
    for device in range(2):
        xs, ws = x[device * half:(device + 1) * half].clone().requires_grad_(), w.clone().requires_grad_()
        out = rules.run_local(info, rows, [xs, ws, offs], LocalContext((2,), (device,)))
        out.mul(weights[device * half:(device + 1) * half]).sum().backward()
        xg.append(xs.grad)
        wg += ws.grad
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ATEN(xr, wr, offs).mul(weights).sum().backward()
    torch.testing.assert_close(torch.cat(xg), xr.grad)
    torch.testing.assert_close(wg, wr.grad)


def test_rows_split_kernel_runs_on_fake_tensors():
    x, w = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(4, 32, 64, dtype=torch.bfloat16)
    offs = torch.tensor([2, 3, 6, 8], dtype=torch.int32)
    info, strategies = _strategies(ATEN, (x, w, offs), (2, 2))  # fake aten._grouped_mm takes bf16 only
    both = next(s for s in strategies if _rows_split(s) and str(s).startswith("(S(0)R, RS(0)"))
    shards = [x[4:], w[2:], offs]  # device (1, 1): the second block of rows, experts 2-3
    with FakeTensorMode() as mode:
        out = rules.run_local(info, both, [mode.from_tensor(t) for t in shards], LocalContext((2, 2), (1, 1)))
    assert tuple(out.shape) == (4, 64)


def test_grouped_matmuls_are_priced_as_matmuls_of_the_rows_computed():
    """FLOPs at the matmul rate (they were priced as a memory-bound op); a device that runs its
    experts only computes their share of the rows (its block of rows: the local shape's)."""
    assert op_kind(str(ATEN)) == op_kind(str(FALLBACK)) == "matmul"
    x, w, offs = torch.randn(8, 32), torch.randn(4, 32, 64), torch.tensor([2, 3, 6, 8], dtype=torch.int32)
    info, strategies = _strategies(ATEN, (x, w, offs), (2, 2))
    shares = {str(s): rows_share(info, s, (2, 2)) for s in strategies}
    assert shares["(RR, RS(0), RR) -> RP [local_experts]"] == 0.5
    assert shares["(RR, S(0)S(0), RR) -> PP [local_experts]"] == 0.25
    assert shares["(S(0)R, RS(2), RR) -> S(0)S(1) [local_experts]"] == 1.0
    assert shares["(RR, RS(2), RR) -> RS(1)"] == 1.0
