"""Compiled layouts against the same layouts written by hand with torch's own APIs.

    python benchmarks/runtime_vs_manual.py            # launches 4 gloo ranks itself

For one small GPT and one batch: DP (autopar's plan vs DDP), ZeRO-3 (autopar's plan vs
FSDP2 ``fully_shard`` per block) and Megatron TP (autopar with the column/row weight
placements vs ``parallelize_module`` with Colwise/Rowwise). Each pair runs interleaved,
step by step, so that load on this shared machine hits both alike; the table gives the
median step time of each and compiled / manual. Ratios, not absolute times, are the
result.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.models import GPT, GPTConfig  # noqa: E402
from passes.capture import capture  # noqa: E402
from passes.plan import plan_from_choice  # noqa: E402
from passes.propagate import choose_by_propagation  # noqa: E402
from passes.strategies import build_strategy_graph  # noqa: E402

STEPS, WARMUP = 12, 3
CFG = GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2)
BATCH = 16


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def plan_for(model, tokens, layout: str, n: int):
    from torch.distributed.tensor import Replicate, Shard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, (n,))
    fixed = {}
    for node in graph.nodes:
        fqn = cap.params.get(node.name, "")
        if node.name in cap.user_inputs:
            fixed[node] = (Shard(0),) if layout in ("dp", "zero3") else (Replicate(),)
        elif layout == "zero3" and fqn:
            fixed[node] = (Shard(0),) if node.meta["val"].shape[0] % n == 0 else (Replicate(),)
        elif layout == "tp" and fqn:
            column = any(k in fqn for k in (".q.", ".k.", ".v.", ".up."))
            row = (".o.weight" in fqn) or (".down.weight" in fqn)
            fixed[node] = (Shard(0),) if column else (Shard(1),) if row else (Replicate(),)
    plan = plan_from_choice(graph, choose_by_propagation(graph, fixed), kind=layout)
    if layout == "zero3":
        plan.zero = {fqn: 3 if "S(" in spec else 0 for fqn, spec in plan.params.items()}
    return plan


def manual(model, layout: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    if layout == "dp":
        return DDP(model)
    if layout == "zero3":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    plan = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def shard_of(x, layout, rank, n):
    return x.chunk(n)[rank] if layout in ("dp", "zero3") else x


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    base = GPT(CFG)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)
    target = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)
    rows = []
    for layout in ("dp", "zero3", "tp"):
        compiled = autopar.compile(copy.deepcopy(base), mesh, (tokens,), loss_fn=loss_fn,
                                           optimizer=adamw, plan=plan_for(base, tokens, layout, n))
        hand = manual(copy.deepcopy(base), layout, mesh)
        hand_opt = adamw(hand.parameters())
        times = {"autopar": [], "manual": []}
        for step in range(STEPS + WARMUP):
            dist.barrier()
            t0 = time.perf_counter()
            compiled.train_step((tokens,), target)
            dist.barrier()
            t1 = time.perf_counter()
            hand_opt.zero_grad()
            loss = loss_fn(hand(shard_of(tokens, layout, rank, n)), shard_of(target, layout, rank, n))
            loss.backward()
            hand_opt.step()
            dist.barrier()
            t2 = time.perf_counter()
            if step >= WARMUP:
                times["autopar"].append(t1 - t0)
                times["manual"].append(t2 - t1)
        a, m = statistics.median(times["autopar"]), statistics.median(times["manual"])
        rows.append((layout, a, m))
    if rank == 0:
        print(f"GPT dim {CFG.dim}, {CFG.n_layers} layers, vocab {CFG.vocab_size}, batch {BATCH}x{CFG.max_seq_len}, "
              f"{n} gloo ranks, median of {STEPS} steps")
        print("| layout | autopar (ms) | by hand (ms) | autopar / by hand |")
        print("| --- | --- | --- | --- |")
        for layout, a, m in rows:
            print(f"| {layout} | {a * 1e3:.1f} | {m * 1e3:.1f} | {a / m:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=4", __file__], env=env))
