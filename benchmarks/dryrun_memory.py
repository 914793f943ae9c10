"""Predicted memory per device against the full-scale dry run's measured peak, per plan.

    python benchmarks/dryrun_memory.py [--cases wide-mlp@8,gpt2@64,...] [--plan PLAN.json --model llama-70b]

Each case is a benchmark workload (``autopar.bench_models``, bf16 on the meta device) on
an H100 mesh of ``autopar.bench`` (``@8``: 2x4, ``@64``: 8x8, ``@512``: 64x8), planned
as ``autopar plan`` plans a model (alone; ``--with-loss``: with its loss, as ``autopar bench``
does, which a pipeline plan cannot train), then dry-run (``autopar.dry_run``). With
``--plan``, a saved plan of a built-in ``autopar plan`` model is dry-run instead (e.g. the
70B demo plan). Prints one markdown row per plan: the plan, predicted and measured GiB by
kind, predicted / measured peak, and the dry run's seconds (wall and CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # costmodels/ is not in the editable install's map

KINDS = ("parameters", "gradients", "optimizer", "activations")
MESHES = {"8": (2, 4), "64": (8, 8), "512": (64, 8)}  # autopar.bench's h100 meshes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="wide-mlp@8,big-vocab@8,gpt2@8", help="model@gpus, comma-separated")
    parser.add_argument("--plan", default=None, help="a saved plan to dry-run instead of planning")
    parser.add_argument("--model", default="llama-70b", help="with --plan: the `autopar plan` model it is for")
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--with-loss", action="store_true", help="plan each workload with its loss")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| plan | predicted GiB (p/g/o/a) | dry run peak GiB (p/g/o/a/temp), worst rank | predicted / peak | "
          "ranks | dry run s (wall / cpu) |")
    print("|---|---|---|---|---|---|")
    if args.plan:
        print(_row(*_saved(args.plan, args.model)))
        return
    for case in args.cases.split(","):
        print(_row(*_planned(case, args.time_limit, args.with_loss)), flush=True)


def _saved(path: str, model_name: str):
    from autopar.cli import load_model
    from passes.plan import Plan

    plan = Plan.load(path)
    model, inputs = load_model(model_name)
    return f"{model_name} {plan.kind} (saved)", plan, model, inputs, {}


def _planned(case: str, time_limit: float, with_loss: bool):
    import autopar
    from autopar.bench_models import build

    name, _, gpus = case.partition("@")
    work = build(name, int(gpus), meta=True)
    loss = {"loss_fn": work.loss_fn, "target": work.target}
    plan = autopar.plan(work.model, MESHES[gpus], work.inputs, hardware="h100", time_limit_s=time_limit,
                        **(loss if with_loss else {}))
    return f"{case} {plan.kind}", plan, work.model, work.inputs, loss


def _row(label: str, plan, model, inputs, loss) -> str:
    import autopar

    pp = plan.pipeline
    shape = f"{plan.mesh_shape}" + (f" PP{pp.stages} M={pp.micro_batches} {pp.schedule}" if pp else "")
    wall, cpu = time.perf_counter(), time.process_time()
    result = autopar.dry_run(plan, model, inputs, **loss)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gib = 2**30
    predicted = "/".join(f"{plan.predicted.memory.get(k, 0) / gib:.2f}" for k in KINDS)
    if not result.ok:
        failed = result.failures[0]
        return f"| {label} {shape} | {predicted} | FAILED: {failed.where()}: {failed.error} | | | |"
    worst = max(result.ranks, key=lambda r: r.peak)
    measured = "/".join(f"{worst.memory[k] / gib:.2f}" for k in (*KINDS, "temporary"))
    return (f"| {label} {shape} | {predicted} (= {result.predicted_total / gib:.2f}) | {measured} "
            f"(= {worst.peak / gib:.2f}, {worst.where()}) | {result.ratio:.2f} | {len(result.ranks)} | "
            f"{wall:.0f} / {cpu:.0f} |")


if __name__ == "__main__":
    main()
