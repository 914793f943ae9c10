"""Serving predictions against published measurements, and the serving layouts side by side.

    python -m benchmarks.inference_published [--rows trtllm-70b-128 trtllm-70b-2048] [--table]
                                             [--sizes 8b 70b 405b] [--time-limit 60] [--dry-run]
                                             [--out benchmarks/results]

1. **Published rows**: NVIDIA TensorRT-LLM
   v0.5's ``docs/source/performance.md``, Llama 2 70B in FP16 on 4 A100 80GB with tensor
   parallelism 4, one sequence: time to first token at 128 and 2,048 input tokens (47 and
   377 ms). Each is priced as it ran: ``autopar.plan(..., inference=, layout="tp")`` on the
   A100 preset, the prefill of the prompt into a cache one position longer (its time to
   first token is the prefill's); the table gives predicted / published.
2. **``--table``**: the auto plan against every serving layout for Llama-3 8B, 70B and 405B
   shapes (bf16) on 8 and 16 H100s (meshes (1, 8) and (2, 8): 8-GPU nodes), under the
   latency objective (one sequence, 128 prompt tokens, 2,048 positions) and the throughput
   objective (the batch searched from the largest that fits): time to first token, time per
   output token, tokens/s per GPU, memory per GPU, and each plan's generation time over the
   best manual layout's. ``--dry-run`` also dry-runs every auto plan (``autopar.dry_run``).

Everything runs on the meta device; the table and the command, commit and machine go to
``<out>/inference_published_<hardware>_<yyyymmdd>.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass

import torch

import autopar
from autopar.costmodels.units import GIB
from autopar.models import MODELS, llama3
from benchmarks.results_file import add_out_argument, write_results

MS = 1e3
SIZES = ("8b", "70b", "405b")
# Llama 2 70B (Touvron et al. 2023, Table 1; the Hugging Face config of meta-llama/Llama-2-70b-hf):
# layers, hidden, heads, key-value heads, FFN, vocabulary, positions
LLAMA2_70B = dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096)


@dataclass(frozen=True)
class Row:
    """One published serving measurement."""

    name: str
    source: str
    prompt: int
    ttft_s: float  # published time to first token
    gpus: int = 4
    hardware: str = "a100"
    layout: str = "tp"


ROWS = {
    "trtllm-70b-128": Row("trtllm-70b-128", "TensorRT-LLM v0.5 docs/source/performance.md: Llama 2 70B FP16, "
                          "4 x A100 80GB, TP 4, batch 1, 128 input tokens", 128, 47e-3),
    "trtllm-70b-2048": Row("trtllm-70b-2048", "same file: 2,048 input tokens", 2048, 377e-3),
}


def llama2_70b() -> torch.nn.Module:
    with torch.device("meta"):
        return MODELS["llama"].build(LLAMA2_70B, 4096).to(torch.float16)


def published_rows(names: list[str], time_limit: float, dry: bool) -> list[str]:
    lines = ["| row | layout | prompt | published TTFT | predicted TTFT | predicted / published | dry run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    model = llama2_70b()
    for name in names:
        row = ROWS[name]
        started = time.perf_counter()
        plan = autopar.plan(model, (row.gpus,), inference=autopar.Inference(batch=1, prompt_len=row.prompt,
                                                                            max_len=row.prompt + 1),
                            hardware=row.hardware, layout=row.layout, time_limit_s=time_limit)
        ttft = plan.predicted.time_to_first_token
        verdict = _dry(plan, model) if dry else "-"
        lines.append(f"| {name} | {row.layout} on {row.gpus} {row.hardware} | {row.prompt} | {row.ttft_s * MS:.0f} ms | "
                     f"{ttft * MS:.1f} ms | {ttft / row.ttft_s:.2f} | {verdict} |")
        print(lines[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
    return lines


def layout_table(time_limit: float, dry: bool, sizes: list[str]) -> list[str]:
    lines = ["| model | GPUs | objective | plan | batch | TTFT | TPOT | tokens/s/GPU | memory/GPU | "
             "plan / best manual | manual layouts (one generation) | dry run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size in sizes:
        with torch.device("meta"):
            model = llama3(size)
        for mesh in ((1, 8), (2, 8)):
            for objective, batch in (("latency", 1), ("throughput", None)):
                started = time.perf_counter()
                workload = autopar.Inference(batch=batch, prompt_len=128, max_len=2048, objective=objective)
                try:
                    plan = autopar.plan(model, mesh, inference=workload, hardware="h100", time_limit_s=time_limit)
                except ValueError as exc:
                    lines.append(f"| llama3-{size} | {mesh[0] * mesh[1]} | {objective} | none fits | | | | | | | "
                                 f"{str(exc)[:80]} | |")
                    print(lines[-1], flush=True)
                    continue
                p = plan.predicted
                manual = ", ".join(f"{k} {v:.3g} s" for k, v in sorted(plan.candidates.items(), key=lambda kv: kv[1]))
                best = min(plan.candidates.values(), default=float("nan"))
                lines.append(
                    f"| llama3-{size} | {mesh[0] * mesh[1]} | {objective} | {plan.kind} | {plan.inference['batch']} | "
                    f"{p.time_to_first_token * MS:.1f} ms | {p.time_per_output_token * MS:.2f} ms | "
                    f"{p.tokens_per_second_per_device:.4g} | {sum(p.memory.values()) / GIB:.1f} GiB | "
                    f"{p.step_time / best:.3f} | {manual} | {_dry(plan, model) if dry else '-'} |")
                print(lines[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
    return lines


def _dry(plan, model) -> str:
    result = autopar.dry_run(plan, model)
    if not result.ok:
        return f"FAILED: {(result.failures[0].error or '')[:60]}"
    return f"ok, {result.peak / GIB:.1f} GiB ({1 / result.ratio:.2f} of predicted)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--table", action="store_true", help="also the Llama-3 layouts table (minutes)")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES), help="the table's models")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--dry-run", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = ["## Time to first token against published measurements", ""]
    lines += published_rows(args.rows, args.time_limit, args.dry_run)
    if args.table:
        lines += ["", "## Serving layouts: Llama-3 shapes on H100s (prompt 128, 2,048 positions)", ""]
        lines += layout_table(args.time_limit, args.dry_run, args.sizes)
    write_results("inference_published", "h100-a100", "Serving predictions", lines, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
