"""Wall and CPU seconds of the full-scale dry run of a Llama-3 demo plan (meta device, H100 preset).

    python -m benchmarks.dryrun_speed --size 70b --mesh 8 8 [--layers 8] [--plan PLAN.json] [--profile OUT.prof]

Plans the model as ``benchmarks/plan_llama.py`` does (batch 16 x 4096; or loads ``--plan``,
a plan saved for the same model and shape; ``--save`` keeps the one made), then runs
``autopar.dry_run`` on it and prints its table, the dry run's wall and CPU seconds, the
process's peak resident memory and the machine's load average (the machine may be
shared: CPU seconds, the workers' included, are the number to compare). ``--profile``
writes a cProfile (CPU time) of the dry run in this process: with ``--workers 1`` all of it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import resource
import time
import warnings

import torch

from autopar.costmodels.units import gib_text
from autopar.dryrun import dry_run
from autopar.models import llama3
from autopar.passes.plan import Plan
from autopar.planning import plan as make_plan
from benchmarks.plan_llama import llama_arguments
from benchmarks.results_file import add_out_argument, write_results


def main() -> None:
    parser = llama_arguments(argparse.ArgumentParser())
    parser.add_argument("--plan", default=None, help="a saved plan of this model to dry-run instead of planning")
    parser.add_argument("--save", default=None, help="save the plan made here")
    parser.add_argument("--profile", default=None, help="write a cProfile of the dry run here")
    parser.add_argument("--workers", type=int, default=None, help="dry_run's worker processes (default: one per core)")
    parser.add_argument("--plan-only", action="store_true", help="plan (and --save), do not dry-run")
    add_out_argument(parser)
    args = parser.parse_args()

    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = llama3(args.size, args.seq, args.layers)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        plan = make_plan(model, tuple(args.mesh), (tokens,), hardware="h100", time_limit_s=args.time_limit)
        if args.save:
            plan.save(args.save)
    pp = plan.pipeline
    what = (f"llama-{args.size} ({model.config.num_hidden_layers} layers), {plan.kind} plan on {plan.mesh_shape}"
            + (f", PP{pp.stages} x {pp.chunks_per_rank} chunks, M={pp.micro_batches}, {pp.schedule}" if pp else ""))
    print(what)
    if args.plan_only:
        return
    profiler = cProfile.Profile(time.process_time) if args.profile else None  # CPU time: the machine is shared
    wall, cpu = time.perf_counter(), _cpu_seconds()
    if profiler:
        profiler.enable()
    result = dry_run(plan, model, (tokens,), workers=args.workers)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    print(result.table())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (ru_maxrss counts KiB), this process; a worker's is alike
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"dry run: {wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS {gib_text(rss)}; load average {load}")
    verdict = f"predicted / dry run {result.ratio:.2f}" if result.ok else f"FAILED: {result.failures[0].where()}"
    write_results("dryrun_speed", "cpu", "Dry-run speed on this machine", [
        "| plan | ranks run | wall s | CPU s | peak RSS | load average | verdict |", "|---|---|---|---|---|---|---|",
        f"| {what} | {len(result.ranks)} of {result.world_size} | {wall:.1f} | {cpu:.1f} | {gib_text(rss)} | {load} "
        f"| {verdict} |"], args.out)
    result.raise_if_failed()


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the dry run's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()
