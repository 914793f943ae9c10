"""Planning speed: wall and CPU seconds of ``autopar.plan`` on the planning-speed targets.

    python -m benchmarks.plan_speed [--targets hf-llama-2x2 llama-70b-8x8 ...] [--published tt-8b ...]
                                    [--workers 1 2] [--time-limit 60] [--plans DIR] [--out DIR]

Targets, each planned once in this process, one after another (the first pays the imports):

- ``hf-llama-2x2``, ``hf-qwen3-2x2``: two-layer Hugging Face models (hidden 128, batch 16 x 64
  tokens) on a 2 x 2 mesh of H100s;
- ``llama-70b-8x8``: Llama-3 70B, 16 x 4,096 tokens, on 8 x 8 H100s, the call
  ``benchmarks.plan_llama`` makes;
- ``--published KEY``: a row of ``benchmarks.published``, its auto plan as that benchmark makes it.

Prints, per target, the wall and CPU seconds of the whole call (CPU: this process's, the
solver's threads and the search's worker processes included), capture and search apart (``Plan.solver``), and the plan's
predicted step. ``--workers 1 2`` plans each target once per count of worker processes, in turn (the
search's independent plans in that many processes; default one per core): the plans must be
equal. ``--plans DIR`` saves each plan's JSON (two runs' plans, less their timings,
must be equal: the budget is counted in work). ``--out DIR`` writes the table to a dated
results file ``plan_speed_<hardware>_<yyyymmdd>.md`` there (``benchmarks.results_file``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from autopar.models import llama3
from autopar.planning import plan
from benchmarks.published import _model_and_inputs, published_rows
from benchmarks.results_file import write_results

HF_TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=2048, max_position_embeddings=64, use_cache=False)
HF_BATCH, HF_SEQ = 16, 64


def _hf_tiny(config_class: str, model_class: str) -> Callable[[], tuple]:
    """A two-layer Hugging Face model of ``HF_TINY``'s shape and its token ids."""
    def build() -> tuple:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**HF_TINY)
        model = getattr(transformers, model_class)(config)
        return model, (torch.zeros(HF_BATCH, HF_SEQ, dtype=torch.long),), {}
    return build


def _llama_70b() -> tuple:
    with torch.device("meta"):
        model = llama3("70b", 4096)
    return model, (torch.zeros(16, 4096, dtype=torch.long, device="meta"),), {}


# name -> (what it builds, the mesh, plan's keywords beside the time limit)
TARGETS: dict[str, tuple[Callable[[], tuple], tuple[int, ...], dict]] = {
    "hf-llama-2x2": (_hf_tiny("LlamaConfig", "LlamaForCausalLM"), (2, 2), {"hardware": "h100"}),
    "hf-qwen3-2x2": (_hf_tiny("Qwen3Config", "Qwen3ForCausalLM"), (2, 2), {"hardware": "h100"}),
    "llama-70b-8x8": (_llama_70b, (8, 8), {"hardware": "h100"}),
}


def _published(key: str) -> tuple[Callable[[], tuple], tuple[int, ...], dict]:
    rows = {row.key: row for row in published_rows()}
    if key not in rows:
        raise SystemExit(f"autopar: no published row {key!r}; expected one of {sorted(rows)}")
    row = rows[key]

    def build() -> tuple:
        model, inputs = _model_and_inputs(row)
        return model, inputs, {}
    return build, row.auto_mesh, {"hardware": row.hardware, "memory_limit": row.device_memory,
                                  "mp_policy": row.mp_policy}


def cpu_seconds() -> float:
    """CPU seconds of this process (its threads) and of the processes it forked and waited for
    (the search's worker processes, ``autopar.passes.planner.workers``)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def measure(name: str, build: Callable[[], tuple], mesh: tuple[int, ...], keywords: dict, time_limit_s: float,
            plans: Path | None, workers: int | None = None) -> dict:
    """One target planned (its independent plans in ``workers`` processes; None: one per core):
    its wall and CPU seconds, capture and search apart, its prediction."""
    model, inputs, kwargs = build()
    started, cpu_started = time.perf_counter(), cpu_seconds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, mesh, inputs, example_kwargs=kwargs or None, time_limit_s=time_limit_s,
                      workers=workers, **keywords)
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu_started
    if plans is not None:
        plans.mkdir(parents=True, exist_ok=True)
        result.save(plans / (f"{name}.json" if workers is None else f"{name}-workers{workers}.json"))
    return {"target": name, "mesh": "x".join(map(str, mesh)), "workers": workers or "per core", "wall": wall, "cpu": cpu,
            "capture": result.solver.get("capture_seconds", float("nan")),
            "search": result.solver.get("planning_seconds", float("nan")),
            "search_cpu": result.solver.get("planning_cpu_seconds", float("nan")),
            "step_ms": result.predicted.step_time * 1e3, "plan": result.kind + (
                f", pp{result.pipeline.stages}" if result.pipeline is not None else "")}


def table(results: list[dict]) -> list[str]:
    lines = ["| target | mesh | workers | wall s | CPU s | capture s | search s | search CPU s | plan | predicted step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['target']} | {r['mesh']} | {r['workers']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['capture']:.1f} | "
                     f"{r['search']:.1f} | {r['search_cpu']:.1f} | {r['plan']} | {r['step_ms']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--published", nargs="*", default=[], metavar="KEY",
                        help="rows of benchmarks.published to plan too (their auto plan)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, nargs="*", default=[None], metavar="N",
                        help="plan each target with the search's independent plans in N processes, for each N "
                             "given in turn (default: one per core)")
    parser.add_argument("--plans", type=Path, help="folder to save each plan's JSON in")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="folder of the dated results file plan_speed_<hardware>_<yyyymmdd>.md (none without)")
    args = parser.parse_args(argv)
    chosen = [(name, *TARGETS[name]) for name in args.targets] + [(key, *_published(key)) for key in args.published]
    load = os.getloadavg()[0]
    results = []
    for name, build, mesh, keywords in chosen:
        for workers in args.workers:
            results.append(measure(name, build, mesh, keywords, args.time_limit, args.plans, workers))
            print(f"{name} ({results[-1]['workers']} workers): {results[-1]['wall']:.1f} s wall, "
                  f"{results[-1]['cpu']:.1f} CPU s", flush=True)
    lines = table(results) + ["", f"Load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
                                  f"time limit {args.time_limit:g} s."]
    print("\n".join(lines))
    if args.out is not None:
        write_results("plan_speed", "cpu", "Planning speed", lines, args.out, argv)


if __name__ == "__main__":
    main()
