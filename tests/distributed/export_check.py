"""Run under torchrun on 4 ranks: plans exported as plain PyTorch (``Plan.export``) and trained by
a plain loop train like one process. Prints one ``RESULT`` JSON line per case on rank 0.

    torchrun --standalone --nproc-per-node 4 -m tests.distributed.export_check gpt2:dp llama:tp+dp ...

A case is ``<model>:<layout>[:recompute]``: Hugging Face GPT-2 or Llama (``tests.models``,
float64) and a layout of ``autopar.layouts.build`` on a 2x2 mesh, ``auto`` (``autopar.plan``'s
own plan), ``pp`` (a 2-stage 1F1B pipeline over axis 0, 2 micro-batches, data-parallel stages,
cut between the two layers) or ``sp`` (Llama: tp+dp with norms and residual adds split by sequence,
``sequence_parallel``); ``recompute``: the plan recomputes layer 0 in backward. Every rank plans and exports its share of the cases (rank ``i mod 4``) into one
folder; then every rank imports each written module, lays a fresh copy of the model out with
its ``parallelize`` (or ``pipeline``), and trains it with AdamW on its rows of each batch (the
module's ``local_batch``), the loss under ``loss_parallel()`` where the module says so, beside
the same model trained whole in one process. The written modules import no autopar.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import json
import os
import re
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import autopar
from autopar.passes.capture import capture
from autopar.passes.node_keys import node_keys
from autopar.passes.placements import spec_str
from autopar.passes.plan import Pipeline, Plan
from autopar.passes.strategy_graph import build_strategy_graph
from tests.distributed import ending

STEPS = 4
BATCH, SEQ = 8, 12  # the batch differs from the sequence, so that the export tells batch rows from positions
MESH = (2, 2)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(family: str) -> torch.nn.Module:
    from tests.models import gpt2, llama

    model, _ = {"gpt2": gpt2, "llama": llama}[family]()
    return model.to(torch.float64)


def batches(vocab: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=gen), torch.randint(0, vocab, (BATCH, SEQ), generator=gen))
            for _ in range(STEPS)]


def make_plan(family: str, layout: str) -> Plan:
    model = build(family)
    tokens = batches(model.config.vocab_size)[0][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layout == "auto":
            return autopar.plan(model, MESH, (tokens,), hardware="h100", time_limit_s=5)
        if layout == "pp":
            return layer_pipeline(model, tokens)
        if layout == "sp":
            return sequence_parallel(model, tokens)
        return autopar.layouts.build(layout, model, MESH, (tokens,), hardware="h100")


def layer_pipeline(model, tokens) -> Plan:
    """Two stages over axis 0 cut before the second layer, 1F1B, 2 micro-batches; each stage data
    parallel over axis 1 (``autopar.layouts.build("dp")`` on the micro-batch)."""
    micro = tokens.chunk(2)[0]
    plan = autopar.layouts.build("dp", model, (MESH[1],), (micro,), hardware="h100", pipeline=False)
    captured = capture(model, (micro,))
    later = False
    stage_of = {}
    for node in captured.nodes("call_function"):
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values()]
        later = later or any(p.endswith((".layers.1", ".h.1")) for p in paths)
        stage_of[node.name] = int(later)
    plan.mesh_shape, plan.axis_names = MESH, ("pp", "dp")
    plan.pipeline = Pipeline(axis=0, stages=2, micro_batches=2, schedule="1F1B", stage_of=stage_of,
                             batch_size=BATCH, batch_split=MESH[1])
    return Plan.from_json(plan.to_json())


def sequence_parallel(model, tokens) -> Plan:
    """Megatron with sequence parallelism as torchtitan lays Llama out: ``autopar.layouts``' tp+dp
    (which the planner completes with whole activations between the linears at these sizes), with
    the norms and the residual adds run split by sequence over the tensor axis (axis 1)."""
    plan = autopar.layouts.build("tp+dp", model, MESH, (tokens,), hardware="h100")
    captured = capture(model, (tokens,))
    graph = build_strategy_graph(captured, MESH)
    keys = node_keys(captured)
    for node, ns in graph.nodes.items():
        path, _, op = keys[node.name].partition(":")
        if not (path.endswith("norm") or (re.search(r"\.layers\.\d+$", path) and op.startswith("aten.add"))):
            continue
        tensors = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
        wanted = ["S(0)S(1)" if a.meta["val"].dim() == 3 else "RR" for a in tensors]
        plan.strategies[node.name] = next(str(s) for s in ns.strategies
                                          if [spec_str(i) for i in s.inputs] == wanted
                                          and spec_str(s.output) == "S(0)S(1)")
    plan.kind = "tp+dp, norms split by sequence"
    return Plan.from_json(plan.to_json())


def export_share(cases: list[str], folder: str) -> None:
    """Plan and export this rank's share of the cases into ``folder``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, case in enumerate(cases):
        if i % world != rank:
            continue
        family, layout, *options = case.split(":")
        stem = os.path.join(folder, _stem(case))
        try:
            plan = make_plan(family, layout)
            if "recompute" in options:
                plan.recompute = ["layer 0"]
            model = build(family)
            exported = plan.export(model, stem + ".py", example_inputs=(batches(model.config.vocab_size)[0][0],))
            said = {"notes": exported.notes, "kind": plan.kind, "pipeline": plan.pipeline is not None,
                    "styles": sorted({name for name in ("ColwiseParallel(", "RowwiseParallel(", "SequenceParallel(",
                                                        "fully_shard(", "DistributedDataParallel(", "checkpoint_wrapper(",
                                                        "PipelineStage(", "distribute_module(", "PrepareModuleOutput(")
                                      if name in exported.source})}
        except Exception:
            said = {"error": traceback.format_exc()[-3000:]}
        with open(stem + ".json", "w") as f:
            json.dump(said, f)


def _stem(case: str) -> str:
    return "case_" + case.replace(":", "_").replace("+", "_")


def imported_modules(source: str) -> set[str]:
    """Every module the source imports (its import statements, wherever they are)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return found


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_parameters(holder: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """The whole value of each parameter ``names`` lists (the model's own names) that ``holder``
    (the laid-out model) trains here, whatever holds it: a tensor, or a DTensor (tensor
    parallelism, FSDP2). Looked up by name, through activation-checkpoint wrappers."""
    modules = {path.replace("_checkpoint_wrapped_module.", "").replace("._checkpoint_wrapped_module", ""): module
               for path, module in holder.named_modules()}
    out = {}
    for name in names:
        path, _, leaf = name.rpartition(".")
        p = getattr(modules[path], leaf, None) if path in modules else None
        if p is None or not p.requires_grad:  # another pipeline stage's layer, or its copy of what another trains
            continue
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
    return out


def run_case(case: str, folder: str) -> dict:
    family = case.split(":")[0]
    with open(os.path.join(folder, _stem(case) + ".json")) as f:
        said = json.load(f)
    if "error" in said:
        return {"case": case, "error": said["error"]}
    written = load(os.path.join(folder, _stem(case) + ".py"), _stem(case))
    source = open(os.path.join(folder, _stem(case) + ".py")).read()
    mesh = init_device_mesh("cpu", written.MESH_SHAPE, mesh_dim_names=written.AXIS_NAMES)
    model = build(family)
    reference = copy.deepcopy(model)
    data = batches(model.config.vocab_size)
    split_loss = getattr(written, "LOSS_PARALLEL", False)
    ctx = loss_parallel if split_loss else contextlib.nullcontext
    if said["pipeline"]:
        stages, schedule = written.pipeline(model, mesh, written.MICROBATCHES, loss_fn=lm_loss)
        params = [p for s in stages for p in s.submod.parameters() if p.requires_grad]
    else:
        laid = written.parallelize(model, mesh)
        params = list(laid.parameters())
    opt, ref_opt = adamw(params), adamw(list(reference.parameters()))
    losses, ref_losses = [], []
    for inputs, target in data:
        x, y = written.local_batch(inputs, mesh), written.local_batch(target, mesh)
        if said["pipeline"]:
            got = []
            with ctx():
                schedule.step(input_ids=x, target=y, losses=got)
            if hasattr(written, "sum_tied_gradients"):
                written.sum_tied_gradients(stages, mesh)
            mine = torch.tensor([sum(float(l) for l in got) / max(len(got), 1), float(bool(got))], dtype=torch.float64)
        else:
            with ctx():
                loss = lm_loss(laid(x).logits, y)
                loss.backward()
            value = loss.full_tensor() if isinstance(loss, DTensor) else loss
            mine = torch.tensor([value.item(), 1.0], dtype=torch.float64)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mine)  # the mean over the ranks that hold a loss (equal rows each)
        losses.append((mine[0] / mine[1]).item())
        ref_opt.zero_grad()
        ref_loss = lm_loss(reference(inputs).logits, target)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    expected = dict(reference.named_parameters())
    if said["pipeline"]:
        full = {n: p for s in stages for n, p in full_parameters(s.submod.model, expected).items()}
    else:
        full = full_parameters(laid.module if isinstance(laid, torch.nn.parallel.DistributedDataParallel) else laid,
                               expected)
    err = torch.tensor([max((full[n] - expected[n]).abs().max().item() for n in full)], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    count = torch.tensor([len(full)], dtype=torch.float64)
    dist.all_reduce(count)  # parameters compared, over all ranks
    return {"case": case, "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_err": err.item(),
            "losses": losses, "compared": int(count.item()), "notes": said["notes"], "kind": said["kind"],
            "styles": said["styles"],
            "imports": sorted(imported_modules(source)),
            "loss_parallel": bool(split_loss)}


def main(cases: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="autopar-export-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    export_share(cases, folder[0])
    dist.barrier()
    for case in cases:
        try:
            result = run_case(case, folder[0])
        except Exception:
            result = {"case": case, "error": traceback.format_exc()[-3000:]}
            print(f"rank {rank}: {case}: {result['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
        dist.barrier()
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
