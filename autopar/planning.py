"""``autopar.plan``: plan a model on a mesh without running it (nothing is started).

Works on meta-device models: capture and costing read only shapes. ``mesh_or_shape``
is a ``DeviceMesh`` (its shape and axis names are kept) or a shape such as ``(8, 8)``
(axis 0 outermost; with a preset, inner axes ride the fast intra-node links).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from autopar import costmodels
from autopar.passes.planner import layouts
from autopar.costmodels.precision import META_KEY
from autopar.costmodels.units import gib_text
from autopar.runtime.faults import failures_shared
from autopar.runtime.loss import WithLoss
from autopar.runtime.precision import Precision, capture_cast, warn_under_autocast
from autopar.passes.capture import capture
from autopar.passes.generation import Inference
from autopar.passes.plan import Plan, check_accumulate
from autopar.runtime.batch import split_batch
from autopar.passes.planner.constraints import Constraints
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.search import plan_captured
from autopar.passes.planner.serving import plan_serving
from autopar.passes.planner.serving_layout import PIPELINED_LAYOUTS, SERVING_LAYOUTS
from autopar.passes.strategy_graph import NoRuleWarning


@failures_shared("planning")
def plan(
    model: torch.nn.Module,
    mesh_or_shape: Any,
    example_inputs: tuple = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    hardware: costmodels.HardwareProfile | str = "h100",
    loss_fn: Callable | None = None,
    target: torch.Tensor | None = None,
    memory_limit: float | None = None,
    time_limit_s: float = 60.0,
    pipeline: bool = True,
    layout: str | None = None,
    axis_names: Sequence[str] | None = None,
    progress: Callable[[str, int, int | None], None] | None = None,
    mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
    inference: Inference | None = None,
    constraints: Constraints | None = None,
    workers: int | None = None,
    accumulate: int = 1,
) -> Plan:
    """The fastest predicted Plan that fits in memory (with ``layout``, under that manual layout's placements).

    ``loss_fn(model(*example_inputs), target)`` is planned too when given (pass ``target``);
    then no pipeline is searched (a pipeline's loss runs apart, on its last stage: plan
    without ``loss_fn`` for pipelines, the planner prices the loss the runtime adds).
    ``memory_limit`` defaults to the device memory of ``hardware``. ``time_limit_s`` sets the
    search's budget after capture, counted in work, not seconds (pipeline depths tried, the
    solvers' deterministic limits), so the same call gives the same plan on a loaded machine;
    a safety net stops it sooner only past 3x the limit in CPU seconds or 30x in wall clock,
    and says so (``plan.solver["clock_cut"]``; the solver's gap is there too). Capture time is
    reported in ``plan.solver["capture_seconds"]``. ``pipeline=False``
    keeps the mesh as given (no pipeline axis); on a ``DeviceMesh`` (what ``autopar.compile``
    plans on) a pipeline may take its whole outermost axis, the others staying intra-op. The result's ``candidates`` lists the
    manual layouts' predicted step times; the auto plan is never slower than the best.
    ``progress(phase, done, total)`` is told each phase as it starts: "capture" (total None),
    then the search's ``total`` steps ("strategies", "no pipeline", "pp2x8", ..., "done").
    ``mp_policy``: priced as ``autopar.compile(..., mp_policy=)`` runs it (the model captured
    as it computes under the policy: compute, activations and parameter gathers in
    ``param_dtype``; float32 masters, gradients and AdamW state; reductions in
    ``reduce_dtype``: ``autopar.costmodels.precision``); the plan records it (``mp_policy``).

    ``layout``: a manual layout (``autopar.layouts.LAYOUTS``) as practitioners write it: every op
    placed by its rules (data split on its data axes, Megatron's on its tensor axis), the fewest
    layers recomputed that make it fit. Pipelined (``"pp+fsdp+tp"``, with its depth
    ``"pp4+fsdp+tp"``, or ``"3d"``), or with ``constraints`` too, it is a pin
    (``Constraints(layout=)``: its placements of every parameter and input, its ZeRO levels and
    axis roles), recomputation, micro-batches, schedule and pipeline depth searched to fit.
    ``plan.kind`` is its name. A layout alone is not priced against the search without it (a
    second search): pin it with ``constraints=autopar.Constraints(layout=...)`` for that.

    ``constraints``: pins (``autopar.Constraints``: ``layout=``, ``tp=``, ``dp=``, ``pp=``, ``axes=``,
    ``micro_batches=``, ``schedule=``, ``chunks=``, ``zero=``, ``zero_by_name=``, ``recompute=``):
    the fastest plan that honours them, everything else searched as without them; the search
    without them runs too, and where its plan honours every pin that is the plan.
    ``plan.pins`` records the unpinned plan's step time and memory and the pins it breaks, and
    ``explain()`` prices them ("pinning tp=8 costs 6% (1.31 s against 1.23 s)"). A pin no plan
    can honour is an ``autopar:`` error naming it.

    ``inference``: plan serving instead of training (``autopar.Inference``: batch, prompt and
    cache lengths, objective): a Hugging Face causal LM's prefill and decode over one layout
    of its weights and key-value cache (``autopar.passes.planner.serving``), no example
    inputs (the workload gives their shapes); ``layout`` one of the serving layouts
    (``replicated``, ``dp``, ``tp``, ``tp+dp``). ``autopar.compile(..., plan=)`` runs it
    (``autopar.runtime.inference.InferenceModule``: ``generate``).

    ``workers``: processes the search's independent plans (without a pipeline, and each
    pipeline depth planned whatever the others give) are made in at once, forked from this one
    (``autopar.passes.planner.workers``); None: one per core; 1: this process alone. The plan is
    the same with any number.

    ``accumulate``: the step accumulates gradients over this many micro-batches
    (``train_step(accumulate=k)``): the example inputs (and ``target``) are the whole batch, cut
    along dim 0 into k; the plan lays out the program of one micro-batch and is priced as the
    step runs it, k times each micro-batch's compute and moves (ZeRO-3's gathers and
    reduce-scatters among them), once its gradient sync and optimizer step
    (``autopar.passes.costing``). ``plan.accumulate`` records it, and ``train_step`` runs it.
    """
    check_accumulate(accumulate)
    if accumulate > 1 and inference is not None:
        raise ValueError(f"autopar: plan(inference=...) takes no accumulate= (a training step's micro-batches); "
                         f"found accumulate={accumulate}; leave it out, or plan training")
    if constraints is not None and inference is not None:
        raise ValueError("autopar: plan(inference=...) takes no constraints= (pins are for training plans); "
                         "leave constraints out, or plan training")
    if inference is not None:
        return _plan_serving(model, mesh_or_shape, example_inputs, inference, hardware=hardware,
                             memory_limit=memory_limit, time_limit_s=time_limit_s, layout=layout, pipeline=pipeline,
                             axis_names=axis_names, others={"loss_fn": loss_fn, "target": target,
                                                            "example_kwargs": example_kwargs, "mp_policy": mp_policy})
    price_pins = constraints is not None  # the user's pins are priced; a layout= alone is not
    # a manual layout alone is planned as practitioners write it (every op placed by its rules,
    # the fewest layers recomputed that fit); pipelined, or with pins, its placements are pins
    exact_layout = layout if constraints is None and layout in layouts.LAYOUTS else None
    try:
        constraints = None if exact_layout else layout_pinned(layout, constraints)
    except ValueError as exc:  # a layout name no pin reads: the request's error, before capture
        raise PlanningError(str(exc)) from None
    precision = Precision.of(mp_policy)
    warn_under_autocast("planning", stacklevel=3)
    shape, names = _mesh(mesh_or_shape, axis_names)
    if loss_fn is not None and target is None:
        raise ValueError("autopar: plan(loss_fn=...) expected a target= tensor for the loss; found none. "
                         "Pass target=labels, or leave loss_fn out to plan the model alone")
    request = PlanRequest(
        mesh_shape=shape, hardware=hardware, memory_limit=memory_limit,
        time_limit_s=time_limit_s,  # the search's own limit: capture (torch.export) cannot be interrupted
        layouts=layouts.LAYOUTS, hint_fn=layouts.hints, layout=exact_layout, axis_names=names,
        # a pipeline trains the model alone and lays its loss out on the last stage (autopar.compile,
        # autopar.dry_run): stages cut from the model-and-loss graph could not run
        pipeline=pipeline and loss_fn is None,
        outer_axis_only=_is_device_mesh(mesh_or_shape),  # the plan keeps the mesh's shape (compile runs it)
        progress=progress, constraints=constraints, price_pins=price_pins, workers=workers,
    )
    if accumulate > 1:  # the program of one micro-batch is what every run of the step lays out
        ((example_inputs, example_kwargs), target), *_ = split_batch((example_inputs, example_kwargs), target,
                                                                     accumulate)
    if loss_fn is not None:
        model, example_inputs = WithLoss(model, loss_fn), (*example_inputs, target)
    started = time.perf_counter()
    if progress is not None:
        progress("capture", 0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)
        if precision is None:
            captured = capture(model, example_inputs, example_kwargs)
        else:
            captured = capture_cast(capture, model, precision)(example_inputs, example_kwargs)
    captured_in = time.perf_counter() - started
    captured.accumulate = accumulate
    with warnings.catch_warnings(record=True) as seen:  # each pipeline option lists strategies anew
        warnings.simplefilter("always", NoRuleWarning)
        result = plan_captured(captured, request)
    for text in dict.fromkeys(str(w.message) for w in seen if issubclass(w.category, NoRuleWarning)):
        warnings.warn(text, NoRuleWarning, stacklevel=2)
    for w in seen:
        if not issubclass(w.category, NoRuleWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    result.solver["capture_seconds"] = captured_in
    result.includes_loss = loss_fn is not None  # the captured module was WithLoss(model, loss_fn)
    result.accumulate = accumulate
    if precision is not None:
        priced = next((n.meta[META_KEY] for n in captured.nodes("placeholder") if META_KEY in n.meta), None)
        result.mp_policy = precision.record(priced)
    if layout is not None or (constraints is not None and constraints.layout is not None):
        result.kind = layout or constraints.layout  # the layout, as written or as pins
    _warn_if_over(result)
    return result


class DoesNotFitWarning(UserWarning):
    """A plan predicted to need more memory per device than it was planned for: a manual layout as
    written (``layout=``) is priced as given, fitting or not."""


def _warn_if_over(plan: Plan) -> None:
    over = plan.memory_over_limit()
    if over:
        total = sum(plan.predicted.memory.values())
        warnings.warn(f"autopar: layout {plan.kind!r} as written is predicted to need {gib_text(total)} per device, "
                      f"{gib_text(over)} more than the {gib_text(total - over)} it was planned for; expected a plan "
                      "that fits: plan without layout= (or pin it, Constraints(layout=...), to search recomputation, "
                      "micro-batches and depth), or on more devices", DoesNotFitWarning, stacklevel=3)


def layout_pinned(layout: str | None, constraints: Constraints | None) -> Constraints | None:
    """``constraints`` with ``layout=`` pinned too: a manual layout is a pin of its placements and
    ZeRO levels (``Constraints.layout``), recomputation, micro-batches, schedule and depth searched."""
    if layout is None:
        return constraints
    if constraints is not None and not isinstance(constraints, Constraints):
        return constraints  # the request says what it expected
    given = constraints or Constraints()
    if given.layout not in (None, layout):
        raise ValueError(f"autopar: plan(layout={layout!r}) and constraints pinning layout={given.layout} name two "
                         "layouts; expected one: pass it once")
    return replace(given, layout=layout)


def _plan_serving(model: torch.nn.Module, mesh_or_shape: Any, example_inputs: tuple, inference: Inference, *,
                  hardware: Any, memory_limit: float | None, time_limit_s: float, layout: str | None,
                  pipeline: bool, axis_names: Sequence[str] | None, others: dict[str, Any]) -> Plan:
    """``plan(..., inference=)``: the serving plan (training's own options refused by name)."""
    if not isinstance(inference, Inference):
        raise TypeError(f"autopar: plan(inference=) expected an autopar.Inference(batch=, prompt_len=, max_len=, "
                        f"objective=); found {type(inference).__name__}")
    given = [name for name, value in others.items() if value is not None] + (["example_inputs"] if example_inputs else [])
    if given:
        raise ValueError(f"autopar: plan(inference=...) plans serving, which takes no {', '.join(given)} (the workload "
                         "gives the inputs' shapes; weights serve in the model's dtype); leave them out")
    shape, names = _mesh(mesh_or_shape, axis_names)
    if layout is not None and layout not in SERVING_LAYOUTS + tuple(PIPELINED_LAYOUTS):
        raise ValueError(f"autopar: {layout!r} is not a serving layout (ZeRO and FSDP gather the weights for every "
                         f"token); expected one of {SERVING_LAYOUTS + tuple(PIPELINED_LAYOUTS)}, or layout=None")
    request = PlanRequest(mesh_shape=shape, hardware=hardware, memory_limit=memory_limit, time_limit_s=time_limit_s,
                          layouts=SERVING_LAYOUTS + tuple(PIPELINED_LAYOUTS), hint_fn=layouts.hints, layout=layout,
                          axis_names=names,
                          pipeline=pipeline, outer_axis_only=_is_device_mesh(mesh_or_shape))
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRuleWarning)
        result = plan_serving(model, inference, request)
    result.solver["planning_seconds"] = time.perf_counter() - started
    _warn_if_over(result)
    return result


def _is_device_mesh(mesh: Any) -> bool:
    return hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "shape") and not isinstance(mesh, (tuple, list))


def _mesh(mesh_or_shape: Any, axis_names: Sequence[str] | None) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    if _is_device_mesh(mesh_or_shape):
        shape = tuple(int(s) for s in mesh_or_shape.shape)
        names = axis_names or mesh_or_shape.mesh_dim_names
    elif isinstance(mesh_or_shape, int):
        shape, names = (mesh_or_shape,), axis_names
    elif isinstance(mesh_or_shape, str):
        sizes = mesh_or_shape.lower().replace(",", "x").split("x")
        shape = f"({', '.join(sizes)},)" if len(sizes) == 1 else f"({', '.join(sizes)})"
        example = shape if all(s.strip().isdigit() for s in sizes) else "(8, 8)"
        raise ValueError(f"autopar: expected a DeviceMesh or a mesh shape as a tuple of sizes; found the string "
                         f"{mesh_or_shape!r} (the command line's form); pass {example}")
    else:
        try:
            shape, names = tuple(int(s) for s in mesh_or_shape), axis_names
        except (TypeError, ValueError):
            raise ValueError(f"autopar: expected a DeviceMesh or a mesh shape such as (8, 8), found "
                             f"{type(mesh_or_shape).__name__}; pass a tuple of sizes, outermost axis first") from None
    if not shape or any(s < 1 for s in shape) or math.prod(shape) < 1:
        raise ValueError(f"autopar: expected a mesh shape of positive sizes such as (8, 8), found {shape}; pass "
                         "one size of at least 1 per mesh axis")
    return shape, tuple(names) if names else None
