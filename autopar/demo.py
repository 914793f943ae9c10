"""The demo: capture a small GPT, show every op's sharding strategies on a 2x2 mesh, and
the plan autopar chooses for it on 2x2 H100s, explained.

Run with ``python -m autopar.demo``. (Training under torchrun and the 70B plan join the
demo with the benchmark issue.)
"""

from __future__ import annotations

import statistics
import time

import torch

from autopar.models import GPT, GPTConfig
from passes.capture import capture
from passes.strategies import build_strategy_graph


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq_len=32, dim=64, n_heads=4, n_layers=2)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, 32))
    mesh_shape = (2, 2)

    start = time.perf_counter()
    captured = capture(model, (tokens,))
    graph = build_strategy_graph(captured, mesh_shape)
    elapsed = time.perf_counter() - start

    n_nodes = sum(1 for _ in captured.nodes("call_function"))
    print(f"Captured GPT ({sum(p.numel() for p in model.parameters()):,} parameters): "
          f"{n_nodes} ATen ops, strategies on a {'x'.join(map(str, mesh_shape))} mesh in {elapsed:.2f} s\n")
    print(f"{'node':<28} {'op':<38} {'#':>4}  first strategies")
    print(graph.table())
    print("\nStrategies per op (min / median / max over its nodes):")
    for op, counts in sorted(graph.counts().items()):
        print(f"  {op:<44} {min(counts):>4} / {statistics.median(counts):>6} / {max(counts):>4}")
    if graph.missing_rules:
        print(f"\nOps without a rule (replicated): {sorted(graph.missing_rules)}")

    from autopar.planning import plan

    start = time.perf_counter()
    chosen = plan(model, mesh_shape, (tokens,), hardware="h100", time_limit_s=30)
    print(f"\nThe plan for {'x'.join(map(str, mesh_shape))} H100s ({time.perf_counter() - start:.1f} s):\n")
    print(chosen.explain())


if __name__ == "__main__":
    main()
