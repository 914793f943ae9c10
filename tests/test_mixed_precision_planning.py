"""Planning under a mixed-precision policy (``autopar.plan(..., mp_policy=)``, ``autopar plan
--mp bf16``): priced as ``autopar.compile(..., mp_policy=)`` runs it (``autopar.costmodels.
precision``). Checked: the per-element formulas, and on a small GPT the ORDER of the
predictions against the same model planned without a policy (float32) and in pure bf16,
the plan's record of the policy (JSON round trip, ``explain()``), the CLI option, and the
full-scale dry run of a policy plan (``autopar.dry_run`` runs the plan's recorded policy).
Measured against the runtime: ``python -m benchmarks.memory_vs_predicted --mp bf16``.
Cost: about 20 CPU-seconds (six small plans, one CLI plan of gpt-small and one dry run of
two distinct ranks, all on the meta device or tiny).
"""

import copy
import json
import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar.cli import main
from autopar.costmodels.compute import rates
from autopar.costmodels.opkinds import Op, backward_ops
from autopar.costmodels.precision import CAST_OP, MixedPrecision
from autopar.costmodels.presets import preset
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.placements import spec_str
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.runtime.precision import Precision, capture_cast
from autopar.models import GPT, GPTConfig
from autopar.passes.plan import Plan

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
BF16_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gradients reduced in bf16 (FSDP2's rule)
STATE = ("parameters", "gradients", "optimizer")


def test_state_bytes_per_element():
    """fp32 master 4 B (split at ZeRO-2), fp32 gradient 4 B (split at 2), AdamW 8 B (split at
    1 and 2); the bf16 working copy 2 B (the cast, or ZeRO-2's gathered copy) is not state:
    the edges that read the parameter where it lies hold it."""
    mp = MixedPrecision(torch.float32, torch.bfloat16, torch.float32)
    assert mp.state_breakdown(1000, 0, 4) == {"parameters": 4000, "gradients": 4000, "optimizer": 8000,
                                              "activations": 0}
    assert mp.state_breakdown(1000, 1, 4) == {"parameters": 4000, "gradients": 4000, "optimizer": 2000,
                                              "activations": 0}
    assert mp.state_breakdown(1000, 2, 4) == {"parameters": 1000, "gradients": 1000, "optimizer": 2000,
                                              "activations": 0}
    assert mp.working_copy_bytes(1000) == 2000
    assert mp.zero_bytes(10) == {"step_gather": 40, "all_gather": 20, "reduce_scatter": 40, "all_reduce": 40}
    assert mp.describe() == "bf16 compute, fp32 master, fp32 reduce"


def test_cast_bytes_per_kernel():
    """The working copy (4 B read, 2 B written per element) and the gradient cast back (2 + 4)."""
    assert MixedPrecision(torch.float32, torch.bfloat16, torch.float32).cast_bytes(1000) == [6000, 6000]


def test_casts_are_priced_as_the_op_the_runtime_runs():
    """``x.to(bf16)`` runs ``aten._to_copy.default``: priced by the op-kind table as that op (its
    kind's byte rate), its backward (the gradient's cast back) as the table says autograd runs
    it: one bandwidth-bound kernel moving the same bytes."""
    mp = MixedPrecision(torch.float32, torch.bfloat16, torch.float32)
    profile = preset("h100", (4,))
    assert CAST_OP == "aten._to_copy.default"
    backward = backward_ops(Op(0.0, 6000.0, "fp32", CAST_OP))
    assert [(op.name, op.bytes) for op in backward] == [("memory", 6000.0)]
    _, forward_rate = rates(CAST_OP, "fp32", profile)
    _, backward_rate = rates("memory", "fp32", profile)
    assert mp.cast_time(1000, profile) == pytest.approx(6000 / forward_rate.rate + 6000 / backward_rate.rate,
                                                        rel=1e-12)


def test_casts_are_priced_on_the_parameters_placement():
    """Under the policy a parameter's placeholder costs its casts (compute, at elementwise
    bandwidth) for the elements of each placement: a quarter for a placement split over 4;
    nothing without a policy."""
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=1))
    tokens = torch.randint(0, 64, (4, 8))
    profile = preset("h100", (4,))
    mp = MixedPrecision(torch.float32, torch.bfloat16, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = build_strategy_graph(capture(model, (tokens,)), (4,))
        cast = build_strategy_graph(capture_cast(capture, model, Precision.of(BF16))((tokens,)), (4,))
    for graph, policy in ((plain, None), (cast, mp)):
        costs = build_costs(graph, profile)
        node = next(n for n in graph.nodes if graph.captured.params.get(n.name) == "head.weight")
        by_spec = {spec_str(s.output): float(costs.compute[costs.index[node]][i])
                   for i, s in enumerate(graph.nodes[node].strategies)}
        if policy is None:
            assert set(by_spec.values()) == {0.0}
            continue
        numel = model.head.weight.numel()
        assert by_spec["R"] == pytest.approx(policy.cast_time(numel, profile), rel=1e-12) and by_spec["R"] > 0
        assert by_spec["S(0)"] == pytest.approx(policy.cast_time(numel / 4, profile), rel=1e-12)
        assert by_spec["S(0)"] < by_spec["R"]


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=32, dim=64, n_heads=4, n_layers=2))
    return model, torch.randint(0, 256, (8, 32))


def planned(gpt, layout, **kwargs) -> Plan:
    model, tokens = gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (4,), (tokens,), hardware="h100", layout=layout, time_limit_s=5, **kwargs)


@pytest.fixture(scope="module")
def dp_plans(gpt):
    bf16_model = copy.deepcopy(gpt[0]).to(torch.bfloat16)
    return {"fp32": planned(gpt, "dp"), "mixed": planned(gpt, "dp", mp_policy=BF16),
            "bf16-reduce": planned(gpt, "dp", mp_policy=BF16_REDUCE),
            "pure-bf16": planned((bf16_model, gpt[1]), "dp")}


def saved_elements(model: torch.nn.Module) -> int:
    """Elements of the parameters whose working copies backward keeps: what a linear's backward
    saves (its weight, not its bias) and a layer norm's (weight and bias); an embedding's
    backward saves no weight."""
    return sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in [m.weight]) + sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())


def test_masters_and_adamw_state_are_priced_in_float32(dp_plans, gpt):
    """The master copy, its gradients and AdamW's moments are float32 as without a policy (a
    pure bf16 model holds half of each), and the bf16 working copies come on top."""
    fp32, mixed, pure = (dp_plans[k].predicted.memory for k in ("fp32", "mixed", "pure-bf16"))
    assert all(mixed[k] == fp32[k] for k in STATE), (mixed, fp32)
    assert all(pure[k] == fp32[k] / 2 for k in STATE), (pure, fp32)
    logits = gpt[1].numel() // 4 * gpt[0].head.out_features  # this rank's rows of the logits
    # activations in bf16 (half of float32's) plus a 2-byte working copy of every parameter
    # backward keeps (dp: whole); the loss reads the logits cast to output_dtype float32: its
    # log-softmax kept in 4 bytes, not 2
    copies = 2 * saved_elements(gpt[0])
    assert mixed["activations"] == pytest.approx(fp32["activations"] / 2 + copies + 2 * logits, rel=0.005)


def test_time_is_bf16_compute_and_reduce_dtype_communication(dp_plans, gpt):
    """bf16 matmul rates with the casts priced on top (at their kind's byte rate; their launch
    latency is not priced: ``MixedPrecision.cast_time``) still compute faster than float32."""
    fp32, mixed, reduce16 = (dp_plans[k].predicted for k in ("fp32", "mixed", "bf16-reduce"))
    mp = MixedPrecision(torch.float32, torch.bfloat16, torch.float32)
    profile = preset("h100", (4,))
    casts = sum(mp.cast_time(p.numel(), profile) for p in gpt[0].parameters())  # dp: every one whole
    assert casts > 0
    assert mixed.compute < fp32.compute
    assert dp_plans["pure-bf16"].predicted.compute < mixed.compute  # a bf16 model casts nothing
    assert reduce16.communication < mixed.communication  # gradients all-reduced in 2 bytes, not 4
    assert mixed.communication == pytest.approx(fp32.communication, rel=0.05)  # float32 reductions either way


def test_zero3_keeps_no_working_copy(gpt, dp_plans):
    """FSDP runs dp's ops on parameters stored split, gathered in bf16 and freed after use
    (ZeRO-3): no working copy stays, where dp keeps a whole 2-byte copy of every parameter
    backward saves, so their activations differ by exactly those copies. Tensor parallelism
    reads its shards where they lie and keeps their copies (a quarter of the column- and
    row-parallel weights, the layer norms whole) on top of fp32's halved activations."""
    dp = dp_plans["mixed"].predicted.memory
    fsdp = planned(gpt, "fsdp", mp_policy=BF16).predicted.memory
    assert dp["activations"] - fsdp["activations"] == pytest.approx(2 * saved_elements(gpt[0]), rel=1e-9)
    tp = planned(gpt, "tp").predicted.memory
    tp_mixed = planned(gpt, "tp", mp_policy=BF16).predicted.memory
    linears = sum(m.weight.numel() for m in gpt[0].modules() if isinstance(m, torch.nn.Linear))
    assert tp_mixed["activations"] - tp["activations"] / 2 >= 2 * linears / 4


def test_zero3_gathers_in_bf16(gpt):
    """FSDP's gathers (forward, and again in backward) move bf16; its reduce-scatters float32."""
    fp32, mixed = planned(gpt, "fsdp").predicted, planned(gpt, "fsdp", mp_policy=BF16).predicted
    reduce16 = planned(gpt, "fsdp", mp_policy=BF16_REDUCE).predicted
    assert reduce16.communication < mixed.communication < fp32.communication


def test_the_plan_records_the_policy(dp_plans):
    plan = dp_plans["mixed"]
    assert plan.mp_policy == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": "float32",
                              "cast_forward_inputs": True, "priced": "bf16 compute, fp32 master, fp32 reduce"}
    assert Plan.from_json(plan.to_json()).mp_policy == plan.mp_policy
    assert "mixed precision: bf16 compute, fp32 master, fp32 reduce" in plan.explain()
    assert dp_plans["fp32"].mp_policy is None and "mixed precision" not in dp_plans["fp32"].explain()


def test_the_dry_run_runs_the_policy_and_agrees_with_the_prediction():
    """The dry run (MemTracker on fake tensors) of an FSDP plan made under the policy holds
    float32 masters and AdamW state as predicted; its peak within 15% of the prediction
    (measured: predicted / dry run = 1.11 here, 1.10 for the auto plan of a larger GPT;
    the prediction adds the gradients to backward's start, where the dry run's peak has none)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, max_seq_len=64, dim=64, n_heads=4, n_layers=2))
    inputs = (torch.zeros(8, 64, dtype=torch.long, device="meta"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2, 2), inputs, hardware="h100", layout="fsdp", mp_policy=BF16)
        result = autopar.dry_run(plan, model, inputs, ranks=[0])  # every rank runs the same program
    assert result.ok, result.table()
    optimizer = max(r.memory["optimizer"] for r in result.ranks)
    assert plan.predicted.memory["optimizer"] == pytest.approx(optimizer, rel=0.02)  # float32 AdamW moments
    assert plan.predicted.memory["optimizer"] == pytest.approx(2 * plan.predicted.memory["parameters"], rel=0.02)
    assert result.ratio == pytest.approx(1.0, abs=0.15), result.table()


def test_cli_plans_under_the_policy(tmp_path, capsys):
    assert main(["plan", "gpt-small", "--mesh", "2", "--layout", "dp", "--mp", "bf16", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    assert "mixed precision: bf16 compute, fp32 master" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["mp_policy"]["param_dtype"] == "bfloat16"
