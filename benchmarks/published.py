"""Predictions against published H100 training runs (FACTS.md, "Published H100 training runs").

    python -m benchmarks.published [--rows tt-8b mlm-7.1b ...] [--time-limit 60] [--dry-run] [--no-auto]

For each published run, on the meta device with the preset of its machine (``Row.hardware``:
``h100``, or ``h100-96gb-500w`` for torchtitan's 96 GB HBM2e H100s at 500 W):

- published tokens/s/GPU (converted from TFLOP/s/GPU where that is what was published,
  with FLOPs per token = 6 * parameters + 12 * layers * hidden * sequence);
- predicted tokens/s/GPU of the PUBLISHED layout (``autopar.passes.planner.pinned.price_pinned``: its
  intra-op layout, stages, micro-batches and schedule, with its activation checkpointing
  where the source states it (full, or none), else the fewest recomputed layers that fit
  the run's GPU memory), and predicted / published;
- predicted memory per GPU of that layout against the published figure, where published;
- the auto plan (``autopar.plan`` on (GPUs / 8, 8), 8-GPU nodes, with the run's GPU
  memory as the limit, as the published layout gets): one line, its predicted
  tokens/s/GPU and MFU (model FLOPs against 989 TFLOP/s dense bf16), planning seconds,
  and, with ``--dry-run`` where ``autopar.dry_run`` exists, the full-scale dry run's verdict.

Prints a markdown table, and the published layouts' predicted step by where it goes
(``autopar.passes.planner.pinned.breakdown``), and writes them to results/published.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


import autopar
from autopar import layouts
from autopar.bench.run import plan_line
from autopar.models import llama3, megatron_gpt
from autopar.planning import plan as plan_auto
from autopar.passes.capture import capture
from autopar.passes.planner.pinned import BREAKDOWN_PARTS, Pinned, price_pinned
from autopar.passes.strategy_graph import NoRuleWarning

PEAK_BF16 = 989e12  # H100 SXM dense bf16 FLOP/s (datasheet; FACTS.md)
GB, GIB = 1e9, 2**30
GRAND_TETON = "h100-96gb-500w"  # torchtitan's runs: 96 GB HBM2e H100s at 500 W (costmodels/presets.py)
GPUS_PER_NODE = 8
# The Llama 3 Herd of Models, sec. 3.3.2 ("Memory"): with pipeline stages' input and output
# tensors deallocated early, "we could pretrain Llama 3 on sequences of 8K tokens without
# activation checkpointing"
LLAMA3_RECOMPUTE = "none"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One published run: what was run, on what, and what it measured."""

    key: str
    source: str
    build: Callable[[], torch.nn.Module]  # the model, built under the meta device
    gpus: int
    batch: int  # sequences per step
    seq: int
    mesh: tuple[int, ...]  # the published layout's mesh: (PP * DP, TP), or (DP,)
    pinned: Pinned
    layout_text: str  # the layout as published
    tokens_per_gpu: float | None = None  # published tokens/s/GPU ...
    tflops_per_gpu: float | None = None  # ... or TFLOP/s/GPU
    memory_gib: float | None = None  # published peak memory per GPU
    hardware: str = "h100"  # the preset of the run's machine (autopar.costmodels.PRESETS)
    note: str = ""

    @property
    def device_memory(self) -> float:
        """Bytes of one GPU of the run's machine: the memory limit of its plans."""
        return autopar.costmodels.preset(self.hardware, (1,)).device.memory_bytes

    @property
    def auto_mesh(self) -> tuple[int, ...]:
        return (self.gpus,) if self.gpus <= GPUS_PER_NODE else (self.gpus // GPUS_PER_NODE, GPUS_PER_NODE)


def _megatron_tp_layout() -> str:
    """Megatron's runs use its distributed optimizer (ZeRO-1 over data parallel); that
    layout where autopar has it, else plain TP + DP."""
    return "tp+zero1" if "tp+zero1" in layouts.LAYOUTS else "tp+dp"


def published_rows() -> list[Row]:
    tt = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
    mlm = "NVIDIA/Megatron-LM README, H100 table (Megatron-Core r0.8.0)"
    herd = "The Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
    tp = _megatron_tp_layout()
    mlm_note = ("README states no recomputation, micro-batch size or interleaving: micro-batches of one "
                "sequence, 1F1B, layout " + tp)
    l405 = lambda: llama3("405b", 8192)  # noqa: E731
    return [
        Row(key="tt-8b", source=tt, build=lambda: llama3("8b", 8192), gpus=8, batch=16, seq=8192, mesh=(8,),
            pinned=Pinned(layout="fsdp"), layout_text="FSDP 8, selective AC", tokens_per_gpu=5762,
            memory_gib=82.4, hardware=GRAND_TETON,
            note="selective AC (op-level, torchtitan's 8B config: every other matmul and every elementwise op "
                 "recomputed in every layer) approximated by the fewest recomputed whole layers that fit 96 GB; "
                 "predicted fast although its matmuls price at or under a measured H100 table "
                 "(tests/test_costmodel_rates.py): not modelled are the 500 W cap's sustained clocks (the preset "
                 "takes the bf16 peak midway between SXM and NVL), eager per-op overheads and that AC policy"),
        Row(key="tt-405b-1f1b", source=tt, build=l405, gpus=512, batch=256, seq=8192, mesh=(64, 8),
            pinned=Pinned(layout="fsdp+tp", stages=8, micro_batches=32, schedule="1f1b", recompute="full"),
            layout_text="FSDP 8 x TP 8 x PP 8, 1F1B, M=32, full AC", tokens_per_gpu=100, memory_gib=82.5,
            hardware=GRAND_TETON, note="Float8 + compile + AsyncTP: an upper reference for bf16"),
        Row(key="tt-405b-i1f1b", source=tt, build=l405, gpus=512, batch=256, seq=8192, mesh=(64, 8),
            pinned=Pinned(layout="fsdp+tp", stages=8, micro_batches=32, schedule="interleaved_1f1b",
                          recompute="full"),
            layout_text="FSDP 8 x TP 8 x PP 8, interleaved 1F1B, M=32, full AC", tokens_per_gpu=128,
            memory_gib=72.7, hardware=GRAND_TETON, note="Float8 + compile + AsyncTP: an upper reference for bf16"),
        Row(key="mlm-7.1b", source=mlm, build=lambda: megatron_gpt("7.1b"), gpus=96, batch=192, seq=4096,
            mesh=(48, 2), pinned=Pinned(layout=tp), layout_text="TP 2, PP 1, DP 48", tflops_per_gpu=465.9,
            note=mlm_note),
        Row(key="mlm-177b", source=mlm, build=lambda: megatron_gpt("177b"), gpus=2304, batch=1152, seq=4096,
            mesh=(288, 8), pinned=Pinned(layout=tp, stages=6, micro_batches=24, schedule="1f1b"),
            layout_text="TP 8, PP 6, DP 48 (M=24)", tflops_per_gpu=432.8, note=mlm_note),
        Row(key="mlm-462b", source=mlm, build=lambda: megatron_gpt("462b"), gpus=6144, batch=3072, seq=4096,
            mesh=(768, 8), pinned=Pinned(layout=tp, stages=16, micro_batches=64, schedule="1f1b"),
            layout_text="TP 8, PP 16, DP 48 (M=64)", tflops_per_gpu=459.9, note=mlm_note),
        Row(key="llama3-8k", source=herd, build=l405, gpus=8192, batch=2048, seq=8192, mesh=(1024, 8),
            pinned=Pinned(layout="fsdp+tp", stages=16, micro_batches=32, schedule="interleaved_1f1b",
                          recompute=LLAMA3_RECOMPUTE),
            layout_text="TP 8, PP 16, DP 64, interleaved (M=32)", tflops_per_gpu=430,
            note="16M tokens per batch; FSDP-style DP; interleaving depth not published: 2 chunks per rank"),
        Row(key="llama3-16k", source=herd, build=l405, gpus=16384, batch=2048, seq=8192, mesh=(2048, 8),
            pinned=Pinned(layout="fsdp+tp", stages=16, micro_batches=16, schedule="interleaved_1f1b",
                          recompute=LLAMA3_RECOMPUTE),
            layout_text="TP 8, PP 16, DP 128, interleaved (M=16)", tflops_per_gpu=400,
            note="16M tokens per batch; FSDP-style DP; interleaving depth not published: 2 chunks per rank, "
                 "whose bubble (P-1)/(v M) (Megatron's and the paper's, sec. 3.3.2) at M=16 is 47% of the work; "
                 "the paper's 400 vs 430 TFLOP/s on 8,192 GPUs (M=32) implies a smaller bubble, a deeper interleave"),
    ]


def model_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters, layers, hidden) of a Hugging Face Llama or an ``autopar.models.GPT``."""
    params = sum(p.numel() for p in model.parameters())
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "num_hidden_layers"):
        return params, cfg.num_hidden_layers, cfg.hidden_size
    return params, model.cfg.n_layers, model.cfg.dim


def flops_per_token(params: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per token of a training step (FACTS.md): 6 * params + 12 * layers * hidden * seq."""
    return 6.0 * params + 12.0 * layers * hidden * seq


def published_tokens(row: Row, per_token: float) -> float:
    return row.tokens_per_gpu if row.tokens_per_gpu is not None else row.tflops_per_gpu * 1e12 / per_token


def tokens_per_gpu(row: Row, step_time: float) -> float:
    return row.batch * row.seq / step_time / row.gpus


def one_line(plan) -> str:
    """The auto plan in one line: ``autopar bench``'s (mesh, pipeline, ZeRO levels,
    recomputation), then against the best manual layout and how far the search went."""
    parts = [plan_line(plan)]
    best = min(plan.candidates.items(), key=lambda kv: kv[1], default=None)
    if best is not None:  # the planner's manual candidates, costed alike
        parts.append(f"÷ best manual ({best[0]}) {plan.predicted.step_time / best[1]:.2f}")
    options = [n for n in plan.notes if n.startswith("pp")]  # the planner's "pp<P>x...: what happened"
    if options:
        skipped = sum("not tried" in n for n in options)
        parts.append(f"pipelines tried {len(options) - skipped}/{len(options)}"
                     + (" (safety net cut)" if plan.solver.get("clock_cut") else ""))
    return ", ".join(parts)


def dry_run_verdict(plan, model, inputs) -> str:
    """"ok" with the dry run's peak memory against the prediction, or the first failing rank."""
    dry_run = getattr(autopar, "dry_run", None)
    if dry_run is None:
        return "no autopar.dry_run"
    try:
        result = dry_run(plan, model, inputs)
    except Exception as exc:  # a crash of the dry run is a finding to report, not a crash of the table
        return f"crashed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]}"
    if not result.ok:
        first = result.failures[0]
        return f"FAILED on {first.where()}: {(first.error or '')[:120]}"
    return f"ok: peak {result.peak / GIB:.1f} GiB, predicted / dry run {result.ratio:.2f} ({result.seconds:.0f} s)"


def evaluate(row: Row, *, time_limit_s: float, dry_run: bool, cache: dict | None = None,
             auto_plan: bool = True) -> dict:
    """One table row's numbers (see the module docstring). ``cache``: kept between rows, so
    rows of the same model and batch share its capture, and of the same GPUs its auto plan.
    ``auto_plan`` False: the published layout only (the auto columns say "skipped")."""
    cache = {} if cache is None else cache
    shared = (row.build, row.batch, row.seq)
    if shared not in cache:
        with torch.device("meta"):
            model = row.build()
        inputs = (torch.zeros(row.batch, row.seq, dtype=torch.long, device="meta"),)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoRuleWarning)
            cache[shared] = (model, inputs, capture(model, inputs))
    model, inputs, captured = cache[shared]
    params, layers, hidden = model_shape(model)
    per_token = flops_per_token(params, layers, hidden, row.seq)
    published = published_tokens(row, per_token)
    out = {"row": row, "params": params, "flops_per_token": per_token, "published": published}
    started = time.perf_counter()
    cost = price_pinned(captured, row.mesh, row.hardware, lambda graph: layouts.hint(row.pinned.layout, graph),
                        row.pinned, memory_limit=row.device_memory)
    out["pinned_seconds"] = time.perf_counter() - started
    out["pinned"] = cost
    out["predicted"] = tokens_per_gpu(row, cost.step_time) if cost.fits else 0.0
    out["ratio"] = out["predicted"] / published
    if not auto_plan:
        out.update(SKIPPED_AUTO)
        return out
    key = shared + (row.gpus,)
    if key in cache:
        out.update(cache[key])
        return out
    auto = {}
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_auto(model, row.auto_mesh, inputs, hardware=row.hardware, time_limit_s=time_limit_s,
                             memory_limit=row.device_memory)
        auto["auto_seconds"] = time.perf_counter() - started
        auto["auto_line"] = one_line(plan)
        auto["auto_tokens"] = tokens_per_gpu(row, plan.predicted.step_time)
        auto["auto_mfu"] = auto["auto_tokens"] * per_token / PEAK_BF16
        auto["auto_memory"] = sum(plan.predicted.memory.values())
        auto["dry_run"] = dry_run_verdict(plan, model, inputs) if dry_run else "not run"
    except Exception as exc:  # reported in the table: the row's other numbers still stand
        auto.update(auto_seconds=time.perf_counter() - started, auto_line=f"FAILED: {str(exc)[:120]}",
                    auto_tokens=0.0, auto_mfu=0.0, auto_memory=math.nan, dry_run="not run")
    cache[key] = auto
    out.update(auto)
    return out


SKIPPED_AUTO = dict(auto_seconds=0.0, auto_line="skipped (--no-auto)", auto_tokens=0.0, auto_mfu=0.0,
                    auto_memory=math.nan, dry_run="not run")

HEADER = ("| run | GPUs | published layout | published tok/s/GPU | predicted (published layout) | ratio | "
          "memory GiB predicted / published | recomputed layers | auto plan | auto tok/s/GPU | auto MFU | "
          "auto ÷ published layout | planning s | dry run |")


def table_row(r: dict) -> str:
    row, cost = r["row"], r["pinned"]
    memory = f"{cost.memory / GIB:.1f}" if math.isfinite(cost.memory) else "—"
    published_memory = f"{row.memory_gib:.1f}" if row.memory_gib is not None else "—"
    speedup = r["auto_tokens"] / r["predicted"] if r["predicted"] else math.nan
    predicted = f"{r['predicted']:,.0f}" if cost.fits else "does not fit"
    return (f"| {row.key} | {row.gpus} | {row.layout_text} | {r['published']:,.0f} | {predicted} | "
            f"{r['ratio']:.2f} | {memory} / {published_memory} | {cost.recomputed}/{cost.layers} | "
            f"{r['auto_line']} | {r['auto_tokens']:,.0f} | {r['auto_mfu']:.0%} | {speedup:.2f} | "
            f"{r['auto_seconds']:.0f} | {r['dry_run']} |")


BREAKDOWN_HEADER = ("| run | step s | " + " | ".join(BREAKDOWN_PARTS) + " | model TFLOP/s/GPU at compute only |")


def breakdown_row(r: dict) -> str:
    """The published layout's predicted step on one GPU by where it goes (``PinnedCost.parts``,
    seconds and share of the step), and the model FLOP/s the compute part alone would give."""
    row, cost = r["row"], r["pinned"]
    if not cost.fits:
        return f"| {row.key} | does not fit |" + " — |" * (len(BREAKDOWN_PARTS) + 1)
    cells = [f"{cost.parts[k]:.3f} ({cost.parts[k] / cost.step_time:.0%})" for k in BREAKDOWN_PARTS]
    compute_only = r["flops_per_token"] * row.batch * row.seq / row.gpus / cost.parts["compute"] / 1e12
    return f"| {row.key} | {cost.step_time:.3f} | " + " | ".join(cells) + f" | {compute_only:.0f} |"


def table(results: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [table_row(r) for r in results]
    lines += ["", BREAKDOWN_HEADER, "|" + "---|" * BREAKDOWN_HEADER.count(" | ") + "---|"]
    lines += [breakdown_row(r) for r in results]
    lines.append("")
    lines += [f"- {r['row'].key}: {r['row'].source}; " + "; ".join([r["row"].note] + r["pinned"].notes)
              for r in results]
    return "\n".join(lines)


def main() -> None:
    rows = {r.key: r for r in published_rows()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(rows), choices=list(rows))
    parser.add_argument("--time-limit", type=float, default=60.0, help="the auto plan's search limit, seconds")
    parser.add_argument("--dry-run", action="store_true", help="dry-run every auto plan (autopar.dry_run)")
    parser.add_argument("--no-auto", action="store_true", help="price the published layouts only, no auto plan")
    parser.add_argument("--out", default="results/published.md")
    args = parser.parse_args()
    results, cache = [], {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for key in args.rows:
        started = time.perf_counter()
        results.append(evaluate(rows[key], time_limit_s=args.time_limit, dry_run=args.dry_run, cache=cache,
                                auto_plan=not args.no_auto))
        print(f"{key}: {time.perf_counter() - started:.0f} s (published layout priced in "
              f"{results[-1]['pinned_seconds']:.0f} s)", file=sys.stderr, flush=True)
        out.write_text(table(results) + "\n")  # after every row: a long run keeps what it has
    print(table(results))


if __name__ == "__main__":
    main()
