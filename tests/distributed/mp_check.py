"""Run under torchrun: mixed precision (FSDP2's ``MixedPrecisionPolicy``: bf16 compute,
float32 master weights and AdamW state) under every non-pipelined layout, compared with one
process applying the same policy, and (``fsdp2:``) with FSDP2 ``fully_shard`` itself.
Prints one JSON line per case on rank 0.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.mp_check 2:gpt:dp fsdp2:2:gpt:fsdp ...

Cases: ``<mesh>:<model>:<layout>`` (policy: bf16 compute, float32 reduce and output; models
``gpt`` (token inputs) and ``mlp`` (float inputs, cast by ``cast_forward_inputs``));
``recompute:`` the same with layer 0 recomputed; ``accum:`` each step as 2 accumulated
micro-batches (``train_step(accumulate=2)``, against the whole-batch reference); ``bf16-reduce:`` reduce_dtype and
output_dtype None (gradients reduced in bf16, as FSDP2 does then; bf16 outputs and loss);
``fsdp2:`` also FSDP2 ``fully_shard`` with the same policy on the same 1-D mesh (each block,
then the root); ``replay:`` the layout planned under the policy (``autopar.plan(..., mp_policy=)``),
its JSON compiled without ``mp_policy`` (the plan's recorded policy runs); ``pp:<mesh>:<model>:<schedule>:<micro-batches>:<chunks>[:<intra-op layout>[:<reduce dtype>]]``
a pipeline over mesh axis 0 (stages cut as ``tests.distributed.plans.pipeline_plan`` cuts
them; data parallel on the other axes, or the layout named, e.g. ``zero2``) under the policy,
with gradients reduced in ``reduce dtype`` (e.g. ``bfloat16``; default float32); ``errors``:
the refused combinations.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import autopar
from autopar.models import GPT, GPTConfig, WideMLP
from autopar.passes.lowering.recompute import Recomputed
from autopar.passes.plan import Plan
from autopar.runtime.precision import MixedGather
from tests.distributed import ending
from tests.distributed.plans import case_plan, pipeline_plan, planned

STEPS = 3
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt_case():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2))  # float32: the masters
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen))
               for _ in range(STEPS)]
    return model, lm_loss, batches


def mlp_case():
    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=2)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(STEPS)]
    return model, F.mse_loss, batches


MODELS = {"gpt": gpt_case, "mlp": mlp_case}


def reference_forward(model, inputs, policy):
    """One process under ``policy``: bf16 copies of the float32 parameters (autograd casts
    their gradients back into the masters' .grad), floating inputs cast, the output cast."""
    working = {n: p.to(policy.param_dtype) for n, p in model.named_parameters()}
    inputs = inputs.to(policy.param_dtype) if inputs.is_floating_point() and policy.cast_forward_inputs else inputs
    out = torch.func.functional_call(model, working, (inputs,))
    return out.to(policy.output_dtype) if policy.output_dtype else out


def reference_run(model, loss_fn, batches, policy):
    """The one-process reference: the same policy, AdamW on the float32 masters."""
    opt = adamw(list(model.parameters()))
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = loss_fn(reference_forward(model, inputs, policy), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class Collectives:
    """The dtypes of the collectives torch.distributed runs inside, by kind."""

    KINDS = ("all_gather_single", "reduce_scatter_single", "all_reduce")

    def __init__(self):
        self.seen = Counter()
        self._saved = {}

    def __enter__(self):
        for kind in self.KINDS:
            original = self._saved[kind] = getattr(dist, kind)

            def recorded(tensor, *args, _kind=kind, _original=original, **kwargs):
                self.seen[f"{_kind}:{str(tensor.dtype).removeprefix('torch.')}"] += 1
                return _original(tensor, *args, **kwargs)

            setattr(dist, kind, recorded)
        return self

    def __exit__(self, *exc):
        for kind, original in self._saved.items():
            setattr(dist, kind, original)


def update_error(before, after, ref_before, ref_after) -> float:
    """|run's update - reference's update| / |reference's update|, over all parameters."""
    diff = sum(((a - b) - (ra - rb)).pow(2).sum() for a, b, ra, rb in zip(after, before, ref_after, ref_before))
    norm = sum((ra - rb).pow(2).sum() for ra, rb in zip(ref_after, ref_before))
    return (diff / norm).sqrt().item()


def mesh_of(text: str):
    shape = tuple(int(x) for x in text.split("x"))
    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(shape))))


def run_case(spec: str) -> dict:
    parts = spec.split(":")
    mode = parts.pop(0) if parts[0] in ("recompute", "bf16-reduce", "fsdp2", "accum", "replay") else None
    mesh_text, model_name, layout = parts
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mode == "bf16-reduce" else POLICY
    mesh = mesh_of(mesh_text)
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    fsdp = FullyShardedRun(copy.deepcopy(model), mesh, loss_fn) if mode == "fsdp2" else None
    before = [p.detach().clone() for p in model.parameters()]
    tokens = batches[0][0]
    plan = planned(model, mesh, tokens, layout) if mode == "recompute" else case_plan(model, mesh, tokens, layout)
    if mode == "recompute":
        plan.recompute = ["layer 0"]
    if mode == "replay":  # a plan priced under the policy, saved, compiled without mp_policy: runs under it
        plan = policy_plan(model, mesh, tokens, layout, policy)
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan, hardware="h100",
                         mp_policy=None if mode == "replay" else policy)
    with torch.no_grad():  # before any step: the same weights everywhere
        logits = pm(tokens)
        fp32_logits = reference(tokens)
        bf16_logits = reference_forward(reference, tokens, policy)
    accumulate = 2 if mode == "accum" else 1
    losses = []
    with Collectives() as seen:
        losses.append(pm.train_step((tokens,), batches[0][1], accumulate=accumulate).item())
    for inputs, target in batches[1:]:
        losses.append(pm.train_step((inputs,), target, accumulate=accumulate).item())
    ref_losses = reference_run(reference, loss_fn, batches, policy)
    full = pm.full_parameters()
    names = [n for n, _ in reference.named_parameters()]
    after = [full[n] for n in names]
    against_fsdp2 = {} if fsdp is None else fsdp.compare(batches, losses, before, after)
    return {
        "case": spec, "losses": losses, "ref_losses": ref_losses,
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "update_err": update_error(before, after, before, [p.detach() for p in reference.parameters()]),
        "param_err": max((a - b.detach()).abs().max().item() for a, b in zip(after, reference.parameters())),
        "logits_dtype": str(logits.dtype), "logit_err": (logits - bf16_logits).abs().max().item(),
        "fp32_logit_err": (fp32_logits - bf16_logits).abs().max().item(),
        **held_dtypes(pm), "collectives": dict(seen.seen),
        "recomputed": [m.layer for gm in programs_of(pm) for m in gm.modules() if isinstance(m, Recomputed)],
        "pipeline": pm.plan.pipeline is not None, **against_fsdp2,
    }


def policy_plan(model, mesh, tokens, layout: str, policy):
    """``autopar.plan(..., layout=, mp_policy=)`` on rank 0, replayed from its JSON on every rank."""
    text = [autopar.plan(model, mesh, (tokens,), hardware="h100", layout=layout, mp_policy=policy).to_json()
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text)
    return Plan.from_json(text[0])


def programs_of(pm) -> list:
    """The rank's graph modules: a ParallelModule's one, a PipelineModule's stages'."""
    return [pm.gm] if hasattr(pm, "gm") else [program.gm for program in pm.programs]


def held_dtypes(pm) -> dict:
    """The dtypes of the masters, their gradients and AdamW's state; the casts and mixed gathers."""
    params = [p for group in pm.optimizer.param_groups for p in group["params"]]  # what it steps (ZeRO: slices)
    gms = programs_of(pm)
    return {
        "masters": sorted({str(p.dtype) for p in params}),
        "grads": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
        "state": sorted({str(t.dtype) for s in pm.optimizer.state.values() for t in s.values() if t.dim() > 0}),
        "casts": sum(1 for gm in gms for n in gm.graph.nodes
                     if n.op == "call_function" and getattr(n.target, "__name__", "") == "to_compute"),
        "mixed_gathers": sum(1 for gm in gms for m in gm.modules() if isinstance(m, MixedGather)),
    }


def pipeline_case(spec: str) -> dict:
    """pp:<mesh>:<model>:<schedule>:<micro-batches>:<chunks>[:<intra-op layout>[:<reduce dtype>]]:
    the stages under POLICY (its reduce_dtype replaced when one is named) against one process
    under it; what the stages send on (forward outputs of all but the last)."""
    _, mesh_text, model_name, schedule, m, v, *rest = spec.split(":")
    intra_layout = rest[0] if rest else None
    policy = dataclasses.replace(POLICY, reduce_dtype=getattr(torch, rest[1])) if len(rest) > 1 else POLICY
    mesh = mesh_of(mesh_text)
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = batches[0][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = pipeline_plan(model, tokens, tuple(mesh.shape), schedule, int(m), int(v), intra_layout)
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan, mp_policy=policy)
    sent = Counter()
    for stage in pm.stages:
        if not stage.is_last:
            stage.submod.register_forward_hook(
                lambda module, args, out: sent.update(str(t.dtype) for t in out if t.is_floating_point()))
    with torch.no_grad():
        logits = pm(tokens)
        bf16_logits = reference_forward(reference, tokens, policy)
    losses = []
    with Collectives() as seen:
        losses.append(pm.train_step((tokens,), batches[0][1]).item())
    for inputs, target in batches[1:]:
        losses.append(pm.train_step((inputs,), target).item())
    ref_losses = reference_run(reference, loss_fn, batches, policy)
    full = pm.full_parameters()
    after = [full[n] for n, _ in reference.named_parameters()]
    return {"zero2_here": len(pm.optimizer_slices.reduced),
        "case": spec, "losses": losses, "ref_losses": ref_losses,
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "update_err": update_error(before, after, before, [p.detach() for p in reference.parameters()]),
        "logits_dtype": str(logits.dtype), "logit_err": (logits - bf16_logits).abs().max().item(),
        **held_dtypes(pm), "sent": dict(sent), "collectives": dict(seen.seen), "stages": len(pm.stages),
    }


class FullyShardedRun:
    """FSDP2 ``fully_shard`` (each block, then the root) with the same policy on the same
    1-D mesh, each rank on its rows of the batch: what autopar's dp and zero3 layouts run."""

    def __init__(self, model, mesh, loss_fn):
        # blocks hand bf16 on; only the root's output is cast (output_dtype)
        inner = MixedPrecisionPolicy(param_dtype=POLICY.param_dtype, reduce_dtype=POLICY.reduce_dtype)
        for block in getattr(model, "blocks", None) or model.layers:
            fully_shard(block, mesh=mesh, mp_policy=inner)
        self.model = fully_shard(model, mesh=mesh, mp_policy=POLICY)
        self.loss_fn = loss_fn

    def compare(self, batches, losses, before, after) -> dict:
        """Train as many steps; the largest loss and update differences from autopar's run."""
        opt = adamw(list(self.model.parameters()))
        rank, world = dist.get_rank(), dist.get_world_size()
        theirs = []
        for inputs, target in batches:
            opt.zero_grad()
            loss = self.loss_fn(self.model(inputs.chunk(world)[rank]), target.chunk(world)[rank])
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            theirs.append(mean.item())
        params = [p.full_tensor() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        return {
            "fsdp2_losses": theirs, "fsdp2_loss_err": max(abs(a - b) for a, b in zip(losses, theirs)),
            "fsdp2_update_err": update_error(before, after, before, [p.detach() for p in params]),
            "fsdp2_param_err": max((a - b.detach()).abs().max().item() for a, b in zip(after, params)),
        }


def error_cases() -> dict:
    """The refused combinations that need a mesh: each an ``autopar:`` error (the policy's
    own checks: tests/test_mixed_precision.py)."""
    mesh = mesh_of(str(dist.get_world_size()))
    model, _, batches = gpt_case()
    tokens = batches[0][0]
    messages = {}

    def expect(what, fn):
        try:
            fn()
            messages[what] = "no error"
        except (ValueError, TypeError) as exc:
            messages[what] = str(exc)

    plan = case_plan(model, mesh, tokens, "dp")
    mixed = copy.deepcopy(model)
    mixed.head.to(torch.float64)
    expect("mixed master dtypes", lambda: autopar.compile(mixed, mesh, (tokens,), loss_fn=lm_loss, optimizer=adamw,
                                                          plan=plan, mp_policy=POLICY))
    return {"case": "errors", "messages": messages}


def run(spec: str) -> dict:
    """One case's result (the ``errors`` case, a pipeline or a layout)."""
    if spec == "errors":
        return error_cases()
    if spec.startswith("pp:"):
        return pipeline_case(spec)
    return run_case(spec)


# --- the checks of a case's result (tests/test_mixed_precision_distributed.py, and the 8-rank
# cases batched into tests/test_train_distributed.py's launch as ``mp:<case>``) ---------------
LOSS_TOLERANCE = 2e-3  # float32 losses (output_dtype float32)
BF16_LOSS_ULPS = 2  # a loss computed in bf16 (output_dtype None) rounds to bf16: within 2 units in its last place
UPDATE_TOLERANCE = 0.15
GATHERED = ("zero2", "fsdp", "zero3", "fsdp+tp")  # layouts that gather parameters from split storage


def bf16_ulp(x: float) -> float:
    """bf16's unit in the last place at ``x``: 2^-7 of its binade."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(abs(x)))


def check_pipeline(case: str, r: dict) -> None:
    """Stages under the policy: float32 masters, bf16 compute and boundary sends; data-parallel
    stages (2x2) sum gradients in reduce_dtype; no reduction split: the first forward exact."""
    assert r["loss_err"] <= LOSS_TOLERANCE, f"{case}: losses {r['losses']} vs one process {r['ref_losses']}"
    assert r["update_err"] <= UPDATE_TOLERANCE, f"{case}: parameter updates differ by {r['update_err']:.3f}"
    assert r["masters"] == r["grads"] == r["state"] == ["torch.float32"] and r["casts"] > 0, r
    assert r["logits_dtype"] == "torch.float32" and r["logit_err"] == 0, r
    assert set(r["sent"]) == {"torch.bfloat16"}, r  # what crosses a stage boundary
    seen = r["collectives"]
    fields = case.split(":")
    if fields[6:7] == ["zero2"]:  # gradients reduce-scattered into the slices, once per step, in reduce_dtype
        reduce = fields[7] if len(fields) > 7 else "float32"
        assert r["zero2_here"] > 0 and seen.get(f"reduce_scatter_single:{reduce}", 0) >= 1, r
        if reduce == "bfloat16":  # activations move in bf16 too: nothing is reduce-scattered in float32
            assert "reduce_scatter_single:float32" not in seen, r
    elif "x" in fields[1]:
        assert seen.get("all_reduce:float32", 0) >= 1 and not any(k.startswith("all_reduce:bfloat16") for k in seen), r


def check_precision(case: str, r: dict) -> None:
    if case.startswith("pp:"):
        return check_pipeline(case, r)
    bf16_reduce = case.startswith("bf16-reduce:")
    layout = case.split(":")[-1]
    tolerance = bf16_ulp(max(r["ref_losses"])) * BF16_LOSS_ULPS if bf16_reduce else LOSS_TOLERANCE
    assert r["loss_err"] <= tolerance, f"{case}: losses {r['losses']} vs one process {r['ref_losses']}"
    assert r["update_err"] <= UPDATE_TOLERANCE, f"{case}: parameter updates differ by {r['update_err']:.3f}"
    # the float32 master copy, its gradients and AdamW's state; compute in bf16, outputs as output_dtype
    assert r["masters"] == r["grads"] == r["state"] == ["torch.float32"], r
    assert r["logits_dtype"] == ("torch.bfloat16" if bf16_reduce else "torch.float32"), r
    seen = r["collectives"]
    if layout in ("dp", "zero3"):  # no reduction split: the first forward is the reference's, bit for bit
        assert r["logit_err"] == 0 < r["fp32_logit_err"], r
    if layout in GATHERED:  # buckets gathered in bf16, gradients reduce-scattered in reduce_dtype
        assert r["mixed_gathers"] > 0 and seen.get("all_gather_single:bfloat16", 0) > 0, r
        reduced = "reduce_scatter_single:" + ("bfloat16" if bf16_reduce else "float32")
        assert seen.get(reduced, 0) >= r["mixed_gathers"], r
    if layout in ("dp", "zero1"):  # data-parallel shares summed in reduce_dtype (float32)
        assert seen.get("all_reduce:float32", 0) >= 1 and not any(k.startswith("all_reduce:bfloat16") for k in seen), r
    if case.startswith("recompute:"):
        assert r["recomputed"] == [0], r
    if case.startswith("fsdp2:"):  # FSDP2 with the same policy: the same reductions in the same order
        assert r["fsdp2_update_err"] == 0 and r["fsdp2_param_err"] == 0, r
        assert r["fsdp2_loss_err"] <= 1e-5, r  # FSDP2's loss: the mean of the ranks' means, rounded otherwise


def main(cases: list[str]) -> None:
    dist.init_process_group("gloo")
    for spec in cases:
        start = time.perf_counter()
        try:
            result = run(spec)
        except Exception as exc:  # reported, then the launch ends: other ranks may be stuck
            print("RESULT " + json.dumps({"case": spec, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            os._exit(1)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({**result, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
