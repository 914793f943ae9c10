"""Compiled layouts against the same layouts written by hand with torch's own APIs.

    python benchmarks/runtime_vs_manual.py            # launches 4 gloo ranks itself

For one small GPT and one batch: DP (autopar's plan vs DDP), ZeRO-3 (autopar's plan vs
FSDP2 ``fully_shard`` per block) and Megatron TP (autopar with the column/row weight
placements vs ``parallelize_module`` with Colwise/Rowwise). The autopar plans are the
same layouts as the hand-written ones (``plan_for``), op for op. Each pair runs
interleaved, step by step, in alternating order (ABBA), so that load on this shared
machine hits both alike; the table gives the median step time of each, compiled /
manual, and the median of the per-step ratios (robust to load that drifts between
steps). Ratios, not absolute times, are the result.
"""

from __future__ import annotations

import copy
import dataclasses
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
from passes.strategies import build_strategy_graph, tensor_inputs  # noqa: E402

STEPS, WARMUP = 30, 4
CFG = GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2)
BATCH = 16


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def plan_for(model, tokens, layout: str, n: int):
    """The plan of the layout the hand-written side runs: DP (batch split, parameters
    replicated); ZeRO-3 (DP's ops, parameters stored split on dim 0 and gathered at each
    use, as ``fully_shard`` does); Megatron TP (q, k, v, up split by output features,
    o and down by input features, everything else replicated, and every op using the
    parameters where they lie, as ``parallelize_module`` does)."""
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
        elif layout == "tp" and fqn:
            column = any(k in fqn for k in (".q.", ".k.", ".v.", ".up."))
            row = (".o.weight" in fqn) or (".down.weight" in fqn)
            fixed[node] = (Shard(0),) if column else (Shard(1),) if row else (Replicate(),)
    if layout == "tp":
        graph, choice = megatron_choice(graph, fixed)
    else:
        choice = choose_by_propagation(graph, fixed)
    if layout == "zero3":
        for node, ns in graph.nodes.items():
            if node.name in cap.params and node.meta["val"].shape[0] % n == 0:
                choice[node] = [s.output for s in ns.strategies].index((Shard(0),))
    plan = plan_from_choice(graph, choice, kind=layout)
    if layout == "zero3":
        plan.zero = {fqn: 3 if "S(" in spec else 0 for fqn, spec in plan.params.items()}
    return plan


def megatron_choice(graph, fixed):
    from torch.distributed.tensor import Shard

    """Propagation restricted to Megatron's moves: every parameter used where it lies, and
    no activation split that a column-parallel weight did not split (no reduce-scatter or
    slice of a whole value; a row-parallel output is all-reduced). Returns the restricted
    graph and its choice."""
    while True:
        choice = choose_by_propagation(graph, fixed)
        have = {n: ns.strategies[choice[n]].outputs for n, ns in graph.nodes.items() if ns.follows is None}
        nodes, changed = {}, False
        for node, ns in graph.nodes.items():
            if ns.info is not None:
                def allowed(s):
                    for src, need in zip(tensor_inputs(node), s.inputs):
                        if need is None:
                            continue
                        if src in fixed and node.op != "placeholder" and src.name in graph.captured.params:
                            if need != fixed[src]:
                                return False
                        elif src in have and any(isinstance(b, Shard) and not isinstance(a, Shard)
                                                 for a, b in zip(have[src][0], need)):
                            return False
                    return True
                keep = tuple(s for s in ns.strategies if allowed(s)) or ns.strategies
                changed |= len(keep) != len(ns.strategies)
                ns = dataclasses.replace(ns, strategies=keep)
            nodes[node] = ns
        graph = dataclasses.replace(graph, nodes=nodes)
        if not changed:
            return graph, choice


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


def hand_step(hand, opt, layout, tokens, target, rank, n):
    opt.zero_grad()
    loss = loss_fn(hand(shard_of(tokens, layout, rank, n)), shard_of(target, layout, rank, n))
    loss.backward()
    opt.step()


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    base, tokens, target = gpt_and_batch()
    rows = []
    for layout in ("dp", "zero3", "tp"):
        compiled = autopar.compile(copy.deepcopy(base), mesh, (tokens,), loss_fn=loss_fn,
                                           optimizer=adamw, plan=plan_for(base, tokens, layout, n))
        hand = manual(copy.deepcopy(base), layout, mesh)
        hand_opt = adamw(hand.parameters())
        runs = {"autopar": lambda pm=compiled: pm.train_step((tokens,), target),
                "manual": lambda m=hand, o=hand_opt, lay=layout: hand_step(m, o, lay, tokens, target, rank, n)}
        times = {"autopar": [], "manual": []}
        for step in range(STEPS + WARMUP):
            order = ("autopar", "manual") if step % 2 == 0 else ("manual", "autopar")  # ABBA: no side goes first always
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                runs[name]()
                dist.barrier()
                if step >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
        a, m = statistics.median(times["autopar"]), statistics.median(times["manual"])
        paired = statistics.median(x / y for x, y in zip(times["autopar"], times["manual"]))
        rows.append((layout, a, m, paired))
    if rank == 0:
        print(f"GPT dim {CFG.dim}, {CFG.n_layers} layers, vocab {CFG.vocab_size}, batch {BATCH}x{CFG.max_seq_len}, "
              f"{n} gloo ranks, median of {STEPS} steps")
        print("| layout | autopar (ms) | by hand (ms) | autopar / by hand | median of step ratios |")
        print("| --- | --- | --- | --- | --- |")
        for layout, a, m, paired in rows:
            print(f"| {layout} | {a * 1e3:.1f} | {m * 1e3:.1f} | {a / m:.2f} | {paired:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


def gpt_and_batch():
    """The benchmark's model (seeded, so every rank builds the same) and one batch."""
    torch.manual_seed(0)
    base = GPT(CFG)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)
    target = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)
    return base, tokens, target


def launch(script: str, nproc: int = 4) -> int:
    """Run ``script`` on ``nproc`` gloo ranks (torchrun), one thread each."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={nproc}", script], env=env)


if __name__ == "__main__":
    sys.exit(main() if "RANK" in os.environ else launch(__file__))
