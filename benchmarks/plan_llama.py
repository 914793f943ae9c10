"""Planning time and plan quality for Llama-shaped models on the meta device (H100 preset).

    python -m benchmarks.plan_llama --size 70b --mesh 8 8 [--time-limit 60] [--out plan.json]

Prints the capture / planning seconds, wall clock and this process's CPU (the machine's
load beside them: on a shared machine CPU seconds are what the planner's budget spends, the
wall clock what the load adds), the auto plan's prediction and every manual layout's
predicted step time with the ratio auto / layout (must be <= 1.00). The planning-speed
claim lives here, not in the tests: ``--size 70b --mesh 8 8`` within 60 s on an idle machine.
The timings and ratios go to ``benchmarks/results/plan_llama_h100_<yyyymmdd>.md`` (``--table-dir``;
``--out`` saves the plan).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

from autopar.models import LLAMA3, llama3
from autopar.planning import plan
from benchmarks.plan_speed import cpu_seconds
from benchmarks.results_file import add_out_argument, write_results


def llama_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Llama-3 shape and mesh to plan (also read by ``dryrun_speed.py``)."""
    parser.add_argument("--size", default="70b", choices=sorted(LLAMA3))
    parser.add_argument("--mesh", type=int, nargs="+", default=[8, 8])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--time-limit", type=float, default=60.0)
    return parser


def main() -> None:
    parser = llama_arguments(argparse.ArgumentParser())
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument("--out", help="save the plan's JSON here (planning twice and comparing the files checks determinism)")
    add_out_argument(parser, "--table-dir")
    args = parser.parse_args()

    warnings.simplefilter("ignore")
    started, cpu_started, load_before = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]
    with torch.device("meta"):
        model = llama3(args.size, args.seq, args.layers)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    result = plan(model, tuple(args.mesh), (tokens,), hardware="h100", time_limit_s=args.time_limit,
                  pipeline=not args.no_pipeline)
    total, cpu = time.perf_counter() - started, cpu_seconds() - cpu_started
    search_cpu = result.solver.get("planning_cpu_seconds", 0.0)
    planned = (f"llama-{args.size} ({model.config.num_hidden_layers} layers) on {tuple(args.mesh)}: planned in "
               f"{total:.1f} s (capture {result.solver.get('capture_seconds', 0):.1f} s, search "
               f"{result.solver.get('planning_seconds', 0):.1f} s); CPU {cpu:.1f} s (capture and model "
               f"{cpu - search_cpu:.1f} s, search {search_cpu:.1f} s); load average {load_before:.1f} before, "
               f"{os.getloadavg()[0]:.1f} after")
    print(planned)
    print(result.explain())
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.to_json())
    step = result.predicted.step_time
    lines = [planned, "", f"Auto plan: {result.kind}, {step * 1e3:.1f} ms predicted step.", "",
             "| layout | auto / layout | layout's predicted step (ms) |", "|---|---|---|"]
    for name, t in sorted(result.candidates.items(), key=lambda kv: kv[1]):
        print(f"  auto / {name:<28} = {step / t:.3f}   ({t * 1e3:.1f} ms)")
        lines.append(f"| {name} | {step / t:.3f} | {t * 1e3:.1f} |")
    write_results("plan_llama", "h100", f"Planning Llama-3 {args.size} on the H100 preset", lines, args.table_dir)


if __name__ == "__main__":
    main()
