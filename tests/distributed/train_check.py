"""Run under torchrun: train compiled models for a few AdamW steps and compare, on every
rank, with the same model trained in one process. Prints one JSON line per case on rank 0.

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.train_check 2x2:gpt:random0 ...
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autopar.models import GPT, GPTConfig, WideMLP
import autopar
from autopar.runtime import checkpoint
from autopar.passes.capture import capture
from autopar.passes.explain import stage_starts
from autopar.passes.lowering.codegen import LocalKernel
from autopar.passes.plan import Pipeline, Plan
from tests.distributed import dropout_check, ending, mp_check
from tests.distributed.plans import case_plan, layout_plan, pipeline_plan, planned

STEPS = 5


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def mse(out, target):
    return F.mse_loss(out, target)


# float64, so that "trains the same" can be checked tightly: AdamW divides by the root of
# tiny second moments, which turns float32 rounding into visible parameter differences.
DTYPE = torch.float64


def gpt_case(layers: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=layers)).to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen))
        for _ in range(STEPS)
    ]
    return model, lm_loss, batches


def mlp_case():
    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=2).to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 16, generator=gen, dtype=DTYPE), torch.randn(8, 16, generator=gen, dtype=DTYPE))
        for _ in range(STEPS)
    ]
    return model, mse, batches


def hf_lm_loss(output, target):
    return lm_loss(output.logits, target)


def _hf_case(factory):
    model, (tokens,) = factory()
    model = model.to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = [
        (torch.randint(0, vocab, tokens.shape, generator=gen), torch.randint(0, vocab, tokens.shape, generator=gen))
        for _ in range(STEPS)
    ]
    return model, hf_lm_loss, batches


def llama_case():
    from tests.models import llama

    return _hf_case(llama)


def llama64_case():
    """Llama with its RMSNorm computing in the model's float64, not float32: no float32 island,
    so a plan of any strategies (a random one) must train like one process to float64 rounding;
    the island, where AdamW turns float32 rounding of tiny gradients into steps of up to its
    learning rate, is left to the ``llama`` cases, at their bound."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class NormInModelDtype(LlamaRMSNorm):
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    model, loss_fn, batches = llama_case()
    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            module.__class__ = NormInModelDtype
    return model, loss_fn, batches


def gpt2_case():
    from tests.models import gpt2

    return _hf_case(gpt2)


def gptj_case():
    """Hugging Face GPT-J, 2 layers: its int64 positions cross a pipeline's cut into the
    rotary tables' ``gather``. Checked by hand (``compile-pp:2x2:gptj``: the planner picks a
    pipeline; minutes of planning, above a launch's budget). Its attention computes in
    float32 whatever the model dtype: bounds as Llama's (``TOLERANCE``)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=16, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPTJForCausalLM(config)
    return _hf_case(lambda: (model, (torch.zeros(4, 8, dtype=torch.long),)))


def indices_case():
    """Positions (int64) and a mask (bool) made at the start, read by gather, index_select
    and masked_fill at the end: a pipeline's cuts carry them (``tests.models.CutIndices``)."""
    from tests.models import CutIndices

    torch.manual_seed(0)
    model = CutIndices(vocab=64, seq=8).to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen))
        for _ in range(STEPS)
    ]
    return model, lm_loss, batches


MODELS = {"gpt": gpt_case, "mlp": mlp_case, "llama": llama_case, "llama64": llama64_case, "gpt2": gpt2_case,
          "indices": indices_case, "gptj": gptj_case, "gpt6": lambda: gpt_case(layers=6)}


def train_against_reference(pm, reference, loss_fn, batches, step=None):
    """Train the compiled model and the one-process reference on the same batches; return
    the compiled losses, the largest loss and parameter differences, and the reference's
    optimizer. ``step(k, inputs, target)`` trains the compiled model on batch k and returns
    its loss (default: one whole-batch ``train_step``)."""
    step = step or (lambda k, inputs, target: pm.train_step((inputs,), target))
    ref_opt = adamw(list(reference.parameters()))
    losses, ref_losses = [], []
    for k, (inputs, target) in enumerate(batches):
        losses.append(step(k, inputs, target).item())
        ref_opt.zero_grad()
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    full = pm.full_parameters()
    param_err = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return losses, max(abs(a - b) for a, b in zip(losses, ref_losses)), param_err, ref_opt


def optimizer_numel(opt) -> int:
    return sum(t.numel() for state in opt.state.values() for t in state.values() if t.dim() > 0)


def run_case(spec: str) -> dict:
    mesh_text, model_name, layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    tokens = batches[0][0]
    plan = case_plan(model, mesh, tokens, layout)
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan, hardware="h100")

    losses, loss_err, param_err, ref_opt = train_against_reference(pm, reference, loss_fn, batches)
    n_reshard = sum(1 for n in pm.gm.graph.nodes if n.op == "call_module" and "Reshard" in type(pm.gm.get_submodule(n.target)).__name__)
    kernels = sorted({m.strategy.kernel for m in pm.gm.modules() if isinstance(m, LocalKernel)})
    state = torch.tensor([optimizer_numel(pm.optimizer)], dtype=torch.float64)
    dist.all_reduce(state)
    return {
        "case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses, "reshards": n_reshard,
        "kernels": kernels,
        "optimizer_numel_rank0": optimizer_numel(pm.optimizer), "optimizer_numel_all": int(state.item()),
        "reference_optimizer_numel": optimizer_numel(ref_opt), "plan_kind": pm.plan.kind,
        "params": pm.plan.params,
    }


CLIP_MAX_NORM = {2.0: 0.05, 3.0: 0.02, float("inf"): 0.002}  # below every step's norm: each step clips


def clip_case(spec: str) -> dict:
    """clip[-<norm type>][-loop]:<mesh>:<model>:<layout> or clip[-<norm type>][-loop]:pp:<pipeline case>:
    ``train_step(max_norm=)`` (``loop``: the loop people write, ``pm.loss(...).backward()``,
    ``pm.clip_grad_norm_``, ``pm.step()``) trains like one process clipping with
    ``torch.nn.utils.clip_grad_norm_``, and ``clip_grad_norm_`` returns torch's norm on every rank."""
    head, rest = spec.split(":", 1)
    options = head.split("-")[1:]
    loop = "loop" in options
    norm_type = next((float(o) for o in options if o != "loop"), 2.0)
    parts = rest.split(":")
    pipelined = parts[0] == "pp"
    mesh_text, model_name = parts[1:3] if pipelined else parts[:2]
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    tokens = batches[0][0]
    if pipelined:
        schedule, m, v, *intra_layout = parts[3:]
        plan = pipeline_plan(model, tokens, mesh_shape, schedule, int(m), int(v), *intra_layout)
    else:
        plan = case_plan(model, mesh, tokens, parts[2])
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan, hardware="h100")
    norms, clip = [], pm.clip_grad_norm_

    def recorded(*args, **kwargs):  # every clip goes through this: keep the norms it returns
        norms.append(clip(*args, **kwargs))
        return norms[-1]

    pm.clip_grad_norm_ = recorded
    max_norm = CLIP_MAX_NORM[norm_type]
    inside_no_sync = "no error"  # clipping unsummed shares must be refused
    if loop:
        try:
            with pm.no_sync():
                clip(max_norm, norm_type)
        except ValueError as exc:
            inside_no_sync = str(exc)
    ref_opt = adamw(list(reference.parameters()))
    losses, ref_losses, ref_norms = [], [], []
    for inputs, target in batches:
        if loop:
            loss = pm.loss((inputs,), target)
            loss.backward()
            pm.clip_grad_norm_(max_norm, norm_type)
            pm.step()
            pm.zero_grad()
        else:
            loss = pm.train_step((inputs,), target, max_norm=max_norm, norm_type=norm_type)
        losses.append(loss.item())
        ref_opt.zero_grad()
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type).item())
        ref_opt.step()
        ref_losses.append(loss.item())
    full = pm.full_parameters()
    param_err = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    mine = torch.stack(norms).to(torch.float64)
    highest, lowest = mine.clone(), mine.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return {"case": spec, "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_err": param_err,
            "losses": losses, "norms": mine.tolist(), "reference_norms": ref_norms, "max_norm": max_norm,
            "norm_err": max(abs(a - b) for a, b in zip(mine.tolist(), ref_norms)),
            "norm_spread": (highest - lowest).abs().max().item(),  # the norm differs between ranks by this
            "optimizer_numel_rank0": optimizer_numel(pm.optimizer), "reference_optimizer_numel": optimizer_numel(ref_opt),
            "module": type(pm).__name__, "plan_kind": pm.plan.kind, "inside_no_sync": inside_no_sync}


def sampled_batches(dataset, batch: int, dp) -> tuple[list, list]:
    """This rank's batches from a DistributedSampler given ``pm.data_parallel``, and the
    whole batches they make together (what one process trains on)."""
    from torch.utils.data import DataLoader, DistributedSampler

    def batches_of(rank):
        sampler = DistributedSampler(dataset, num_replicas=dp.num_replicas, rank=rank, shuffle=True, seed=0)
        return list(DataLoader(dataset, batch_size=batch // dp.num_replicas, sampler=sampler))

    everyone = [batches_of(r) for r in range(dp.num_replicas)]
    wholes = [tuple(torch.cat([b[k][i] for b in everyone]) for i in range(len(everyone[0][k])))
              for k in range(len(everyone[0]))]
    return everyone[dp.rank], wholes


def data_ranks(pm) -> list:
    """Every rank's (num_replicas, rank) from ``pm.data_parallel``, in global rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pm.data_parallel.num_replicas, pm.data_parallel.rank))
    return gathered


def local_case(spec: str) -> dict:
    """local:<mesh>:<model>:<layout>: per-rank data from the first step. Each rank draws its
    rows (inputs and targets) with a DistributedSampler given ``pm.data_parallel`` and
    passes them with ``local=True``; one process trains on the batches those rows make
    together; then one whole-batch step (local=False) on the same module."""
    _, mesh_text, model_name, layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    tokens = batches[0][0]
    # "pp": a 1F1B pipeline over axis 0, data parallel on the others
    plan = pipeline_plan(model, tokens, mesh_shape, "1F1B", 2, 1) if layout == "pp" else case_plan(
        model, mesh, tokens, layout)
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan, hardware="h100")
    dataset = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    mine, wholes = sampled_batches(dataset, tokens.shape[0], pm.data_parallel)

    def step(k, inputs, target):  # this rank's rows (local=True), but the last step's whole batch
        local = k < len(wholes) - 1
        x, y = mine[k] if local else (inputs, target)
        return pm.train_step((x,), y, local=local)

    losses, loss_err, param_err, ref_opt = train_against_reference(pm, reference, loss_fn, wholes, step)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err,
            "losses": losses, "data_ranks": data_ranks(pm), "plan_kind": pm.plan.kind,
            "pipeline": pm.plan.pipeline is not None, "optimizer_numel_rank0": optimizer_numel(pm.optimizer),
            "reference_optimizer_numel": optimizer_numel(ref_opt)}


def hf_loss_case(spec: str) -> dict:
    """hf-loss:<mesh>:<layout>: Hugging Face GPT-2 given ``labels=`` as a keyword input and
    compiled with ``example_kwargs`` and ``loss_fn=None`` trains its own ``.loss`` like one
    process: whole-batch steps, then per-rank rows (``local=True``, labels among them)."""
    from tests.models import gpt2

    _, mesh_text, layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, (tokens,) = gpt2()
    model = model.to(DTYPE)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (tokens.shape[0] * STEPS, tokens.shape[1]), generator=gen)
    labels = torch.randint(0, vocab, rows.shape, generator=gen)
    labels[0, :3] = -100  # ignored positions: the mean is over the counted ones
    example = {"input_ids": tokens, "labels": tokens}
    plan = None if layout == "auto" else layout_plan(model, (), layout, mesh_shape, example)
    pm = autopar.compile(model, mesh, example_kwargs=example, optimizer=adamw, plan=plan, hardware="h100")
    mine, wholes = sampled_batches(torch.utils.data.TensorDataset(rows, labels), tokens.shape[0], pm.data_parallel)
    ref_opt = adamw(list(reference.parameters()))
    losses, ref_losses = [], []
    for k, (x, y) in enumerate(wholes):
        local = k >= 2
        given = mine[k] if local else (x, y)
        losses.append(pm.train_step({"labels": given[1], "input_ids": given[0]}, None, local=local).item())
        ref_opt.zero_grad()
        loss = reference(input_ids=x, labels=y, use_cache=False).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    full = pm.full_parameters()
    param_err = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return {"case": spec, "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_err": param_err,
            "losses": losses, "data_ranks": data_ranks(pm), "plan_kind": pm.plan.kind,
            "optimizer_numel_rank0": optimizer_numel(pm.optimizer), "reference_optimizer_numel": optimizer_numel(ref_opt)}


def recompute_case(spec: str) -> dict:
    """recompute:<mesh>:<model>:<layout>: the layout (from autopar.layouts) with layer 0
    recomputed in backward, as a plan that must recompute some layers to fit would say."""
    from autopar.passes.lowering.recompute import Recomputed

    _, mesh_text, model_name, layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    tokens = batches[0][0]
    plan = planned(model, mesh, tokens, layout)
    plan.recompute = ["layer 0"]
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    wrapped = [m.layer for m in pm.gm.modules() if isinstance(m, Recomputed)]
    assert wrapped == [0], f"expected layer 0 under checkpointing, found {wrapped}"
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses}


def moves_case() -> dict:
    """moves (4 ranks): every move of a tensor between two placements of a 2x2 mesh that
    codegen runs axis by axis (``AxisMove.chain``) over more than one axis, or with an
    all-to-all (``S(i) -> S(j)`` on an axis), gives the same forward values (a Partial's sum)
    and the same input gradient as DTensor's redistribute (the reference), for each gradient
    layout a consumer can hand back (its own placement, or shares where it is replicated)."""
    import itertools

    from torch.distributed.tensor import Partial, distribute_tensor

    from autopar.passes.lowering.codegen import Reshard
    from autopar.passes.lowering.collectives import grad_side

    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()

    def local_of(whole, spec):  # a Partial axis holds unequal parts (1/3, 2/3) of the sum
        plain = tuple(Replicate() if isinstance(p, Partial) else p for p in spec)
        x = distribute_tensor(whole, mesh, plain).to_local().clone()
        for a, p in enumerate(spec):
            if isinstance(p, Partial):
                x = x * (1 + coord[a]) / 3.0
        return x

    def summed(y, spec):  # a Partial's parts may be split otherwise (S -> P keeps each shard in place): their sum
        y = y.clone(memory_format=torch.contiguous_format)  # collectives need a dense buffer of its own
        for a, p in enumerate(spec):
            if isinstance(p, Partial):
                dist.all_reduce(y, group=mesh.get_group(a))
        return y

    gen = torch.Generator().manual_seed(0)
    value, gradient = (torch.randn(4, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    placements = [Replicate(), Shard(0), Shard(1), Partial()]
    checked, all_to_alls, mismatched = 0, 0, []
    for src, dst in itertools.product(itertools.product(placements, repeat=2), repeat=2):
        for grad in itertools.product(*[[grad_side(d)] + ([Partial()] if isinstance(d, Replicate) else []) for d in dst]):
            chained = Reshard(mesh, src, dst, grad)
            if chained.fast is None:
                continue  # DTensor's own needs no check
            swaps = any(isinstance(s.src, Shard) and isinstance(s.dst, Shard) for s in chained.fast)
            if len(chained.fast) < 2 and not swaps:
                continue  # other one-axis moves are the other cases' business
            all_to_alls += swaps
            reference = Reshard(mesh, src, dst, grad)
            reference.fast = None
            results = []
            for module in (chained, reference):
                x = local_of(value, src).requires_grad_()
                y = module(x)
                y.backward(local_of(gradient, grad))
                results.append((summed(y.detach(), dst), x.grad))
            checked += 1
            if not all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(*results)):
                mismatched.append(chained.extra_repr())
    return {"case": "moves", "checked": checked, "all_to_alls": all_to_alls, "mismatched": mismatched}


def error_cases(nproc: int) -> dict:
    """Bad input on a real mesh: each must be a clear autopar: error, raised on every rank."""
    model, loss_fn, batches = MODELS["gpt"]()
    tokens, target = batches[0]
    messages = {}

    def expect(name, fn):
        try:
            fn()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)

    flat = init_device_mesh("cpu", (nproc,))
    square = init_device_mesh("cpu", (2, nproc // 2))
    plan = layout_plan(model, (tokens,), "dp", (nproc,))
    pm = autopar.compile(model, flat, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    own = tokens.clone()
    own[0, 0] = (own[0, 0] + dist.get_rank()) % 64  # rank r > 0 sees a different batch
    expect("different inputs per rank", lambda: pm.train_step((own,), target))
    expect("plan for another mesh", lambda: autopar.compile(
        model, square, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan))
    expect("indivisible batch", lambda: layout_plan(model, (tokens[:3],), "dp", (nproc,)))
    expect("not a mesh", lambda: autopar.compile(model, (nproc,), (tokens,), plan=plan))
    expect("input of another dtype", lambda: pm.train_step((tokens.to(torch.int32),), target))

    def per_token(out, y):  # forgot the reduction: one loss per token
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")

    expect("loss_fn returning a non-scalar", lambda: autopar.compile(
        model, flat, (tokens,), loss_fn=per_token, optimizer=adamw, plan=plan).train_step((tokens,), target))
    expect("optimizer factory returning None", lambda: autopar.compile(
        model, flat, (tokens,), loss_fn=loss_fn, optimizer=lambda params: None, plan=plan))
    expect("loss_fn=None, no .loss in the output", lambda: autopar.compile(
        model, flat, (tokens,), optimizer=adamw, plan=plan))
    keyed = autopar.compile(model, flat, example_kwargs={"tokens": tokens}, loss_fn=loss_fn, optimizer=adamw, plan=plan)
    expect("other keyword inputs than compiled", lambda: keyed.train_step({"input_ids": tokens}, target))
    expect("positional inputs where keywords were compiled", lambda: keyed.train_step((tokens,), target))
    with_loss = Plan.from_json(plan.to_json())  # as autopar.plan(..., loss_fn=) marks its plans
    with_loss.includes_loss, with_loss.pipeline = True, Pipeline(axis=0, stages=nproc, micro_batches=2, schedule="GPipe")
    expect("pipeline planned with the loss", lambda: autopar.compile(
        model, flat, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=with_loss))
    return {"case": "errors", "messages": messages}


def resume_case(spec: str) -> dict:
    """resume:<mesh>:<layout>:<mesh>:<layout>: train 3 steps, save, train 2; load into the
    second layout from scratch and train the same 2 steps; losses must match."""
    _, mesh_a, layout_a, mesh_b, layout_b = spec.split(":")
    shape_a = tuple(int(x) for x in mesh_a.split("x"))
    shape_b = tuple(int(x) for x in mesh_b.split("x"))
    model, loss_fn, batches = MODELS["gpt"]()
    fresh = copy.deepcopy(model)
    tokens = batches[0][0]
    first = autopar.compile(model, init_device_mesh("cpu", shape_a), (tokens,), loss_fn=loss_fn,
                                    optimizer=adamw, plan=layout_plan(model, (tokens,), layout_a, shape_a))
    for inputs, target in batches[:3]:
        first.train_step((inputs,), target)
    path = [tempfile.mkdtemp(prefix="autopar-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    checkpoint.save(first, path[0])
    uninterrupted = [first.train_step((i,), t).item() for i, t in batches[3:]]
    second = autopar.compile(fresh, init_device_mesh("cpu", shape_b), (tokens,), loss_fn=loss_fn,
                                     optimizer=adamw, plan=layout_plan(fresh, (tokens,), layout_b, shape_b))
    checkpoint.load(second, path[0])
    resumed = [second.train_step((i,), t).item() for i, t in batches[3:]]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return {"case": spec, "uninterrupted": uninterrupted, "resumed": resumed,
            "loss_err": max(abs(a - b) for a, b in zip(uninterrupted, resumed))}


def freed_case(spec: str) -> dict:
    """freed:<mesh>:<model>: ZeRO-3 frees gathered weights after use and gathers them again
    in backward. The same ops run as DP and as ZeRO-3 (``zero3``); the bytes autograd keeps
    for backward (``measure_memory``) must be the same but for a small part of the whole
    parameters (with the gathered weights kept, the difference would be all of them), and
    ZeRO-3 must train like one process."""
    _, mesh_text, model_name = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape)
    model, loss_fn, batches = MODELS[model_name]()
    tokens, target = batches[0]
    kept = {}
    for layout in ("dp", "zero3"):
        pm = autopar.compile(copy.deepcopy(model), mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw,
                             plan=layout_plan(model, (tokens,), layout, mesh_shape))
        kept[layout] = pm.measure_memory((tokens,), target)
    reference = copy.deepcopy(model)
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw,
                         plan=layout_plan(model, (tokens,), "zero3", mesh_shape))
    buckets = sum(1 for m in pm.gm.modules() if type(m).__name__ == "GatherBucket")
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses, "memory": kept,
            "param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()), "buckets": buckets}


def planned_pipeline_case(spec: str) -> dict:
    """pp-planned:<P>x<D>:<model>[:recompute|:measured]: the planner's pipelined plan (P stages
    over D-way intra-op), made on rank 0 with the H100 preset, run by the runtime; with
    ``recompute``, every layer is recomputed in backward inside its stage; with ``measured``,
    planned from a measured-style profile of the (P, D) mesh (``tests.profiles``)."""
    from autopar import layouts
    from autopar.passes.planner.pipeline import pipeline_plan as plan_pipeline
    from autopar.passes.planner.request import PlanRequest
    from autopar.passes.lowering.recompute import Recomputed, plan_layers
    from tests.profiles import measured_style

    _, mesh_text, model_name, *extra = spec.split(":")
    p, d = (int(x) for x in mesh_text.split("x"))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    tokens = batches[0][0]
    text = [None]
    if dist.get_rank() == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture(model, (tokens,))
        hardware = measured_style((p, d)) if extra == ["measured"] else "h100"
        request = PlanRequest(mesh_shape=(p, d), hardware=hardware, memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = plan_pipeline(captured, p, (d,), request, solver_time_s=20)
        text[0] = plan.to_json() if plan is not None else why
    dist.broadcast_object_list(text)
    plan = Plan.from_json(text[0])
    if extra == ["recompute"]:
        plan.recompute = [f"layer {k}" for k in sorted(set(plan_layers(plan).values()))]
    mesh = init_device_mesh("cpu", (p, d), mesh_dim_names=("pp", "intra"))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    wrapped = sorted(m.layer for program in pm.programs for m in program.gm.modules() if isinstance(m, Recomputed))
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses,
            "schedule": plan.pipeline.schedule, "micro_batches": plan.pipeline.micro_batches,
            "recomputed_here": wrapped, "recompute": plan.recompute, "axis_names": list(plan.axis_names)}


def quietly(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with its warnings (capture's, planning's) kept out of the output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **kwargs)


def pinned_case(spec: str) -> dict:
    """pinned:<mesh>:<model>:<pin>/<pin>/...: the plan ``autopar.plan`` makes under the pins (as
    the command line writes them) for a mesh of this shape, on rank 0 with the H100 preset, run by
    ``autopar.compile`` on the mesh as the user built it (the plan's own mesh may split its axes)."""
    _, mesh_text, model_name, pins_text = spec.split(":", 3)
    shape = tuple(int(x) for x in mesh_text.split("x"))
    model, loss_fn, batches = MODELS[model_name]()
    reference, tokens = copy.deepcopy(model), batches[0][0]
    pins = autopar.Constraints.from_pins(pins_text.split("/"))
    made = [quietly(autopar.plan, model, shape, (tokens,), hardware="h100", time_limit_s=5, constraints=pins)
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made)  # planning once: the same plan on every rank
    plan = made[0]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(shape))))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    pp = plan.pipeline
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses,
            "mesh": list(plan.mesh_shape), "params": plan.params, "stage_starts": stage_starts(plan),
            "pipeline": None if pp is None else [pp.stages, pp.chunks_per_rank, pp.schedule]}


def compiled_pipeline_case(spec: str) -> dict:
    """compile-pp:<P>x<D>:<model>: ``autopar.compile`` given no plan plans on its mesh by itself
    (``plan_once``, the H100 preset) and considers a pipeline over the mesh's outer axis;
    where it picks one, it trains like one process."""
    _, mesh_text, model_name = spec.split(":")
    mesh = init_device_mesh("cpu", tuple(int(x) for x in mesh_text.split("x")), mesh_dim_names=("a0", "a1"))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw, hardware="h100")
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    pp = pm.plan.pipeline
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses,
            "pipeline": None if pp is None else [pp.stages, pp.micro_batches, pp.schedule], "notes": pm.plan.notes}


def pipeline_case(spec: str) -> dict:
    """pp:<mesh>:<model>:<schedule>:<micro-batches>:<chunks per rank>[:<intra-op layout>]"""
    _, mesh_text, model_name, schedule, m, v, *intra_layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    plan = pipeline_plan(model, batches[0][0], mesh_shape, schedule, int(m), int(v), *intra_layout)
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses, "stages": len(pm.stages),
            "params": plan.params}


def pipeline_zero2_case(spec: str) -> dict:
    """pp-zero2:<mesh>:<model>:<schedule>:<micro-batches>:<chunks>:<intra-op ZeRO-1 layout>: the
    layout's ZeRO-1 parameters raised to ZeRO-2 (``tp+zero1`` has no ZeRO-2 twin in
    autopar.layouts): slices split over an axis on which the gradient is whole (tensor
    parallel) as well as over data-parallel ones train like one process."""
    _, mesh_text, model_name, schedule, m, v, layout = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    plan = pipeline_plan(model, batches[0][0], mesh_shape, schedule, int(m), int(v), layout)
    plan.zero = {fqn: 2 if level == 1 else level for fqn, level in plan.zero.items()}
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    reduced = pm.optimizer_slices.reduced
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, batches)
    return {"case": spec, "loss_err": loss_err, "param_err": param_err, "losses": losses,
            "zero_levels": sorted(set(plan.zero.values())), "zero2_here": len(reduced),
            # level 0: parameters whose state no dim splits further (state_costs.zero_split_dim)
            "level0_dims": sorted({reference.get_parameter(f).ndim for f, z in plan.zero.items() if z == 0}),
            "reduce_scattered_axes": sorted({a for axes in reduced.values() for a in axes})}


def held_gradient_bytes(pm) -> int:
    """Bytes of the gradients a pipeline keeps after its step: its stages' parameters' and
    the optimizer's slices' that are not views of those (ZeRO-2's, reduce-scattered)."""
    wholes = [t.grad for t, _ in pm.state.values() if isinstance(t, torch.nn.Parameter) and t.grad is not None]
    storages = {g.untyped_storage().data_ptr() for g in wholes}
    own = [s.grad for s in pm.optimizer_slices.slices.values()
           if s.grad is not None and s.grad.untyped_storage().data_ptr() not in storages]
    return sum(g.numel() * g.element_size() for g in wholes + own)


def optimizer_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values() if t.dim() > 0)


def reduce_scatters(step) -> int:
    """How many reduce-scatters this rank calls while ``step()`` runs."""
    calls, original = [], dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        step()
    finally:
        dist.reduce_scatter_single = original
    return len(calls)


def pipeline_memory_case(spec: str) -> dict:
    """pp-memory:<mesh>:<model>:<schedule>:<micro-batches>: pipeline stages hold the optimizer
    state and gradients their plan predicts, at ZeRO 0 (intra-op layout ``dp``), 1 and 2
    (``zero1``, ``zero2``: stored split over the data-parallel axes). On a float32 copy of the
    model, after one ``train_step``: each rank's AdamW state bytes and kept gradient bytes,
    summed over the pipeline ranks of its intra-op coordinate (together they hold every
    layer), against ``plan.predicted.memory`` of the intra-op layout (which prices every
    layer on one device). ZeRO-2's reduce-scatters: as many in a step of 2 accumulated
    schedule runs as in a step of one (once per step, not per micro-batch)."""
    _, mesh_text, model_name, schedule, m = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    model, loss_fn, batches = MODELS[model_name]()
    model = model.float()
    inputs, target = (t.float() if t.is_floating_point() else t for t in batches[0])
    result = {"case": spec}
    for layout in ("dp", "zero1", "zero2"):
        plan = pipeline_plan(model, inputs, mesh_shape, schedule, int(m), 1, layout)
        pm = autopar.compile(copy.deepcopy(model), mesh, (inputs,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
        scatters = [reduce_scatters(lambda: pm.train_step((inputs,), target, accumulate=k)) for k in (2, 1)]
        mine = torch.tensor([optimizer_bytes(pm.optimizer), held_gradient_bytes(pm)], dtype=torch.float64)
        summed = mine.clone()
        dist.all_reduce(summed, group=mesh.get_group(0))  # over the pipeline ranks: every layer once
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, summed.tolist())
        predicted = plan.predicted.memory
        result[layout] = {
            "zero_levels": sorted(set(plan.zero.values())),
            "optimizer_rank0": mine[0].item(), "gradients_rank0": mine[1].item(),
            "optimizer_stages_summed": sorted({o for o, _ in everyone}),  # per intra-op coordinate
            "gradients_stages_summed": sorted({g for _, g in everyone}),
            "predicted_optimizer": predicted["optimizer"], "predicted_gradients": predicted["gradients"],
            "reduce_scatters_per_step": scatters,  # train_step(accumulate=2), then accumulate=1
        }
    return result


_PLANS: dict[tuple, Plan] = {}  # (model class, mesh shape, layout) -> the plan made for the first case that named it


def compiled_for(parts: list[str], model, mesh_shape, tokens, loss_fn):
    """The ParallelModule or PipelineModule a case names after its mesh and model: a layout
    (``case_plan``), or ``pp`` then <schedule>:<micro-batches>:<chunks>[:<intra-op layout>].
    Plans are made once per mesh and layout (the planner's own takes seconds)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    key = (type(model).__name__, mesh_shape, tuple(parts))
    if key not in _PLANS and parts[0] == "pp":
        schedule, m, v, *intra_layout = parts[1:]
        _PLANS[key] = pipeline_plan(model, tokens, mesh_shape, schedule, int(m), int(v), *intra_layout)
    elif key not in _PLANS:
        _PLANS[key] = case_plan(model, mesh, tokens, parts[0])
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=_PLANS[key],
                         hardware="h100")
    _PLANS[key] = pm.plan
    return pm


ACCUMULATE_STEPS = 3


def accumulate_case(spec: str) -> dict:
    """accum:<mesh>:<model>:<layout or pp:...>: a batch run as 2 micro-batches with gradients
    synchronised once trains like one process on the whole batch, both by
    ``train_step(accumulate=2)`` and by the loop written by hand (``no_sync()`` for the first
    micro-batch, then ``step()``, ``zero_grad()``), pipelines included."""
    _, mesh_text, model_name, *parts = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    model, loss_fn, batches = MODELS[model_name]()
    batches = batches[:ACCUMULATE_STEPS]
    reference = copy.deepcopy(model)
    ref_opt = adamw(list(reference.parameters()))
    ref_losses = []
    for inputs, target in batches:
        ref_opt.zero_grad()
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    def by_hand(pm, inputs, target, step):
        """Steps 0 and 2 as DDP's loop (the first half inside no_sync()); step 1 with both
        backwards outside it, which must not sum the first half's gradients twice."""
        (x0, x1), (t0, t1) = inputs.chunk(2), target.chunk(2)
        before = len(sent)
        with pm.no_sync() if step % 2 == 0 else contextlib.nullcontext():
            first = pm.loss((x0,), t0) / 2
            first.backward()
        if step % 2 == 0:
            sent_inside.append(len(sent) - before)
        second = pm.loss((x1,), t1) / 2
        second.backward()
        pm.step()
        pm.zero_grad()
        return (first + second).item()

    loops = {"accumulate": lambda pm, inputs, target, _: pm.train_step((inputs,), target, accumulate=2).item(),
             "manual": by_hand}
    result = {"case": spec}
    sent, sent_inside = [], []  # gradient buckets sent by the manual loop's backwards; inside no_sync()
    for name, loop in loops.items():
        pm = compiled_for(parts, copy.deepcopy(model), mesh_shape, batches[0][0], loss_fn)
        if name == "manual" and hasattr(pm, "grads"):  # pipelines sum their gradients per stage, unbucketed
            start = pm.grads._start

            def counted(params, *rest):
                sent.extend([1] if params else [])
                return start(params, *rest)

            pm.grads._start = counted
        losses = [loop(pm, inputs, target, step) for step, (inputs, target) in enumerate(batches)]
        full = pm.full_parameters()
        result[name] = {"losses": losses, "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                        "param_err": max((full[n] - p.detach()).abs().max().item()
                                         for n, p in reference.named_parameters())}
        if name == "manual":
            result["mixed"] = mixed_error(pm, *batches[0])
    result["buckets_sent"], result["buckets_sent_inside_no_sync"] = len(sent), sum(sent_inside)
    result["pipeline"] = pm.plan.pipeline is not None
    result["loss_err"] = max(r["loss_err"] for r in result.values() if isinstance(r, dict))
    result["param_err"] = max(r["param_err"] for r in result.values() if isinstance(r, dict))
    return result


def mixed_error(pm, inputs, target) -> str:
    """A backward inside no_sync() onto summed gradients must be an error, not a silent
    second sum. None where nothing is summed after backward (ZeRO-3: gradients leave
    backward reduce-scattered, and those sums just add up)."""
    if hasattr(pm, "grads") and not pm.grads.buckets:
        return None
    try:
        pm.loss((inputs,), target).backward()
        with pm.no_sync():
            pm.loss((inputs,), target).backward()
        return "no error"
    except ValueError as exc:
        return str(exc)


def odd_batch_case(spec: str) -> dict:
    """odd-batch:<mesh>:<model>:<layout or pp:...>: whole-batch steps of 6 sequences, which
    the plan's split of 8 over the mesh does not divide, train like one process (the capture at
    6 is laid out by the plan: ``autopar.passes.planner.relayout``); a pipeline's steps, of
    micro-batches of one sequence, which its data-parallel axis cannot split: gradients made
    whole there are summed as the compiled stages' shares are (``lower``'s ``sync_as``)."""
    _, mesh_text, model_name, *parts = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    model, loss_fn, batches = MODELS[model_name]()
    reference = copy.deepcopy(model)
    pm = compiled_for(parts, model, mesh_shape, batches[0][0], loss_fn)
    rows = pm.plan.pipeline.micro_batches if pm.plan.pipeline is not None else 6
    odd = [(inputs[:rows], target[:rows]) for inputs, target in batches[:3]]
    losses, loss_err, param_err, _ = train_against_reference(pm, reference, loss_fn, odd)
    return {"case": spec, "losses": losses, "loss_err": loss_err, "param_err": param_err}


def eval_case(spec: str) -> dict:
    """eval:<mesh>:<model>:<layout or pp:...>: after ``pm.eval()`` the outputs equal
    ``model.eval()``'s on one process (captured under ``no_grad``, where export names ops
    otherwise than in training) at the compiled batch and at a batch of 1 row (laid out by
    the plan: ``autopar.passes.planner.relayout``); the GPT at 3 rows too (a pipeline cuts
    them into as many micro-batches as divide them). The GPT has dropout 0.1:
    ``pm.train()`` outputs differ; the other models have none: in train mode under
    ``torch.no_grad()`` a batch of one equals the reference too."""
    _, mesh_text, model_name, *parts = spec.split(":")
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    if model_name == "gpt":
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2, dropout=0.1)).to(DTYPE)
        tokens, loss_fn = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1)), lm_loss
    else:
        model, loss_fn, batches = MODELS[model_name]()
        tokens = batches[0][0]
    logits = (lambda out: getattr(out, "logits", out))  # a Hugging Face output, or the logits
    reference = copy.deepcopy(model).eval()
    pm = compiled_for(parts, model, mesh_shape, tokens, loss_fn)
    assert pm.eval() is pm and not pm.training
    errors, kept = {}, False
    for rows in (len(tokens), 1, 3) if model_name == "gpt" else (len(tokens), 1):
        with torch.no_grad():
            expected = logits(reference(tokens[:rows]))
        out = logits(pm(tokens[:rows]))
        kept |= out.requires_grad
        errors[rows] = (out - expected).abs().max().item()
    pm.train()
    result = {"case": spec, "eval_errors": errors, "grad_kept": kept}
    if model_name == "gpt":
        result["train_mode_diff"] = (pm(tokens).detach() - logits(reference(tokens))).abs().max().item()
    else:
        with torch.no_grad():
            result["no_grad_train_error"] = (logits(pm(tokens[:1])) - logits(reference(tokens[:1]))).abs().max().item()
    return result


def main(cases: list[str]) -> None:
    dist.init_process_group("gloo")
    for spec in cases:
        started = time.perf_counter()
        try:
            if spec == "errors":
                result = error_cases(dist.get_world_size())
            elif spec == "moves":
                result = moves_case()
            elif spec.startswith("pp-planned:"):
                result = planned_pipeline_case(spec)
            elif spec.startswith("pinned:"):
                result = pinned_case(spec)
            elif spec.startswith("compile-pp:"):
                result = compiled_pipeline_case(spec)
            elif spec.startswith("pp:"):
                result = pipeline_case(spec)
            elif spec.startswith("pp-memory:"):
                result = pipeline_memory_case(spec)
            elif spec.startswith("pp-zero2:"):
                result = pipeline_zero2_case(spec)
            elif spec.startswith("resume:"):
                result = resume_case(spec)
            elif spec.startswith("recompute:"):
                result = recompute_case(spec)
            elif spec.startswith("local:"):
                result = local_case(spec)
            elif spec.startswith("hf-loss:"):
                result = hf_loss_case(spec)
            elif spec.startswith("clip"):
                result = clip_case(spec)
            elif spec.startswith("freed:"):
                result = freed_case(spec)
            elif spec.startswith("accum:"):
                result = accumulate_case(spec)
            elif spec.startswith("eval:"):
                result = eval_case(spec)
            elif spec.startswith("odd-batch:"):
                result = odd_batch_case(spec)
            elif spec.startswith("dropout:"):  # layout-independent dropout (tests/distributed/dropout_check.py)
                result = {**dropout_check.run_case(spec.removeprefix("dropout:")), "case": spec}
            elif spec.startswith("mp:"):  # mixed precision, batched into this launch (tests/distributed/mp_check.py)
                result = {**mp_check.run(spec.removeprefix("mp:")), "case": spec}
            else:
                result = run_case(spec)
        except Exception as exc:  # reported, then the launch ends: other ranks may be stuck
            print("RESULT " + json.dumps({"case": spec, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            os._exit(1)
        if dist.get_rank() == 0:  # seconds: where a launch's time goes
            print("RESULT " + json.dumps({**result, "seconds": time.perf_counter() - started}), flush=True)
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
