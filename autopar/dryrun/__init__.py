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

Pipelines: one process holding one rank at a time cannot run send/recv between stages, so
the schedule's own action list for this rank is replayed on fake activations, and the
shapes one stage sends are checked against those the next expects (``autopar.dryrun.pipeline``).
Only the fewest micro-batches whose schedule reaches every state of the plan's are replayed
(1F1B: P + 1 of M; ``replayed_micro_batches``): the same peak in a fraction of the time.
A pipeline's whole batch is made on a device the tracker does not count (``tracker.HOST``,
a real run's host memory): a rank is charged the rows its runtime moves to its device
(``PipelineModule._stage_inputs``), not views of the whole batch.

Speed: the model is captured and its strategy graph built once, then the distinct ranks
run in worker processes forked from that state (one per core), each rank's step on its own
fake process group. The tracker keeps the whole rank's peak only: MemTracker's per-module
peaks, updated after every op over every module it has seen, made the step's cost grow
with the square of the model's depth.

A plan that fails its dry run is a planner bug: the result names the rank and the error.

Here: the driver (one capture, the distinct ranks, worker processes, one rank's build and
step); the memory measurement is ``autopar.dryrun.tracker``, the results and their table
``autopar.dryrun.results``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import multiprocessing
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.faults import failures_shared
from autopar.runtime.loss import WithLoss
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelineModule
from autopar.runtime.precision import Precision, capture_cast, recorded_policy
from autopar.dryrun.pipeline import check_stage_boundaries, pipeline_step, replayed_micro_batches
from autopar.dryrun.serving import dry_run_serving
from autopar.dryrun.results import DryRunError, DryRunResult, RankResult
from autopar.dryrun.tracker import CPU, HOST, FakeState, create_optimizer_state, peak_memory, tracker_for
from autopar.passes.capture import Captured, capture, on_device
from autopar.passes.loss_memory import cross_entropy, default_loss
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.planner.workers import worker_count
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph

__all__ = ["dry_run", "distinct_ranks", "DryRunResult", "DryRunError", "RankResult"]


@failures_shared("dry run")
def dry_run(
    plan: Plan,
    model: nn.Module,
    example_inputs: tuple = (),
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    ranks: Sequence[int] | None = None,
    raise_on_failure: bool = False,
    workers: int | None = None,
    micro_batches: int | None = None,
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
    rank; 1 runs them here, one after another). ``micro_batches``: how many of a pipeline
    plan's micro-batches to replay (default: the fewest with the same peak memory as all of
    them, ``autopar.dryrun.pipeline.replayed_micro_batches``; the plan's count replays all).

    Needs no process group of its own: it starts torch's fake one per rank and destroys it
    after; one already initialised here is an error (run the dry run outside torchrun).

    A serving plan (``Plan.inference``) takes no example inputs: each distinct rank runs its
    prefill and a decode step (``autopar.dryrun.serving``).
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
    if plan.inference is not None:  # a serving plan: its prefill and decode step (autopar.dryrun.serving)
        coordinates = [_coordinate(r, shape) for r in chosen]
        result = dry_run_serving(plan, model, chosen, coordinates, [_predicted_for(plan, c) for c in coordinates])
        if raise_on_failure:
            result.raise_if_failed()
        return result
    results = [RankResult(r, _coordinate(r, shape)) for r in chosen]
    processes = _workers(workers, len(results))
    replayed = _replayed(plan, micro_batches)
    try:
        work = _prepare(plan, model, example_inputs, loss_fn, target, replayed and replayed[0])
    except ValueError as e:  # the plan does not fit the model at all: every rank would fail to build
        for r in results:
            r.error = _one_line(e)
        work = None
    if work is not None:
        _run_ranks(work, results, optimizer or _adamw, processes)
        if plan.pipeline is not None:
            check_stage_boundaries(work.stage_io, results)
    for r in results:
        r.predicted = _predicted_for(plan, r.coordinate)
    result = DryRunResult(plan.kind, shape, results, dict(plan.predicted.memory), time.perf_counter() - started,
                          micro_batches=replayed)
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


def _predicted_for(plan: Plan, coordinate: tuple[int, ...]) -> dict[str, float]:
    """The plan's predicted memory by kind for the rank at ``coordinate``: its pipeline rank's
    where the plan has one per pipeline rank, else the one every device shares."""
    by_rank = plan.predicted.memory_by_rank
    if plan.pipeline is not None and len(by_rank) == plan.mesh_shape[plan.pipeline.axis]:
        return dict(by_rank[coordinate[plan.pipeline.axis]])
    return dict(plan.predicted.memory)


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
    replayed: int | None = None  # a pipeline's micro-batches replayed (of the plan's, each of the plan's size)


def _prepare(plan: Plan, model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
             target: torch.Tensor | None, replayed: int | None) -> _Work:
    inputs = tuple(example_inputs)
    if plan.includes_loss:  # the plan covers the model and its loss: the loss is the output
        if loss_fn is None or target is None:
            raise ValueError("autopar: this plan was made with the loss (autopar.plan(..., loss_fn=, target=)); "
                             "expected the same loss_fn and target for its dry run, found none")
        if plan.pipeline is not None:
            raise ValueError("autopar: this pipeline plan was made for the model and its loss together; "
                             "pipelines train the model alone (plan without loss_fn)")
        model, inputs, loss_fn = WithLoss(model, loss_fn), (*inputs, target), _loss_is_output
        # unread; cut with the batch where the step accumulates micro-batches (``split_batch``)
        target = torch.zeros((target.shape[0],) if plan.accumulate > 1 else (), device="meta")
    if plan.accumulate > 1 and plan.pipeline is not None:
        # one of the step's schedule runs (``Plan.accumulate``): each reaches the same peak
        inputs = _micro_batch(inputs, plan.accumulate)
        target = None if target is None else _micro_batch((target,), plan.accumulate)[0]
    # the programs run: a pipeline's micro-batch, or one of the micro-batches a step accumulates
    runs = plan.pipeline.micro_batches if plan.pipeline else plan.accumulate
    capture_inputs = _micro_batch(inputs, runs) if runs > 1 else inputs
    precision = Precision.of(recorded_policy(plan.mp_policy))  # a plan priced under a policy runs under it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = on_device(capture(model, capture_inputs) if precision is None
                             else capture_cast(capture, model, precision)(capture_inputs), CPU)
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
                 (tuple(target.shape), target.dtype), replayed=replayed)


def _replayed(plan: Plan, asked: int | None) -> tuple[int, int] | None:
    """(micro-batches replayed, the plan's) for a pipeline plan: ``asked``, else the fewest with
    the same peak (``replayed_micro_batches``); None without a pipeline."""
    pp = plan.pipeline
    if pp is None:
        return None
    if asked is not None and not 1 <= asked <= pp.micro_batches:
        raise ValueError(f"autopar: dry_run(micro_batches=...) expected 1 to the plan's {pp.micro_batches} "
                         f"micro-batches, found {asked}; leave it out to replay the fewest with the same peak")
    return (asked or replayed_micro_batches(pp.schedule, pp.stages, pp.micro_batches, pp.chunks_per_rank),
            pp.micro_batches)


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
    return worker_count(asked, n_ranks)  # 1 without fork (Windows): the ranks run in this process


def _run_ranks(work: _Work, results: list[RankResult], optimizer: Callable, workers: int) -> None:
    if workers == 1:
        for r in results:
            _run_rank(work, r, optimizer)
        return
    context = multiprocessing.get_context("fork")
    shares = [results[k::workers] for k in range(workers)]
    running = []
    # A fork copies one thread. An object the workers inherit and collect could wait in its
    # finaliser on threads left behind (a destroyed gloo process group in a reference cycle
    # hung both workers so): garbage is collected here, and what is left is frozen, never
    # collected by a worker.
    gc.collect()
    gc.freeze()
    try:
        for share in shares:
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_worker, args=(work, share, optimizer, sender), daemon=True)
            process.start()
            sender.close()  # the worker's end: EOF here when it exits
            running.append((share, process, receiver))
    finally:
        gc.unfreeze()
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
        with FakeTensorMode(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")  # recorded: autopar's alone, each time (not a record per op)
            warnings.filterwarnings("always", message="autopar:")
            state = FakeState(work.captured, work.model)
            captured = dataclasses.replace(work.captured, constant_values=state.constants)
            if plan.pipeline is None:
                module = ParallelModule(state, captured, work.graph, plan, mesh, work.loss_fn, optimizer,
                                        check_inputs=False, mp_policy=recorded_policy(plan.mp_policy))
            else:
                module = PipelineModule(state, captured, work.graph, plan, mesh, work.loss_fn, optimizer,
                                        recorded_policy(plan.mp_policy))
                result.stages = tuple(s.stage_index for s in module.stages)
            # a pipeline rank moves its rows of the batch to its device (PipelineModule._stage_inputs):
            # the whole batch lies in host memory, which the tracker does not count
            where = HOST if plan.pipeline is not None else CPU
            inputs = tuple(torch.zeros(s, dtype=d, device=where) for s, d in work.inputs)
            target = torch.zeros(work.target[0], dtype=work.target[1], device=where)
            create_optimizer_state(module.optimizer)
            tracker = tracker_for(module)
            # only a graph that counts integers with histc pays a dispatch mode on every op
            with tracker, (_AsOnDevice() if _AsOnDevice.needed(work.captured) else contextlib.nullcontext()):
                if plan.pipeline is None:
                    module.train_step(inputs, target)
                else:
                    pipeline_step(module, inputs, target, work.stage_io, work.replayed)
        result.peak, result.memory = peak_memory(tracker)
        result.warnings = list(dict.fromkeys(str(w.message) for w in caught))
        result.ok = True
    except Exception as e:  # noqa: BLE001  (any failure is the finding: reported with its rank)
        result.error = _one_line(e)
        result.traceback = traceback.format_exc()
    finally:
        dist.destroy_process_group()
        result.seconds = time.perf_counter() - started


# --- small helpers ------------------------------------------------------------------------

class _AsOnDevice(TorchDispatchMode):
    """Ops that the capture (on the meta device) took the accelerator's path for, run as that
    path runs although the fake tensors live on the CPU: ``histc`` of integers (Hugging Face's
    grouped-matmul experts count tokens so on CUDA; the CPU kernel takes floats only, and the
    fake tensor's checks follow the CPU's) counts the same values as floats."""

    @staticmethod
    def needed(captured: Captured) -> bool:
        return any(n.target is torch.ops.aten.histc.default for n in captured.nodes("call_function"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            args = (args[0].float(), *args[1:])
        return func(*args, **kwargs)


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
