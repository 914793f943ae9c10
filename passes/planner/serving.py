"""The serving planner: a causal LM's prefill and decode on a mesh -> the Plan that serves a
workload (``autopar.passes.generation.Inference``) best.

The two programs are captured at the workload's batch, prompt and cache lengths and laid
out together (``autopar.passes.planner.serving_layout``: one generation's time, weights and
cache one layout); on the whole mesh, and with the outermost axis as a pipeline of stages
(``autopar.passes.planner.serving_stages``); the fastest generation that fits is the plan.
At a given batch that is also what the throughput objective maximises (generated tokens
per second per device); without a batch, the throughput objective searches it
(``searched_batch``): from the largest that fits, halved while that serves more.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from autopar.costmodels.units import gib_text
from autopar.passes.generation import Inference, Programs, capture_programs
from autopar.passes.plan import Plan
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.search import pipeline_options
from autopar.passes.planner.serving_layout import PIPELINED_LAYOUTS, joint_problem, plan_on_mesh
from autopar.passes.planner.serving_stages import pipelined

def plan_serving(model, inference: Inference, request: PlanRequest) -> Plan:
    """The serving Plan of ``model`` for ``inference`` on ``request``'s mesh and hardware."""
    if inference.batch is None:
        return searched_batch(model, inference, request)
    programs = capture_programs(model, inference.batch, inference.prompt_len, inference.max_len)
    return plan_programs(programs, inference, request,
                         lambda batch: capture_programs(model, batch, inference.prompt_len, inference.max_len))


def searched_batch(model, inference: Inference, request: PlanRequest) -> Plan:
    """The throughput objective without a batch: the batch serving the most tokens per second
    per device. The plan at one sequence (one per micro-batch where they are given) prices a
    sequence's cache and activations per device; the batch whose caches fill the memory the
    weights leave is planned first, halved while nothing fits, and the gap to the smallest
    batch that did not fit halved twice more (so the largest that fits is found to within a
    quarter of it). A larger batch reads the same weights for more sequences, but can fit only
    layouts that spread its cache wider (deeper pipelines, wider splits) whose steps are
    slower, so the batch is then halved while the halved batch serves more, and the best
    planned is the plan. The batches are multiples of the given micro-batch count, or else of
    every pipeline depth, so that a pipeline can keep one micro-batch per stage in flight."""
    unit = inference.micro_batches or 1
    step = unit if inference.micro_batches else math.lcm(1, *(p for p, _ in pipeline_options(request)))
    one = plan_serving(model, replace(inference, batch=unit), request)
    memory = one.predicted.memory
    per_sequence = (memory.get("kv_cache", 0.0) + memory.get("activations", 0.0)) / unit
    room = request.memory_bytes - memory.get("parameters", 0.0)
    plans: dict[int, Plan] = {unit: one}
    refused: dict[int, str] = {}

    def planned(batch: int) -> Plan | None:
        if batch not in plans and batch not in refused:
            try:
                plans[batch] = plan_serving(model, replace(inference, batch=batch), request)
            except PlanningError as exc:
                refused[batch] = str(exc)
        return plans.get(batch)

    batch = max(step, int(room // per_sequence) // step * step) if per_sequence > 0 else step
    while planned(batch) is None and batch > step:
        batch = _halved(batch, step)
    tried = [plans[batch]] if batch in plans else []
    for _ in range(2 if tried else 0):  # between the largest that fits and the smallest that did not
        above = min((b for b in refused if b > batch), default=None)
        middle = None if above is None else (batch + above) // 2 // step * step
        if middle is None or middle <= batch:
            break
        if planned(middle) is not None:
            batch = middle
            tried.append(plans[batch])
    while tried and batch > step:  # smaller batches, while they serve more
        batch = _halved(batch, step)
        plan = planned(batch)
        if plan is None:
            break
        tried.append(plan)
        if _served(plan) <= _served(tried[-2]):
            break
    best = max(tried or [one], key=_served)
    priced = ", ".join(f"{p.inference['batch']}: {p.predicted.tokens_per_second_per_device:.4g}" for p in tried or [one])
    best.reasons.insert(0, f"batch {best.inference['batch']}: the most tokens/s per device of the batches planned "
                           f"({priced}), from the largest the memory holds (one sequence's cache and activations "
                           f"{gib_text(per_sequence)} per device beside {gib_text(memory.get('parameters', 0.0))} "
                           "of weights), halved while that served more")
    if refused:
        smallest = min(refused)
        best.reasons.insert(1, f"batches that did not fit: {', '.join(map(str, sorted(refused, reverse=True)))}; "
                               f"at {smallest}: {refused[smallest]}")
    return best


def _halved(batch: int, step: int) -> int:
    return max(step, batch // 2 // step * step)


def _served(plan: Plan) -> float:
    return plan.predicted.tokens_per_second_per_device


def plan_programs(programs: Programs, inference: Inference, request: PlanRequest,
                  recapture: Callable[[int], Programs] | None = None) -> Plan:
    """The serving Plan of captured ``programs`` (the module docstring): on the whole mesh,
    and (``request.pipeline``) with the outermost axis as a pipeline of stages
    (``autopar.passes.planner.serving_stages``); the fastest generation that fits.
    ``recapture(batch)``: the programs at another batch, for a throughput pipeline's
    micro-batches. ``request.layout``: that manual layout, priced alike, no search."""
    if request.layout in PIPELINED_LAYOUTS:  # a pipeline over the whole outermost axis, the rest as named
        shape = request.mesh_shape
        intra = tuple(shape[1:]) or (1,)
        found = _pipeline(programs, inference, request, shape[0], intra, PIPELINED_LAYOUTS[request.layout], recapture)
        if found is None:
            raise PlanningError(f"autopar: the serving layout {request.layout!r} does not fit or does not apply on mesh "
                                f"{shape} ({shape[0]} stages; each must fit a device and hold a repeated layer)")
        found.kind = request.layout
        return found
    best, error = None, None
    try:
        best = plan_on_mesh(joint_problem(programs, inference, request), programs, inference, request)
    except PlanningError as exc:
        error = exc
    for p, intra in pipeline_options(request):
        found = _pipeline(programs, inference, request, p, intra, None, recapture)
        if found is not None and (best is None or found.predicted.step_time < best.predicted.step_time):
            best = found
    if best is None:
        raise error
    return best


def _pipeline(programs: Programs, inference: Inference, request: PlanRequest, p: int, intra: tuple[int, ...],
              layout: str | None, recapture: Callable[[int], Programs] | None) -> Plan | None:
    """A pipeline of ``p`` stages running ``inference.micro_batches`` at once, or where not
    given the faster of the batch through the stages in turn and, under the throughput
    objective where ``p`` divides the batch, ``p`` micro-batches at once."""
    counts = [inference.micro_batches] if inference.micro_batches else [1]
    if inference.micro_batches is None and inference.objective == "throughput" and programs.batch % p == 0:
        counts.append(p)
    options = []
    for m in counts:
        if m > 1 and (recapture is None or programs.batch % m):
            continue
        micro = programs if m == 1 else recapture(programs.batch // m)
        options.append(pipelined(micro, inference, request, p, intra, layout=layout, micro_batches=m))
    return min((o for o in options if o is not None), key=lambda o: o.predicted.step_time, default=None)
