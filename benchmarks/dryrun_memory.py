"""Predicted memory per device against the full-scale dry run's measured peak, per plan and kind.

    python -m benchmarks.dryrun_memory [--cases gpt@64,wide-mlp@8,...] [--plan PLAN.json --model llama-70b]

Cases (``--cases``, comma-separated; ``all``: every one of ``CASES``):

- ``NAME@GPUS`` for a benchmark workload (``autopar.bench.workloads``, bf16 on the meta device)
  on an H100 mesh of ``autopar bench`` (``@8``: 2x4, ``@64``: 8x8, ``@512``: 64x8), planned as
  ``autopar plan`` plans a model: alone (``--with-loss``: with its loss, as ``autopar bench``
  does, which a pipeline plan cannot train);
- ``gpt@64`` and ``gpt-pp2@16``: the small GPT plans of ``tests/test_dryrun.py`` (the search's
  (8, 8) plan; a 2-stage pipeline over (2, 8));
- ``llama70b-2l@64``: the Llama-70B shape with 2 layers (batch 16 x 4096) in the ``fsdp+tp``
  layout on (8, 8), as ``benchmarks/plan_llama.py`` shapes it;
- ``mlm-7.1b@96``: Megatron's GPT 7.1B, batch 192 x 4096, auto plan on 96 GPUs (12 x 8), the
  published row of ``benchmarks/published.py``;
- ``llama-zero3-pp2@8``: a 4-layer Llama (hidden 1024, bf16, batch 8 x 256) pipelined over 2
  stages of (2, 2), 1F1B, with a device memory of 150 MB and the ``fsdp+tp`` layout as the
  search's only manual candidate: its ZeRO-3 stages win.

With ``--plan``, a saved plan of a built-in ``autopar plan`` model is dry-run instead (e.g. the
70B demo plan). Prints one markdown row per plan: predicted and dry-run GiB by kind
(parameters / gradients / optimizer / activations / temporary), each kind's predicted ÷
measured, the total's, and the dry run's seconds. The dry run's kinds are MemTracker's at
the worst rank's peak (``autopar.dryrun``); for a pipeline, also the least and most of every
pipeline rank's predicted (``Prediction.memory_by_rank``) ÷ its dry-run peak. The table goes to
``benchmarks/results/dryrun_memory_h100_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopar
from autopar import layouts
from autopar.bench.workloads import build
from autopar.cli import load_model
from autopar.costmodels.units import GIB, MIB
from autopar.models import GPT, MODELS, GPTConfig, llama3, megatron_gpt
from autopar.passes.capture import capture
from autopar.passes.plan import Plan
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest
from autopar.passes.state_costs import at_peak
from benchmarks.results_file import add_out_argument, write_results

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporary")
MESHES = {"8": (2, 4), "64": (8, 8), "512": (64, 8)}  # autopar.bench's h100 meshes
CASES = ("gpt@64", "gpt-pp2@16", "wide-mlp@8", "big-vocab@8", "gpt2@8", "big-vocab@64", "wide-mlp@64",
         "llama70b-2l@64", "mlm-7.1b@96", "llama-zero3-pp2@8")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt@64,gpt-pp2@16,wide-mlp@8,big-vocab@8,gpt2@8",
                        help="cases, comma-separated, or 'all'")
    parser.add_argument("--plan", default=None, help="a saved plan to dry-run instead of planning")
    parser.add_argument("--model", default="llama-70b", help="with --plan: the `autopar plan` model it is for")
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--with-loss", action="store_true", help="plan each workload with its loss")
    add_out_argument(parser)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    lines = ["| plan | predicted (p/g/o/a/t) | dry run (p/g/o/a/t), worst rank | predicted ÷ dry run by kind "
             "| predicted ÷ peak: sum of kinds / at the peak instant | dry run s |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    if args.plan:
        lines.append(_row(*_saved(args.plan, args.model)))
        print(lines[-1])
    else:
        for case in CASES if args.cases == "all" else args.cases.split(","):
            lines.append(_row(*_planned(case, args.time_limit, args.with_loss)))
            print(lines[-1], flush=True)
    write_results("dryrun_memory", "h100", "Predicted memory per device against the full-scale dry run", lines,
                  args.out)


def _saved(path: str, model_name: str):
    plan = Plan.load(path)
    model, inputs = load_model(model_name)
    return f"{model_name} {plan.kind} (saved)", plan, model, inputs, {}


def _planned(case: str, time_limit: float, with_loss: bool):
    def tokens(batch: int, seq: int) -> tuple:
        return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)

    if case in ("gpt@64", "gpt-pp2@16"):
        with torch.device("meta"):
            model = GPT(GPTConfig())
        if case == "gpt@64":
            inputs = tokens(64, 64)
            return case, autopar.plan(model, (8, 8), inputs, hardware="h100", time_limit_s=2, pipeline=False), \
                model, inputs, {}
        inputs = tokens(16, 64)
        request = PlanRequest(mesh_shape=(2, 8), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (8,), request, solver_time_s=2)
        if plan is None:
            raise SystemExit(f"autopar: the {case} pipeline plan was expected; the search found none: {why}")
        return case, plan, model, inputs, {}
    if case == "llama-zero3-pp2@8":
        with torch.device("meta"):
            model = MODELS["llama"].build(dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                               num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                               use_cache=False), 256).to(torch.bfloat16)
        inputs = tokens(8, 256)
        request = PlanRequest(mesh_shape=(2, 2, 2), hardware="h100", memory_limit=150e6, layouts=("fsdp+tp",),
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (2, 2), request, solver_time_s=2, schedules=("1f1b",))
        if plan is None:
            raise SystemExit(f"autopar: the {case} pipeline plan was expected; the search found none: {why}")
        return case, plan, model, inputs, {}
    if case == "llama70b-2l@64":
        with torch.device("meta"):
            model = llama3("70b", 4096, 2)
        inputs = tokens(16, 4096)
        return case, autopar.plan(model, (8, 8), inputs, hardware="h100", layout="fsdp+tp"), model, inputs, {}
    if case == "mlm-7.1b@96":
        with torch.device("meta"):
            model = megatron_gpt("7.1b")
        inputs = tokens(192, 4096)
        return case, autopar.plan(model, (12, 8), inputs, hardware="h100", time_limit_s=time_limit), \
            model, inputs, {}
    name, _, gpus = case.partition("@")
    work = build(name, int(gpus), meta=True)
    loss = {"loss_fn": work.loss_fn, "target": work.target}
    plan = autopar.plan(work.model, MESHES[gpus], work.inputs, hardware="h100", time_limit_s=time_limit,
                        **(loss if with_loss else {}))
    return case, plan, work.model, work.inputs, (loss if with_loss else {})


def _row(label: str, plan, model, inputs, loss) -> str:
    pp = plan.pipeline
    shape = f"{plan.kind} {plan.mesh_shape}" + (f" PP{pp.stages} M={pp.micro_batches} {pp.schedule}" if pp else "")
    zero = sorted(set(plan.zero.values()))
    shape += f" ZeRO {zero}" + (f", {len(plan.recompute)} recomputed" if plan.recompute else "")
    started = time.perf_counter()
    result = autopar.dry_run(plan, model, inputs, **loss)
    seconds = time.perf_counter() - started
    predicted = [plan.predicted.memory.get(k, 0.0) for k in KINDS]
    if not result.ok:
        failed = result.failures[0]
        return f"| {label} {shape} | {_in(predicted, GIB)} GiB | FAILED: {failed.where()}: {failed.error} | | | |"
    worst = max(result.ranks, key=lambda r: r.peak)
    measured = [worst.memory.get(k, 0) for k in KINDS]
    unit, size = ("GiB", GIB) if worst.peak >= GIB else ("MiB", MIB)
    # a kind's ratio where the dry run holds at least 1% of the peak in it ("–": less)
    by_kind = "/".join(f"{p / m:.2f}" if m >= worst.peak / 100 else "–" for p, m in zip(predicted, measured))
    # the sum of every kind's most is what the solver constrains; without a pipeline the step
    # peaks at one of two instants (state_costs.at_peak), with a pipeline gradients and
    # activations meet and the sum is the prediction
    instant = sum(at_peak(plan.predicted.memory).values()) if pp is None else sum(predicted)
    return (f"| {label} {shape} | {_in(predicted, size)} (= {sum(predicted) / size:.2f} {unit}) | "
            f"{_in(measured, size)} (= {worst.peak / size:.2f} {unit}, {worst.where()}) | {by_kind} | "
            f"{result.ratio:.2f} / {instant / worst.peak:.2f}{_per_rank(plan, result)} | {seconds:.0f} |")


def _per_rank(plan, result) -> str:
    """A pipeline's predicted ÷ dry-run peak of each pipeline rank run (``Prediction.memory_by_rank``)."""
    by_rank = plan.predicted.memory_by_rank
    if plan.pipeline is None or not by_rank:
        return ""
    axis = plan.pipeline.axis
    ratios = [sum(by_rank[r.coordinate[axis]].values()) / r.peak for r in result.ranks if r.peak]
    return f"; per pipeline rank {min(ratios):.2f}–{max(ratios):.2f}"


def _in(values, size: float) -> str:
    return "/".join(f"{v / size:.2f}" for v in values)


if __name__ == "__main__":
    main()
