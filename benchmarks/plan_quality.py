"""Plan quality: predicted step time of the automatic plan / every manual layout (<= 1.00).

    python -m benchmarks.plan_quality [--time-limit 20]

Models (meta device, H100 preset): a GPT with a 128k vocabulary (the embedding and head
dominate: per-layer choices should beat any uniform layout), a small Mixtral (MoE), and
a 16-layer GPT-2-sized model, each on 8 devices (2 x 4: inter-node x NVLink). Prints, per
model, the auto plan and auto / layout for every manual layout that fits, and writes them as a
table to ``benchmarks/results/plan_quality_h100_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from benchmarks.results_file import add_out_argument, write_results


def models():
    from transformers import MixtralConfig, MixtralForCausalLM

    from autopar.models import GPT, GPTConfig

    def big_vocab():
        cfg = GPTConfig(vocab_size=131072, max_seq_len=2048, dim=2048, n_heads=16, n_layers=4)
        return GPT(cfg), (torch.zeros(16, 2048, dtype=torch.long),)

    def moe():
        cfg = MixtralConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=2048)
        return MixtralForCausalLM(cfg), (torch.zeros(8, 1024, dtype=torch.long),)

    def gpt_medium():
        cfg = GPTConfig(vocab_size=50304, max_seq_len=1024, dim=1024, n_heads=16, n_layers=16)
        return GPT(cfg), (torch.zeros(32, 1024, dtype=torch.long),)

    return {"gpt-128k-vocab": big_vocab, "mixtral-4x8e": moe, "gpt-16-layers": gpt_medium}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--mesh", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", default=None)
    add_out_argument(parser)
    args = parser.parse_args()
    from autopar.planning import plan

    warnings.simplefilter("ignore")
    lines = ["| model | mesh | auto plan | planning s | layout | auto / layout |", "|---|---|---|---|---|---|"]
    for name, build in models().items():
        if args.only and name != args.only:
            continue
        with torch.device("meta"):
            model, inputs = build()
        inputs = tuple(x.to("meta") for x in inputs)
        started = time.perf_counter()
        try:
            result = plan(model, tuple(args.mesh), inputs, hardware="h100", time_limit_s=args.time_limit)
        except Exception as exc:  # a benchmark row, not a crash: say what failed
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            lines.append(f"| {name} | {tuple(args.mesh)} | FAILED: {type(exc).__name__} | | | |")
            continue
        step = result.predicted.step_time
        worst = max((step / t for t in result.candidates.values()), default=float("nan"))
        best = min((step / t for t in result.candidates.values()), default=float("nan"))
        seconds = time.perf_counter() - started
        auto = f"{step * 1e3:.4g} ms on mesh {result.mesh_shape}{' pipelined' if result.pipeline else ''}"
        print(f"{name} on {tuple(args.mesh)}: planned in {seconds:.1f} s; auto {auto}; "
              f"auto/layout from {best:.3f} to {worst:.3f}")
        for layout, t in sorted(result.candidates.items(), key=lambda kv: kv[1]):
            print(f"    auto / {layout:<28} = {step / t:.3f}")
            lines.append(f"| {name} | {tuple(args.mesh)} | {auto} | {seconds:.1f} | {layout} | {step / t:.3f} |")
    write_results("plan_quality", "h100", "Plan quality: auto plan / every manual layout, predicted step time",
                  lines, args.out)


if __name__ == "__main__":
    main()
