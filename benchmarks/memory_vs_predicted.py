"""Memory per rank, measured while training, against the plan's prediction.

    python -m benchmarks.memory_vs_predicted            # launches 4 gloo ranks itself
    python -m benchmarks.memory_vs_predicted --mp bf16  # under a MixedPrecisionPolicy (runtime.precision.POLICIES)
    python -m benchmarks.memory_vs_predicted --layouts zero3 dp  # a subset

For the small GPT of ``runtime_vs_manual.py`` on 4 ranks: DP, ZeRO-1, ZeRO-2, ZeRO-3
(the same layouts as that benchmark: DP's ops, parameters stored split on dim 0), Megatron
TP, the same with every layer recomputed in backward (``+recompute``: activation
checkpointing, ``autopar.passes.lowering.recompute``), and the automatic plan (``autopar.plan`` with the
H100 preset, no pipeline). Each layout's prediction is ``plan.predicted.memory`` from the
planner's own cost model (``autopar.passes.costing``, ``autopar.passes.planner.search.predict``; bytes per
device by kind).

There is no allocator to ask on CPU, so each kind is measured as what it is, per rank,
by ``ParallelModule.measure_memory`` on the step after a warm-up step, and the table
gives the largest over the ranks:

- parameters: bytes of the parameter shards and buffers the rank holds, plus the
  gathered whole copies it keeps for backward (ZeRO-1 holds parameters whole; ZeRO-2
  keeps the copies that backward reads; ZeRO-3 frees its copies after use and gathers
  again in backward, so keeps none);
- gradients: bytes of the shards' ``.grad`` after the step (ZeRO-1: the whole
  gradients; they live until the next step's ``zero_grad``);
- optimizer: bytes of the optimizer's state tensors (AdamW's two moments; the 0-d step
  counters are left out);
- activations: bytes of the distinct storages autograd keeps for backward, collected
  at the end of forward (``saved_tensors_hooks``), leaving out the parameters' own
  storages (a weight saved by a matmul is not an activation) and the gathered copies
  counted above. The loss's are included; the plans here are of the model alone, and
  the predictor counts its logits instead. A checkpointed layer keeps no activation
  through autograd's hooks (its own hooks hold them), so for recomputed layouts two more
  parts are measured (``Checkpoints``): the distinct storages each checkpointed layer
  holds as inputs from forward to its backward, and the most one layer's rebuild keeps
  while backward runs it again (the layer's forward run once more, on every rank alike,
  under the same hooks), which is the transient the predictor charges once.

Transient buffers (a bucket's flat all-gather, a gradient bucket in flight, the one
ZeRO-3 bucket gathered at a time) are not measured, and not predicted either. What the
prediction calls ``temporary`` (alive only while backward runs: the loss's gradients being
made) is not measured either: it gets a row of its own and stays out of both totals, which
add the four measured kinds. The table goes to
``benchmarks/results/memory_vs_predicted_gloo_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


import autopar
from autopar.costmodels.presets import preset
from autopar.costmodels.units import MIB
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.lowering.buckets import gathered
from autopar.passes.planner.assemble import chosen, node_breakdown, predict, storage_specs, zero_levels
from autopar.passes.lowering.recompute import Recomputed
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.runtime.precision import POLICIES, Precision, capture_cast
from benchmarks.results_file import add_out_argument, write_results
from benchmarks.runtime_vs_manual import BATCH, CFG, adamw, gpt_and_batch, launch, loss_fn, plan_for

KINDS = ("parameters", "gradients", "optimizer", "activations")
LAYOUTS = ("dp", "zero1", "zero2", "zero3", "tp", "dp+recompute", "zero3+recompute", "tp+recompute", "auto")
RECOMPUTE = "+recompute"
TOLERANCE = 0.15


def costed(model, tokens, layout: str, n: int, mp_policy=None) -> Plan:
    """The layout's plan with the planner's prediction (ZeRO-1/2: DP's ops, the optimizer
    state (and, at 2, gradients) sharded, parameters stored split as the planner stores them;
    ``+recompute``: every repeated layer recomputed in backward)."""
    base = layout.removesuffix(RECOMPUTE)
    plan = plan_for(model, tokens, "dp" if base in ("zero1", "zero2") else base, (n,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,)) if mp_policy is None else capture_cast(
            capture, model, Precision.of(mp_policy))((tokens,))  # as it computes under the policy
    graph = build_strategy_graph(cap, (n,))
    # memory does not depend on the hardware
    costs = build_costs(graph, preset("h100", (n,)), recompute=layout.endswith(RECOMPUTE))
    level = {"zero1": 1, "zero2": 2}.get(base, 0)
    zero = {node: level for node in graph.nodes if node.name in cap.params}
    assignment = costs.assignment(choice_from_plan(graph, plan), zero)
    picked = chosen(costs, assignment)
    plan.predicted = predict(costs, picked)
    plan.zero = zero_levels(costs, picked)
    plan.params = storage_specs(costs, picked)
    plan.breakdown = node_breakdown(costs, assignment)  # each node's layer, which recomputation reads
    plan.recompute = [f"layer {k}" for k in sorted(costs.recompute)]
    plan.kind = layout
    return plan


class Checkpoints:
    """What checkpointed layers keep outside autograd's hooks, measured on one step: the
    storages each holds as inputs (``held``), and the most one layer's forward, run again,
    keeps for backward (``rebuilt``: the transient of backward's recomputation)."""

    def __init__(self, pm, own: set[int]):
        self.own, self.held, self.rebuilt = own, {}, 0
        self.handles = [m.register_forward_pre_hook(self._inputs) for m in pm.gm.modules()
                        if isinstance(m, Recomputed)]

    def _storages(self, tensors) -> dict[int, int]:
        out = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and gathered(t) is None and t.untyped_storage().data_ptr() not in self.own:
                out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out

    def _inputs(self, module: Recomputed, args: tuple) -> None:
        self.held.update(self._storages(args))
        kept: list[torch.Tensor] = []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            module.segment(*args)  # what backward rebuilds for this layer (collectives alike on every rank)
        inside = self._storages(kept)
        self.rebuilt = max(self.rebuilt, sum(b for ptr, b in inside.items() if ptr not in self.held))

    def bytes_beyond(self, kept: set[int]) -> int:
        """Held inputs autograd does not keep anyway, plus the largest rebuild."""
        for h in self.handles:
            h.remove()
        return sum(b for ptr, b in self.held.items() if ptr not in kept) + self.rebuilt


def measure(pm, tokens, target) -> dict[str, float]:
    """``pm.measure_memory``'s kinds; for recomputed layouts, activations as checkpointing keeps them."""
    if not pm.plan.recompute:
        return pm.measure_memory((tokens,), target)
    own = {p.untyped_storage().data_ptr() for p in pm.shards}
    kept: dict[int, int] = {}

    def observe(t: torch.Tensor, is_weight: bool) -> None:
        if not is_weight and t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    out = pm.measure_memory((tokens,), target)
    checkpoints = Checkpoints(pm, own)
    pm.train_step((tokens,), target, observe=observe)
    out["activations"] = sum(kept.values()) + checkpoints.bytes_beyond(set(kept))
    return out


def auto_plan(model, tokens, n: int, mp_policy=None) -> Plan:
    text = [autopar.plan(model, (n,), (tokens,), hardware="h100", pipeline=False, mp_policy=mp_policy).to_json()
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text)
    return Plan.from_json(text[0])


def main(layouts: list[str], mp: str | None, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    mp_policy = POLICIES[mp] if mp else None
    base, tokens, target = gpt_and_batch()
    rows = []
    for layout in layouts:
        plan = auto_plan(base, tokens, n, mp_policy) if layout == "auto" else costed(base, tokens, layout, n, mp_policy)
        pm = autopar.compile(copy.deepcopy(base), mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan,
                             mp_policy=mp_policy)
        pm.train_step((tokens,), target)  # warm-up: the loss program and the optimizer state exist after it
        mine = measure(pm, tokens, target)
        peak = torch.tensor([mine[k] for k in KINDS], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append((layout if layout != "auto" else f"auto ({plan.kind}, ZeRO {sorted(set(plan.zero.values()))})",
                     plan.predicted.memory, dict(zip(KINDS, peak.tolist()))))
    if dist.get_rank() == 0:
        lines = [f"GPT dim {CFG.dim}, {CFG.n_layers} layers, vocab {CFG.vocab_size}, batch {BATCH}x{CFG.max_seq_len}, "
                 f"{n} gloo ranks, mixed precision {mp or 'none'}; MiB per rank (largest over ranks); ! where measured "
                 f"is off by more than {TOLERANCE:.0%}", "",
                 "| layout | kind | predicted | measured | measured / predicted |",
                 "| --- | --- | --- | --- | --- |"]
        for layout, predicted, measured in rows:
            for kind in (*KINDS, "total"):  # the total: of the measured kinds, on both sides
                p = sum(predicted.get(k, 0.0) for k in KINDS) if kind == "total" else predicted.get(kind, 0.0)
                m = sum(measured.values()) if kind == "total" else measured[kind]
                ratio = m / p if p else float("inf") if m else 1.0
                flag = " !" if abs(ratio - 1) > TOLERANCE else ""
                lines.append(f"| {layout} | {kind} | {p / MIB:.2f} | {m / MIB:.2f} | {ratio:.2f}{flag} |")
            unmeasured = {k: b for k, b in predicted.items() if k not in KINDS and b}
            for kind, p in unmeasured.items():
                lines.append(f"| {layout} | {kind} (not measured, not in the total) | {p / MIB:.2f} | | |")
        print("\n".join(lines))
        write_results("memory_vs_predicted", "gloo", "Memory per rank while training against the plan's prediction",
                      lines, out)
    dist.barrier()
    dist.destroy_process_group()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), metavar="LAYOUT",
                        help=f"which layouts to measure (default: all of {', '.join(LAYOUTS)})")
    parser.add_argument("--mp", choices=sorted(POLICIES), default=None,
                        help="under mp_policy=POLICIES[MP] (autopar.runtime.precision), planned and run")
    add_out_argument(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    mp = ["--mp", options.mp] if options.mp else []
    sys.exit(main(options.layouts, options.mp, options.out) if "RANK" in os.environ
             else launch("benchmarks.memory_vs_predicted", ["--layouts", *options.layouts, *mp,
                                                            "--out", str(options.out.resolve())]))
