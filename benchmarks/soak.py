"""Soak: a long data-parallel run with checkpoints, its memory and its losses against one process.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 -m benchmarks.soak \
        --steps 1000 --every 50 --layout fsdp --out soak.json

A GPT (float64, dropout 0: a one-process run draws other dropout masks) trains ``--steps``
AdamW steps under an LR warm-up (LambdaLR, saved as ``extra``) on 4 gloo ranks, with a
``Checkpointer`` save every ``--every`` steps (keep 2), alternately synchronous and
asynchronous. Each rank samples its resident memory (``/proc/self/statm``) after every
step. At the end rank 0 trains the same model one process, on the same batches, and
prints (and writes to ``--out``) one JSON object:

- ``rss_mib``: per rank, the resident memory at each checkpoint step; ``rss_drift``: per
  rank, (max - min) / min over the samples after warm-up (the first ``--warmup`` steps);
- ``loss_diff_max``: the largest |loss - one-process loss| over all steps;
- ``save_s``: how long the training loop was blocked by each save, synchronous and
  asynchronous (the asynchronous one: until the state was copied to memory), and the
  checkpoint's size on disk;
- ``steps_per_s`` and the machine's load average (the machine may be shared).

The same numbers, as a table, go to ``benchmarks/results/soak_gloo_<yyyymmdd>.md`` (``--table-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


import autopar
from autopar.costmodels.units import MIB
from autopar.runtime.checkpoint import Checkpointer
from autopar.models import GPT, GPTConfig
from benchmarks.results_file import add_out_argument, torchrun, write_results
from tests.distributed.train_check import layout_plan

PAGE = os.sysconf("SC_PAGE_SIZE")
BATCH, SEQ, VOCAB = 8, 32, 256
LR, WARMUP_LR_STEPS = 1e-3, 100


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=128, n_heads=4, n_layers=2)).to(torch.float64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def warmup(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP_LR_STEPS))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / MIB


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MIB


def one_process(steps: int) -> list[float]:
    reference = model()
    optimizer = adamw(reference.parameters())
    scheduler = warmup(optimizer)
    losses = []
    for step in range(steps):
        inputs, target = batch(step)
        optimizer.zero_grad()
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100, help="steps before memory must be flat")
    parser.add_argument("--layout", default="fsdp", choices=["dp", "fsdp", "zero1", "zero2"])
    parser.add_argument("--root", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--out", default=None, help="also write the JSON object here")
    add_out_argument(parser, "--table-dir")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    world = dist.get_world_size()
    temporary = args.root is None
    root = [(tempfile.mkdtemp(prefix="autopar-soak-") if temporary else args.root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    net = model()
    tokens = batch(0)[0]
    plan = layout_plan(net, (tokens,), args.layout, (world,))
    pm = autopar.compile(net, init_device_mesh("cpu", (world,)), (tokens,), loss_fn=loss_fn, optimizer=adamw,
                         plan=plan)
    scheduler = warmup(pm.optimizer)
    saver = Checkpointer(pm, root[0], keep=2)
    losses, rss, blocked = [], [], {"sync": [], "async": []}
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, target = batch(step)
        losses.append(pm.train_step((inputs,), target).item())
        scheduler.step()
        rss.append(rss_mib())
        if (step + 1) % args.every == 0:
            asynchronous = (step + 1) // args.every % 2 == 0
            began = time.perf_counter()
            saver.save(step + 1, extra={"scheduler": scheduler}, asynchronous=asynchronous)
            blocked["async" if asynchronous else "sync"].append(time.perf_counter() - began)
    saver.wait()
    seconds = time.perf_counter() - start
    sampled = [rss[i] for i in range(args.every - 1, args.steps, args.every)]
    after = rss[args.warmup:]
    every_rank = [None] * world
    dist.all_gather_object(every_rank, {"rss_mib": sampled, "drift": (max(after) - min(after)) / min(after),
                                        "blocked": blocked})
    if dist.get_rank() == 0:
        reference = one_process(args.steps)
        newest = Path(root[0]) / f"step_{saver.complete_steps()[-1]:08d}"
        result = {
            "steps": args.steps, "every": args.every, "layout": args.layout, "world": world,
            "rss_mib": [r["rss_mib"] for r in every_rank],
            "rss_drift": [round(r["drift"], 4) for r in every_rank],
            "loss_diff_max": max(abs(a - b) for a, b in zip(losses, reference)),
            "loss_first_last": [losses[0], losses[-1]],
            "save_s": {kind: {"median": statistics.median(v), "max": max(v), "n": len(v)}
                       for kind, v in blocked.items() if v},
            "checkpoint_mib": round(folder_mib(newest), 2),
            "steps_per_s": args.steps / seconds,
            "load_average": os.getloadavg(),
        }
        print(json.dumps(result), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        if temporary:
            shutil.rmtree(root[0], ignore_errors=True)
        save = {kind: f"{v['median']:.3f} / {v['max']:.3f}" for kind, v in result["save_s"].items()}
        write_results("soak", "gloo", "Soak: a long data-parallel run with checkpoints against one process", [
            "| layout | ranks | steps | save every | largest loss difference | largest RSS drift after warm-up "
            "| synchronous save s (median / max) | asynchronous save blocked s (median / max) | checkpoint MiB "
            "| steps/s |", "|---|---|---|---|---|---|---|---|---|---|",
            f"| {args.layout} | {world} | {args.steps} | {args.every} | {result['loss_diff_max']:.3g} | "
            f"{max(result['rss_drift']):.2%} | {save.get('sync', '—')} | {save.get('async', '—')} | "
            f"{result['checkpoint_mib']} | {result['steps_per_s']:.2f} |"], args.table_dir, launcher=torchrun(world))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
