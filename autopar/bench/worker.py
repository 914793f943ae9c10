"""The measuring half of ``autopar.bench``: runs on every rank under torchrun (gloo on CPU).

    torchrun --standalone --nproc_per_node 4 -m autopar.bench.worker JOB.json

``JOB.json`` (written by ``autopar.bench``) names the mesh, and either ``"profile"``
(measure or load this machine's profile for the mesh and write it to a file) or a list
of cases: a model and a saved Plan per layout. For each model, every case is compiled
and run once (the first step, where failures show: a failing case is recorded with its
one-line reason and left out), its memory is measured in one more step, and then the
cases' steps are timed interleaved (case A, B, C, A, B, C, ...), so that load on this
shared machine hits every layout alike. Rank 0 appends one JSON line per event to the
job's ``results`` file as it goes, so a launch that dies leaves what it had measured.

Every case trains ``WithLoss(model, loss_fn)`` -- the model and its loss as one module,
as ``autopar.plan(..., loss_fn=, target=)`` plans it -- so the step that runs is the step
that was predicted, loss included.

Memory per rank: ``ParallelModule.measure_memory`` (one training step; the four kinds the
plan predicts: parameter shards and buffers plus gathered copies kept for backward,
gradients, optimizer state tensors, and the distinct storages autograd keeps for backward
at the end of forward), on the most loaded rank. A module without it (a pipeline) has
memory left unmeasured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.bench.workloads import build
from autopar.costmodels.profiler import Sweep, profile_mesh
from autopar.runtime.loss import WithLoss
from autopar.runtime.module import ParallelModule
from autopar.passes.capture import capture
from autopar.passes.plan import Plan
from autopar.passes.strategy_graph import build_strategy_graph


def compile_plan(model, captured, graph, plan: Plan, mesh, inputs: tuple):
    """``autopar.compile(model, mesh, inputs, loss_fn=..., optimizer=..., plan=plan)`` without
    its capture: every layout of a model shares one capture and strategy graph (the same
    ones compile would make; a pipeline plan goes through compile itself)."""
    if plan.pipeline is not None:
        return autopar.compile(model, mesh, inputs, loss_fn=loss_is_output, optimizer=adamw, plan=plan)
    return ParallelModule(model, captured, graph, plan, mesh, loss_is_output, adamw, check_inputs=False)


def reshards(pm) -> int:
    """Resharding steps in this rank's model program (each one or more collectives)."""
    programs = [pm.gm] if hasattr(pm, "gm") else [p.gm for p in pm.programs]
    return sum(1 for gm in programs for n in gm.graph.nodes
               if n.op == "call_module" and "Reshard" in type(gm.get_submodule(n.target)).__name__)


def loss_is_output(loss: torch.Tensor, _unused: torch.Tensor) -> torch.Tensor:
    """The compiled module (``WithLoss``) already returns the loss."""
    return loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def measure_memory(pm, inputs: tuple, target: torch.Tensor) -> dict[str, float] | None:
    """This rank's bytes by kind over one training step, where the module can measure them."""
    if not hasattr(pm, "measure_memory"):
        return None
    return {kind: float(b) for kind, b in pm.measure_memory(inputs, target).items()}


class Job:
    def __init__(self, path: str):
        self.spec = json.loads(Path(path).read_text())
        self.rank = dist.get_rank()
        self.results = Path(self.spec["results"])

    def emit(self, record: dict) -> None:
        record["t"] = time.time()
        if self.rank == 0:
            with self.results.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def agree(self, ok: bool, error: str | None) -> str | None:
        """Every rank's verdict: None if all succeeded, else the first failing rank's reason."""
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if ok else error)
        return next((e for e in errors if e is not None), None)


def run_model(job: Job, mesh, model_name: str, cases: list[dict]) -> None:
    spec = job.spec
    steps, warmup = int(spec["steps"]), int(spec["warmup"])
    work = build(model_name, "cpu")
    inputs = (*work.inputs, work.target)
    dummy = torch.zeros(work.target.shape[0])  # the runtime's own loss program gets the loss itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(WithLoss(work.model, work.loss_fn), inputs)
    graph = build_strategy_graph(captured, tuple(mesh.shape))
    running = []
    for case in cases:
        job.emit({"event": "begin", "model": model_name, "layout": case["layout"], "phase": "compile"})
        error, pm, first_loss = None, None, None
        try:
            plan = Plan.load(case["plan"])
            model = WithLoss(build(model_name, "cpu").model, work.loss_fn)  # fresh: the same start for all
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                started = time.perf_counter()
                pm = compile_plan(model, captured, graph, plan, mesh, inputs)
                compile_s = time.perf_counter() - started
                first_loss = float(pm.train_step(inputs, dummy))
        except Exception as exc:  # a failing layout is a row of the table, not the end of the run
            error = one_line(exc)
            if os.environ.get("AUTOPAR_BENCH_TRACEBACK"):
                traceback.print_exc()
        reason = job.agree(error is None, error)
        if reason is not None:
            job.emit({"event": "result", "model": model_name, "layout": case["layout"], "status": "failed",
                      "error": reason})
            continue
        memory = measure_memory(pm, inputs, dummy)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, memory)
        most = max(every, key=lambda m: sum(m.values())) if memory is not None else None
        running.append((case, pm, {"memory": most, "first_loss": first_loss, "compile_seconds": compile_s,
                                   "reshards": reshards(pm)}))
    job.emit({"event": "begin", "model": model_name, "layout": "*", "phase": "timing"})
    times: dict[str, list[float]] = {case["layout"]: [] for case, _, _ in running}
    for step in range(warmup + steps):
        for case, pm, _ in running:
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(inputs, dummy)
            dist.barrier()
            if step >= warmup:
                times[case["layout"]].append(time.perf_counter() - t0)
    for case, pm, info in running:
        measured = times[case["layout"]]
        job.emit({"event": "result", "model": model_name, "layout": case["layout"], "status": "ok",
                  "step_time": statistics.median(measured), "step_times": measured, **info})


def profile_only(job: Job) -> None:

    spec = job.spec
    sweep = Sweep.quick() if spec.get("quick_sweep") else None
    profile, path, measured = profile_mesh(tuple(spec["shape"]), tuple(spec["names"]), cache_dir=spec.get("cache_dir"),
                                           sweep=sweep, progress=bool(spec.get("progress")))
    if job.rank == 0:
        profile.save(spec["profile_out"])
        job.emit({"event": "profile", "path": str(path), "measured": measured})


def main(job_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("AUTOPAR_BENCH_TIMEOUT", 300))))
    job = Job(job_path)
    if "profile_out" in job.spec:
        profile_only(job)
    else:
        mesh = init_device_mesh("cpu", tuple(job.spec["shape"]), mesh_dim_names=tuple(job.spec["names"]))
        by_model: dict[str, list[dict]] = {}
        for case in job.spec["cases"]:
            by_model.setdefault(case["model"], []).append(case)
        for model_name, cases in by_model.items():
            run_model(job, mesh, model_name, cases)
            job.emit({"event": "done", "model": model_name})
    dist.barrier()  # with 8 ranks, a rank can die with SIGABRT at exit without it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
