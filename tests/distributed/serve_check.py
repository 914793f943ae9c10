"""Run under torchrun: serve Hugging Face causal LMs by a plan and compare, on every rank,
with Hugging Face's own ``generate`` in one process. Prints one JSON line per case on rank 0.

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.serve_check 2x2:llama:tp+dp ...

A case ``<mesh>:<model>:<layout>[:<micro-batches>]`` (``auto``: the planner's choice; a
pipeline's micro-batches in flight under the throughput objective, where given) plans
serving for 4 sequences of up to 6 prompt tokens and 16 positions, compiles it and checks: greedy
generation of left-padded prompts (3 rows: a batch smaller than planned), of one prompt
(batch 1), and with an eos token, token for token against ``model.generate``; the logits
of a prompt against ``model(ids).logits``; sampling with a seed picks the same tokens on
every rank although each rank's own generator was seeded differently. ``errors``: bad
input to a serving module is one ``autopar:`` error each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import MODELS as REGISTRY
from tests.distributed import ending
from tests.distributed.plans import made_once
from tests.models import BATCH, SEQ, TINY, gpt2, llama, mixtral


def llama4():
    """The tiny Llama with 4 layers: a pipeline of 4 stages, a layer each."""
    torch.manual_seed(0)
    config = {**TINY["llama"], "num_hidden_layers": 4}
    model = REGISTRY["llama"].build(config, SEQ)
    args, _ = REGISTRY["llama"].inputs(config, BATCH, SEQ, generator=torch.Generator().manual_seed(0))
    return model, args


# float64 where the model allows: greedy tokens then match to the last digit; Mixtral's
# grouped matmuls take float32 only
MODELS = {"llama": (llama, torch.float64), "llama4": (llama4, torch.float64), "gpt2": (gpt2, torch.float64),
          "mixtral": (mixtral, torch.float32)}
WORKLOAD = autopar.Inference(batch=4, prompt_len=6, max_len=16)
NEW_TOKENS = 10


def prompts(tokens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts of up to 6 tokens, left-padded as Hugging Face pads them (the second
    is 4 tokens long, the third 5)."""
    ids = tokens[:rows, :6].clone()
    mask = torch.ones_like(ids)
    for row, length in enumerate((6, 4, 5)[:rows]):
        mask[row, :6 - length] = 0
    ids[mask == 0] = 0
    return ids, mask


@made_once
def serving_plan(model, mesh, layout, workload=WORKLOAD):
    """The plan on rank 0 (capture and the joint solve take seconds), given to every rank."""
    return autopar.plan(model, mesh, inference=workload, hardware="h100", time_limit_s=2, layout=layout)


def serve_case(spec: str) -> dict:
    mesh_text, model_name, layout, *micro = spec.split(":")
    workload = (dataclasses.replace(WORKLOAD, objective="throughput", micro_batches=int(micro[0])) if micro
                else WORKLOAD)
    shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(shape))))
    factory, dtype = MODELS[model_name]
    model, (tokens,) = factory()
    model = model.to(dtype).eval()
    torch.manual_seed(1234 + dist.get_rank())  # each rank seeded its own way, as training scripts do
    plan = serving_plan(model, mesh, None if layout == "auto" else layout, workload)
    pm = autopar.compile(model, mesh, plan=plan)
    result = {"case": spec, "kind": plan.kind,
              "micro_batches": plan.pipeline.micro_batches if plan.pipeline is not None else 1, "params": {k: v for k, v in plan.params.items() if "proj" in k or "attn" in k}}
    mismatched = []
    for rows in (3, 1):
        ids, mask = prompts(tokens, rows)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=0)
        out = pm.generate(ids, mask, max_new_tokens=NEW_TOKENS)
        if not torch.equal(out, expected):
            mismatched.append({"rows": rows, "expected": expected.tolist(), "found": out.tolist()})
    ids, mask = prompts(tokens, 3)
    eos = int(expected[0, 6 + 2])  # a token the first row emits: it stops there, the others go on
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0)
    out = pm.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=0)
    if not torch.equal(out, expected):
        mismatched.append({"eos": eos, "expected": expected.tolist(), "found": out.tolist()})
    with torch.no_grad():
        reference = model(ids[:1]).logits
    result["logits_err"] = (pm(ids[:1]) - reference).abs().max().item()
    sampled = pm.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=20, seed=7)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sampled.tolist())
    result["sampled_alike"] = all(s == every[0] for s in every)
    result["resampled_alike"] = torch.equal(
        pm.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=20, seed=7), sampled)
    result["mismatched"] = mismatched
    result["memory"] = pm.memory()
    result["predicted_memory"] = plan.predicted.memory
    return result


def error_cases() -> dict:
    """Bad input to serving: each must be a clear autopar: error."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, (tokens,) = llama()
    model = model.to(torch.float64).eval()
    pm = autopar.compile(model, mesh, plan=serving_plan(model, mesh, "tp"))
    messages = {}

    def expect(name, fn):
        try:
            fn()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)

    expect("prompt longer than planned", lambda: pm.generate(tokens[:2, :8]))
    expect("batch over the planned one", lambda: pm.generate(torch.cat([tokens, tokens])[:5, :4]))
    expect("more new tokens than the cache holds", lambda: pm.generate(tokens[:2, :4], max_new_tokens=11))
    expect("token ids out of the vocabulary", lambda: pm.generate(tokens[:2, :4] + model.config.vocab_size))
    expect("max_len beyond the model's positions", lambda: autopar.plan(
        model, mesh, inference=autopar.Inference(batch=1, prompt_len=8, max_len=64), hardware="h100"))
    expect("a model without a cache path", lambda: autopar.plan(
        torch.nn.Linear(4, 4), mesh, inference=WORKLOAD, hardware="h100"))
    expect("training options with inference", lambda: autopar.plan(
        model, mesh, (tokens,), inference=WORKLOAD, hardware="h100"))
    expect("a training layout for serving", lambda: autopar.plan(
        model, mesh, inference=WORKLOAD, hardware="h100", layout="fsdp"))
    training = autopar.compile(model, mesh, (tokens,), plan=autopar.plan(model, mesh, (tokens,), hardware="h100",
                                                                          layout="dp"))
    expect("generate on a training plan", lambda: training.generate(tokens[:1, :4]))
    return {"case": "errors", "messages": messages}


def main(cases: list[str]) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    for spec in cases:
        started = time.perf_counter()
        try:
            result = error_cases() if spec == "errors" else serve_case(spec)
        except Exception as exc:  # reported, then the launch ends: other ranks may be stuck
            print("RESULT " + json.dumps({"case": spec, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            os._exit(1)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({**result, "seconds": time.perf_counter() - started}), flush=True)
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
