"""Reading a Plan: ``explain`` (a table per layer and why) and ``diff`` (what two plans change).

Works from the Plan alone (a loaded JSON plan explains itself): the per-node
``breakdown`` the planner stored, the manual layouts' predicted times
(``candidates``) and the comparisons made while planning (``reasons``).
"""

from __future__ import annotations

import math
import re
from itertools import groupby

from torch.distributed.tensor import Shard

from autopar.costmodels.units import gib_text
from autopar.passes.placements import parse_spec
from autopar.passes.rules.overlapped import GATHER, SCATTER
from autopar.passes.rules.registry import KernelExplain, kernel_explain

MS = 1e3


def duration(t: float) -> str:
    """A duration in the unit that reads best: 12.3 us, 57.48 ms, 41.64 s."""
    if not math.isfinite(t):
        return "inf"
    if abs(t) >= 1:
        return f"{t:.4g} s"
    if abs(t) >= 1e-3 or t == 0:
        return f"{t * MS:.4g} ms"
    return f"{t * 1e6:.4g} us"


def device_mesh_call(plan) -> str:
    """The ``init_device_mesh`` call that builds the mesh this plan runs on, with its axis names."""
    shape = "(" + ", ".join(map(str, plan.mesh_shape)) + ("," if len(plan.mesh_shape) == 1 else "") + ")"
    names = "(" + ", ".join(f'"{n}"' for n in plan.axis_names) + ("," if len(plan.axis_names) == 1 else "") + ")"
    return (f'to run it: mesh = init_device_mesh("cuda", {shape}, mesh_dim_names={names}) on '
            f"{math.prod(plan.mesh_shape)} ranks (\"cpu\" under gloo), then autopar.compile(model, mesh, ..., plan=plan)")


def layer_rows(plan) -> list[tuple[str, float, float, float]]:
    """(layer label, compute s, communication s, bytes) per layer; nodes outside layers as 'other'."""
    rows: dict = {}
    for name, row in plan.breakdown.items():
        key = int(row["layer"]) if "layer" in row else -1
        acc = rows.setdefault(key, [0.0, 0.0, 0.0])
        acc[0] += row.get("compute", 0.0)
        acc[1] += row.get("comm", 0.0)
        acc[2] += row.get("memory", 0.0)
    return [("other" if k < 0 else f"layer {k}", *rows[k]) for k in sorted(rows)]


def _layer_signature(plan, layer: int) -> tuple:
    """Placements of a layer's parameters, named without the layer's own path (to fold identical layers)."""
    mine = sorted(fqn for fqn, k in plan.param_layers.items() if k == layer)
    if not mine:
        return ()
    prefix = _common_prefix(mine)
    return tuple((fqn[len(prefix):], plan.params.get(fqn, "?")) for fqn in mine)


def _common_prefix(names: list[str]) -> str:
    """The shared dotted prefix of a layer's parameter names, e.g. 'model.layers.3.'."""
    parts = [n.split(".") for n in names]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    if len(names) == 1:
        common = common[:-1]
    return ".".join(common) + "." if common else ""


def _kinds(memory: dict) -> list[str]:
    order = ["parameters", "gradients", "optimizer", "activations"]
    return [k for k in order if k in memory] + sorted(k for k in memory if k not in order)


def _inputs(text: str) -> tuple:
    return tuple(parse_spec(s) for s in text[1:text.index(") ->")].split(", "))


def _said(text: str) -> KernelExplain | None:
    """How the kernel a printed strategy runs says it is read (``autopar.passes.rules.registry.
    KernelExplain``); None for no kernel or one that says nothing."""
    return kernel_explain(text[text.rindex("[") + 1:-1]) if text.endswith("]") else None


def expert_axes(plan) -> tuple[list[str], list[int]]:
    """(the strategies that run only this rank's experts and the mesh axes their experts are
    split over: where the weights per expert, as their kernel names them, split dim 0)."""
    chosen, axes = [], set()
    for text in plan.strategies.values():
        said = _said(text)
        if said is None:
            continue
        weights = _inputs(text)[said.experts]
        by_expert = {_mesh_axis(plan, a) for a, p in enumerate(weights) if isinstance(p, Shard) and p.dim == 0}
        if by_expert:  # a kernel may also run blocks of rows with every expert: not expert parallel
            chosen.append(text)
            axes |= by_expert
    return chosen, sorted(axes)


def expert_parallel(plan) -> str | None:
    """'expert parallel: ...' for a plan that splits experts by expert, then what its kernels
    say of the strategies that do (how tokens reach the experts), each phrase counted."""
    chosen, axes = expert_axes(plan)
    if not chosen:
        return None
    where = ", ".join(f"{plan.axis_names[a]} (size {plan.mesh_shape[a]})" for a in axes)
    lines = [f"expert parallel: experts split by expert over {where}"]
    counts: dict[tuple[str, int | None], int] = {}
    for text in chosen:
        for phrase, a in _said(text).phrases(_inputs(text)):
            key = (phrase, None if a is None else _mesh_axis(plan, a))
            counts[key] = counts.get(key, 0) + 1
    # phrases about no axis first, then by mesh axis
    for (phrase, a), n in sorted(counts.items(), key=lambda kv: -1 if kv[0][1] is None else kv[0][1]):
        lines.append(f"{n} {phrase.format(axis=plan.axis_names[a]) if a is not None else phrase}")
    return "; ".join(lines)


def async_tensor_parallel(plan) -> str | None:
    """'async tensor parallel: ...' for a plan whose linears run their tensor-parallel
    collective inside, in chunks beside their matmuls (``autopar.passes.rules.overlapped``):
    how many of each kind; None for a plan without."""
    kernels = [text[text.rindex("[") + 1:-1] for text in plan.strategies.values() if text.endswith("]")]
    said = [f"{n} linear{'s' if n > 1 else ''} {what}" for n, what in (
        (kernels.count(SCATTER), "reduce-scattering the sum"), (kernels.count(GATHER), "gathering the input's rows")) if n]
    if not said:
        return None
    return "async tensor parallel (the collective in chunks, each beside another chunk's matmul): " + ", ".join(said)


def _mesh_axis(plan, a: int) -> int:
    """The plan's mesh axis of a strategy's axis ``a``: a pipeline plan's strategies live on
    the mesh without its pipeline axis."""
    if plan.pipeline is None:
        return a
    return [i for i in range(len(plan.mesh_shape)) if i != plan.pipeline.axis][a]


def _serving_lines(plan) -> list[str]:
    """A serving plan's head: the workload, its times, memory and where the cache lies."""
    p, w = plan.predicted, plan.inference
    new = w["max_len"] - w["prompt_len"]
    caches = sorted({spec for fqn, spec in _cache_specs(plan).items()})
    split = sum(1 for spec in plan.params.values() if "S(" in spec)
    return [
        f"serving plan {plan.kind} for {plan.model} on mesh {plan.mesh_shape} (axes {', '.join(plan.axis_names)})",
        device_mesh_call(plan),
        f"workload: {w['batch']} sequence(s), prompts up to {w['prompt_len']} tokens, {w['max_len']} positions cached "
        f"({new} new tokens each), objective {w['objective']}",
        f"predicted time to first token {duration(p.time_to_first_token)}, time per output token "
        f"{duration(p.time_per_output_token)}; one generation {duration(p.step_time)} (the prefill and {new - 1} "
        f"decode steps: compute {duration(p.compute)} + communication {duration(p.communication)}); "
        f"{p.tokens_per_second_per_device:.4g} tokens/s per device",
        "predicted memory per device: " + ", ".join(f"{k} {gib_text(v)}" for k, v in p.memory.items())
        + _total_text(plan),
        f"weights: {split} of {len(plan.params)} parameters split over the mesh; key-value cache laid out as "
        + (", ".join(caches) or "?"),
    ]


def _cache_specs(plan) -> dict[str, str]:
    """The cache buffers' placements, from the prefill's strategies of their placeholders."""
    return {name: text.split("->")[-1].strip() for name, text in plan.strategies.items()
            if name.startswith("b_cache_keys_") or name.startswith("b_cache_values_")}


def _total_text(plan) -> str:
    total = sum(plan.predicted.memory.values())
    over = plan.memory_over_limit()
    if not over:
        return f" (total {gib_text(total)})"
    return (f" (total {gib_text(total)}: DOES NOT FIT in the {gib_text(total - over)} per device it was planned for; "
            "a layout as written is priced as given: plan without layout= for one that fits, or on more devices)")


def explain(plan) -> str:
    p = plan.predicted
    if plan.inference is not None:
        lines = _serving_lines(plan)
        if plan.pipeline:
            pl = plan.pipeline
            lines.append(f"pipeline on axis {pl.axis}: {pl.stages} stages, each holding its layers' weights and cache; "
                         "one batch through them in turn")
        if plan.solver:
            lines.append(_solver_line(plan.solver))
        return "\n".join(lines + ["", "why:"] + [f"  {r}" for r in plan.reasons] + _candidate_lines(plan)
                         + [f"  note: {n}" for n in plan.notes])
    lines = [
        f"plan {plan.kind} for {plan.model} on mesh {plan.mesh_shape} (axes {', '.join(plan.axis_names)})",
        device_mesh_call(plan),
        f"predicted step {duration(p.step_time)} = compute {duration(p.compute)} + communication {duration(p.communication)}"
        f" + bubble {duration(p.bubble)}" + _hidden_text(p),
        "predicted memory per device: " + ", ".join(f"{k} {gib_text(p.memory[k])}" for k in _kinds(p.memory))
        + _total_text(plan),
    ]
    if plan.pipeline:
        pl = plan.pipeline
        lines.append(f"pipeline on axis {pl.axis}: {pl.stages} stages, {pl.micro_batches} micro-batches, "
                     f"{pl.schedule}" + (f", {pl.chunks_per_rank} chunks per rank" if pl.chunks_per_rank > 1 else "")
                     + (f"; its bubble {p.bubble / p.step_time:.0%} of the step" if p.step_time > 0 else ""))
    if plan.accumulate > 1:
        lines.append(f"gradient accumulation: each step runs {plan.accumulate} micro-batches of 1/{plan.accumulate} of "
                     "the batch, their gradients synced and the optimizer stepped once (priced so; train_step runs it)")
    if plan.mp_policy:
        lines.append(f"mixed precision: {plan.mp_policy['priced']}")
    if plan.recompute:
        lines.append(f"recomputed in backward: {len(plan.recompute)} layers")
    experts = expert_parallel(plan)
    if experts:
        lines.append(experts)
    fused = async_tensor_parallel(plan)
    if fused:
        lines.append(fused)
    zero = {}
    for level in plan.zero.values():
        zero[level] = zero.get(level, 0) + 1
    if zero:
        lines.append("ZeRO levels: " + ", ".join(f"{n} parameters at {lvl}" for lvl, n in sorted(zero.items())))
    if plan.solver:
        lines.append(_solver_line(plan.solver))
    lines += pin_lines(plan)
    rows = layer_rows(plan)
    if rows:
        lines += ["", f"{'layers':<16} {'compute':>12} {'comm':>12} {'memory':>10}  parameters"]
        layered = [r for r in rows if r[0] != "other"]
        keyed = [(r, _layer_signature(plan, int(r[0].split()[1]))) for r in layered]
        for (_, sig), group in groupby(keyed, key=lambda rs: (round(rs[0][1], 12), rs[1])):
            group = [g[0] for g in group]
            first, last = group[0][0].split()[1], group[-1][0].split()[1]
            label = f"layer {first}" if first == last else f"layers {first}-{last}"
            shown = ", ".join(f"{k} {v}" for k, v in sig[:6]) + (", ..." if len(sig) > 6 else "")
            r = group[0]
            lines.append(f"{label:<16} {duration(r[1]):>12} {duration(r[2]):>12} {gib_text(r[3]):>10}  {shown}"
                         + (" (each)" if len(group) > 1 else ""))
        for r in rows:
            if r[0] == "other":
                lines.append(f"{'other':<16} {duration(r[1]):>12} {duration(r[2]):>12} {gib_text(r[3]):>10}")
    lines += ["", "why:"]
    lines += [f"  {r}" for r in plan.reasons]
    lines += _candidate_lines(plan)
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def pin_lines(plan) -> list[str]:
    """A pinned plan (``Plan.pins``) beside the fastest plan the search found without its pins:
    step time, memory, layout, and what the pins it breaks cost ("pinning tp=8 costs 6.5%
    (1.31 s against 1.23 s)"); nothing for a plan without pins."""
    record = getattr(plan, "pins", None)
    if not record:
        return []
    pins, free, broken = ", ".join(record["pins"]), record.get("unpinned"), record.get("broken") or []
    if not record.get("priced", True):
        return [f"pins: {pins} (not priced against the search without them: pass them as constraints= for that)"]
    if free is None:
        return [f"pins: {pins}; without them no plan fits either, so their price is unknown"]
    if not broken:
        return [f"pins: {pins}: the fastest plan without them honours them all, so they cost nothing (this is it)"]
    t, t0 = plan.predicted.step_time, free["step_time"]
    m, m0 = sum(plan.predicted.memory.values()), free["memory"]
    lines = [f"pins: {pins}", f"  {'':<14} {'pinned':>12}  {'without them':>12}",
             f"  {'step':<14} {duration(t):>12}  {duration(t0):>12}",
             f"  {'memory/device':<14} {gib_text(m):>12}  {gib_text(m0):>12}",
             f"  pinned:        {record.get('layout', '')}", f"  without them:  {free['layout']}"]
    change = t / t0 - 1 if t0 > 0 else math.nan
    if change >= 0:
        lines.append(f"  pinning {', '.join(broken)} costs {100 * change:.3g}% ({duration(t)} against {duration(t0)})")
    else:  # the budgets differ: the search without pins did not reach this plan
        lines.append(f"  pinning {', '.join(broken)} costs nothing the search can see: this plan is {-100 * change:.3g}% "
                     f"faster than the one it found without them ({duration(t)} against {duration(t0)})")
    return lines + pin_diff(free.get("placement"), plan)


PIN_DIFF_LINES = 12  # differences shown; the rest counted


def pin_diff(free: dict | None, plan) -> list[str]:
    """Where a pinned plan differs from the plan without its pins (``Plan.pins``' record of its
    placements: ``pin_price.placement_record``), layer by layer as ``diff`` folds them: each
    parameter placed or ZeRO-levelled otherwise, and the layers recomputed."""
    if free is None:
        return []
    names = sorted(set(free["params"]) | set(plan.params))
    placed = [(f, free["params"].get(f), plan.params.get(f)) for f in names
              if free["params"].get(f) != plan.params.get(f)]
    zeroed = [(f, free["zero"].get(f), plan.zero.get(f)) for f in names if free["zero"].get(f) != plan.zero.get(f)]
    layers = {**free["param_layers"], **plan.param_layers}
    changes = _folded("param", placed, layers) + _folded("zero", zeroed, layers)
    if sorted(free["recompute"]) != sorted(plan.recompute):
        changes.append(f"recompute: {_layers_text(free['recompute'])} -> {_layers_text(plan.recompute)}")
    starts = stage_starts(plan)
    if free.get("stage_starts", []) != starts:
        changes.insert(0, f"stages start at: {_starts_text(free.get('stage_starts', []))} -> {_starts_text(starts)}")
    if not changes:
        return ["  where they differ: no parameter placed or ZeRO-levelled otherwise, no stage starting or layer "
                "recomputed otherwise (their ops' strategies only)"]
    more = len(changes) - PIN_DIFF_LINES
    return (["  where they differ (without them -> pinned), layer by layer:"]
            + [f"    {line}" for line in changes[:PIN_DIFF_LINES]] + ([f"    ... and {more} more"] if more > 0 else []))


def stage_starts(plan) -> list[int]:
    """The repeated layers where a plan's (virtual) stages 2, 3, ... start, read off where its
    parameters lie ([] without a pipeline)."""
    if plan.pipeline is None:
        return []
    fqn = {name: key.removeprefix("param:") for name, key in plan.node_keys.items() if key.startswith("param:")}
    first: dict[int, int] = {}
    for name, stage in plan.pipeline.stage_of.items():
        if (layer := plan.param_layers.get(fqn.get(name, ""))) is not None:
            first[stage] = min(first.get(stage, layer), layer)
    return [first[s] for s in sorted(first) if s > 0]


def _starts_text(starts: list[int]) -> str:
    return "layers " + ", ".join(map(str, starts)) if starts else "no pipeline"


def _layers_text(recomputed: list[str]) -> str:
    numbers = sorted(int(text.split()[-1]) for text in recomputed)
    return f"layers {ranges(numbers)}" if numbers else "no layer"


def _hidden_text(p) -> str:
    """The communication that ran beside compute and hid behind it, where any did."""
    if not p.hidden_communication:
        return ""
    return (f" (communication exposed; {duration(p.hidden_communication)} more ran beside compute and hid "
            "behind it)")


def _solver_line(s: dict) -> str:
    """The intra-op solver's verdict and bound, and for a searched plan a second line: what the
    search covered (``_searched_words``) and what the clock cut (``_clock_words``)."""
    if s.get("status") is None:  # a layout priced as given: nothing was solved
        head = "solver: none (a manual layout, priced as given)"
    else:
        status = {"optimal": "proven the fastest", "feasible": "fits, not proven the fastest"}.get(
            s.get("status"), str(s.get("status")))
        head = (f"solver: {status}; found by {_found_by(str(s.get('method')))}; {_gap_words(s.get('gap'))}; "
                f"{s.get('decisions')} decisions, {s.get('seconds', 0):.2f} s")
    if s.get("searched"):
        return f"{head}\nsearched: {_searched_words(s['searched'])}; {_clock_words(s)}"
    return head if s.get("status") is None else f"{head}; {_clock_words(s)}"


def _found_by(method: str) -> str:
    """Who found the solver's plan (``SolveResult.method``), in words."""
    words = {"chain_dp": "the exact dynamic program over the layer chain", "ilp": "the integer program (CP-SAT)",
             "elimination": "exact variable elimination over the layer graph",
             "heuristic": "the chain-relaxation heuristic", "min_memory": "the least-memory plan",
             "trivial": "the only choice (one strategy per node)"}
    if method in words:
        return words[method]
    hint = re.fullmatch(r"hint (\d+)", method)
    if hint:
        return f"starting candidate {hint.group(1)} (a manual layout or an earlier solve): the search found none faster"
    return method.replace("layout ", "the manual layout ", 1)


def _gap_words(gap: float | None) -> str:
    """The intra-op solver's gap, (time - bound) / time, as what it promises: about the layouts
    of this plan's pipeline (its depth; no pipeline: the whole mesh), not about other depths
    (``_searched_words`` says which were tried)."""
    if gap == 0:
        return "intra-op layout proven the best for this pipeline (bound reached)"
    if gap is None or not math.isfinite(gap):
        return "intra-op: no bound was proven, so how far the layout is from the best for this pipeline is unknown"
    bound = f"{gap:.1%}" if gap >= 0.0005 else "0.1%"
    return f"intra-op layout within {bound} of the best layout for this pipeline (the solver's proven bound)"


def _searched_words(searched: dict) -> str:
    """What the planner's search covered (``Plan.solver["searched"]``: ``autopar.passes.planner.
    searched``): the pipeline depths and schedules tried, those ruled out or skipped and why,
    the interleaved schedules' chunks per rank, the micro-batch counts."""
    parts = [_covered("pipeline depths", searched["pipeline_depths"])] if "pipeline_depths" in searched else []
    schedules, chunks = searched.get("schedules") or {}, searched.get("chunks_per_rank") or {}
    if schedules.get("tried") or schedules.get("skipped"):
        def with_chunks(name: str) -> str:  # the chunks per rank of an interleaved schedule that ran
            ran = name in chunks and name not in schedules.get("ruled_out", {})
            return f"{name} with {_either(chunks[name])} chunks per rank" if ran else name

        parts.append(_covered("schedules", schedules, with_chunks))
    if searched.get("micro_batches"):
        parts.append(f"micro-batches {_either(searched['micro_batches'])}")
    return "; ".join(parts)


def _covered(what: str, coverage: dict, name=str) -> str:
    """'pipeline depths 1, 2 (2 ruled out: why, 4 and 8 skipped: why)': a ``searched.Coverage``
    record, the options that share a reason named together."""
    tried = [str(k) for k in coverage.get("tried", [])]

    def order(item: tuple[str, str]) -> tuple:  # as tried, then by depth: a saved plan's JSON sorts its keys
        key = item[0]
        return tried.index(key) if key in tried else len(tried), int(key) if key.isdigit() else 0, key

    told: dict[tuple[str, str], list[str]] = {}
    for verb in ("ruled_out", "skipped"):
        for key, why in sorted(coverage.get(verb, {}).items(), key=order):
            told.setdefault((verb.replace("_", " "), _short(why)), []).append(key)
    said = [f"{_either(keys, 'and')} {verb}: {why}" for (verb, why), keys in told.items()]
    return f"{what} {', '.join(name(k) for k in tried) or 'none tried'}" + (f" ({', '.join(said)})" if said else "")


def _either(items, word: str = "or") -> str:
    """'1, 2 or 4'."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {word} {items[-1]}"


def _short(why: str, limit: int = 100) -> str:
    """A reason as one short clause: without the ``autopar:`` prefix, to its first ';' or line
    end, at most ``limit`` characters."""
    why = why.removeprefix("autopar: ").split("\n")[0].split("; ")[0]
    return why if len(why) <= limit else why[:limit].rsplit(" ", 1)[0] + " ..."


def _clock_words(s: dict) -> str:
    """Whether a safety net (the wall clock, CPU seconds) stopped any of the search, which
    otherwise runs its deterministic budget (``Plan.solver["clock_cut"]``)."""
    cuts = (s.get("searched") or {}).get("clock_cut") or []
    if cuts:
        return f"the clock cut {_either(cuts, 'and')} (a safety net, not the budget)"
    if s.get("clock_cut"):
        return "the clock cut the search short (a safety net, not the budget)"
    return "the clock cut nothing"


def _candidate_lines(plan) -> list[str]:
    """The best manual layout against the plan, and every layout that fits (their predicted
    step, or for a serving plan one generation)."""
    if not plan.candidates:
        return []
    best = min(plan.candidates.items(), key=lambda kv: (kv[1], kv[0]))
    ratio = plan.predicted.step_time / best[1] if best[1] > 0 else math.nan
    return [f"  best manual layout: {best[0]} at {duration(best[1])}; {plan.kind} / best = {ratio:.3f}",
            "  manual layouts that fit: " + ", ".join(
                f"{k} {duration(v)}" for k, v in sorted(plan.candidates.items(), key=lambda kv: (kv[1], kv[0])))]


def diff(a, b) -> str:
    """What two plans change: a summary first (mesh, pipeline, recompute, prediction, how
    many parameters and strategies differ), then each difference, a change made alike in
    identical repeated layers written once for the first layer with the others named."""
    summary = []
    if a.mesh_shape != b.mesh_shape or a.axis_names != b.axis_names:
        summary.append(f"mesh: {a.mesh_shape} {a.axis_names} -> {b.mesh_shape} {b.axis_names}")
    pa = a.pipeline and (a.pipeline.stages, a.pipeline.micro_batches, a.pipeline.schedule)
    pb = b.pipeline and (b.pipeline.stages, b.pipeline.micro_batches, b.pipeline.schedule)
    if pa != pb:
        summary.append(f"pipeline (stages, micro-batches, schedule): {pa} -> {pb}")
    if sorted(a.recompute) != sorted(b.recompute):
        summary.append(f"recompute: {len(a.recompute)} -> {len(b.recompute)} layers")
    ta, tb = a.predicted.step_time, b.predicted.step_time
    if ta != tb:
        summary.append(f"predicted step: {duration(ta)} -> {duration(tb)} ({(tb / ta if ta else math.inf):.3f}x)")
    ma, mb = sum(a.predicted.memory.values()), sum(b.predicted.memory.values())
    if ma != mb:
        summary.append(f"predicted memory: {gib_text(ma)} -> {gib_text(mb)} per device")
    names = sorted(set(a.params) | set(b.params))
    placed = [(f, a.params.get(f), b.params.get(f)) for f in names if a.params.get(f) != b.params.get(f)]
    zeroed = [(f, a.zero.get(f), b.zero.get(f)) for f in names if a.zero.get(f) != b.zero.get(f)]
    if placed or zeroed:
        summary.append(f"{len(placed)} of {len(names)} parameters placed differently, {len(zeroed)} at another ZeRO level")
    changed = [n for n in a.strategies if n in b.strategies and a.strategies[n] != b.strategies[n]]
    if changed:
        summary.append(f"{len(changed)} node strategies differ, e.g. " + "; ".join(
            f"{n}: {a.strategies[n]} -> {b.strategies[n]}" for n in changed[:3]))
    missing = set(a.strategies) ^ set(b.strategies)
    if missing:
        summary.append(f"{len(missing)} nodes are in only one plan (different model or inputs)")
    if not summary:
        return "plans are identical"
    layers = {**b.param_layers, **a.param_layers}
    details = _folded("param", placed, layers) + _folded("zero", zeroed, layers)
    return "\n".join(summary + (["", "each difference:"] + details if details else []))


def _folded(kind: str, changes: list[tuple[str, object, object]], layers: dict[str, int]) -> list[str]:
    """``kind fqn: x -> y`` per change; the same change at the same place of other repeated
    layers folded into the first one's line."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for fqn, x, y in changes:
        k = layers.get(fqn)
        place = re.sub(rf"(^|\.){k}\.", r"\1#.", fqn, count=1) if k is not None else fqn
        groups.setdefault((place, x, y), []).append((-1 if k is None else k, fqn))
    lines = []
    for (_, x, y), members in groups.items():
        members.sort()
        more = [k for k, _ in members[1:]]
        also = f" (and the same in {len(more)} more layers: {ranges(more)})" if more else ""
        lines.append(f"{kind} {members[0][1]}: {x} -> {y}{also}")
    return lines


def ranges(numbers: list[int], sep: str = ", ") -> str:
    """Sorted whole numbers as runs: 1, 2, 3, 5 -> '1-3, 5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return sep.join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
