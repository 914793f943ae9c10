"""Auto versus manual layouts, predicted and measured, in one command (``autopar bench``).

    from autopar import bench
    table = bench.run()                          # every model, every mesh (17-22 minutes here, shared)
    table = bench.run(["gpt2"], ["gloo-4"])      # a subset
    table = bench.run(quick=True)                # a tiny subset, well under a minute

``quick``: wide-mlp on gloo-4 and h100-8, layouts dp, fsdp and tp, 3 timed steps, the
planner's time limit capped at 4 s, and (if no profile of this machine is cached) a
quick profile sweep, cached apart from full profiles.

For every model of ``MODELS`` and mesh of ``MESHES``, the automatic plan and every
manual layout (``autopar.layouts.LAYOUTS``; on H100 meshes also the best pipelined
version of each, from the planner's pipeline search) are planned with the same cost
model; the predicted step time, memory per device and planning time are recorded.

- ``gloo-4`` / ``gloo-8``: 2x2 and 2x4 meshes of gloo ranks on this machine, small
  float32 models. Predictions use this machine's measured hardware profile (cached by
  ``costmodels.profiler.profile_mesh``; measured once in a torchrun launch if missing).
  Every plan is then compiled and trained under ONE torchrun launch per mesh
  (``autopar.bench.worker``): median step time and peak memory per rank, measured.
- ``h100-8`` / ``h100-64`` / ``h100-512``: 2x4, 8x8 and 64x8 meshes of the H100 preset,
  bf16 models sized for those machines, built on the meta device: predicted only. With
  ``dry_run``, every auto plan there is also dry-run at its full world size
  (``autopar.dry_run``): its verdict, the worst rank's peak memory, predicted ÷ that peak,
  and the seconds it took; a failure is its row's ``autopar:`` message, not the end of the run.

On gloo each model is planned together with its loss (``autopar.plan(..., loss_fn=, target=)``),
and the same module (model and loss) is what trains, so the prediction covers the step
that is measured. On H100 meshes, where pipelines are searched too, each model is planned
alone (``autopar.plan(...)``; the planner prices the loss that the runtime adds), so that
every plan is one ``autopar.compile`` and ``autopar.dry_run`` can run. A layout that does
not apply, does not fit, or fails to compile or run is a row with its one-line reason. Writes ``table.md``, ``results.json``
and PNG charts (``autopar.bench.report``) to ``out_dir``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from autopar import costmodels
from autopar.costmodels.cache import cache_path, check_profile, machine_fingerprint
from autopar.costmodels.units import gib_text
from autopar import layouts
from autopar.bench import report as bench_report
from autopar.bench.workloads import MODELS, Workload, build
from autopar.dryrun import dry_run as dry_run_plan
from autopar.runtime.loss import WithLoss
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner.intra_op import PlanningError, plan_layout
from autopar.passes.planner.request import PlanRequest
from autopar.passes.planner.search import plan_captured
from autopar.passes.strategy_graph import NoRuleWarning, build_strategy_graph

__all__ = ["MODELS", "MESHES", "run"]

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    hardware: str  # "gloo": this machine, measured; else a preset name, predicted only
    scale: Any  # the model size (``autopar.bench.workloads``)

    @property
    def devices(self) -> int:
        return math.prod(self.shape)


MESH_SPECS: dict[str, MeshSpec] = {
    "gloo-4": MeshSpec((2, 2), ("dp", "tp"), "gloo", "cpu"),
    "gloo-8": MeshSpec((2, 4), ("dp", "tp"), "gloo", "cpu"),
    "h100-8": MeshSpec((2, 4), ("dp", "tp"), "h100", 8),
    "h100-64": MeshSpec((8, 8), ("dp", "tp"), "h100", 64),
    "h100-512": MeshSpec((64, 8), ("dp", "tp"), "h100", 512),
}
MESHES: list[str] = list(MESH_SPECS)

# The quick run: one small model on the smallest gloo mesh and the smallest H100 mesh.
QUICK_MODELS, QUICK_MESHES = ["wide-mlp"], ["gloo-4", "h100-8"]
QUICK_LAYOUTS = ("dp", "fsdp", "tp")
QUICK_TIME_LIMIT_S = 4.0


@dataclass(frozen=True)
class Settings:
    out_dir: Path
    quick: bool
    time_limit_s: float
    say: Callable[[str], None]
    dry_run: bool = False  # dry-run every auto plan on a preset (H100) mesh

    @property
    def steps(self) -> int:
        return 3 if self.quick else 6

    @property
    def warmup(self) -> int:
        return 0  # the first step (compile) and the memory step warm up

    @property
    def layouts(self) -> tuple[str, ...]:
        return QUICK_LAYOUTS if self.quick else layouts.LAYOUTS


def run(models: list[str] | None = None, meshes: list[str] | None = None, out_dir: str = "results/bench",
        quick: bool = False, progress: bool = True, time_limit_s: float = 20.0, dry_run: bool = False) -> Path:
    """Runs the benchmark, writes out_dir/table.md, out_dir/results.json and PNG charts; returns out_dir/table.md's path.
    ``dry_run``: also dry-run every auto plan of a preset (H100) mesh (``autopar.dry_run``)."""
    models = list(models) if models else (QUICK_MODELS if quick else list(MODELS))
    meshes = list(meshes) if meshes else (QUICK_MESHES if quick else list(MESHES))
    _check_names("model", models, list(MODELS))
    _check_names("mesh", meshes, MESHES)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print(f"autopar bench: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    settings = Settings(out, quick, min(time_limit_s, QUICK_TIME_LIMIT_S) if quick else time_limit_s, say, dry_run)
    started = time.perf_counter()
    load = bench_report.load_average()
    rows: list[dict] = []
    for mesh in meshes:
        rows += bench_mesh(mesh, models, settings)
    meta = {"models": models, "meshes": meshes, "quick": quick, "time_limit_s": settings.time_limit_s,
            "dry_run": dry_run,
            "seconds": time.perf_counter() - started, "load": load, "steps": settings.steps, "warmup": settings.warmup,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mesh_shapes": {m: MESH_SPECS[m].shape for m in meshes}}
    return bench_report.write(rows, meta, out)


def _check_names(what: str, given: list[str], valid: list[str]) -> None:
    bad = [n for n in given if n not in valid]
    if bad:
        raise ValueError(f"autopar: unknown benchmark {what} {', '.join(map(repr, bad))}; expected some of "
                         f"{', '.join(valid)}")


# --- one mesh -----------------------------------------------------------------------
def bench_mesh(mesh: str, models: list[str], settings: Settings) -> list[dict]:
    spec = MESH_SPECS[mesh]
    hardware: Any = spec.hardware
    if spec.hardware == "gloo":
        hardware = gloo_profile(mesh, settings)
    rows, cases, first_of = [], [], {}
    for model in models:
        settings.say(f"planning {model} on {mesh} {spec.shape}")
        planned = plan_model(model, spec, hardware, settings)
        for row, plan in planned:
            row["mesh"] = mesh
            rows.append(row)
            if plan is None or (spec.hardware != "gloo" and row["layout"] != "auto"):
                continue  # saved: every plan that runs, and the auto plans
            path = settings.out_dir / "plans" / mesh / f"{model}-{row['layout'].replace('+', '_')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
            row["plan"] = str(path)
            if spec.hardware != "gloo":
                continue
            same = first_of.setdefault((model, runs_as(plan)), row["layout"])
            if same != row["layout"]:  # the runtime would run the very same program: measure it once
                row["same_as"] = same
                continue
            cases.append({"model": model, "layout": row["layout"], "plan": str(path)})
    if cases:
        measured = measure(mesh, cases, settings)
        for row in rows:
            row.update(measured.get((row["model"], row.get("same_as", row["layout"])), {}))
            if "same_as" in row:
                row["what"] = "; ".join(filter(None, [row.get("what"), f"runs as {row['same_as']}: measured once"]))
    return rows


def runs_as(plan) -> str:
    """What the runtime runs: strategies, storage, ZeRO levels, pipeline and recomputation.
    Two plans with the same key are the same program."""
    zero = plan.zero
    pipeline = None if plan.pipeline is None else vars(plan.pipeline)
    return json.dumps([plan.strategies, plan.params, zero, pipeline, plan.recompute], sort_keys=True)


def plan_model(model: str, spec: MeshSpec, hardware, settings: Settings) -> list[tuple[dict, Any]]:
    """(row, Plan or None) for the auto plan and every manual layout of ``model`` on ``spec``."""
    work = build(model, spec.scale, meta=spec.hardware != "gloo")
    # On gloo every plan compiles from the model-and-loss capture that trains there, and a
    # pipeline plan cannot (its stages are captured from the model alone, per micro-batch,
    # and the runtime lays the loss out on the last stage): the gloo auto plan is intra-op.
    # Presets search pipelines too, so there every row is planned from the model alone
    # (the loss the runtime adds priced by the planner), as autopar.plan without loss_fn:
    # a plan that autopar.compile and autopar.dry_run can run.
    with_loss = spec.hardware == "gloo"
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)
        captured = (capture(WithLoss(work.model, work.loss_fn), (*work.inputs, work.target)) if with_loss
                    else capture(work.model, work.inputs))
    capture_s = time.perf_counter() - started
    request = PlanRequest(mesh_shape=spec.shape, hardware=hardware, time_limit_s=settings.time_limit_s,
                          layouts=layouts.LAYOUTS, hint_fn=layouts.hints, axis_names=spec.names,
                          pipeline=not with_loss)
    limit = request.memory_bytes

    def row_of(name: str, plan, seconds: float, error: str | None = None) -> tuple[dict, Any]:
        row = {"model": model, "layout": name, "label": work.label, "plan_seconds": seconds}
        if plan is None:
            row.update(status="n/a", error=error)
        else:
            row.update(plan_row(plan, limit))
        return row, plan

    started = time.perf_counter()
    try:
        auto = plan_captured(captured, request)
        out = [row_of("auto", auto, capture_s + time.perf_counter() - started)]
    except ValueError as exc:  # PlanningError: nothing fits
        auto, out = None, [row_of("auto", None, capture_s + time.perf_counter() - started, _first_line(exc))]
    for name, (plan, seconds, error) in layout_plans(captured, request.profile, settings.layouts, spec.names).items():
        out.append(row_of(name, plan, seconds, error))
    for _, plan in out:
        if plan is not None:
            plan.includes_loss = with_loss  # as autopar.plan(..., loss_fn=) or autopar.plan(...) would record
    if auto is not None:
        out[0][0]["what"] = describe(auto, {r["layout"]: p for r, p in out[1:] if p is not None})
        out[0][0]["search"] = list(auto.notes)  # what the planner tried: "pp2x4: 52.7 ms (...)", ...
        if spec.hardware != "gloo":  # predicted only: on gloo every row is also measured
            out += [(row, None) for row in pipeline_rows(auto, model, work.label)]
            if settings.dry_run:
                settings.say(f"dry-running the auto plan of {model} on {spec.shape}")
                dry = out[0][0]["dry_run"] = dry_run_row(auto, work, limit)
                settings.say(f"dry run of {model} on {spec.shape} ({dry['plan']}): {dry['status']}"
                             + (f", peak {gib_text(dry['peak'])}{' (over the device)' * dry['over_memory']}, "
                                f"predicted ÷ peak {dry['ratio']:.2f}"
                                if dry["status"] == "ok" else f": {dry['error']}") + f", {dry['seconds']:.0f} s")
    return out


def dry_run_row(plan, work: Workload, memory_limit: float) -> dict:
    """``autopar.dry_run`` of ``plan``, training with ``work``'s loss and target: ok or failed with
    the first failing rank's ``autopar:`` message (and its traceback), the worst rank's peak bytes,
    predicted ÷ that peak, whether that peak is over ``memory_limit`` (the device's bytes: the plan
    would not fit), seconds. A dry run that raises is a failed row, not the end of the run."""
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = dry_run_plan(plan, work.model, work.inputs, loss_fn=work.loss_fn, target=work.target)
    except Exception as exc:  # noqa: BLE001  (the finding is the row's, the other plans still run)
        text = _first_line(exc)
        return {"status": "failed", "error": text if text.startswith("autopar:") else f"{type(exc).__name__}: {text}",
                "seconds": time.perf_counter() - started, "plan": plan_line(plan)}
    row = {"status": "ok" if result.ok else "failed", "peak": result.peak, "seconds": result.seconds,
           "ratio": result.ratio if result.peak else None, "ranks": len(result.ranks), "plan": plan_line(plan),
           "over_memory": result.peak > memory_limit, "memory_limit": memory_limit}
    if result.micro_batches:  # a pipeline's micro-batches replayed, of the plan's (the fewest with the same peak)
        row["micro_batches"] = list(result.micro_batches)
    if result.rank_ratios:  # each distinct rank's own prediction / its peak (a pipeline's differ by rank)
        row["rank_ratios"] = [min(result.rank_ratios), max(result.rank_ratios)]
    if not result.ok:
        first = result.failures[0]
        row["error"] = f"{first.where()}: {first.error}"
        row["traceback"] = first.traceback
    return row


def layout_plans(captured, profile: costmodels.HardwareProfile, names: Sequence[str],
                 axis_names: Sequence[str]) -> dict[str, tuple[Any, float, str | None]]:
    """Layout -> (Plan or None, seconds, why not). Each is what ``autopar.plan(..., layout=name)``
    returns (``autopar.passes.planner.intra_op.plan_layout``: the hint completed on the cost
    tables, then costed), with the strategy graph and cost tables built once for all layouts;
    the seconds are the time that one layout alone would take after capture (the shared build
    included)."""
    started = time.perf_counter()
    graph = build_strategy_graph(captured, tuple(profile.mesh_shape))
    costs = build_costs(graph, profile, memory_limit=float(profile.device.memory_bytes))
    hints = {h.name: h for h in layouts.hints(graph, names)}
    shared = time.perf_counter() - started  # counted in every layout's time, as if planned alone
    out = {}
    for name in names:
        started = time.perf_counter() - shared
        if name not in hints:
            out[name] = (None, time.perf_counter() - started, NOT_APPLICABLE)
            continue
        try:  # recomputing what must be
            plan, _ = plan_layout(costs, hints, name, costs.problem.memory_limit, axis_names)
        except PlanningError:  # the hint is there: its placements contradict the model's structure
            out[name] = (None, time.perf_counter() - started, CONTRADICTS)
            continue
        out[name] = (plan, time.perf_counter() - started, None)
    return out


NOT_APPLICABLE = "does not apply on this mesh (the same placements as another layout here)"
CONTRADICTS = ("its placements contradict this model's structure (they break tied layers or followers: "
               "repeated layers placed unalike)")


def plan_row(plan, limit: float) -> dict:
    memory = dict(plan.predicted.memory)
    total = sum(memory.values())
    fits = total <= limit * (1 + 1e-9)
    return {"status": "planned" if fits else "does not fit", "predicted_step": plan.predicted.step_time,
            "predicted_memory": memory, "predicted_memory_total": total, "fits": fits,
            "prediction": {"compute": plan.predicted.compute, "communication": plan.predicted.communication,
                           "bubble": plan.predicted.bubble},
            **({} if fits else {"error": f"predicted {gib_text(total)} per device > {gib_text(limit)}"})}


def pipeline_rows(auto, model: str, label: str) -> list[dict]:
    """The planner's pipelined manual layouts (``"pp+dp[pp4x2x8]"``): the fastest mesh split of each."""
    best: dict[str, tuple[str, float]] = {}
    for key, t in auto.candidates.items():
        if "[" not in key:
            continue
        name, where = key[:-1].split("[", 1)
        if name not in best or t < best[name][1]:
            best[name] = (where, t)
    return [{"model": model, "layout": name, "label": label, "status": "planned", "fits": True,
             "predicted_step": t, "what": f"mesh {where}; memory not reported by the pipeline search"}
            for name, (where, t) in sorted(best.items())]


def plan_line(plan) -> str:
    """The plan in one line: mesh, pipeline (stages, schedule, micro-batches), ZeRO levels, recomputed layers."""
    parts = [f"mesh {'x'.join(map(str, plan.mesh_shape))}"]
    if plan.pipeline is not None:
        p = plan.pipeline
        parts.append(f"PP{p.stages} {p.schedule}{f' v{p.chunks_per_rank}' if p.chunks_per_rank > 1 else ''} "
                     f"M={p.micro_batches}")
    parts.append(f"ZeRO {'/'.join(map(str, sorted(set(plan.zero.values()))))}")
    if plan.recompute:
        parts.append(f"recompute {len(plan.recompute)}")
    return ", ".join(parts)


def describe(plan, manual: dict[str, Any]) -> str:
    """The auto plan in a few words: its pipeline, and which manual layout it equals, if any."""
    parts = []
    if plan.pipeline is not None:
        p = plan.pipeline
        parts.append(f"pipeline {p.stages} stages x mesh {tuple(plan.mesh_shape[1:])}, {p.micro_batches} "
                     f"micro-batches, {p.schedule}")
    same = [name for name, other in manual.items()
            if other.strategies == plan.strategies and other.zero == plan.zero and plan.pipeline is None]
    if same:
        parts.append("same placements as " + " = ".join(same))
    elif plan.pipeline is None:
        levels = sorted({z for z in plan.zero.values()})
        parts.append(f"per-op layout, ZeRO levels {levels}")
    if plan.recompute:
        parts.append("recomputes every layer")
    return "; ".join(parts)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


# --- gloo: the profile and the measurement launch -----------------------------------------
def gloo_profile(mesh: str, settings: Settings) -> costmodels.HardwareProfile:
    """This machine's profile for the mesh: the cached one, else measured in one launch
    (the default sweep, cached for later runs; ``quick``, when none is cached: a small sweep,
    cached apart so that a full run never takes it)."""
    spec = MESH_SPECS[mesh]
    work = settings.out_dir / "work" / mesh
    work.mkdir(parents=True, exist_ok=True)
    target = work / "profile.json"
    job = {"shape": spec.shape, "names": spec.names, "profile_out": str(target), "results": str(work / "profile.jsonl"),
           "progress": False}
    quick_cache = costmodels.default_cache_dir() / "quick-sweep"  # apart: never taken for a full profile
    cached = _cached_profile(spec) or (_cached_profile(spec, quick_cache) if settings.quick else None)
    if cached is not None:
        return cached
    if settings.quick:
        job.update(quick_sweep=True, cache_dir=str(quick_cache))
    settings.say(f"measuring this machine's profile for {mesh} {spec.shape} "
                 f"({'quick sweep' if settings.quick else 'default sweep, about a minute or two; cached'})")
    ok, tail = launch(spec.devices, job, work / "profile-job.json", timeout=900)
    if not ok:
        raise RuntimeError(f"autopar: measuring the {mesh} profile failed: {tail}")
    return costmodels.HardwareProfile.load(target)


def _cached_profile(spec: MeshSpec, cache_dir: Path | None = None) -> costmodels.HardwareProfile | None:
    """The cached profile for ``spec`` (default cache unless ``cache_dir``) when one matches this
    machine (as ``profile_mesh`` names it under torchrun: ``cpu (N ranks per host)``)."""

    machine = machine_fingerprint(f"cpu ({spec.devices} ranks per host)")
    path = cache_path(machine, "gloo", spec.shape, spec.names, cache_dir)
    if not path.is_file():
        return None
    try:
        profile = costmodels.HardwareProfile.load(path)
        check_profile(profile, machine=machine, backend="gloo", mesh_shape=spec.shape, axis_names=spec.names)
    except (ValueError, OSError):
        return None
    return profile


def measure(mesh: str, cases: list[dict], settings: Settings) -> dict[tuple[str, str], dict]:
    """Measured results by (model, layout). A launch that dies blames the case it was running
    (recorded as failed with the launch's last words) and the rest run in a new launch."""
    spec = MESH_SPECS[mesh]
    work = settings.out_dir / "work" / mesh
    work.mkdir(parents=True, exist_ok=True)
    results = work / "measure.jsonl"
    results.unlink(missing_ok=True)
    (work / "events.jsonl").unlink(missing_ok=True)
    done: dict[tuple[str, str], dict] = {}
    todo = list(cases)
    for attempt in range(4):
        if not todo:
            break
        settings.say(f"measuring {len(todo)} plans on {mesh}: {spec.devices} gloo ranks"
                     + (f" (launch {attempt + 1})" if attempt else ""))
        job = {"shape": spec.shape, "names": spec.names, "cases": todo, "results": str(results),
               "steps": settings.steps, "warmup": settings.warmup}
        ok, tail = launch(spec.devices, job, work / "measure-job.json", timeout=3600)
        text = results.read_text() if results.exists() else ""
        with (work / "events.jsonl").open("a") as log:  # every launch's events, kept for reading later
            log.write(text)
        results.unlink(missing_ok=True)
        events = [json.loads(line) for line in text.splitlines()]
        begun = None
        for e in events:
            if e["event"] == "begin":
                begun = e
            elif e["event"] == "result":
                done[(e["model"], e["layout"])] = _measured(e)
        if ok:
            break
        if begun is None:
            raise RuntimeError(f"autopar: the {mesh} measurement launch failed before its first case: {tail}")
        blamed = [(c["model"], c["layout"]) for c in todo if c["model"] == begun["model"]
                  and (begun["layout"] in ("*", c["layout"])) and (c["model"], c["layout"]) not in done]
        for key in blamed:
            done[key] = {"status": "failed", "error": f"launch died in {begun['phase']}: {tail}"}
        todo = [c for c in todo if (c["model"], c["layout"]) not in done]
    return done


def _measured(event: dict) -> dict:
    if event["status"] != "ok":
        return {"status": "failed", "error": event["error"]}
    memory = event["memory"]
    return {"status": "measured", "measured_step": event["step_time"], "measured_steps": event["step_times"],
            "measured_memory": memory, "measured_memory_total": sum(memory.values()) if memory else None,
            "first_loss": event["first_loss"], "compile_seconds": event["compile_seconds"],
            "reshards": event["reshards"]}


def launch(nproc: int, job: dict, job_path: Path, timeout: float) -> tuple[bool, str]:
    """Run ``autopar.bench.worker`` on ``nproc`` gloo ranks; (succeeded, last line of its output)."""
    job_path.write_text(json.dumps(job, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    log = job_path.with_suffix(".log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "autopar.bench.worker", str(job_path)]
    with log.open("w") as f:
        try:
            rc = subprocess.call(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s (log: {log})"
    if rc == 0:
        return True, ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return False, ((errors or lines or ["no output"])[-1])[:300] + f" (exit {rc}; log: {log})"
