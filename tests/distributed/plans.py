"""The plans the distributed checks train (``tests/distributed/train_check.py``,
``tests/distributed/mp_check.py``): manual layouts made here, autopar.layouts' and the
planner's, hand-cut pipelines; each made on rank 0 and given to every rank, once per launch
for each request (``made_once``), from one capture per model and inputs (``captured_once``)."""

from __future__ import annotations

import functools
import operator
import random
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.passes.capture import capture
from autopar.passes.plan import Pipeline, Plan, plan_from_choice
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.rules.overlapped import GATHER, SCATTER
from autopar.passes.strategy_graph import build_strategy_graph


def layout_choice(graph, captured, layout: str, mesh_shape):
    if layout.startswith("random"):
        rng = random.Random(int(layout.removeprefix("random") or 0))
        return {n: rng.randrange(len(ns.strategies)) for n, ns in graph.nodes.items()}
    if layout == "zero3":  # DP's ops, parameters stored split on dim 0 over every axis: FSDP as written by hand
        choice = layout_choice(graph, captured, "dp", mesh_shape)
        split = (Shard(0),) * len(mesh_shape)
        for node, ns in graph.nodes.items():
            outputs = [s.output for s in ns.strategies]
            if node.name in captured.params and split in outputs:
                choice[node] = outputs.index(split)
        return choice
    n_axes = len(mesh_shape)
    fixed = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        shape = tuple(node.meta["val"].shape)
        if node.name in captured.user_inputs:
            fixed[node] = (Shard(0),) * n_axes  # the batch over every axis
        elif node.name in captured.params and layout in ("fsdp", "zero1", "zero2"):
            fixed[node] = (Shard(0),) * n_axes if shape and shape[0] % _size(mesh_shape) == 0 else (Replicate(),) * n_axes
    return choose_by_propagation(graph, fixed)


def _size(mesh_shape):
    out = 1
    for s in mesh_shape:
        out *= s
    return out


def request_key(value):
    """What a plan made from these arguments depends on: a model's module tree (sizes,
    dropout), parameter and buffer shapes and dtypes and mode (a launch's models that agree
    on those run the same code); tensors' shapes and dtypes; a mesh's shape and axis names;
    other values as they are."""
    if isinstance(value, torch.nn.Module):
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*value.named_parameters(), *value.named_buffers()])
        return ("module", repr(value), value.training, tensors)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, DeviceMesh):
        return ("mesh", tuple(value.shape), value.mesh_dim_names)
    if isinstance(value, (tuple, list)):
        return tuple(request_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, request_key(v)) for k, v in sorted(value.items()))
    return value


def made_once(make):
    """``make`` run on rank 0 and given to every rank, once per launch for each
    ``request_key`` of its arguments: a plan depends on nothing else, so cases of a launch
    that ask for the same one share it (capture and planning take seconds, and ranks that
    all plan share the cores; every rank asks in the same order). Kept as JSON: each caller
    gets its own copy, as a saved plan replays. An error is raised on every rank."""
    texts = {}

    @functools.wraps(make)
    def plan_for(*args, **kwargs):
        key = request_key((args, kwargs))
        if key not in texts:
            texts[key] = on_rank0(lambda: _json_of(make(*args, **kwargs)))
        return None if texts[key] is None else Plan.from_json(texts[key])

    return plan_for


def _json_of(plan):
    return None if plan is None else plan.to_json()  # None: compile plans by itself


def on_rank0(make):
    """``make()`` on rank 0, its value (or the exception it raised) given to every rank;
    without a process group (a benchmark's one process), ``make()`` here."""
    if not dist.is_initialized():
        return make()
    sent = [None]
    if dist.get_rank() == 0:
        try:
            sent[0] = ("value", make())
        except Exception as exc:  # raised on every rank, rank 0's with its traceback
            dist.broadcast_object_list([("error", exc)])
            raise
    dist.broadcast_object_list(sent)
    kind, value = sent[0]
    if kind == "error":
        raise value
    return value


_CAPTURED: dict[tuple, object] = {}  # request_key -> Captured, for the plans made here (they only read it)


def captured_once(model, inputs, kwargs=None):
    """``capture`` of a model and inputs, once per launch for each ``request_key``."""
    key = request_key((model, inputs, kwargs))
    if key not in _CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CAPTURED[key] = capture(model, inputs, kwargs)
    return _CAPTURED[key]


@made_once
def layout_plan(model, inputs, layout: str, mesh_shape, kwargs=None):
    captured = captured_once(model, inputs, kwargs)
    graph = build_strategy_graph(captured, mesh_shape)
    plan = plan_from_choice(graph, layout_choice(graph, captured, layout, mesh_shape), kind=layout)
    if layout in ("fsdp", "zero3"):  # sharded storage, gathered at each use
        plan.zero = {fqn: 3 if "S(" in spec else 0 for fqn, spec in plan.params.items()}
    if layout in ("zero1", "zero2"):  # the same storage: used whole / gathered once per step
        level = int(layout[-1])
        plan.zero = {fqn: level if "S(" in spec else 0 for fqn, spec in plan.params.items()}
    return plan


PLANNED = ("auto", "tp", "tp+dp", "tp+zero1", "tp+sp", "fsdp+tp", "zero1")  # by autopar's planner and layouts


@made_once
def planned(model, mesh, tokens, layout: str):
    """The planner's own plan ("auto") or a manual layout from autopar.layouts, made on
    rank 0 with the H100 preset and given to every rank."""
    if layout == "auto":
        return None  # autopar.compile plans (on rank 0) by itself
    return autopar.layouts.build(layout, model, mesh, (tokens,), hardware="h100")


@made_once
def fused_plan(model, mesh, tokens, layout: str):
    """autopar.layouts' Megatron ``layout`` with every tensor-parallel linear's collective run
    inside it, pipelined (async TP, ``autopar.passes.rules.overlapped``): a column-parallel
    linear reads its input split by rows and gathers it, a row-parallel one reduce-scatters
    its sum by rows; the values between move as the edges say."""
    plan = autopar.layouts.build(layout, model, mesh, (tokens,), hardware="h100")
    graph = build_strategy_graph(captured_once(model, (tokens,)), tuple(mesh.shape))
    for node, ns in graph.nodes.items():
        chosen = next((s for s in ns.strategies if str(s) == plan.strategies.get(node.name)), None)
        if chosen is None:
            continue
        fused = [s for s in ns.strategies if s.inputs[1:2] == chosen.inputs[1:2] and (
            (s.kernel == GATHER and s.output == chosen.output)
            or (s.kernel == SCATTER and s.inputs[0] == chosen.inputs[0]))]
        if fused:
            plan.strategies[node.name] = str(fused[0])
    plan.kind = f"fused-{layout}"
    return plan


def case_plan(model, mesh, tokens, layout: str):
    """The plan a case names: the planner's or autopar.layouts' (``PLANNED``), their Megatron
    layouts with the collectives inside the linears (``fused-<layout>``), or one made here."""
    if layout in PLANNED:
        return planned(model, mesh, tokens, layout)
    if layout.startswith("fused-"):
        return fused_plan(model, mesh, tokens, layout.removeprefix("fused-"))
    return layout_plan(model, (tokens,), layout, tuple(mesh.shape))  # as JSON: what a saved plan replays


@made_once
def pipeline_plan(model, batch, mesh_shape, schedule: str, micro_batches: int, chunks: int,
                  intra_layout: str | None = None):
    """Pipeline over mesh axis 0; stages cut evenly by node count; on the other axes, data
    parallel, or ``intra_layout`` as autopar.layouts builds it (e.g. "tp+dp": 3D)."""
    micro = batch.chunk(micro_batches)[0]
    captured = captured_once(model, (micro,))
    intra = mesh_shape[1:]
    if intra_layout is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.layouts.build(intra_layout, model, intra, (micro,), hardware="h100", pipeline=False)
    else:
        graph = build_strategy_graph(captured, intra)
        fixed = {n: (Shard(0),) * len(intra) for n in graph.nodes if n.name in captured.user_inputs}
        plan = plan_from_choice(graph, choose_by_propagation(graph, fixed), kind="pp")
    n_stages = mesh_shape[0] * chunks
    ops = list(captured.nodes("call_function"))
    stage_of = {}
    for i, node in enumerate(ops):
        producer = node.args[0] if node.target is operator.getitem else None
        stage_of[node.name] = stage_of[producer.name] if producer is not None else i * n_stages // len(ops)
    plan.mesh_shape = mesh_shape
    plan.axis_names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    plan.pipeline = Pipeline(axis=0, stages=mesh_shape[0], micro_batches=micro_batches, schedule=schedule,
                             stage_of=stage_of, chunks_per_rank=chunks)
    return Plan.from_json(plan.to_json())
