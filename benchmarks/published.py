"""Predictions against published H100 training runs (each ``Row`` cites its source).

    python -m benchmarks.published [--rows tt-8b mlm-7.1b ...] [--time-limit 60] [--dry-run] [--no-auto]
                                   [--bf16-throughout] [--plans DIR [--reuse-plans]] [--counterfactuals]

For each published run, on the meta device with the preset of its machine (``Row.hardware``:
``h100``, or ``h100-96gb-500w`` for torchtitan's 96 GB HBM2e H100s at 500 W), under the run's
mixed precision where autopar runs it as the run did (``Row.mp_policy``: float32 masters, bf16
compute, float32 gradient reductions; ``--bf16-throughout`` prices every row without it):

- published tokens/s/GPU (converted from TFLOP/s/GPU where that is what was published, with
  the FLOPs per token its publisher counted: ``Row.counted``, Megatron-LM's own count for its
  rows; else 6 * parameters + 12 * layers * hidden * sequence);
- predicted tokens/s/GPU of the PUBLISHED layout, planned through the public path
  (``autopar.plan(..., layout=, constraints=)``, ``published_pins``): its layout's placements
  and ZeRO levels, its stages, micro-batches, schedule and interleaving depth pinned, with its
  activation checkpointing where the source states it (``recompute=all``, or ``none``), else
  searched (the fewest recomputed layers that fit the run's GPU memory), and the gradient
  accumulation it ran (``Pinned.accumulate``: ``autopar.plan(..., accumulate=)``), and predicted / published;
- predicted memory per GPU of that layout against the published figure, where published;
- where that memory is over the card (a run that fixed its recomputation, priced as it was
  made), the published layout WITHIN the card: the fewest recomputed layers that fit, priced
  as the auto plan is (``fitting_layout``). The auto plan must fit, so it is compared with
  that one (its ratio to the run's own layout printed beside it); the ratio to published
  stays on the run's own recomputation: that is the prediction check;
- the auto plan (``autopar.plan`` on (GPUs / 8, 8), 8-GPU nodes, with the run's GPU
  memory as the limit, as the published layout gets): one line, its predicted
  tokens/s/GPU and MFU (model FLOPs against 989 TFLOP/s dense bf16), planning seconds,
  and, with ``--dry-run`` where ``autopar.dry_run`` exists, the full-scale dry run's verdict.

With ``--counterfactuals``, what the overlap-aware cost model and the zero-bubble schedules
changed in each auto plan (``counterfactuals``): the auto plan again with no communication
hidden (the preset's overlap off), and the best plan without a zero-bubble schedule (one stage;
1F1B and interleaved 1F1B pinned in turn: GPipe has 1F1B's bubble and more memory), each with
whether its layout differs from the auto plan's and the auto plan's predicted gain over it.

Prints a markdown table, and the published layouts' predicted step by where it goes
(``Plan.predicted``: compute, exposed communication, pipeline bubble; and the communication that
ran hidden behind compute, not part of the step). Writes them to results/published.md
(``--out``) after every row, and at the end to ``benchmarks/results/published_h100_<yyyymmdd>.md``
(``--table-dir``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar import Constraints, layouts
from autopar.bench.run import plan_line
from autopar.costmodels.units import GIB
from autopar.models import llama3, megatron_gpt
from autopar.planning import plan as plan_auto
from autopar.passes.plan import Plan
from autopar.passes.planner.pinned import Pinned, PinnedCost
from benchmarks.results_file import add_out_argument, write_results

PEAK_BF16 = 989e12  # H100 SXM dense bf16 FLOP/s (NVIDIA H100 Tensor Core GPU datasheet)
GRAND_TETON = "h100-96gb-500w"  # torchtitan's runs: 96 GB HBM2e H100s at 500 W (costmodels/presets.py)
GPUS_PER_NODE = 8
# The Llama 3 Herd of Models, sec. 3.3.2 ("Memory"): with pipeline stages' input and output
# tensors deallocated early, "we could pretrain Llama 3 on sequences of 8K tokens without
# activation checkpointing"
LLAMA3_RECOMPUTE = "none"
# Llama 3 paper, sec. 3.3.2 ("Pipeline parallelism"): interleaved schedule, 16 pipeline ranks,
# and one Transformer layer fewer on the first and the last rank, so that "the first model chunk
# on the first stage has only the embedding, and the last model chunk on the last stage has only
# output projection and loss calculation". The depth is not stated; of the interleaved depths,
# only 8 chunks per rank fill 16 x v chunks with 126 layers evenly around those two (16 * 8 - 2 =
# 126 chunks of one layer; (16v - 2) divides 126 for no other v > 1). autopar's stage cut puts at
# least one repeated layer in every chunk (the embedding and the head ride the first and last
# layer), so at most 126 // 16 = 7 chunks per rank: priced at 7, whose chunks of one or two
# layers leave a fill-and-drain bubble up to twice the paper's chunks of one
LLAMA3_STAGES, LLAMA3_405B_LAYERS = 16, 126  # the paper's Table 4 PP, and the 405B's layers (its Table 3)
LLAMA3_CHUNKS_IMPLIED = 8
LLAMA3_CHUNKS = min(LLAMA3_CHUNKS_IMPLIED, LLAMA3_405B_LAYERS // LLAMA3_STAGES)
# bf16 compute on float32 masters, gradients reduced in float32, as these runs trained:
# torchtitan's defaults (torchtitan/config_manager.py, end of 2024: --training.mixed_precision_param
# "bfloat16", --training.mixed_precision_reduce "float32", applied through FSDP2's
# MixedPrecisionPolicy, exactly what autopar prices and runs); the Llama 3 paper, sec. 3.3.2
# ("Numerical stability"): FP32 gradient accumulation over micro-batches and gradients
# reduce-scattered in FP32 across data-parallel workers in FSDP.
BF16_FP32_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


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
    # the run's mixed precision (float32 masters) where autopar runs it as the run did; None:
    # the model trained in bf16 throughout (see ``published_rows`` for Megatron's rows)
    mp_policy: MixedPrecisionPolicy | None = None
    # the model FLOPs per token (of the model, the sequence) its publisher divided by, where it
    # published TFLOP/s/GPU: they convert that back to tokens; None: ``flops_per_token``
    counted: Callable[[torch.nn.Module, int], float] | None = None
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
    # Megatron's bf16 runs also keep float32 masters and reduce gradients in float32
    # (megatron/training/arguments.py: bf16 sets accumulate_allreduce_grads_in_fp32), but its
    # distributed optimizer shards the masters and all-gathers bf16 parameters, where autopar's
    # ZeRO-1 under a policy keeps whole float32 masters and gathers them: priced in bf16
    # throughout, whose gather is as run and whose reduce-scatter is half the run's bytes
    mlm_note = ("README states no recomputation, micro-batch size or interleaving: micro-batches of one "
                "sequence, 1F1B, layout " + tp + "; bf16 throughout (float32 reduce-scatter, bf16 gather as run "
                "not expressible)")
    l405 = lambda: llama3("405b", 8192)  # noqa: E731
    return [
        Row(key="tt-8b", source=tt, build=lambda: llama3("8b", 8192), gpus=8, batch=16, seq=8192, mesh=(8,),
            pinned=Pinned(layout="fsdp"), layout_text="FSDP 8, selective AC", tokens_per_gpu=5762,
            memory_gib=82.4, hardware=GRAND_TETON, mp_policy=BF16_FP32_REDUCE,
            note="selective AC (torchtitan's op-level policy of the time, torchtitan/parallelisms/"
                 "parallelize_llama.py _save_list: per layer every mm output saved but every second one, and "
                 "attention's; every other op recomputed) approximated by the fewest recomputed whole layers "
                 "that fit 96 GB; that policy's own recompute, summed from the same per-op forward times, is "
                 "about 0.27 s a step against 0.31 s for the whole layers (time only, its memory not modelled). "
                 "Not modelled: eager overheads beyond 5 us a kernel (the same run under torch.compile: 6,667), "
                 "the 500 W cap's sustained clocks, the float32 loss (not in the captured graph)"),
        Row(key="tt-405b-1f1b", source=tt, build=l405, gpus=512, batch=256, seq=8192, mesh=(64, 8),
            pinned=Pinned(layout="fsdp+tp", stages=8, micro_batches=32, schedule="1f1b", recompute="full"),
            layout_text="FSDP 8 x TP 8 x PP 8, 1F1B, M=32, full AC", tokens_per_gpu=100, memory_gib=82.5,
            hardware=GRAND_TETON, mp_policy=BF16_FP32_REDUCE,
            note="Float8 + compile + AsyncTP: an upper reference for bf16"),
        Row(key="tt-405b-i1f1b", source=tt, build=l405, gpus=512, batch=256, seq=8192, mesh=(64, 8),
            pinned=Pinned(layout="fsdp+tp", stages=8, micro_batches=32, schedule="interleaved_1f1b",
                          recompute="full"),
            layout_text="FSDP 8 x TP 8 x PP 8, interleaved 1F1B, M=32, full AC", tokens_per_gpu=128,
            memory_gib=72.7, hardware=GRAND_TETON, mp_policy=BF16_FP32_REDUCE,
            note="Float8 + compile + AsyncTP: an upper reference for bf16"),
        Row(key="mlm-7.1b", source=mlm, build=lambda: megatron_gpt("7.1b"), gpus=96, batch=192, seq=4096,
            mesh=(48, 2), pinned=Pinned(layout=tp, accumulate=4), layout_text="TP 2, PP 1, DP 48",
            tflops_per_gpu=465.9, counted=megatron_flops_per_token,
            note=mlm_note + "; without a pipeline, each data-parallel rank's 4 sequences run as 4 accumulated "
                 "micro-batches, their gradients reduced once"),
        Row(key="mlm-177b", source=mlm, build=lambda: megatron_gpt("177b"), gpus=2304, batch=1152, seq=4096,
            mesh=(288, 8), pinned=Pinned(layout=tp, stages=6, micro_batches=24, schedule="1f1b"),
            layout_text="TP 8, PP 6, DP 48 (M=24)", tflops_per_gpu=432.8, counted=megatron_flops_per_token,
            note=mlm_note),
        Row(key="mlm-462b", source=mlm, build=lambda: megatron_gpt("462b"), gpus=6144, batch=3072, seq=4096,
            mesh=(768, 8), pinned=Pinned(layout=tp, stages=16, micro_batches=64, schedule="1f1b"),
            layout_text="TP 8, PP 16, DP 48 (M=64)", tflops_per_gpu=459.9, counted=megatron_flops_per_token,
            note=mlm_note),
        Row(key="llama3-8k", source=herd, build=l405, gpus=8192, batch=2048, seq=8192, mesh=(1024, 8),
            pinned=Pinned(layout="fsdp+tp", stages=LLAMA3_STAGES, micro_batches=32, schedule="interleaved_1f1b",
                          chunks=LLAMA3_CHUNKS, recompute=LLAMA3_RECOMPUTE),
            layout_text="TP 8, PP 16, DP 64, interleaved (M=32)", tflops_per_gpu=430, mp_policy=BF16_FP32_REDUCE,
            note="16M tokens per batch; FSDP-style DP; interleaved, 7 chunks per rank (depth not stated: 8, "
                 "the only one the paper's first/last-rank balancing fills evenly, less the embedding-only and "
                 "head-only chunks autopar cannot cut)"),
        Row(key="llama3-16k", source=herd, build=l405, gpus=16384, batch=2048, seq=8192, mesh=(2048, 8),
            pinned=Pinned(layout="fsdp+tp", stages=LLAMA3_STAGES, micro_batches=16, schedule="interleaved_1f1b",
                          chunks=LLAMA3_CHUNKS, recompute=LLAMA3_RECOMPUTE),
            layout_text="TP 8, PP 16, DP 128, interleaved (M=16)", tflops_per_gpu=400, mp_policy=BF16_FP32_REDUCE,
            note="16M tokens per batch; FSDP-style DP; interleaved, 7 chunks per rank (depth not stated: 8, "
                 "the only one the paper's first/last-rank balancing fills evenly, less the embedding-only and "
                 "head-only chunks autopar cannot cut); at the 2 chunks assumed before, (P-1)/(v M) = 47% of the "
                 "work at M=16 sat in the bubble"),
    ]


def model_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters, layers, hidden) of a Hugging Face Llama or an ``autopar.models.GPT``."""
    params = sum(p.numel() for p in model.parameters())
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "num_hidden_layers"):
        return params, cfg.num_hidden_layers, cfg.hidden_size
    return params, model.cfg.n_layers, model.cfg.dim


def flops_per_token(params: int, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per token of a training step (Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1): 6 * params + 12 * layers * hidden * seq."""
    return 6.0 * params + 12.0 * layers * hidden * seq


def megatron_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """Model FLOPs per token as Megatron-LM counts them for the TFLOP/s/GPU it logs and publishes
    (megatron/training/training.py ``num_floating_point_operations`` at core_r0.8.0), for its
    GPT (multi-head attention, an MLP of ``mlp_ratio`` x hidden without gating):
    12 L h^2 (1 + 1 + s / h + ffn / h + V / (2 L h)). It counts one vocabulary-wide matmul, the
    logits, and no input embedding (a lookup): 6 V h fewer than 6 * parameters, 7% of a
    7.1B's count."""
    cfg = model.cfg
    layers, hidden, vocab, ffn = cfg.n_layers, cfg.dim, cfg.vocab_size, cfg.mlp_ratio * cfg.dim
    return 12.0 * layers * hidden**2 * (2 + seq / hidden + ffn / hidden + vocab / (2 * layers * hidden))


def published_tokens(row: Row, per_token: float) -> float:
    """The run's tokens/s/GPU: as published, or its TFLOP/s/GPU over ``per_token``, the FLOPs
    per token its publisher counted (``publisher_flops_per_token``)."""
    return row.tokens_per_gpu if row.tokens_per_gpu is not None else row.tflops_per_gpu * 1e12 / per_token


def publisher_flops_per_token(row: Row, model: torch.nn.Module, ours: float) -> float:
    """The FLOPs per token ``row``'s publisher counted: ``Row.counted``, else ``ours``."""
    return row.counted(model, row.seq) if row.counted is not None else ours


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
    print(result.table(), file=sys.stderr, flush=True)  # every rank's peak by kind beside its prediction
    if not result.ok:
        first = result.failures[0]
        return f"FAILED on {first.where()}: {(first.error or '')[:120]}"
    ratios = result.rank_ratios
    per_rank = (f", per rank {min(ratios):.2f}–{max(ratios):.2f}"
                if len(ratios) > 1 and max(ratios) - min(ratios) >= 0.005 else "")
    limit = plan.solver.get("memory_limit")  # the device's bytes the plan was made for
    over = f" (**over the device's {limit / GIB:.1f} GiB**)" if limit and result.peak > limit else ""
    return (f"ok: peak {result.peak / GIB:.1f} GiB{over}, predicted / dry run {result.ratio:.2f}{per_rank} "
            f"({result.seconds:.0f} s{result.replayed()})")


def _model_and_inputs(row: Row) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The run's model on the meta device (float32 masters where the run kept them:
    ``Row.mp_policy``) and a batch of token ids."""
    with torch.device("meta"):
        model = row.build()
    if row.mp_policy is not None:
        model = model.float()
    return model, (torch.zeros(row.batch, row.seq, dtype=torch.long, device="meta"),)


RECOMPUTE_PINS = {"full": "all", "none": "none", "fit": None}  # Pinned.recompute -> Constraints.recompute
AS_RUN_MEMORY = float(2**70)  # bytes per GPU: no limit (the planner takes finite limits only)


def published_pins(pinned: Pinned, *, recompute: str | None = None) -> tuple[str, Constraints]:
    """The published layout as ``autopar.plan`` takes it: (``layout=``, ``constraints=``): its
    intra-op layout, pipelined (``pp+LAYOUT``) with its stages, micro-batches, schedule and
    interleaving depth where it ran a pipeline; its recomputation where the run states it
    (``recompute``: another ``Pinned.recompute`` policy instead of the run's)."""
    policy = RECOMPUTE_PINS[recompute or pinned.recompute]
    if pinned.stages == 1:
        return pinned.layout, Constraints(recompute=policy)
    interleaved = pinned.schedule is autopar.costmodels.Schedule.INTERLEAVED_1F1B
    return f"pp+{pinned.layout}", Constraints(pp=pinned.stages, micro_batches=pinned.micro_batches,
                                              schedule=pinned.schedule, chunks=pinned.chunks if interleaved else None,
                                              recompute=policy)


# where a step's seconds go, from ``Plan.predicted`` (``PinnedCost.parts`` of a planned layout):
# communication exposed (what the step waits for), and apart, not in the step, what ran hidden
# behind compute (``costmodels.overlap``)
BREAKDOWN_PARTS = ("compute", "communication", "bubble", "other", "hidden comm")


def layout_cost(plan: Plan, layers: int, notes: list[str] | None = None) -> PinnedCost:
    """``plan``'s predicted step: time, the fullest device's memory, recomputed layers, where the time goes."""
    p = plan.predicted
    parts = {"compute": p.compute, "communication": p.communication, "bubble": p.bubble}
    parts["other"] = max(0.0, p.step_time - sum(parts.values()))
    parts["hidden comm"] = p.hidden_communication
    return PinnedCost(step_time=p.step_time, memory=sum(p.memory.values()), recomputed=len(plan.recompute),
                      layers=layers, fits=True, notes=list(notes or []), parts=parts)


def price_published(model, inputs, row: Row, layers: int, *, memory_limit: float, time_limit_s: float,
                    recompute: str | None = None) -> PinnedCost:
    """The published layout planned by ``autopar.plan(..., layout=, constraints=)`` on the run's mesh
    and machine, within ``memory_limit`` (``AS_RUN_MEMORY``: priced as the run was made, whatever memory
    it needs, with a note where that is over the card); ``fits`` False with the planner's reason
    where no plan honours it."""
    layout, pins = published_pins(row.pinned, recompute=recompute)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, row.mesh, inputs, hardware=row.hardware, layout=layout, constraints=pins,
                                memory_limit=memory_limit, time_limit_s=time_limit_s, mp_policy=row.mp_policy,
                                accumulate=row.pinned.accumulate)
    except ValueError as exc:
        return PinnedCost(step_time=math.inf, memory=math.inf, recomputed=0, layers=layers, fits=False,
                          notes=[str(exc).removeprefix("autopar: ")[:300]])
    cost = layout_cost(plan, layers)
    if cost.memory > row.device_memory:
        cost.notes.append(f"predicted {cost.memory / GIB:.1f} GiB per GPU, over the device's "
                          f"{row.device_memory / GIB:.1f} GiB, with the run's own recomputation")
    return cost


def over_the_card(cost: PinnedCost, memory_limit: float) -> bool:
    """Whether a layout priced as the run made it is predicted over the card's memory."""
    return cost.fits and cost.memory > memory_limit


def fitting_layout(model, inputs, row: Row, as_run: PinnedCost, *, time_limit_s: float) -> PinnedCost | None:
    """Where the run's own recomputation is predicted over the card, the published layout with
    its recomputation searched within the card (the fewest recomputed layers that fit, as the
    auto plan's): the layout the auto plan, which must fit, is compared with. Where that search
    finds none, every layer recomputed, if that fits, with a note saying so; ``fits`` False where
    neither does. None where the run's own recomputation fits."""
    if not over_the_card(as_run, row.device_memory):
        return None
    fewest = price_published(model, inputs, row, as_run.layers, memory_limit=row.device_memory,
                             time_limit_s=time_limit_s, recompute="fit")
    if fewest.fits or row.pinned.recompute == "full":
        return fewest
    full = price_published(model, inputs, row, as_run.layers, memory_limit=row.device_memory,
                           time_limit_s=time_limit_s, recompute="full")
    if not full.fits:
        return fewest
    full.notes[:0] = [f"within the card: the planner's search for the fewest recomputed layers found none "
                      f"({'; '.join(fewest.notes) or 'no reason given'}): every layer recomputed"]
    return full


def compared_tokens(row: Row, r: dict) -> float:
    """Predicted tokens/s/GPU of the published layout the auto plan is compared with: as run
    where that fits the card, else within it (``fitting_layout``; 0 where none is found)."""
    fitting = r["fitting"]
    if fitting is None:
        return r["predicted"]
    return tokens_per_gpu(row, fitting.step_time) if fitting.fits else 0.0


def evaluate(row: Row, *, time_limit_s: float, dry_run: bool, cache: dict | None = None,
             auto_plan: bool = True, plans: Path | None = None, reuse: bool = False,
             what_changed: bool = False) -> dict:
    """One table row's numbers (see the module docstring). ``cache``: kept between rows, so
    rows of the same model and batch share its capture, and of the same GPUs its auto plan.
    ``auto_plan`` False: the published layout only (the auto columns say "skipped").
    ``plans``: a folder to save the auto plan in (``<row>.json``), to dry-run or inspect again;
    ``reuse``: load the plan saved there instead of planning again, where there is one.
    ``what_changed``: the auto plan's ``counterfactuals`` too."""
    cache = {} if cache is None else cache
    shared = (row.build, row.batch, row.seq, row.mp_policy)
    if shared not in cache:
        cache[shared] = _model_and_inputs(row)
    model, inputs = cache[shared]
    params, layers, hidden = model_shape(model)
    per_token = flops_per_token(params, layers, hidden, row.seq)
    published = published_tokens(row, publisher_flops_per_token(row, model, per_token))
    out = {"row": row, "params": params, "flops_per_token": per_token, "published": published}
    started = time.perf_counter()
    # priced as the run was made: its own recomputation, whatever memory that needs (where it
    # states none, the fewest recomputed layers that fit the card)
    as_run = row.device_memory if row.pinned.recompute == "fit" else AS_RUN_MEMORY
    cost = price_published(model, inputs, row, layers, memory_limit=as_run, time_limit_s=time_limit_s)
    out["pinned"] = cost
    out["predicted"] = tokens_per_gpu(row, cost.step_time) if cost.fits else 0.0
    out["ratio"] = out["predicted"] / published  # the prediction check: the run's own recomputation
    out["fitting"] = fitting_layout(model, inputs, row, cost, time_limit_s=time_limit_s)
    out["pinned_seconds"] = time.perf_counter() - started
    out["compared"] = compared_tokens(row, out)
    if not auto_plan:
        out.update(SKIPPED_AUTO)
        return out
    key = shared + (row.gpus,)
    if key in cache:
        out.update(cache[key])
        return out
    auto = {}
    started = time.perf_counter()
    saved = None if plans is None else plans / f"{row.key}.json"
    try:
        if reuse and saved is not None and saved.exists():  # planned before: its own planning seconds
            plan = Plan.load(saved)
            auto["auto_seconds"] = plan.solver.get("planning_seconds", math.nan)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = plan_auto(model, row.auto_mesh, inputs, hardware=row.hardware, time_limit_s=time_limit_s,
                                 memory_limit=row.device_memory, mp_policy=row.mp_policy)
            auto["auto_seconds"] = time.perf_counter() - started
            if saved is not None:
                plan.save(saved)
        auto["auto_plan"] = plan
        auto["auto_line"] = one_line(plan)
        auto["auto_tokens"] = tokens_per_gpu(row, plan.predicted.step_time)
        auto["auto_mfu"] = auto["auto_tokens"] * per_token / PEAK_BF16
        auto["auto_memory"] = sum(plan.predicted.memory.values())
        auto["dry_run"] = dry_run_verdict(plan, model, inputs) if dry_run else "not run"
        if what_changed:
            auto.update(counterfactuals(row, model, inputs, plan, time_limit_s=time_limit_s))
    except Exception as exc:  # reported in the table: the row's other numbers still stand
        auto.update(auto_seconds=time.perf_counter() - started, auto_line=f"FAILED: {str(exc)[:120]}",
                    auto_tokens=0.0, auto_mfu=0.0, auto_memory=math.nan, dry_run="not run")
    cache[key] = auto
    out.update(auto)
    return out


SKIPPED_AUTO = dict(auto_seconds=0.0, auto_line="skipped (--no-auto)", auto_tokens=0.0, auto_mfu=0.0,
                    auto_memory=math.nan, dry_run="not run")

HEADER = ("| run | GPUs | published layout | published tok/s/GPU | predicted (published layout) | "
          "predicted ÷ published | memory GiB predicted / published | recomputed layers | "
          "published layout within the card | auto plan | auto tok/s/GPU | auto MFU | auto ÷ published layout | "
          "planning s | dry run |")


def table_row(r: dict) -> str:
    """One run's row: the prediction check on the run's own recomputation (predicted, ratio,
    memory, recomputed layers); where that is over the card, the published layout within it
    (``fitting_layout``), which the auto plan is compared with, the ratio to the run's own beside it."""
    row, cost = r["row"], r["pinned"]
    memory = f"{cost.memory / GIB:.1f}" if math.isfinite(cost.memory) else "—"
    if over_the_card(cost, row.device_memory):
        memory += f" (**over the card's {row.device_memory / GIB:.1f}**)"
    published_memory = f"{row.memory_gib:.1f}" if row.memory_gib is not None else "—"
    predicted = f"{r['predicted']:,.0f}" if cost.fits else "does not fit"
    return (f"| {row.key} | {row.gpus} | {row.layout_text} | {r['published']:,.0f} | {predicted} | "
            f"{r['ratio']:.2f} | {memory} / {published_memory} | {cost.recomputed}/{cost.layers} | "
            f"{within_the_card(r)} | {r['auto_line']} | {r['auto_tokens']:,.0f} | {r['auto_mfu']:.0%} | "
            f"{auto_against_published(r)} | {r['auto_seconds']:.0f} | {r['dry_run']} |")


def within_the_card(r: dict) -> str:
    """The published layout within the card: "as run", or its recomputed layers, predicted
    tokens/s/GPU and memory, or that none was found."""
    fitting = r["fitting"]
    if fitting is None:
        return "as run"
    if not fitting.fits:
        return f"none found ({'; '.join(fitting.notes)})"
    return (f"{fitting.recomputed}/{fitting.layers} recomputed: {r['compared']:,.0f} tok/s/GPU, "
            f"{fitting.memory / GIB:.1f} GiB")


def auto_against_published(r: dict) -> str:
    """Auto plan ÷ the published layout it is compared with (within the card), and where that
    is not the run's own layout, ÷ the run's own beside it, marked over the card; "—" without
    an auto plan (skipped, or failed)."""
    if not r["auto_tokens"]:
        return "—"
    against = f"{r['auto_tokens'] / r['compared']:.2f}" if r["compared"] else "—"
    if r["fitting"] is None:
        return against
    as_run = r["auto_tokens"] / r["predicted"] if r["predicted"] else math.nan
    return f"{against} (÷ as run, over the card: {as_run:.2f})"


# the schedules a plan without zero-bubble ones picks among: no pipeline, or 1F1B or interleaved
# 1F1B pinned (GPipe has 1F1B's bubble and holds more: never faster under the same memory limit)
WITHOUT_ZERO_BUBBLE = (Constraints(pp=1), Constraints(schedule="1f1b"), Constraints(schedule="interleaved_1f1b"))


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans lay the model out alike: mesh, placements, ZeRO levels, pipeline, recomputation."""
    def pipeline(p: Plan):
        q = p.pipeline
        return None if q is None else (q.stages, q.micro_batches, q.schedule, q.chunks_per_rank, q.stage_of)
    return (a.mesh_shape == b.mesh_shape and a.strategies == b.strategies and a.zero == b.zero
            and pipeline(a) == pipeline(b) and a.recompute == b.recompute)


@contextmanager
def overlap_off(name: str):
    """The preset ``name`` with nothing hidden behind compute, as a preset of its own name while
    the block runs (yielded): by name, as the auto plan gets its preset, the planner factorises
    the mesh for pipelines, where a profile object would be taken as measured on the whole mesh."""
    presets = autopar.costmodels.PRESETS
    key, build = f"{name}-no-overlap", presets[name]
    presets[key] = lambda mesh_shape, axis_names=None: replace(build(mesh_shape, axis_names), overlap={})
    try:
        yield key
    finally:
        del presets[key]


def counterfactuals(row: Row, model, inputs, plan: Plan, *, time_limit_s: float) -> dict:
    """What overlap and the zero-bubble schedules changed in ``row``'s auto ``plan``: the auto plan
    with the preset's overlap off (``overlap_off``: priced with nothing hidden), and, where the
    plan runs a zero-bubble schedule, the fastest plan of ``WITHOUT_ZERO_BUBBLE`` (priced as the
    auto plan is). Each as (plan or None where none fits, its tokens/s/GPU)."""
    kwargs = dict(time_limit_s=time_limit_s, memory_limit=row.device_memory, mp_policy=row.mp_policy)

    def best(hardware, pins_list) -> tuple[Plan | None, float]:
        found = []
        for pins in pins_list:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found.append(plan_auto(model, row.auto_mesh, inputs, hardware=hardware, constraints=pins,
                                           **kwargs))
            except ValueError:  # nothing fits under these pins
                continue
        if not found:
            return None, 0.0
        fastest = min(found, key=lambda p: p.predicted.step_time)
        return fastest, tokens_per_gpu(row, fastest.predicted.step_time)

    with overlap_off(row.hardware) as hidden_none:
        out = {"without_overlap": best(hidden_none, [None])}
    zero_bubble = plan.pipeline is not None and autopar.costmodels.Schedule.parse(plan.pipeline.schedule).split_backward
    out["without_zero_bubble"] = best(row.hardware, WITHOUT_ZERO_BUBBLE) if zero_bubble else None
    return out


COUNTERFACTUAL_HEADER = ("| run | auto plan | without overlap: plan | its tok/s/GPU (nothing hidden) | same layout | "
                         "auto ÷ it | without zero-bubble schedules: best plan | same layout | auto ÷ it |")


def counterfactual_row(r: dict) -> str:
    """One run's auto plan beside the plans made without overlap and without zero-bubble schedules."""
    plan, auto = r["auto_plan"], r["auto_tokens"]

    def cells(found: tuple[Plan | None, float], with_tokens: bool) -> list[str]:
        other, tokens = found
        if other is None:
            return ["none fits"] + ["—"] * (2 + with_tokens)
        return ([plan_line(other)] + ([f"{tokens:,.0f}"] if with_tokens else [])
                + ["yes" if same_layout(plan, other) else "no", f"{auto / tokens:.3f}"])

    zero_bubble = r["without_zero_bubble"]
    row = [r["row"].key, plan_line(plan)] + cells(r["without_overlap"], True) + (
        cells(zero_bubble, False) if zero_bubble is not None else ["not zero-bubble: unchanged", "—", "—"])
    return "| " + " | ".join(row) + " |"


BREAKDOWN_HEADER = ("| run | step s | " + " | ".join(BREAKDOWN_PARTS) + " | model TFLOP/s/GPU at compute only |")


def breakdown_row(r: dict, label: str | None = None) -> str:
    """The published layout's predicted step on one GPU by where it goes (``PinnedCost.parts``,
    seconds and share of the step), and the model FLOP/s the compute part alone would give;
    ``label``: the first cell, the run's key where not given."""
    row, cost = r["row"], r["pinned"]
    label = row.key if label is None else label
    if not cost.fits:
        return f"| {label} | does not fit |" + " — |" * (len(BREAKDOWN_PARTS) + 1)
    cells = [f"{cost.parts[k]:.3f} ({cost.parts[k] / cost.step_time:.0%})" for k in BREAKDOWN_PARTS]
    compute_only = r["flops_per_token"] * row.batch * row.seq / row.gpus / cost.parts["compute"] / 1e12
    return f"| {label} | {cost.step_time:.3f} | " + " | ".join(cells) + f" | {compute_only:.0f} |"


def table(results: list[dict]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [table_row(r) for r in results]
    lines += ["", BREAKDOWN_HEADER, "|" + "---|" * BREAKDOWN_HEADER.count(" | ") + "---|"]
    for r in results:
        lines.append(breakdown_row(r))
        if r["fitting"] is not None:
            lines.append(breakdown_row({**r, "pinned": r["fitting"]}, label=f"{r['row'].key} within the card"))
    shown = [r for r in results if "without_overlap" in r]
    if shown:
        lines += ["", COUNTERFACTUAL_HEADER, "|" + "---|" * COUNTERFACTUAL_HEADER.count(" | ") + "---|"]
        lines += [counterfactual_row(r) for r in shown]
    lines.append("")
    lines += [f"- {r['row'].key}: {r['row'].source}; " + "; ".join([r["row"].note] + _notes(r)) for r in results]
    return "\n".join(lines)


def _notes(r: dict) -> list[str]:
    """The published layout's notes as run, then those of it within the card not said already."""
    within = r["fitting"].notes if r["fitting"] is not None else []
    return r["pinned"].notes + [n for n in within if n not in r["pinned"].notes]


def main(argv: list[str] | None = None) -> None:
    rows = {r.key: r for r in published_rows()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(rows), choices=list(rows))
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="each plan's search limit (the auto plan's, the published layout's), seconds")
    parser.add_argument("--dry-run", action="store_true", help="dry-run every auto plan (autopar.dry_run)")
    parser.add_argument("--no-auto", action="store_true", help="price the published layouts only, no auto plan")
    parser.add_argument("--bf16-throughout", action="store_true",
                        help="price every row in bf16 throughout, without its run's mixed precision (Row.mp_policy)")
    parser.add_argument("--out", default="results/published.md", help="the table, rewritten after every row")
    add_out_argument(parser, "--table-dir")
    parser.add_argument("--plans", type=Path, default=None, help="save every auto plan here (<row>.json)")
    parser.add_argument("--counterfactuals", action="store_true",
                        help="re-plan every auto plan without overlap and without zero-bubble schedules: what they "
                             "changed (``counterfactuals``)")
    parser.add_argument("--reuse-plans", action="store_true",
                        help="load the auto plan saved in --plans where there is one, instead of planning again")
    args = parser.parse_args(argv)
    if args.bf16_throughout:
        rows = {k: replace(r, mp_policy=None) for k, r in rows.items()}
    results, cache = [], {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plans is not None:
        args.plans.mkdir(parents=True, exist_ok=True)
    for key in args.rows:
        started = time.perf_counter()
        results.append(evaluate(rows[key], time_limit_s=args.time_limit, dry_run=args.dry_run, cache=cache,
                                auto_plan=not args.no_auto, plans=args.plans, reuse=args.reuse_plans,
                                what_changed=args.counterfactuals))
        print(f"{key}: {time.perf_counter() - started:.0f} s (published layout priced in "
              f"{results[-1]['pinned_seconds']:.0f} s)", file=sys.stderr, flush=True)
        out.write_text(table(results) + "\n")  # after every row: a long run keeps what it has
    print(table(results))
    write_results("published", "h100", "Predictions against published H100 training runs",
                  table(results).splitlines(), args.table_dir, argv)


if __name__ == "__main__":
    main()
