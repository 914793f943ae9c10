"""How long a Checkpointer save blocks training, synchronous against asynchronous.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 -m benchmarks.save_times --dim 512 --repeat 3

A GPT (float32, ``--dim`` wide, 4 layers, vocab 4096) laid out ``--layout`` on 4 gloo
ranks takes one AdamW step, then is saved ``--repeat`` times each way. Rank 0 prints one
JSON object: the checkpoint's size; for synchronous saves the seconds the call took; for
asynchronous ones the seconds the call blocked (the state copied to memory) and the
seconds until the checkpoint was complete (``wait()``); the machine's load average (it may
be shared: compare numbers taken together). The medians also go to
``benchmarks/results/save_times_gloo_<yyyymmdd>.md`` (``--out``).
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

VOCAB, SEQ, BATCH = 4096, 64, 8


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layout", default="fsdp", choices=["dp", "fsdp", "zero1", "zero2"])
    add_out_argument(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    world = dist.get_world_size()
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=args.dim, n_heads=8, n_layers=4))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    plan = layout_plan(net, (tokens,), args.layout, (world,))
    pm = autopar.compile(net, init_device_mesh("cpu", (world,)), (tokens,), loss_fn=loss_fn,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)
    pm.train_step((tokens,), tokens)
    root = [tempfile.mkdtemp(prefix="autopar-save-times-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    saver = Checkpointer(pm, root[0], keep=1)
    sync, blocked, complete = [], [], []
    for i in range(args.repeat):
        began = time.perf_counter()
        saver.save(2 * i + 1)
        sync.append(time.perf_counter() - began)
        began = time.perf_counter()
        saver.save(2 * i + 2, asynchronous=True)
        blocked.append(time.perf_counter() - began)
        saver.wait()
        complete.append(time.perf_counter() - began)
    if dist.get_rank() == 0:
        newest = Path(root[0]) / f"step_{saver.complete_steps()[-1]:08d}"
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) / MIB
        print(json.dumps({
            "layout": args.layout, "world": world, "parameters": sum(p.numel() for p in net.parameters()),
            "checkpoint_mib": round(size, 1),
            "sync_s": statistics.median(sync), "async_blocked_s": statistics.median(blocked),
            "async_complete_s": statistics.median(complete), "all": {"sync": sync, "async_blocked": blocked,
                                                                      "async_complete": complete},
            "load_average": os.getloadavg(),
        }), flush=True)
        shutil.rmtree(root[0], ignore_errors=True)
        table = ["| layout | ranks | dim | checkpoint MiB | synchronous s | asynchronous: blocked s "
                 "| asynchronous: complete s |", "|---|---|---|---|---|---|---|",
                 f"| {args.layout} | {world} | {args.dim} | {size:.1f} | {statistics.median(sync):.3f} | "
                 f"{statistics.median(blocked):.3f} | {statistics.median(complete):.3f} |", "",
                 f"Medians of {args.repeat} saves each way."]
        write_results("save_times", "gloo", "How long a checkpoint save blocks training", table, args.out,
                      launcher=torchrun(world))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
