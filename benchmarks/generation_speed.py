"""Time per generated token: a served plan on 4 gloo ranks against Hugging Face's own
``generate`` in one process.

    python -m benchmarks.generation_speed                 # launches 4 gloo ranks itself
    python -m benchmarks.generation_speed --layouts tp+dp --tokens 16 --repeats 5

The 2-layer Llama of the test suite (64 wide, grouped-query attention), in float32, one
prompt of 8 tokens, ``--tokens`` new ones, greedy. One process: ``model.generate`` with
its dynamic cache, run on rank 0 while the other ranks wait. Compiled: ``autopar.compile``
of a serving plan on a 2x2 mesh (``--layouts``; ``auto`` is the planner's, for this mesh's
measured profile), then
``pm.generate``, which runs the prefill and decode programs captured once. The two run in
alternating order (ABBA) so that load on a shared machine hits both alike; the table gives
the median time per token of each and their ratio. Ratios, not absolute times, are the
result. Before timing, the compiled tokens are checked against the one-process ones. The table
goes to ``benchmarks/results/generation_speed_gloo_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.models import MODELS
from benchmarks.results_file import add_out_argument, write_results
from benchmarks.runtime_vs_manual import launch

CONFIG = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
PROMPT = 8
LAYOUTS = ("tp+dp", "tp", "auto")


def model_and_prompt():
    """The benchmark's model (seeded, so every rank builds the same) and one prompt."""
    torch.manual_seed(0)
    model = MODELS["llama"].build(CONFIG, CONFIG["max_position_embeddings"]).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    return model, ids


def one_process(model, ids, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)


def timed(run) -> float:
    dist.barrier()
    started = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - started


def main(layouts: list[str], tokens: int, repeats: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    model, ids = model_and_prompt()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a0", "a1"))
    work = autopar.Inference(batch=1, prompt_len=PROMPT, max_len=PROMPT + tokens)
    expected = one_process(model, ids, tokens)
    rows = []
    for layout in layouts:
        plan = None
        if layout != "auto":
            plan = autopar.plan(model, (2, 2), inference=work, hardware="h100", layout=layout, time_limit_s=5)
        # the planner's own plan is made for this mesh's measured profile (gloo on CPU: a
        # collective costs milliseconds), as compile does without a hardware name
        pm = autopar.compile(model, mesh, inference=None if plan else work, plan=plan)
        got = pm.generate(ids, max_new_tokens=tokens)
        if not torch.equal(got, expected):
            raise SystemExit(f"autopar: {layout}: generated {got.tolist()}, one process {expected.tolist()}")
        runs = {"compiled": lambda: pm.generate(ids, max_new_tokens=tokens),
                "one process": (lambda: one_process(model, ids, tokens)) if rank == 0 else (lambda: None)}
        times = {name: [] for name in runs}
        for repeat in range(repeats):
            order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in order:
                times[name].append(timed(runs[name]) / tokens)
        compiled, alone = statistics.median(times["compiled"]), statistics.median(times["one process"])
        rows.append((f"{layout} ({plan.kind if plan else pm.plan.kind})", compiled, alone))
    if rank == 0:
        lines = [f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, float32, "
                 f"prompt {PROMPT}, {tokens} new tokens greedy, 4 gloo ranks (2x2), median of {repeats} runs per side",
                 "",
                 "| layout | compiled (ms/token) | one process (ms/token) | compiled / one process |",
                 "| --- | --- | --- | --- |"]
        lines += [f"| {layout} | {compiled * 1e3:.2f} | {alone * 1e3:.2f} | {compiled / alone:.2f} |"
                  for layout, compiled, alone in rows]
        print("\n".join(lines))
        write_results("generation_speed", "gloo", "Time per generated token: served plans on 4 gloo ranks against "
                      "one process", lines, out)
    dist.barrier()
    dist.destroy_process_group()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generation (default 16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per side (default 5)")
    add_out_argument(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    if "RANK" in os.environ:
        sys.exit(main(options.layouts, options.tokens, options.repeats, options.out))
    sys.exit(launch("benchmarks.generation_speed", ["--layouts", *options.layouts, "--tokens", str(options.tokens),
                                                    "--repeats", str(options.repeats),
                                                    "--out", str(options.out.resolve())]))
