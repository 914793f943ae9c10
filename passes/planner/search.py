"""The planner: a captured model on a mesh -> the fastest Plan that fits, with its Prediction.

Steps (``plan_intra_op`` for one intra-op mesh, ``plan_captured`` for the whole search):

1. strategies (``autopar.passes.strategy_graph``) and costs (``autopar.passes.costing``) on the mesh;
2. manual layouts (the caller's hints: fixed placeholder placements and ZeRO levels,
   completed by ``complete`` with the solver's heuristic) evaluated on the same costs and handed to ``autopar.passes.solve.solve`` as candidate solutions, so the result
   is never predicted slower than the best layout that fits;
3. the intra-op solve (followers, tied layers, chain DP or CP-SAT, a deterministic search
   budget: the same call gives the same plan; the wall clock only a reported safety net);
   manual layouts that fit only with layers recomputed are costed so (``cost_layout``), and
   one predicted faster than the solver's plan is the plan (``fastest_of``);
4. the pipeline search (``autopar.passes.planner.pipeline``) over device factorisations into a
   pipeline axis times intra-op axes (``pipeline_factorisations``: with a preset every
   split of the outermost axis, with a measured profile the whole outermost axis, the
   only one it prices), stage cuts, micro-batches and schedules; as many depths as
   ``factorisation_budget`` counts (work, not seconds), stopped sooner only by ``SafetyNet``
   (CPU seconds, and a runaway wall clock), which the plan reports (``solver["clock_cut"]``);
   what it covered (depths, schedules, chunks, micro-batches: tried, ruled out, skipped, and
   why) and what the clock cut go in ``solver["searched"]`` (``autopar.passes.planner.searched``);
5. the Plan: placements, ZeRO levels, pipeline, and the predicted step time and memory
   broken down; per-node costs and the rejected alternatives feed ``Plan.explain()``.

With pins (``autopar.Constraints``, ``plan_pinned``): the search without them first, then,
unless its plan honours them all, the search under them: only the depths their roles can be
laid on (``constraints.mesh_roles``), each intra-op problem restricted by them
(``pin_restrictions``), the pipeline search held to the pinned settings; ``Plan.pins``
records what they cost.

A memory limit nothing meets raises an ``autopar:`` error with the least memory any
plan needs, its breakdown, and what would make it fit.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Iterator, Sequence

from autopar.passes.explain import duration
from autopar.passes.plan import Plan
from autopar.costmodels.units import GIB
from autopar.passes.planner.constraints import MeshRoles, check_mesh, check_recompute, intra_axes, mesh_roles
from autopar.passes.planner.intra_op import PlanningError, plan_intra_op
from autopar.passes.planner.mesh_split import split_request
from autopar.passes.planner.pin_price import broken_pins, price_record
from autopar.passes.planner.pin_restrictions import check_outputs, check_patterns
from autopar.passes.planner.pipeline import pipeline_plan, repeated_layer_count
from autopar.passes.planner.request import PlanRequest
from autopar.passes.planner.searched import Coverage, merged
from autopar.passes.planner.stage_starts import start_layers
from autopar.passes.planner.workers import ForkedJobs, worker_count
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph


def factorisations(shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """(P, intra-op shape) with P > 1 taken out of the outermost (slowest) axis."""
    return [(p, intra_axes(shape, p)[0]) for p in range(2, shape[0] + 1) if shape[0] % p == 0]


def pipeline_factorisations(request: PlanRequest, shape: tuple[int, ...] | None = None
                            ) -> list[tuple[int, tuple[int, ...]]]:
    """The factorisations the request's hardware can price on ``shape`` (default: the request's
    mesh): any (``factorisations``) for a preset, which is built for each; for a measured profile
    only the pipeline over the whole outermost axis, the intra-op mesh being the other measured
    axes (``pipeline.pipeline_profile``)."""
    shape = shape or request.mesh_shape
    if request.preset is not None:
        return factorisations(shape)
    return [(shape[0], tuple(shape[1:]) or (1,))] if shape[0] > 1 else []


def depths_not_offered(request: PlanRequest, shape: tuple[int, ...]) -> dict[int, str]:
    """The pipeline depths of ``shape``'s outermost axis (``factorisations``) the request does not
    let the search plan (``pipeline_options``), and why."""
    offered = {p for p, _ in pipeline_options(request, shape)}
    priced = {p for p, _ in pipeline_factorisations(request, shape)}
    return {p: ("no pipeline asked for" if not request.pipeline else
                f"the layout {request.layout!r} is priced as given" if request.layout is not None else
                "a measured profile prices only a pipeline over the whole outermost axis" if p not in priced else
                "the plan keeps the mesh's shape (a pipeline over the whole outermost axis only)")
            for p, _ in factorisations(shape) if p not in offered}


def pipeline_options(request: PlanRequest, shape: tuple[int, ...] | None = None) -> list[tuple[int, tuple[int, ...]]]:
    """The factorisations the request may pipeline over on ``shape`` (default: the request's mesh;
    none without ``request.pipeline`` or with a fixed ``layout``); ``request.outer_axis_only``:
    the whole outermost axis only (a plan for a given device mesh keeps its shape)."""
    if not request.pipeline or request.layout is not None:
        return []
    shape = shape or request.mesh_shape
    options = pipeline_factorisations(request, shape)
    if request.outer_axis_only:
        options = [(p, intra) for p, intra in options if p == shape[0] and tuple(intra) == tuple(shape[1:])]
    return options


# Seconds one pipeline depth takes to plan besides its solve (strategies and costs on its
# mesh, layout completion, recomputation fits, the stage search), per node of the captured
# graph. From the idle-machine run of benchmarks/plan_llama.py --size 70b --mesh 8 8 before
# this budget existed (about 5,900 nodes; search 52.5 s for 4 plans, up to 30 s of it the
# solvers' budget): 1 to 2 ms per node. At 1.5 ms that 70B call keeps all three depths at a
# 60 s limit; Megatron's 96-layer GPT (3,700 nodes) on 288 x 8 plans five of its 15 at 60 s,
# all at 300 s.
PLANNING_SECONDS_PER_NODE = 1.5e-3


def factorisation_budget(captured, time_limit_s: float) -> int:
    """How many pipeline depths the search plans: the half of ``time_limit_s`` the solvers do
    not get, over what one depth costs besides its solve (``PLANNING_SECONDS_PER_NODE`` per
    node of the captured graph); at least one. A count, not a clock: the same call plans the
    same depths."""
    per_depth = PLANNING_SECONDS_PER_NODE * len(captured.graph.nodes)
    return max(1, int(0.5 * time_limit_s / per_depth))


def seed_factorisations(n: int) -> list[int]:
    """The indices ``next_factorisation`` takes first of ``n`` depths, whatever the others gave:
    the middle, then the quarter points."""
    return list(dict.fromkeys((n // 2, n // 4, (3 * n) // 4)))


def next_factorisation(options: Sequence[tuple[int, tuple[int, ...]]], results: dict[int, float]) -> int | None:
    """Index into ``options`` (pipeline depths in increasing order) of the next one to try,
    given the predicted step times found so far (index -> seconds, inf where none fits); None
    when all are tried.

    Step time falls with depth while data-parallel traffic and memory shrink, and rises once
    the bubble and the per-stage imbalance dominate: about one valley. So first a spread (the
    middle, then the quarter points: a search cut short has seen shallow and deep pipelines
    alike), then a bisection of the untried depths between the best found and its tried
    neighbours (the larger side first, the shallower on a tie), then the rest nearest the best;
    while nothing fits, the deepest untried (a deeper pipeline holds less per device)."""
    n = len(options)
    untried = [i for i in range(n) if i not in results]
    if not untried:
        return None
    for seed in seed_factorisations(n):
        if seed not in results:
            return seed
    finite = {i: t for i, t in results.items() if math.isfinite(t)}
    if not finite:
        return max(untried)
    best = min(finite, key=lambda i: (finite[i], i))
    below = max((i for i in results if i < best), default=-1)
    above = min((i for i in results if i > best), default=n)
    if below < best - 1 or above > best + 1:
        if best - below >= above - best:
            return (below + best) // 2 if below >= 0 else (below + best + 1) // 2
        return (best + above + 1) // 2
    return min(untried, key=lambda i: (abs(i - best), -i))


def _no_slower_than_layouts(best: Plan, candidates: dict[str, float], graph, request: PlanRequest) -> Plan:
    """``best``, or the manual layout (without a pipeline) predicted faster, costed the same way
    (the pipelines' own layouts already compete inside ``pipeline_plan``)."""
    flat = {name: t for name, t in candidates.items() if "[" not in name}
    if not flat or min(flat.values()) >= best.predicted.step_time * (1 - 1e-9):
        return best
    name = min(flat, key=flat.get)
    try:
        manual, _ = plan_intra_op(graph, replace(request, layout=name))
    except PlanningError:
        return best
    too_big = sum(manual.predicted.memory.values()) > request.memory_bytes
    if manual.predicted.step_time >= best.predicted.step_time or too_big:
        return best
    manual.reasons.append(f"the {name} layout ({duration(manual.predicted.step_time)}) beat the search's best "
                          f"({duration(best.predicted.step_time)}) under the same costing, so it is the plan")
    return manual


# The safety nets that stop the pipeline search before its deterministic budget (depths,
# ``factorisation_budget``) runs out, and say so (``Plan.solver["clock_cut"]``): this
# process's CPU seconds past CPU_SAFETY_FACTOR x the time limit, or wall seconds past
# WALL_SAFETY_FACTOR x it. CPU time depends little on the machine's load (the 70B capture:
# 16.7 s wall idle; 17.0-17.8 CPU s at load 13 on 2 cores, 25.7 at load 16, where it took
# 62-337 s of wall clock), so the budget, not the load, decides the plan. The budget's own
# CPU use is about 1.4 x the limit at most (the solvers' half of it on 2 threads, the rest
# on one), 2 x with load's inflation; 3 x is a net, not the limit. The wall factor lets a starved process finish its budget: at load 19-25 on 2
# cores a planning process got a tenth of a core (Megatron's 177B GPT on 288 x 8: 67.8 CPU s
# in 762 s), and 10 x cut that search after 3 of its 5 depths.
CPU_SAFETY_FACTOR = 3.0
WALL_SAFETY_FACTOR = 30.0


@dataclass(frozen=True)
class SafetyNet:
    """The search's safety nets from its start: ``cut()`` is why it must stop now, or ""."""

    time_limit_s: float
    wall_started: float
    cpu_started: float

    @classmethod
    def start(cls, time_limit_s: float) -> SafetyNet:
        return cls(time_limit_s, time.perf_counter(), time.process_time())

    def cut(self) -> str:
        cpu = time.process_time() - self.cpu_started
        if cpu > CPU_SAFETY_FACTOR * self.time_limit_s:
            return f"{cpu:.0f} CPU s used, over {CPU_SAFETY_FACTOR:g} x the {self.time_limit_s:g} s limit"
        wall = time.perf_counter() - self.wall_started
        if wall > WALL_SAFETY_FACTOR * self.time_limit_s:
            return f"{wall:.0f} s of wall clock, over {WALL_SAFETY_FACTOR:g} x the {self.time_limit_s:g} s limit"
        return ""


class Graphs:
    """Strategy graphs of one capture by mesh, built once (each op call's OpInfo, and what else
    the capture alone decides, shared too): a pinned search plans the same meshes twice, with
    the pins and without."""

    def __init__(self, captured) -> None:
        self.captured = captured
        self.calls: dict = {}  # each op call's OpInfo, the same on every mesh: worked out once
        self.shared: dict = {}  # what else the capture alone decides (``StrategyGraph.once``)
        self.built: dict[tuple[int, ...], StrategyGraph] = {}

    def on(self, mesh: tuple[int, ...]) -> StrategyGraph:
        if tuple(mesh) not in self.built:
            self.built[tuple(mesh)] = build_strategy_graph(self.captured, tuple(mesh), self.calls, self.shared)
        return self.built[tuple(mesh)]


def plan_captured(captured, request: PlanRequest) -> Plan:
    """Intra-op plan on ``request.mesh_shape``, and (``request.pipeline``) pipelined plans over
    factorisations; the fastest wins. ``request.progress(phase, done, total)``, if given, is
    called as each of the ``total`` search steps starts. ``request.outer_axis_only``: pipelines
    only over the whole outermost axis (a plan for a given device mesh keeps its shape); none on
    a 1-D mesh. With pins (``request.constraints``): ``plan_pinned``."""
    with cyclic_collection_paused():
        if request.pinned:
            return plan_pinned(captured, request)
        return _search(captured, request, Graphs(captured))


@contextlib.contextmanager
def cyclic_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after. The search makes millions
    of small objects that live until it ends (prices, tables, cuts) and few reference cycles;
    the collector, started every 700 new objects, walks the old ones again and again: a
    tenth of a 70B plan's time. What cycles the search leaves are collected after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_pinned(captured, request: PlanRequest) -> Plan:
    """The fastest plan that honours the pins, and what they cost: the search without them
    first; where its plan honours every pin it is the plan (the pins cost nothing), else the
    search again with the pins as restrictions of its problems (``_search``). ``Plan.pins``
    records the unpinned plan's step time and memory and the pins it breaks (``explain()``)."""
    pins, started, cpu_started = request.constraints, time.perf_counter(), time.process_time()
    check_mesh(pins, request.mesh_shape, request.pipeline)
    check_patterns(pins, captured.params)
    check_outputs(pins, captured)
    layers = repeated_layer_count(captured)
    check_recompute(pins, layers)
    if pins.stage_starts:
        start_layers(pins, captured)  # names that name no layer's start: one error before any search
    graphs = Graphs(captured)
    free = None
    if request.price_pins:
        free_request = replace(request, constraints=None, progress=_prefixed(request.progress, "without pins: "))
        try:
            free = _search(captured, free_request, graphs)
        except PlanningError:
            pass
    breaks = broken_pins(free, pins, request.mesh_shape, graphs.on, layers) if free is not None else None
    if free is not None and not breaks:
        best = free
    else:
        try:  # on the mesh the pins need: an axis split where the degrees lie on no whole axes
            best = _search(captured, split_request(request, lambda shape: [1] + [
                p for p, _ in pipeline_options(request, shape)]), graphs)
        except PlanningError as exc:
            raise PlanningError(f"autopar: no plan honours the pins {pins}"
                                + ("" if free is None else f" (without them: {duration(free.predicted.step_time)})")
                                + f": {str(exc).removeprefix('autopar: ')}") from None
    best.pins = price_record(pins, best, free, breaks, priced=request.price_pins)
    best.solver["planning_seconds"] = time.perf_counter() - started  # both searches
    best.solver["planning_cpu_seconds"] = time.process_time() - cpu_started
    return best


def _prefixed(progress, prefix: str):
    """``progress`` told each phase with ``prefix``, and never "done" (a search follows)."""
    if progress is None:
        return None
    return lambda phase, done, total: None if phase == "done" else progress(prefix + phase, done, total)


def _depth_coverage(tried: dict[str, str], depth_of: dict[str, int], fitted: set[int]) -> Coverage:
    """The pipeline depths the search planned, ruled out (planned, nothing fits: not in
    ``fitted``) and skipped, read off its notes (``tried``: where -> what came of it, or "not
    tried: why"; ``depth_of``: where -> its depth)."""
    coverage = Coverage()
    for where, text in tried.items():
        p = depth_of[where]
        if text.startswith("not tried: "):
            coverage.skipped[str(p)] = text.removeprefix("not tried: ")
            continue
        coverage.tried.append(p)
        if p not in fitted:
            coverage.ruled_out[str(p)] = text.removeprefix("autopar: ")
    coverage.tried.sort()
    return coverage


def _start(pool: ForkedJobs, graphs: Graphs, meshes: dict) -> None:
    """The jobs ``meshes`` keys (key -> the mesh it plans on) started in ``pool``'s workers, their
    strategy graphs built here first: their warnings (an op replicated) are this process's, and
    the search reuses them after. Nothing where one process runs the search."""
    if pool.workers == 1:
        return
    for mesh in meshes.values():
        graphs.on(mesh)
    pool.start(*meshes)


def _step_time(candidate: Plan | None) -> float:
    """A planned depth's predicted step seconds (inf: nothing fits)."""
    return candidate.predicted.step_time if candidate is not None else math.inf


def next_guesses(options: Sequence[tuple[int, tuple[int, ...]]], results: dict[int, float],
                 pending: Sequence[int], budget: int) -> list[int]:
    """The depths ``next_factorisation`` may ask for once the ``pending`` ones (planned, their
    step times not known yet) are known: first as if none of them were the best, then as if
    they were; none where the budget ends with them."""
    if len(results) + len(pending) >= budget:
        return []
    lowest = min((t for t in results.values() if math.isfinite(t)), default=0.0)
    found = [next_factorisation(options, results | {i: t for i in pending}) for t in (math.inf, lowest - 1.0)]
    return [i for i in dict.fromkeys(found) if i is not None]


def _search(captured, request: PlanRequest, graphs: Graphs) -> Plan:
    """``plan_captured``'s search; with pins, over the factorisations their roles can be laid on
    (``constraints.mesh_roles``), each planned under them."""
    started = time.perf_counter()
    net = SafetyNet.start(request.time_limit_s)
    report = request.progress or (lambda phase, done, total: None)
    shape, limit, time_limit_s = request.mesh_shape, request.memory_bytes, request.time_limit_s
    pins = request.constraints if request.pinned else None
    where_of = lambda p, intra: f"pp{p}x{'x'.join(map(str, intra))}"  # noqa: E731
    tried = {"no pipeline": ""}
    options = pipeline_options(request)
    depth_of = {"no pipeline": 1} | {where_of(p, intra): p for p, intra in options}  # where -> pipeline depth
    layers = repeated_layer_count(captured)
    too_deep = [(p, intra) for p, intra in options if p > max(layers, 1)]
    options = [(p, intra) for p, intra in options if p <= max(layers, 1)]
    roles: dict[int, MeshRoles | None] = {}  # stages -> the pinned roles of its intra-op axes
    if pins is not None:
        laid = {p: mesh_roles(pins, shape, p) for p in [1] + [p for p, _ in options]}
        for p, intra in options:
            if isinstance(laid[p], str):
                tried[where_of(p, intra)] = f"not tried: {laid[p]}"
        options = [(p, intra) for p, intra in options if not isinstance(laid[p], str)]
        roles = {p: r[0] for p, r in laid.items() if not isinstance(r, str)}
        if 1 not in roles:
            tried["no pipeline"] = f"not tried: {laid[1]}"
    budget = min(len(options), factorisation_budget(captured, time_limit_s))
    flat = pins is None or 1 in roles  # the no-pipeline plan is searched
    total = int(flat) + budget
    report("strategies", 0, total)
    # a fixed share, not what the clock left: the same call gets the same search (the rest of
    # the time: costs, completion, stage search)
    solver_time = 0.5 * time_limit_s / (1 + budget)
    best, error, candidates = None, None, {}
    flat_request = replace(request, roles=roles.get(1))
    flat_job = lambda: plan_intra_op(graphs.on(shape), flat_request, solver_time_s=solver_time)[0]  # noqa: E731
    depth_job = lambda i: pipeline_plan(captured, options[i][0], options[i][1], request,  # noqa: E731
                                        solver_time_s=solver_time, graph=graphs.on(options[i][1]),
                                        roles=roles.get(options[i][0]))
    # The plan without a pipeline and the depths planned whatever the others give (all of them
    # within the budget, else its first seeds) are independent: started in worker processes at
    # once, each to its budget (a safety net that has cut already leaves them to this process).
    # A worker that would idle meanwhile plans a guess of the depth asked for next.
    first = range(len(options)) if budget == len(options) else seed_factorisations(len(options))[:budget]
    jobs = ({None: flat_job} if flat else {}) | {i: partial(depth_job, i) for i in range(len(options))}
    pool = ForkedJobs(jobs, worker_count(request.workers, int(flat) + budget))
    results: dict[int, float] = {}  # option index -> predicted step seconds (inf: none fits)

    def guesses() -> list[int]:
        """The depths asked for next as ``next_guesses`` sees them from the depths planned
        (those finished but not taken read), likeliest first: the next if none pending is the
        best, the one after it, and so on to the budget; then the other ways."""
        known, pending = dict(results), []
        for i in (k for k in pool.pending() if k is not None):
            done = pool.peek(i)
            if done is not None and done.error is None:
                known[i] = _step_time(done.value[0])
            else:
                pending.append(i)
        likeliest, other = [], []
        while not net.cut() and (found := next_guesses(options, known, pending, budget)):
            likeliest.append(found[0])
            other.extend(found[1:])
            pending.append(found[0])
        return list(dict.fromkeys(likeliest + other))

    with pool:
        if not net.cut():
            _start(pool, graphs, ({None: shape} if flat else {}) | {i: options[i][1] for i in first})
        if flat:
            report("no pipeline", 0, total)
            try:
                best = pool.result(None, guesses).result()
                tried["no pipeline"] = duration(best.predicted.step_time)
                candidates.update(best.candidates)
            except PlanningError as exc:
                error, tried["no pipeline"] = exc, str(exc)
        outcome: dict[int, str] = {}
        stage_searches: list[dict] = []  # what each planned depth's stage search covered
        cut_solves: list[str] = []  # the intra-op solves the wall clock stopped
        if best is not None and best.solver.get("clock_cut"):
            cut_solves.append("the intra-op solve without a pipeline")
        clock_cut = ""
        while len(results) < budget and (i := next_factorisation(options, results)) is not None:
            p, intra = options[i]
            report(where_of(p, intra), len(results) + int(flat), total)
            if not pool.started(i) and (clock_cut := net.cut()):
                break  # a safety net: the deterministic budget did not run out
            candidate, outcome[i] = pool.result(i, guesses).result()
            results[i] = _step_time(candidate)
            if candidate is None:
                continue
            stage_searches.append(candidate.solver["searched"])
            if candidate.solver.get("clock_cut"):
                cut_solves.append(f"the intra-op solve of the {p}-stage pipeline")
            candidates.update({f"{k_}[{where_of(p, intra)}]": t for k_, t in candidate.candidates.items()})
            if best is None or candidate.predicted.step_time < best.predicted.step_time:
                best = candidate
    for i, (p, intra) in enumerate(options):
        tried[where_of(p, intra)] = outcome.get(i) or (
            f"not tried: out of time ({clock_cut}: a safety net, not the budget)" if clock_cut else
            f"not tried: beyond the search budget of {budget} pipeline depths (next_factorisation's order)")
    for p, intra in too_deep:
        tried[where_of(p, intra)] = f"not tried: {p} stages for {layers} repeated layers"
    if best is None:
        if pins is not None:
            raise PlanningError("autopar: " + "; ".join(f"{k}: {v.removeprefix('autopar: ')}" for k, v in tried.items()))
        raise error or PlanningError(f"autopar: no plan fits in {limit / GIB:.3g} GiB per device on mesh {shape}")
    if flat:
        best = _no_slower_than_layouts(best, candidates, graphs.on(shape), flat_request)
    best.notes.extend(f"{k}: {v}" for k, v in tried.items())
    cuts = cut_solves + ([f"the pipeline search after {len(results)} of {budget} depths ({clock_cut})"]
                         if clock_cut else [])
    if cuts:
        best.solver["clock_cut"] = True  # a safety net, not the budget, left options out
    fitted = {options[i][0] for i, t in results.items() if math.isfinite(t)}
    fitted |= {1} if flat and error is None else set()
    depths = _depth_coverage(tried, depth_of, fitted)
    depths.skipped.update({str(p): why for p, why in depths_not_offered(request, shape).items()})
    best.solver["searched"] = {"pipeline_depths": depths.record(), **merged(stage_searches), "clock_cut": cuts}
    best.candidates = candidates
    best.hardware = request.preset or request.profile.machine
    best.solver["planning_seconds"] = time.perf_counter() - started
    # this process's, solver threads included, and its worker processes'
    best.solver["planning_cpu_seconds"] = time.process_time() - net.cpu_started + pool.cpu
    best.solver["memory_limit"] = limit
    report("done", total, total)
    return best
