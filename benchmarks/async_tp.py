"""Async tensor parallelism, predicted: the same plans with and without the linears that run
their collective inside, pipelined with the matmul (``autopar.passes.rules.overlapped``).

    python -m benchmarks.async_tp [--batches 8 1] [--layouts tp+dp tp+sp fsdp+tp] [--out DIR]

On the H100 preset, for two Llama-3-70B layers (4,096 tokens a sequence): ``autopar.plan``
pinned to TP 8 on 8 GPUs at each batch of ``--batches``, and each of ``--layouts`` on 2 x 8
at batch 16, each planned twice side by side in this process: as autopar plans it (the fused
strategies offered, taken where the cost model says they pay) and with them left out.
Prints the predicted step, its compute and communication, and how many linears run fused.
``--out DIR`` writes the table to ``async_tp_h100_<yyyymmdd>.md`` there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import warnings
from pathlib import Path

import torch

import autopar
from autopar.models import llama3
from autopar.passes.rules import overlapped
from benchmarks.results_file import write_results

SEQ = 4096


@contextlib.contextmanager
def _fused(offered: bool):
    """The fused linears offered (as autopar plans) or left out (``overlapped.options`` empty)."""
    options = overlapped.options
    if not offered:
        overlapped.options = lambda info: []
    try:
        yield
    finally:
        overlapped.options = options


def _row(what: str, offered: bool, plan) -> dict:
    kernels = collections.Counter(s.split("[")[-1].rstrip("]") for s in plan.strategies.values() if "[" in s)
    p = plan.predicted
    return {"what": what, "fused": offered, "step": p.step_time, "compute": p.compute, "comm": p.communication,
            "kernels": {k: n for k, n in kernels.items() if k in (overlapped.GATHER, overlapped.SCATTER)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 1])
    parser.add_argument("--layouts", nargs="*", default=["tp+dp", "tp+sp", "fsdp+tp"])
    parser.add_argument("--out", type=Path, metavar="DIR", help="folder of the dated results file")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = llama3("70b", SEQ, 2)
    rows = []
    for batch in args.batches:
        tokens = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
        for offered in (True, False):
            with _fused(offered):
                plan = autopar.plan(model, (8,), (tokens,), hardware="h100", time_limit_s=60, pipeline=False,
                                    constraints=autopar.Constraints(tp=8))
            rows.append(_row(f"auto, TP 8 pinned, 8 GPUs, batch {batch}", offered, plan))
    tokens = torch.zeros(16, SEQ, dtype=torch.long, device="meta")
    for layout in args.layouts:
        for offered in (True, False):
            with _fused(offered):
                plan = autopar.layouts.build(layout, model, (2, 8), (tokens,), hardware="h100", pipeline=False)
            rows.append(_row(f"{layout}, 2 x 8 GPUs, batch 16", offered, plan))
    lines = ["Two Llama-3-70B layers, 4,096 tokens a sequence, H100 preset; predicted. Each plan made twice side "
             "by side: with the fused linears offered and with them left out.", "",
             "| plan | fused linears | step ms | compute ms | communication ms | linears run fused | step with / without |",
             "|---|---|---|---|---|---|---|"]
    for with_, without in zip(rows[::2], rows[1::2]):
        for r in (with_, without):
            fused = ", ".join(f"{n} {k}" for k, n in sorted(r["kernels"].items())) or "none"
            ratio = f"{with_['step'] / without['step']:.3f}" if r is with_ else ""
            lines.append(f"| {r['what']} | {'offered' if r['fused'] else 'left out'} | {r['step'] * 1e3:.2f} | "
                         f"{r['compute'] * 1e3:.2f} | {r['comm'] * 1e3:.2f} | {fused} | {ratio} |")
    print("\n".join(lines))
    if args.out:
        write_results("async_tp", "h100", "Async tensor parallelism, predicted", lines, args.out,
                      sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
