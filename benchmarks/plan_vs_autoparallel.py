"""Planning Llama-3 8B on 8 x 8 H100s: autopar against Meta's autoparallel, side by side.

    python -m benchmarks.plan_vs_autoparallel [--repeats 2] [--solver ilp [approximate]] [--time-limit 60]
                                              [--out DIR]

The job is autoparallel's own example (its ``examples/example_llama3.py``): Llama-3 8B, a batch of
16 x 8,192 tokens, a mesh of 8 x 8 H100s. The planners take turns, A B A B (A B C A B C with two
solvers), each run planning in a fresh subprocess, so that every run pays its own imports and its
peak memory is its planner's alone. Per run the table gives the wall seconds of the subprocess,
its CPU seconds (user and system, its own and those of every process it waited for: CBC, forked
workers) and its peak resident memory (the largest of those processes, from ``wait4``; not their
sum), then the medians and their ratios autoparallel ÷ autopar. ``--out DIR`` writes them to a
dated results file ``plan_vs_autoparallel_cpu_<yyyymmdd>.md`` there (``benchmarks.results_file``).

- autopar: ``autopar.planning.plan`` of ``autopar.models.llama3("8b", 8192)`` built on the meta
  device, mesh (8, 8), hardware "h100", as ``benchmarks.plan_speed`` plans (pipeline search
  included; ``--time-limit`` its budget).
- autoparallel, as its example: a fake process group of 64 ranks and a (dp 8, tp 8) device mesh;
  its torchtitan Llama (``autoparallel._testing.models.llama3``) of autopar's 8B shape (hidden
  4,096, 32 layers, 32 heads, 8 KV heads, FFN 14,336, vocabulary 128,256) built on the meta
  device, selective activation checkpointing, computing in bf16 and reducing gradients in fp32;
  ``AutoParallel(...)`` with ``add_parameter_memory_constraint()``, the input sharded by batch,
  the output vocabulary-parallel, then ``optimize_placement()``. ``--solver ilp`` is its default
  exact solver (PuLP's CBC), ``--solver approximate`` its experimental heuristic one (TRW-S,
  memory by Lagrangian relaxation, no PuLP problem built: ``AutoParallel(..., solver="approx")``).

Where the two jobs differ:

- the models: autopar's is Hugging Face's ``LlamaForCausalLM`` with bf16 weights, autoparallel's
  torchtitan's Transformer with fp32 weights computing in bf16 (its example's
  ``MixedPrecisionPolicy``); same shape, same parameter count;
- autopar also searches pipeline stages; autoparallel places shardings on the 2-D mesh only;
- to run without a GPU, autoparallel's mesh is of device type "cpu" (torch without CUDA can not
  hold fake CUDA tensors) and the device name its cost models ask torch for reads "NVIDIA H100",
  as its own tests' ``conftest.py`` patches it; its attention calls
  ``aten._scaled_dot_product_flash_attention`` directly, a fused kernel SDPA runs on GPUs (on an
  H100 its model would ask for cuDNN's first): on a CPU device SDPA would pick
  ``_scaled_dot_product_flash_attention_for_cpu``, which autoparallel has no sharding rule, FLOP
  formula or checkpointing rule for (it would replicate attention and count no FLOPs for it).

autoparallel is not a dependency of autopar; install it at the commit this benchmark is pinned to:

    pip install numpy "autoparallel @ git+https://github.com/meta-pytorch/autoparallel@8eda68d266fa7667d0fe432774ac7c78324a6d6b"

That commit is the head of autoparallel's pull request #484 (branch ``kaijian/approx_solver_pr``,
2026-06-08), the one commit holding both solvers; its main branch (a54c252, 2026-06-29, which also
runs on torch 2.13.0) has the ILP only. The pinned commit runs on torch 2.13.0. Without autoparallel the benchmark stops before planning anything, with that command
and exit status 1: a comparison asked for and not made is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

from benchmarks.results_file import REPO, write_results

AUTOPARALLEL_COMMIT = "8eda68d266fa7667d0fe432774ac7c78324a6d6b"
INSTALL = f'pip install numpy "autoparallel @ git+https://github.com/meta-pytorch/autoparallel@{AUTOPARALLEL_COMMIT}"'
NOT_INSTALLED = (f"autopar: autoparallel is not installed; expected Meta's autoparallel importable to plan beside "
                 f"autopar, found no module 'autoparallel' (it is not a dependency of autopar); install it at the "
                 f"commit this benchmark is pinned to: {INSTALL}")
SOLVERS = {"ilp": "ilp", "approximate": "approx"}  # this benchmark's name -> autoparallel's
BATCH, SEQ, MESH, SIZE = 16, 8192, (8, 8), "8b"
H100 = "NVIDIA H100 80GB HBM3"
RESULT = "result: "  # the child's last stdout line: this, then its JSON


def autoparallel_installed() -> str | None:
    """The installed autoparallel's commit ('unknown' when pip recorded none), None when there is none."""
    if importlib.util.find_spec("autoparallel") is None:
        return None
    try:
        direct = json.loads(importlib.metadata.distribution("autoparallel").read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:  # importable from a source tree, not installed
        direct = {}
    return direct.get("vcs_info", {}).get("commit_id", "unknown")


def plan_autopar(time_limit_s: float) -> dict:
    """autopar's plan of the job (in a child): its planning seconds and the plan's kind."""
    import torch

    from autopar.models import llama3
    from autopar.planning import plan

    started = time.perf_counter()
    with torch.device("meta"):
        model = llama3(SIZE, SEQ)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, MESH, (tokens,), hardware="h100", time_limit_s=time_limit_s)
    kind = result.kind + (f", pp{result.pipeline.stages}" if result.pipeline is not None else "")
    return {"planning_s": time.perf_counter() - started,
            "plan": f"{kind}, {result.predicted.step_time * 1e3:.0f} ms predicted step"}


def _flash_attention(self, q, k, v):
    """Causal attention as SDPA runs it on an H100, whatever the (fake) device."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]


@contextlib.contextmanager
def _named_h100():
    """The device name autoparallel's compute and NCCL cost models read, on a machine without a GPU."""
    with mock.patch("torch.cuda.get_device_name", lambda *args, **kwargs: H100), \
            mock.patch("torch.cpu.get_device_name", lambda *args, **kwargs: H100, create=True):
        yield


def plan_autoparallel(solver: str) -> dict:
    """autoparallel's placement of the job (in a child), as its ``examples/example_llama3.py`` makes it."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.placement_types import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoparallel._testing.models import llama3 as titan
    from autoparallel.api import AutoParallel
    from autopar.models import LLAMA3

    choices = getattr(AutoParallel, "SOLVER_CHOICES", ("ilp",))
    if SOLVERS[solver] not in choices:
        raise SystemExit(f"autopar: expected an autoparallel with the solver {SOLVERS[solver]!r}; found one with "
                         f"{list(choices)}; install the commit this benchmark is pinned to: {INSTALL}")
    hidden, ffn, layers, heads, kv_heads, vocab = LLAMA3[SIZE]
    started = time.perf_counter()
    with _named_h100():
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=MESH[0] * MESH[1])
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
        titan.ScaledDotProductAttention.forward = _flash_attention
        args = titan.TransformerModelArgs(dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                                          ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000,
                                          vocab_size=vocab, max_seq_len=SEQ)  # the example's FFN rule
        with torch.device("meta"):
            model = titan.Transformer(args)
        built_ffn = model.layers["0"].feed_forward.w1.out_features
        if built_ffn != ffn:
            raise SystemExit(f"autopar: expected autoparallel's Llama of FFN {ffn} as autopar's {SIZE}; found "
                             f"{built_ffn}; fix the arguments of TransformerModelArgs here")
        titan.apply_ac(model, mode="selective", selective_ac_option="op")
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def input_fn():
            return torch.randint(0, vocab, (BATCH, SEQ), device="cpu")

        chosen = {"solver": SOLVERS[solver]} if hasattr(AutoParallel, "SOLVER_CHOICES") else {}  # main: ILP only
        with AutoParallel(model, input_fn, mesh, mp_policy, repeated_subgraphs=True, **chosen) as autop:
            autop.add_parameter_memory_constraint(low=None, high=None)
            autop.add_input_constraints([(Shard(0), Replicate())])
            autop.add_output_constraints([(Shard(0), Shard(2))])  # vocabulary-parallel, as the example
            placement = autop.optimize_placement()
        torch.distributed.destroy_process_group()
    return {"planning_s": time.perf_counter() - started, "plan": f"{len(placement)} nodes placed"}


def run_child(planner: str, solver: str, time_limit_s: float) -> dict:
    """One planning in a fresh subprocess: its wall and CPU seconds, its peak RSS and what it reported."""
    command = [sys.executable, "-m", "benchmarks.plan_vs_autoparallel", "--child", planner,
               "--solver", solver, "--time-limit", str(time_limit_s)]
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # this child's rusage alone, its waited-for processes in it
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().splitlines()
    reported = [line for line in lines if line.startswith(RESULT)]
    if child.returncode != 0 or not reported:
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"autopar: expected the {planner} planning to print its result and exit 0; found exit "
                         f"status {child.returncode}; its output ends:\n{tail}")
    return {"planner": planner, "solver": solver if planner == "autoparallel" else "—", "wall": wall,
            "cpu": usage.ru_utime + usage.ru_stime, "rss_gib": usage.ru_maxrss * 1024 / 2**30,  # Linux: KiB
            **json.loads(reported[-1][len(RESULT):])}


def table(runs: list[dict]) -> list[str]:
    """Every run, then per autoparallel solver the medians and the ratios autoparallel ÷ autopar."""
    lines = ["| run | planner | solver | wall s | CPU s | peak RSS GiB | planning s | plan |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['planner']} | {r['solver']} | {r['wall']:.1f} | {r['cpu']:.1f} | "
                     f"{r['rss_gib']:.2f} | {r['planning_s']:.1f} | {r['plan']} |")
    autopar = [r for r in runs if r["planner"] == "autopar"]
    lines += ["", "| autoparallel solver | runs | quantity (median) | autopar | autoparallel "
                  "| autoparallel ÷ autopar |", "|---|---|---|---|---|---|"]
    for solver in dict.fromkeys(r["solver"] for r in runs if r["planner"] == "autoparallel"):
        theirs = [r for r in runs if r["planner"] == "autoparallel" and r["solver"] == solver]
        for key, name, digits in (("wall", "wall s", 1), ("cpu", "CPU s", 1), ("rss_gib", "peak RSS GiB", 2)):
            a, b = (statistics.median(r[key] for r in rs) for rs in (autopar, theirs))
            lines.append(f"| {solver} | {len(autopar)} + {len(theirs)} | {name} | {a:.{digits}f} | {b:.{digits}f} | "
                         f"{b / a:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each planner (default 2)")
    parser.add_argument("--solver", nargs="+", default=["ilp"], choices=list(SOLVERS),
                        help="autoparallel's solver(s): ilp (its default, CBC) and/or approximate (TRW-S)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="autopar's planning budget, seconds")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="folder of the dated results file plan_vs_autoparallel_cpu_<yyyymmdd>.md (none without)")
    parser.add_argument("--child", choices=["autopar", "autoparallel"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        reported = (plan_autopar(args.time_limit) if args.child == "autopar" else plan_autoparallel(args.solver[0]))
        print(RESULT + json.dumps(reported), flush=True)
        return
    commit = autoparallel_installed()
    if commit is None:
        raise SystemExit(NOT_INSTALLED)
    if args.repeats < 1:
        parser.error(f"expected --repeats of at least 1; found {args.repeats}")
    load = os.getloadavg()[0]
    runs = []
    for _ in range(args.repeats):
        for planner, solver in [("autopar", "ilp")] + [("autoparallel", s) for s in args.solver]:
            runs.append(run_child(planner, solver, args.time_limit))
            r = runs[-1]
            print(f"{planner} {r['solver']}: {r['wall']:.1f} s wall, {r['cpu']:.1f} CPU s, "
                  f"{r['rss_gib']:.2f} GiB peak", flush=True)
    installed = ("autoparallel from a source tree (pip recorded no commit)" if commit == "unknown" else
                 f"autoparallel {commit[:7]}" + ("" if commit == AUTOPARALLEL_COMMIT else
                                                 f", not the pinned {AUTOPARALLEL_COMMIT[:7]}"))
    lines = table(runs) + ["", f"Llama-3 {SIZE}, {BATCH} x {SEQ} tokens, mesh {MESH[0]} x {MESH[1]} (H100); "
                               f"{installed}; autopar's time limit {args.time_limit:g} s; load average {load:.1f} before, "
                               f"{os.getloadavg()[0]:.1f} after."]
    print("\n".join(lines))
    if args.out is not None:
        write_results("plan_vs_autoparallel", "cpu", "Planning Llama-3 8B on 8 x 8 H100s: autopar and autoparallel",
                      lines, args.out, argv)


if __name__ == "__main__":
    main()
