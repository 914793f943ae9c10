"""Full-scale dry run: a plan's training step at its real world size, on one machine, no devices.

``dry_run(plan, model, example_inputs)`` builds the program of every distinct rank of the
plan's mesh (64, 512, ... ranks) on torch's ``"fake"`` process group, under
``FakeTensorMode``: no memory is allocated and no device is needed. Each rank runs
a training step through its own ``ParallelModule`` or ``PipelineModule`` -- forward, loss,
backward, the gradients' collectives, the optimizer step -- so every shape and every
collective of its program is checked (a shard that does not fit, a collective whose sizes
disagree, a stage that sends what the next one does not expect raise here), and its peak
memory is measured by torch's own tracker (``torch.distributed._tools.mem_tracker.
MemTracker``), as torchtitan's memory estimation does, in a step that holds the optimizer
state from the start (as every step after the first).

Distinct ranks: shards are even by construction (``autopar.passes.placements.fits``), so every
coordinate of an intra-op axis runs the same program on the same shapes; programs differ
by pipeline coordinate. One rank per pipeline coordinate is run, the intra-op axes at 0 but
for the last coordinate, where the world's last rank runs (the far end of every axis: shard
offsets); without a pipeline, the first rank and the last.

Pipelines: torch's schedules exchange activations by send/recv between stages, which one
process holding one rank at a time cannot run. The schedule's own action list for this
rank (``schedule.pipeline_order``) is replayed instead: each forward runs the stage's
program on fake received activations of the shapes the stage expects, each backward starts
from fake gradients of its outputs (the last stage: from the loss), with the micro-batches
in flight exactly as the schedule keeps them. The shapes one stage sends are checked
against those the next stage expects, across ranks.

Speed: the model is captured and its strategy graph built once, then the distinct ranks
run in worker processes forked from that state (one per core), each rank's step on its own
fake process group. The tracker keeps the whole rank's peak only: MemTracker's per-module
peaks, updated after every op over every module it has seen, made the step's cost grow
with the square of the model's depth.

A plan that fails its dry run is a planner bug: the result names the rank and the error.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining.schedules import _ComputationType
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

from autopar.runtime.pipeline import PipelineModule
from autopar.runtime.loss import WithLoss
from autopar.runtime.module import ParallelModule
from autopar.passes.capture import Captured, capture
from autopar.passes.loss_memory import cross_entropy, default_loss
from autopar.passes.placements import local_shape, local_slice
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporary")
# MemTracker's reference types -> the plan's kinds. Buffers and constants are held state,
# as the plan counts them; "temporary" is what the plan does not predict: gradients of
# activations in backward, gradient buckets being summed, the optimizer's scratch.
_KIND_OF = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters", _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporary",
    _MemRefType.OTH: "temporary",
}
CPU = torch.device("cpu")  # the fake tensors' device (the ranks' real device does not matter to shapes)


@dataclass
class RankResult:
    """One rank's dry run: its mesh coordinate, the pipeline stages it runs, pass/fail with
    the error, and its peak memory in bytes, by kind as at the peak."""

    rank: int
    coordinate: tuple[int, ...]
    stages: tuple[int, ...] = ()
    ok: bool = False
    error: str | None = None
    peak: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    traceback: str = field(default="", repr=False)  # of the failure, for a planner bug report

    def where(self) -> str:
        plural = "s" if len(self.stages) > 1 else ""
        stages = f", stage{plural} {', '.join(map(str, self.stages))}" if self.stages else ""
        return f"rank {self.rank} (coordinate {self.coordinate}{stages})"


@dataclass
class DryRunResult:
    """Every distinct rank's result, and the plan's predicted memory per device to compare."""

    plan_kind: str
    mesh_shape: tuple[int, ...]
    ranks: list[RankResult]
    predicted: dict[str, float]
    seconds: float = 0.0

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def failures(self) -> list[RankResult]:
        return [r for r in self.ranks if not r.ok]

    @property
    def peak(self) -> int:
        """The largest peak over the ranks run (bytes)."""
        return max((r.peak for r in self.ranks if r.ok), default=0)

    @property
    def predicted_total(self) -> float:
        return float(sum(self.predicted.values()))

    @property
    def ratio(self) -> float:
        """Predicted memory per device / the dry run's largest peak (1.0: exact; nan: nothing measured)."""
        return self.predicted_total / self.peak if self.peak else math.nan

    def raise_if_failed(self) -> None:
        if self.ok:
            return
        first = self.failures[0]
        others = f" (and {len(self.failures) - 1} more rank(s))" if len(self.failures) > 1 else ""
        raise DryRunError(
            f"autopar: the {self.plan_kind} plan for mesh {self.mesh_shape} fails its dry run on "
            f"{first.where()}{others}: {first.error.removeprefix('autopar: ')}. The plan was expected to "
            "build and train on every rank; a plan that fails its dry run is a planner bug: report it with the "
            "plan's JSON"
        )

    def table(self) -> str:
        """One line per rank: peak and its kinds, then the prediction beside the largest peak."""
        lines = [f"dry run of the {self.plan_kind} plan on mesh {self.mesh_shape} ({self.world_size} ranks, "
                 f"{len(self.ranks)} distinct run) in {self.seconds:.1f} s"]
        for r in self.ranks:
            if r.ok:
                kinds = ", ".join(f"{k} {_gib(r.memory.get(k, 0))}" for k in KINDS)
                lines.append(f"  {r.where()}: ok, peak {_gib(r.peak)} ({kinds}), {r.seconds:.1f} s")
            else:
                lines.append(f"  {r.where()}: FAILED: {r.error}")
        if self.peak:
            lines.append(f"predicted {_gib(self.predicted_total)} per device; dry-run peak {_gib(self.peak)}; "
                         f"predicted / dry run = {self.ratio:.2f}")
        return "\n".join(lines)


class DryRunError(ValueError):
    """A plan failed its dry run (``DryRunResult.raise_if_failed``)."""


def dry_run(
    plan: Plan,
    model: nn.Module,
    example_inputs: tuple,
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    ranks: Sequence[int] | None = None,
    raise_on_failure: bool = False,
    workers: int | None = None,
) -> DryRunResult:
    """Run a training step of ``plan`` on every distinct rank of its mesh, on this machine
    (``workers``), on fake tensors and torch's fake process group; see the module docstring.

    ``model`` may live on the meta device (nothing is allocated). ``loss_fn(outputs, target)``
    defaults to cross-entropy against the input ids for a language model (outputs of shape
    ``ids.shape + (vocab,)``), else to the mean square of the first output; a plan made with
    the loss (``autopar.plan(..., loss_fn=, target=)``) needs the same ``loss_fn`` and
    ``target`` here. ``optimizer`` defaults to AdamW. ``ranks``: which global ranks to run
    (default: the distinct ones). ``raise_on_failure``: raise an ``autopar:`` error naming the
    first failing rank instead of returning it in the result. ``workers``: processes the ranks
    run in, forked after the one capture they share (default: one per core, at most one per
    rank; 1 runs them here, one after another).

    Needs no process group of its own: it starts torch's fake one per rank and destroys it
    after; one already initialised here is an error (run the dry run outside torchrun).
    """
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"autopar: dry_run starts torch's fake process group itself, found one already initialised "
            f"(backend {dist.get_backend()}); run the dry run in a process without a process group "
            "(not under torchrun), or destroy it first"
        )
    started = time.perf_counter()
    shape = tuple(plan.mesh_shape)
    chosen = list(ranks) if ranks is not None else distinct_ranks(plan)
    results = [RankResult(r, _coordinate(r, shape)) for r in chosen]
    processes = _workers(workers, len(results))
    try:
        work = _prepare(plan, model, example_inputs, loss_fn, target)
    except ValueError as e:  # the plan does not fit the model at all: every rank would fail to build
        for r in results:
            r.error = _one_line(e)
        work = None
    if work is not None:
        _run_ranks(work, results, optimizer or _adamw, processes)
        if plan.pipeline is not None:
            _check_stage_boundaries(work, results)
    result = DryRunResult(plan.kind, shape, results, dict(plan.predicted.memory), time.perf_counter() - started)
    if raise_on_failure:
        result.raise_if_failed()
    return result


def distinct_ranks(plan: Plan) -> list[int]:
    """The ranks whose programs differ: one per pipeline coordinate, its intra-op axes at 0,
    except the last, which is the world's last rank (the far end of every axis); without a
    pipeline, the first rank and the last (see the module docstring)."""
    shape = tuple(plan.mesh_shape)
    last = math.prod(shape) - 1
    if plan.pipeline is None:
        return sorted({0, last})
    axis = plan.pipeline.axis
    firsts = [_rank(tuple(k if a == axis else 0 for a in range(len(shape))), shape) for k in range(shape[axis] - 1)]
    return firsts + [last]


# --- preparation: one capture for every rank --------------------------------------------

@dataclass
class _Work:
    """What every rank's build shares: the capture and strategy graph (at micro-batch size
    for a pipeline), and the whole inputs and target's shapes and dtypes."""

    plan: Plan
    model: nn.Module  # the model as captured (with its loss, for a plan made with it)
    captured: Captured
    graph: StrategyGraph
    loss_fn: Callable
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    target: tuple[tuple[int, ...], torch.dtype]
    stage_io: dict[int, dict[str, list]] = field(default_factory=dict)  # stage -> "sends"/"expects" shapes


def _prepare(plan: Plan, model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
             target: torch.Tensor | None) -> _Work:
    inputs = tuple(example_inputs)
    if plan.model == "WithLoss":  # the plan covers the model and its loss: the loss is the output
        if loss_fn is None or target is None:
            raise ValueError("autopar: this plan was made with the loss (autopar.plan(..., loss_fn=, target=)); "
                             "expected the same loss_fn and target for its dry run, found none")
        if plan.pipeline is not None:
            raise ValueError("autopar: this pipeline plan was made for the model and its loss together; "
                             "pipelines train the model alone (plan without loss_fn)")
        model, inputs, loss_fn = WithLoss(model, loss_fn), (*inputs, target), _loss_is_output
        target = torch.zeros((), device="meta")
    capture_inputs = inputs
    if plan.pipeline is not None:
        capture_inputs = _micro_batch(inputs, plan.pipeline.micro_batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = _on_cpu(capture(model, capture_inputs))
    if plan.pipeline is not None:
        _check_stage_order(captured, plan.pipeline.stage_of)
    flat = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    if loss_fn is None:
        loss_fn, target = _default_loss(captured, flat, plan.pipeline.micro_batches if plan.pipeline else 1)
    if target is None:
        raise ValueError("autopar: dry_run(loss_fn=...) expected a target= tensor for the loss; found none")
    mesh = tuple(plan.mesh_shape)
    intra = tuple(s for i, s in enumerate(mesh) if plan.pipeline is None or i != plan.pipeline.axis)
    graph = build_strategy_graph(captured, intra)
    choice_from_plan(graph, plan)  # the plan fits the graph, checked once (and every strategy's name made once)
    return _Work(plan, model, captured, graph, loss_fn, [(tuple(x.shape), x.dtype) for x in flat],
                 (tuple(target.shape), target.dtype))


def _check_stage_order(captured: Captured, stage_of: dict[str, int]) -> None:
    """Every value is made in the stage that uses it or an earlier one (a stage cannot
    receive what a later stage makes)."""
    for node in captured.nodes("call_function"):
        for src in node.all_input_nodes:
            if stage_of.get(src.name, -1) > stage_of.get(node.name, math.inf):
                raise ValueError(
                    f"autopar: the plan's pipeline runs {node.name} in stage {stage_of[node.name]} and its input "
                    f"{src.name} in the later stage {stage_of[src.name]}; expected every value made no later than "
                    "where it is used. Re-plan (a planner bug: report it with the plan's JSON)"
                )


def _micro_batch(inputs: tuple, micro_batches: int) -> tuple:
    """The first of ``micro_batches`` equal micro-batches of every input (the pipeline's capture)."""
    flat, spec = pytree.tree_flatten(inputs)
    for x in flat:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % micro_batches):
            raise ValueError(
                f"autopar: the plan's {micro_batches} micro-batches expect a batch that divides into them; "
                f"found an input of shape {tuple(x.shape)}; re-plan, or give a batch that divides"
            )
    return pytree.tree_unflatten([x.chunk(micro_batches)[0] if isinstance(x, torch.Tensor) else x for x in flat],
                                 spec)


def _on_cpu(captured: Captured) -> Captured:
    """The capture with tensors made or moved onto the meta device (a meta model's
    ``arange(device=...)``, ``x.to(device)``) made on the fake tensors' device instead."""
    def cpu(v: Any) -> Any:
        return CPU if isinstance(v, torch.device) and v.type == "meta" else v

    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            node.args = tuple(cpu(v) for v in node.args)
            node.kwargs = {k: cpu(v) for k, v in node.kwargs.items()}
    captured.gm.recompile()
    return captured


def _default_loss(captured: Captured, inputs: list[torch.Tensor], micro_batches: int) -> tuple[Callable, torch.Tensor]:
    """The loss the planner prices for a plan made without one (``autopar.passes.loss_memory.
    default_loss``), with a whole-batch target (``captured`` may be one of ``micro_batches``
    micro-batches)."""
    loss_fn, target = default_loss(captured)
    if loss_fn is cross_entropy:
        return loss_fn, torch.zeros(inputs[0].shape, dtype=torch.long, device="meta")
    whole = (target.shape[0] * micro_batches, *target.shape[1:]) if target.dim() else ()
    return loss_fn, torch.zeros(whole, dtype=target.dtype, device="meta")


def _loss_is_output(loss: torch.Tensor, _unused: torch.Tensor) -> torch.Tensor:
    return loss


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)  # one multi-tensor op per update: fast on fake tensors


# --- the ranks, in forked worker processes ------------------------------------------------
# Each rank's step is independent of the others' (the stage boundaries are compared after),
# and single-threaded Python: forked after the shared capture, the workers use every core
# and inherit the capture, strategy graph, model and optimizer factory without pickling them.

def _workers(asked: int | None, n_ranks: int) -> int:
    if asked is not None and asked < 1:
        raise ValueError(f"autopar: dry_run(workers=...) expected at least 1 process, found {asked}")
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1  # no fork here (Windows): the ranks run in this process
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(asked or cores, n_ranks))


def _run_ranks(work: _Work, results: list[RankResult], optimizer: Callable, workers: int) -> None:
    if workers == 1:
        for r in results:
            _run_rank(work, r, optimizer)
        return
    context = multiprocessing.get_context("fork")
    shares = [results[k::workers] for k in range(workers)]
    running = []
    for share in shares:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_worker, args=(work, share, optimizer, sender), daemon=True)
        process.start()
        sender.close()  # the worker's end: EOF here when it exits
        running.append((share, process, receiver))
    for share, process, receiver in running:
        try:
            done, stage_io = receiver.recv()
        except EOFError:
            done, stage_io = None, {}
        process.join()
        if done is None:
            for r in share:
                r.error = (f"autopar: the dry run's worker process for rank(s) {[r.rank for r in share]} exited "
                           f"with status {process.exitcode} before reporting; expected a result per rank. Run "
                           "with workers=1 to see the failure in this process")
            continue
        for r, d in zip(share, done):
            r.__dict__.update(d.__dict__)
        work.stage_io.update(stage_io)


def _worker(work: _Work, share: list[RankResult], optimizer: Callable, sender: Any) -> None:
    torch.set_num_threads(1)  # fake tensors compute nothing; the other workers have the other cores
    for r in share:
        _run_rank(work, r, optimizer)
    sender.send((share, work.stage_io))
    sender.close()


# --- one rank ---------------------------------------------------------------------------

def _run_rank(work: _Work, result: RankResult, optimizer: Callable) -> None:
    """Build ``result.rank``'s module on the fake process group and step it under the tracker."""
    plan = work.plan
    started = time.perf_counter()
    dist.init_process_group("fake", rank=result.rank, world_size=math.prod(plan.mesh_shape), store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.axis_names))
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = _FakeState(work.captured, work.model)
            captured = dataclasses.replace(work.captured, constant_values=state.constants)
            if plan.pipeline is None:
                module = ParallelModule(state, captured, work.graph, plan, mesh, work.loss_fn, optimizer,
                                        check_inputs=False)
            else:
                module = PipelineModule(state, captured, work.graph, plan, mesh, work.loss_fn, optimizer)
                result.stages = tuple(s.stage_index for s in module.stages)
            inputs = tuple(torch.zeros(s, dtype=d, device=CPU) for s, d in work.inputs)
            target = torch.zeros(work.target[0], dtype=work.target[1], device=CPU)
            _create_optimizer_state(module.optimizer)
            tracker = _tracker_for(module)
            with tracker:
                if plan.pipeline is None:
                    module.train_step(inputs, target)
                else:
                    _pipeline_step(module, inputs, target, work.stage_io)
            peak = tracker.get_tracker_snapshot("peak").get(CPU, {})
        result.peak = int(peak.get(_TOTAL_KEY, 0))
        result.memory = {k: 0 for k in KINDS}
        for ref, kind in _KIND_OF.items():
            result.memory[kind] += int(peak.get(ref, 0))
        result.ok = True
    except Exception as e:  # noqa: BLE001  (any failure is the finding: reported with its rank)
        result.error = _one_line(e)
        result.traceback = traceback.format_exc()
    finally:
        dist.destroy_process_group()
        result.seconds = time.perf_counter() - started


class _FakeState:
    """The model's parameters, buffers and lifted constants as fake tensors of the same shapes,
    dtypes and ``requires_grad`` (read from the model: a meta one allocates nothing), served
    as the runtime reads a model's state (by qualified name)."""

    def __init__(self, captured: Captured, model: nn.Module):
        values = captured.state_values(model)
        self._params = {fqn: nn.Parameter(_fake_like(values[ph]), requires_grad=values[ph].requires_grad)
                        for ph, fqn in captured.params.items()}
        self._buffers = {fqn: _fake_like(values[ph]) for ph, fqn in captured.buffers.items()}
        self.constants = {name: _fake_like(v) for name, v in captured.constant_values.items()}

    def named_parameters(self, remove_duplicate: bool = False):
        return iter(self._params.items())

    def named_buffers(self, remove_duplicate: bool = False):
        return iter(self._buffers.items())


def _fake_like(v: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(v.shape), dtype=v.dtype, device=CPU)


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state made as its first step makes it (a step from zero gradients),
    so that the tracked step holds it from the start, as every step after the first does
    (torchtitan's estimation runs two steps for this; one optimizer step is cheaper)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracker_for(module: nn.Module) -> "_Tracker":
    """A MemTracker that knows the rank's state (parameters as parameters, buffers and
    constants as buffers) and optimizer state, and sees its gradients as gradients."""
    tracker = _Tracker()
    params = list(module.parameters())
    seen = {id(p) for p in params}
    held = nn.Module()
    for i, t in enumerate(_state_tensors(module)):
        if id(t) not in seen:
            seen.add(id(t))
            held.register_buffer(f"b{i}", t)
    tracker.track_external(held, module, module.optimizer)
    tracker.watch_gradients(params)
    return tracker


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    if isinstance(module, ParallelModule):
        return list(module.local.values())
    return [t for named in module.stage_state for t in named.values()] + [
        t for stage in module.stages for t in stage.submod.state]


class _Tracker(MemTracker):
    """MemTracker, with gradients that autograd accumulates into parameters the module does
    not call as submodules (the runtime's programs take them as inputs) counted as gradients,
    as MemTracker's own per-module gradient hook does; and a pipeline stage's program called
    once per micro-batch in one step (MemTracker takes a second forward call of a module for
    the next step: its per-module statistics, which the dry run does not read, keep the first)."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The whole rank's peak only. MemTracker's own also updates the peak of every module
        it has seen, looping over all of them after every op: a cost per op that grows with
        the model's depth (most of a 70B dry run's time), for statistics the dry run does not read."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def watch_gradients(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._as_gradient)

    def _as_gradient(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)


# --- pipelines: the schedule's actions for this rank, replayed ----------------------------

def _pipeline_step(pm: PipelineModule, inputs: tuple, target: torch.Tensor,
                   stage_io: dict[int, dict[str, list]] | None) -> None:
    """One training step of this rank's stages, in the order its schedule runs them
    (``schedule.pipeline_order``), then the gradients' sums and the optimizer step, as
    ``PipelineModule.train_step`` does after its schedule."""
    pp = pm.plan.pipeline
    if pm.schedule is None:
        pm._build_schedule(target.chunk(pp.micro_batches)[0])  # the loss program and torch's schedule
    pm.zero_grad()
    stages = {stage.stage_index: (stage, program) for stage, program in zip(pm.stages, pm.programs)}
    in_flight: dict[tuple[int, int], tuple] = {}
    for action in pm.schedule.pipeline_order[pm.pp_rank]:
        if action is None:
            continue
        kind, index, mb = action.computation_type, action.stage_index, action.microbatch_index
        if kind == _ComputationType.FORWARD:
            stage, program = stages[index]
            received = _received(pm, index, program, inputs, mb)
            outputs = stage.submod(*received)
            if stage_io is not None and mb == 0:
                stage_io.setdefault(index, {})["expects"] = [_shape(t) for t in received]
                stage_io[index]["sends"] = [_shape(t) for t in outputs]
            if stage.is_last:
                outputs = (pm._micro_loss(outputs, _micro_target(pm, target, mb)),)
            in_flight[index, mb] = (received, outputs)
        elif kind == _ComputationType.FULL_BACKWARD:
            _, outputs = in_flight.pop((index, mb))
            needs = [t for t in outputs if t.requires_grad]
            grads = [None if stages[index][0].is_last else torch.zeros_like(t) for t in needs]
            torch.autograd.backward(needs, grads)  # received gradients: fake, of the outputs' shapes
        elif kind != _ComputationType.REDUCE_GRAD:  # summed below, for every stage at once
            raise ValueError(f"autopar: the dry run replays forward and full-backward actions; found {action} "
                             f"in schedule {pp.schedule}")
    pm._sum_gradients(None)  # as train_step: summed once (ZeRO-2: reduce-scattered into the optimizer's slices)
    pm.step()  # the optimizer step, then (ZeRO-1/2) the whole parameters gathered from the slices


def _received(pm: PipelineModule, index: int, program, inputs: tuple, mb: int) -> list[torch.Tensor]:
    """What stage ``index`` receives for micro-batch ``mb``: this rank's shard of the user
    inputs (stage 0), or fake activations of the local shapes the stage's program expects."""
    cap = pm.captured
    held = {*cap.params, *cap.buffers, *cap.constant_values}  # state: the stage's own, not received
    received = [n for n in pm.parts[index].inputs if n.name not in held]
    if index == 0:
        flat = pytree.tree_leaves(inputs)
        out = []
        for x, node in zip(flat, received[-len(flat):]):
            piece = x.chunk(pm.plan.pipeline.micro_batches)[mb]
            spec = program.input_specs.get(node.name)
            out.append(local_slice(piece, spec, pm.intra.shape, pm.intra.get_coordinate())
                       if pm.intra is not None and spec is not None else piece)
        return out
    intra = tuple(pm.intra.shape) if pm.intra is not None else ()
    out = []
    for node in received:
        val = node.meta["val"]
        spec = program.input_specs.get(node.name)
        shape = local_shape(tuple(val.shape), spec, intra) if spec is not None else tuple(val.shape)
        out.append(torch.zeros(shape, dtype=val.dtype, device=pm.device, requires_grad=val.dtype.is_floating_point))
    return out


def _micro_target(pm: PipelineModule, target: torch.Tensor, mb: int) -> torch.Tensor:
    piece = target.chunk(pm.plan.pipeline.micro_batches)[mb]
    if pm.intra is None:
        return piece
    program, cap = pm._loss
    return local_slice(piece, program.input_specs[cap.user_inputs[-1]], pm.intra.shape, pm.intra.get_coordinate())


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


def _check_stage_boundaries(work: _Work, results: list[RankResult]) -> None:
    """What each stage sends is what the next stage expects (shapes and dtypes, this rank's
    shard): a failure is the receiving stage's rank's."""
    holder = {s: r for r in results if r.ok for s in r.stages}
    for s, io in sorted(work.stage_io.items()):
        nxt = work.stage_io.get(s + 1)
        if nxt is None or "sends" not in io or s + 1 not in holder:
            continue
        if io["sends"] != nxt["expects"]:
            r = holder[s + 1]
            r.ok = False
            r.error = (f"autopar: stage {s + 1} expects to receive {_shapes(nxt['expects'])}, stage {s} "
                       f"(rank {holder[s].rank}) sends {_shapes(io['sends'])}")


def _shapes(items: list) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d in items) + "]"


# --- small helpers ------------------------------------------------------------------------

def _coordinate(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for size in reversed(shape):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def _rank(coord: Sequence[int], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, size in zip(coord, shape):
        rank = rank * size + c
    return rank


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if text.startswith("autopar:") else f"{type(e).__name__}: {text}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"
