"""Train a Hugging Face GPT-2 with autopar, written the way a training loop usually is:
a per-rank DataLoader with a DistributedSampler, AdamW with a warm-up schedule, gradient
clipping and accumulation, periodic evaluation and a checkpoint.

    torchrun --nproc_per_node 4 examples/train_hf.py --mesh 2x2 --layout tp+dp
    python examples/train_hf.py --reference      # the same training, plain PyTorch, one process

The model is a small random GPT-2 (no download). It computes its own loss from
``labels=`` (``loss_fn=None``). Each rank loads only its rows of every batch: the plan
says how many distinct batch shards there are (``pm.data_parallel``; tensor-parallel peers
share one). The global batch of step k is the k-th block of one shuffled order, whatever
the number of shards, so ``--reference`` trains on the same batches. The last line
printed is ``RESULT {json}``: the training losses, the evaluation losses, and (with
``--checkpoint``) the evaluation loss of a module loaded from the saved checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import autopar
from autopar.runtime import checkpoint
from autopar.compiler import plan_once


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", action="store_true", help="train in one process with plain PyTorch")
    p.add_argument("--mesh", default=None, help="mesh shape such as 2x2 (default: all ranks on one axis)")
    p.add_argument("--layout", default="auto", help="auto (the planner's choice) or a manual layout: dp, tp+dp, ...")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--max-norm", type=float, default=0.5, help="gradient clipping")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3, help="steps of linear learning-rate warm-up")
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--checkpoint", default=None, help="save here at the end, then load into a fresh module")
    p.add_argument("--float64", action="store_true", help="train in float64 (tight comparisons)")
    return p.parse_args()


def build_model(dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config).to(dtype)


def datasets(args: argparse.Namespace) -> tuple[TensorDataset, torch.Tensor]:
    """Random token rows for training, and one batch held out for evaluation."""
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, 128, (args.batch * args.steps, args.seq), generator=gen)
    held_out = torch.randint(0, 128, (args.batch, args.seq), generator=gen)
    return TensorDataset(train), held_out


def loader(dataset: TensorDataset, args: argparse.Namespace, num_replicas: int, rank: int) -> DataLoader:
    """This data rank's rows: batch / num_replicas of each global batch."""
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=args.batch // num_replicas, sampler=sampler)


def warmup(args: argparse.Namespace):
    return lambda step: min(1.0, (step + 1) / args.warmup)


def train_parallel(args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"axis{i}" for i in range(len(shape))))
    dtype = torch.float64 if args.float64 else torch.float32
    dataset, held_out = datasets(args)
    example = {"input_ids": dataset.tensors[0][:args.batch], "labels": dataset.tensors[0][:args.batch]}

    def compiled(model: GPT2LMHeadModel, plan=None):
        return autopar.compile(model, mesh, example_kwargs=example, plan=plan, hardware="h100",
                               optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1))

    model = build_model(dtype)
    # "auto": autopar.compile plans by itself; a manual layout is planned on rank 0, given to all
    plan = None if args.layout == "auto" else plan_once(
        model, mesh, (), "h100", layout=args.layout, example_kwargs=example, pipeline=False)
    pm = compiled(model, plan)
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup(args))
    dp = pm.data_parallel  # how many distinct batch shards the plan makes, and this rank's
    losses, evals = [], []
    for step, (rows,) in enumerate(loader(dataset, args, dp.num_replicas, dp.rank)):
        loss = pm.train_step({"input_ids": rows, "labels": rows}, None, local=True,
                             max_norm=args.max_norm, accumulate=args.accumulate)
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % args.eval_every == 0:
            pm.eval()
            evals.append(pm(input_ids=held_out, labels=held_out).loss.item())
            pm.train()
    result = {"losses": losses, "evals": evals, "data_parallel": [dp.num_replicas, dp.rank]}
    if args.checkpoint:
        checkpoint.save(pm, args.checkpoint)
        fresh = compiled(build_model(dtype), pm.plan)  # as a resumed job starts: the same plan, then the checkpoint
        checkpoint.load(fresh, args.checkpoint)
        fresh.eval()
        result["reloaded_eval"] = fresh(input_ids=held_out, labels=held_out).loss.item()
    weights = pm.full_parameters()  # plain tensors, whole on every rank (e.g. to save_pretrained)
    result["weights_norm"] = math.sqrt(sum(w.double().square().sum().item() for w in weights.values()))
    result["rank"] = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return result


def train_reference(args: argparse.Namespace) -> dict:
    """The same training in one process: whole batches (accumulation gives the same step)."""
    dtype = torch.float64 if args.float64 else torch.float32
    model = build_model(dtype)
    dataset, held_out = datasets(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(args))
    losses, evals = [], []
    for step, (rows,) in enumerate(loader(dataset, args, 1, 0)):
        optimizer.zero_grad()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                evals.append(model(input_ids=held_out, labels=held_out).loss.item())
            model.train()
    weights_norm = math.sqrt(sum(p.detach().double().square().sum().item() for p in model.parameters()))
    return {"losses": losses, "evals": evals, "weights_norm": weights_norm}


def main() -> None:
    args = parse_args()
    result = train_reference(args) if args.reference else train_parallel(args)
    if result.get("rank", 0) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
