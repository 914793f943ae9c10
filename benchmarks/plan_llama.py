"""Planning time and plan quality for Llama-shaped models on the meta device (H100 preset).

    python benchmarks/plan_llama.py --size 70b --mesh 8 8 [--time-limit 60]

Prints the capture / planning seconds, the auto plan's prediction and every manual
layout's predicted step time with the ratio auto / layout (must be <= 1.00).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # costmodels/ is not in the editable install's map

SIZES = {  # Llama 3 (Meta, 2024): hidden, ffn, layers, heads, kv heads, vocab
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "70b": (8192, 28672, 80, 64, 8, 128256),
    "405b": (16384, 53248, 126, 128, 8, 128256),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="70b", choices=sorted(SIZES))
    parser.add_argument("--mesh", type=int, nargs="+", default=[8, 8])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--no-pipeline", action="store_true")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.planning import plan

    hidden, ffn, layers, heads, kv, vocab = SIZES[args.size]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=args.layers or layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=args.seq, torch_dtype=torch.bfloat16)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    result = plan(model, tuple(args.mesh), (tokens,), hardware="h100", time_limit_s=args.time_limit,
                  pipeline=not args.no_pipeline)
    total = time.perf_counter() - started
    print(f"llama-{args.size} ({cfg.num_hidden_layers} layers) on {tuple(args.mesh)}: planned in {total:.1f} s "
          f"(capture {result.solver.get('capture_seconds', 0):.1f} s, search {result.solver.get('planning_seconds', 0):.1f} s)")
    print(result.explain())
    step = result.predicted.step_time
    for name, t in sorted(result.candidates.items(), key=lambda kv: kv[1]):
        print(f"  auto / {name:<28} = {step / t:.3f}   ({t * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
