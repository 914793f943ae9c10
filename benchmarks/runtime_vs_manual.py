"""Compiled layouts against the same layouts written by hand with torch's own APIs.

    python -m benchmarks.runtime_vs_manual                      # launches 4 gloo ranks itself
    python -m benchmarks.runtime_vs_manual --layouts dp tp+dp   # a subset
    python -m benchmarks.runtime_vs_manual --mp bf16 --layouts dp zero3 --nproc 2  # mixed precision

For one small GPT and one batch, each layout as autopar runs it (a plan that is the same
layout op for op: ``plan_for``, ``pipeline_plan_for``) and as people write it by hand:

| layout | mesh | by hand |
| --- | --- | --- |
| ``dp`` | 4 | DDP |
| ``zero1`` | 4 | DDP + ``ZeroRedundancyOptimizer`` (AdamW state split by parameter) |
| ``zero2`` | 4 | FSDP2 ``fully_shard(..., reshard_after_forward=False)`` per block and at the root |
| ``zero3`` | 4 | FSDP2 ``fully_shard`` per block and at the root |
| ``tp`` | 4 | ``parallelize_module``: Colwise q, k, v, up; Rowwise o, down |
| ``tp+dp`` | 2x2 (dp, tp) | ``tp``'s ``parallelize_module`` on the tp sub-mesh, DDP over the dp sub-mesh |
| ``pp-1f1b``, ``pp-gpipe`` | 2x2 (pp, dp) | two halves cut by hand, a ``PipelineStage`` each, in DDP over dp |

The pipelines' halves: the embeddings and the first half of the blocks; the other blocks,
the final norm and the head. ``Schedule1F1B`` / ``ScheduleGPipe``, 4 micro-batches per
step on each data-parallel rank; autopar's plan cuts its stages at the same place.

autopar's ZeRO-1 (``autopar.runtime.zero1``) keeps parameters whole and all-reduces gradients in
DDP's buckets while backward runs, steps AdamW on this rank's slice (dim 0) of each
parameter and all-gathers the slices after the step, a bucket at a time;
``ZeroRedundancyOptimizer`` gives each parameter to one rank and broadcasts it after
the step. autopar's ZeRO-2 stores the parameters split on dim 0, as FSDP splits them,
gathers them once per step and keeps them for backward, and reduce-scatters gradients.

Each pair runs interleaved, step by step, in alternating order (ABBA), so that load on
this shared machine hits both alike; the table gives the median step time of each,
compiled / by hand, and the median of the per-step ratios (robust to load that drifts
between steps). Ratios, not absolute times, are the result.

``--mp bf16`` (a policy of ``autopar.runtime.precision.POLICIES``): autopar compiles with
``mp_policy=``; by hand, FSDP2 (``zero2``, ``zero3``) gets ``fully_shard(..., mp_policy=)``
with the same policy, and every other layout runs its forward and loss under
``torch.autocast(dtype=param_dtype)`` (DDP + autocast: float32 weights and gradients,
so gradients are summed in float32, which is the policy's ``reduce_dtype``).

The table goes to ``benchmarks/results/runtime_vs_manual_gloo_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.layers import layer_path
from autopar.passes.plan import Pipeline, plan_from_choice
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import build_strategy_graph, tensor_inputs
from autopar.runtime.precision import POLICIES
from benchmarks.results_file import RESULTS_DIR, add_out_argument, write_results

STEPS, WARMUP = 60, 4  # timed steps per side (``--steps``), and untimed ones before them
CFG = GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2)
BATCH = 16
MICRO_BATCHES = 4  # pipelines: per step, on every data-parallel rank
LAYOUTS = ("dp", "zero1", "zero2", "zero3", "tp", "tp+dp", "pp-1f1b", "pp-gpipe")
ZERO = {"zero1": 1, "zero2": 2, "zero3": 3}
COLUMN, ROW = ("attn.q", "attn.k", "attn.v", "mlp.up"), ("attn.o", "mlp.down")


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def mesh_of(layout: str, n: int) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """(shape, axis names) of the mesh a layout runs on."""
    if layout == "tp+dp":
        return (2, n // 2), ("dp", "tp")
    if layout.startswith("pp-"):
        return (2, n // 2), ("pp", "dp")
    return (n,), None


def plan_for(model, tokens, layout: str, mesh_shape: tuple[int, ...]):
    """The plan of the layout the hand-written side runs: DP (batch split, parameters
    replicated); ZeRO-1/2/3 (DP's ops, parameters stored split on dim 0 as ``fully_shard``
    splits them: used whole with the optimizer on the slice (1), gathered once per step (2)
    or at each use (3)); Megatron TP (q, k, v,
    up split by output features, o and down by input features, everything else
    replicated, and every op using the parameters where they lie, as
    ``parallelize_module`` does) on the last axis, with the batch split on the others
    (``tp+dp``)."""
    from torch.distributed.tensor import Replicate, Shard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, mesh_shape)
    n_axes = len(mesh_shape)
    tp_axes = {"tp": tuple(range(n_axes)), "tp+dp": (n_axes - 1,)}.get(layout, ())
    fixed = {}
    for node in graph.nodes:
        fqn = cap.params.get(node.name, "")
        if node.name in cap.user_inputs:
            fixed[node] = tuple(Replicate() if a in tp_axes else Shard(0) for a in range(n_axes))
        elif tp_axes and fqn:
            column = any(f".{k}." in fqn for k in COLUMN)
            row = any(fqn.endswith(f".{k}.weight") for k in ROW)
            split = Shard(0) if column else Shard(1) if row else Replicate()
            fixed[node] = tuple(split if a in tp_axes else Replicate() for a in range(n_axes))
    if tp_axes:
        graph, choice = megatron_choice(graph, fixed, tp_axes)
    else:
        choice = choose_by_propagation(graph, fixed)
    if layout in ZERO:
        split = (Shard(0),) * n_axes
        size = 1
        for s in mesh_shape:
            size *= s
        for node, ns in graph.nodes.items():
            if node.name in cap.params and node.meta["val"].shape[0] % size == 0:
                choice[node] = [s.output for s in ns.strategies].index(split)
    plan = plan_from_choice(graph, choice, kind=layout)
    if layout in ZERO:
        plan.zero = {fqn: ZERO[layout] if "S(" in spec else 0 for fqn, spec in plan.params.items()}
    return plan


def megatron_choice(graph, fixed, tp_axes: tuple[int, ...]):
    """Propagation restricted to Megatron's moves on ``tp_axes``: every parameter used where
    it lies, and no activation split that a column-parallel weight did not split (no
    reduce-scatter or slice of a whole value; a row-parallel output is all-reduced).
    Returns the restricted graph and its choice."""
    from torch.distributed.tensor import Shard

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
                        elif src in have and any(isinstance(need[a], Shard) and not isinstance(have[src][0][a], Shard)
                                                 for a in tp_axes):
                            return False
                    return True
                keep = tuple(s for s in ns.strategies if allowed(s)) or ns.strategies
                changed |= len(keep) != len(ns.strategies)
                ns = dataclasses.replace(ns, strategies=keep)
            nodes[node] = ns
        graph = dataclasses.replace(graph, nodes=nodes)
        if not changed:
            return graph, choice


def pipeline_plan_for(model, tokens, mesh_shape: tuple[int, ...], schedule: str):
    """Pipeline over mesh axis 0 (two stages cut where the hand-written halves are cut:
    before block ``n_layers // 2``), data parallel on the other axes (DP's ops on one
    micro-batch)."""
    from torch.distributed.tensor import Shard

    micro = tokens.chunk(MICRO_BATCHES)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (micro,))
    intra = mesh_shape[1:]
    graph = build_strategy_graph(cap, intra)
    fixed = {n: (Shard(0),) * len(intra) for n in graph.nodes if n.name in cap.user_inputs}
    plan = plan_from_choice(graph, choose_by_propagation(graph, fixed), kind=f"pp-{schedule}",
                            axis_names=("dp",) * len(intra))
    stage_of, stage = {}, 0
    for node in cap.nodes("call_function"):
        where = layer_path(node, cap.params)
        if where is not None and where[1] >= CFG.n_layers // 2:
            stage = 1
        stage_of[node.name] = stage
    plan.mesh_shape = mesh_shape
    plan.axis_names = ("pp",) + plan.axis_names
    plan.pipeline = Pipeline(axis=0, stages=mesh_shape[0], micro_batches=MICRO_BATCHES, schedule=schedule,
                             stage_of=stage_of)
    return type(plan).from_json(plan.to_json())


class Front(nn.Module):
    """The first pipeline stage written by hand: embeddings and the first half of the blocks."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[: len(gpt.blocks) // 2])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return x


class Back(nn.Module):
    """The second pipeline stage written by hand: the other blocks, the final norm, the head."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[len(gpt.blocks) // 2 :])
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def autocast(policy) -> contextlib.AbstractContextManager:
    """The hand-written side's mixed precision where FSDP2 is not used: autocast to the
    policy's compute dtype (none without a policy)."""
    if policy is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=policy.param_dtype)


def manual(model: GPT, layout: str, mesh, tokens, target, policy=None) -> Callable[[], None]:
    """The hand-written side: one training step on this rank's part of the batch
    (``policy``: FSDP2's ``mp_policy`` for zero2/zero3, autocast otherwise)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    if layout.startswith("pp-"):
        return manual_pipeline(model, layout, mesh, tokens, target, policy)
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = tokens.chunk(n)[rank], target.chunk(n)[rank]  # the batch split over every rank
    if layout in ("dp", "zero1"):
        hand = DDP(model)
    elif layout in ("zero2", "zero3"):
        sharding = {"mesh": mesh, "reshard_after_forward": layout == "zero3"}
        # blocks hand param_dtype on; only the root's output is cast (output_dtype), as autopar casts it
        inner = {} if policy is None else {"mp_policy": dataclasses.replace(policy, output_dtype=None)}
        for block in model.blocks:
            fully_shard(block, **sharding, **inner)
        hand = fully_shard(model, **sharding, **({} if policy is None else {"mp_policy": policy}))
        policy = None  # FSDP2 applies it: no autocast besides
    else:
        tp_mesh = mesh["tp"] if layout == "tp+dp" else mesh
        tp_plan = {}
        for i in range(len(model.blocks)):
            tp_plan.update({f"blocks.{i}.{name}": ColwiseParallel() for name in COLUMN})
            tp_plan.update({f"blocks.{i}.{name}": RowwiseParallel() for name in ROW})
        hand = parallelize_module(model, tp_mesh, tp_plan)
        if layout == "tp+dp":
            dp_mesh = mesh["dp"]
            hand = DDP(hand, device_mesh=dp_mesh)  # DDP over the dp sub-mesh of a TP model
            x, y = (t.chunk(dp_mesh.size())[dp_mesh.get_local_rank()] for t in (tokens, target))
        else:
            x, y = tokens, target
    if layout == "zero1":
        opt = ZeroRedundancyOptimizer(hand.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = adamw(hand.parameters())

    def step() -> None:
        opt.zero_grad()
        with autocast(policy):
            loss = loss_fn(hand(x), y)
        loss.backward()
        opt.step()

    return step


def manual_pipeline(model: GPT, layout: str, mesh, tokens, target, policy=None) -> Callable[[], None]:
    """Two hand-cut stages on the pp axis, each data parallel (DDP) over the dp axis."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp, dp = mesh["pp"], mesh["dp"]
    first = pp.get_local_rank() == 0
    part = Front(model) if first else Back(model)
    x, y = (t.chunk(dp.size())[dp.get_local_rank()] for t in (tokens, target))
    # (GPipe: without find_unused_parameters, DDP's bucket rebuild after the first step
    # finds every parameter marked twice and fails; 1F1B runs as is)
    wrapped = DDP(part, process_group=dp.get_group(), find_unused_parameters=layout == "pp-gpipe")
    stage = PipelineStage(wrapped, pp.get_local_rank(), pp.size(), torch.device("cpu"), group=pp.get_group())
    schedule_cls = Schedule1F1B if layout == "pp-1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, MICRO_BATCHES, loss_fn=loss_fn)
    opt = adamw(part.parameters())

    def step() -> None:
        opt.zero_grad()
        with autocast(policy):  # the schedule runs forward, loss and backward inside
            if first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
        opt.step()

    return step


def compiled(base: GPT, layout: str, mesh, tokens, policy=None):
    shape = tuple(mesh.shape)
    if layout.startswith("pp-"):
        plan = pipeline_plan_for(base, tokens, shape, {"pp-1f1b": "1F1B", "pp-gpipe": "GPipe"}[layout])
    else:
        plan = plan_for(base, tokens, layout, shape)
    return autopar.compile(copy.deepcopy(base), mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan,
                           mp_policy=policy)


def measure(runs: dict[str, Callable[[], None]], steps: int) -> dict[str, list[float]]:
    """Step times of each side, interleaved step by step in ABBA order."""
    times = {name: [] for name in runs}
    names = list(runs)
    for step in range(steps + WARMUP):
        order = names if step % 2 == 0 else names[::-1]  # ABBA: no side goes first always
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            dist.barrier()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return times


def main(layouts: list[str], steps: int, mp: str | None = None, out: Path = RESULTS_DIR) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    warnings.filterwarnings("ignore")  # torch's notes on gloo, DDP with DTensors, pipelining's shapes
    rank, n = dist.get_rank(), dist.get_world_size()
    base, tokens, target = gpt_and_batch()
    policy = POLICIES[mp] if mp else None
    rows = []
    for layout in layouts:
        shape, names = mesh_of(layout, n)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pm = compiled(base, layout, mesh, tokens, policy)
        runs = {"autopar": lambda pm=pm: pm.train_step((tokens,), target),
                "manual": manual(copy.deepcopy(base), layout, mesh, tokens, target, policy)}
        times = measure(runs, steps)
        a, m = statistics.median(times["autopar"]), statistics.median(times["manual"])
        paired = statistics.median(x / y for x, y in zip(times["autopar"], times["manual"]))
        rows.append((f"{layout} ({'x'.join(map(str, shape))})", a, m, paired))
    if rank == 0:
        lines = [f"GPT dim {CFG.dim}, {CFG.n_layers} layers, vocab {CFG.vocab_size}, batch {BATCH}x{CFG.max_seq_len}, "
                 f"{n} gloo ranks, median of {steps} steps; pipelines: {MICRO_BATCHES} micro-batches; "
                 f"mixed precision: {mp or 'none'}", "",
                 "| layout (mesh) | autopar (ms) | by hand (ms) | autopar / by hand | median of step ratios |",
                 "| --- | --- | --- | --- | --- |"]
        lines += [f"| {layout} | {a * 1e3:.1f} | {m * 1e3:.1f} | {a / m:.2f} | {paired:.2f} |"
                  for layout, a, m, paired in rows]
        print("\n".join(lines))
        write_results("runtime_vs_manual", "gloo", "Training step time: autopar against the same layouts by hand",
                      lines, out)
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


REPO = Path(__file__).resolve().parents[1]


def launch(module: str, args: Sequence[str] = (), nproc: int = 4) -> int:
    """Run ``python -m module`` (``benchmarks.<name>``, from the repository root) on ``nproc``
    gloo ranks (torchrun), one thread each."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={nproc}", "-m", module, *args], env=env, cwd=REPO)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), metavar="LAYOUT",
                        help=f"which layouts to compare (default: all of {', '.join(LAYOUTS)})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"timed steps per side (default {STEPS})")
    parser.add_argument("--mp", choices=sorted(POLICIES), default=None,
                        help="mixed precision: autopar under mp_policy=POLICIES[MP], by hand FSDP2's mp_policy or autocast")
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks to launch (default 4)")
    add_out_argument(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    if "RANK" in os.environ:
        sys.exit(main(options.layouts, options.steps, options.mp, options.out))
    mp = ["--mp", options.mp] if options.mp else []
    sys.exit(launch("benchmarks.runtime_vs_manual", ["--layouts", *options.layouts, "--steps", str(options.steps), *mp,
                                                     "--out", str(options.out.resolve())],
                    nproc=options.nproc))
