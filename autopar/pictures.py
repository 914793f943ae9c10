"""Pictures of a Plan, as PNG files: the pipeline schedule, memory per device, and where
every layer's weights live. Each picture is a function ``(plan, path) -> path``; they
read the Plan alone, so a saved plan draws itself (``autopar explain plan.json
--pictures DIR``). matplotlib (Agg backend, no display) is imported inside the
functions that draw.

- ``pipeline_schedule``: rank x time, a box per forward or backward (or, split, each of its
  input- and weight-gradient parts) of one micro-batch on one (virtual) stage, in the order
  torch's schedule runs them (``costmodels.schedule_replay``); the white space is the
  bubble. Box lengths are the plan's own
  per-stage costs (``Plan.breakdown`` summed over each stage's nodes, split forward :
  backward as 1 : ``BACKWARD_FACTOR``), or equal where the plan has none.
- ``memory_per_device``: the predicted bytes per device stacked by kind, against the
  device memory the plan was made for (``plan.solver["memory_limit"]``).
- ``weight_placement``: a row per parameter, a column per mesh axis, each cell the
  parameter's storage placement on that axis, plus its ZeRO level; repeated layers with
  identical placements fold into one group ("layers 0-79"); an axis experts are split
  over by expert (expert parallel) is marked "by expert".
"""

from __future__ import annotations

import math
from itertools import groupby
from pathlib import Path

from autopar.costmodels import Schedule
from autopar.costmodels.formulas import BACKWARD_FACTOR
from autopar.costmodels.schedule_replay import replay
from autopar.costmodels.units import GIB, MIB, gib_text
from autopar.passes.explain import _common_prefix, _kinds, expert_axes
from autopar.passes.placements import parse_spec, spec_str


def write_all(plan, out_dir: str | Path) -> dict[str, Path | str]:
    """Every picture of ``plan`` into ``out_dir``: name -> its path, or why it was not drawn."""
    out = {}
    for name, (filename, draw) in PICTURES.items():
        try:
            out[name] = draw(plan, Path(out_dir) / filename) or "the plan has no pipeline"
        except ValueError as e:  # a plan the picture cannot show, e.g. a schedule torch cannot run
            out[name] = str(e).removeprefix("autopar: ")
    return out


# --- pipeline schedule -------------------------------------------------------------


def stage_times(plan, chunks: int) -> tuple[list[float], list[float], bool]:
    """Forward and backward seconds per micro-batch of every virtual stage, and whether they come
    from the plan's costs (else equal: forward 1, backward ``BACKWARD_FACTOR``)."""
    pl = plan.pipeline
    n = pl.stages * chunks
    total = [0.0] * n
    for name, row in plan.breakdown.items():
        s = pl.stage_of.get(name)
        if s is not None and 0 <= s < n:
            total[s] += row.get("compute", 0.0) + row.get("comm", 0.0)
    from_costs = all(math.isfinite(t) and t > 0 for t in total)
    per = [t / pl.micro_batches for t in total] if from_costs else [1.0 + BACKWARD_FACTOR] * n
    share = 1.0 / (1.0 + BACKWARD_FACTOR)  # of a forward-and-backward, the forward's part
    return [t * share for t in per], [t * (1.0 - share) for t in per], from_costs


def pipeline_schedule(plan, path: str | Path) -> Path | None:
    """The schedule as rank x time boxes; None (nothing written) for a plan without a pipeline."""
    pl = plan.pipeline
    if pl is None:
        return None
    from matplotlib import colormaps, patches

    schedule = Schedule.parse(pl.schedule)
    p, m, v = pl.stages, pl.micro_batches, schedule.chunks(pl.chunks_per_rank)
    forward, backward, from_costs = stage_times(plan, v)
    # a split backward's two parts taken as equal (Qi et al. 2024's ZB-H1 assumption)
    half = 0.5 if schedule.split_backward else 1.0
    boxes = [a for a in replay(schedule, m, forward, [b * half for b in backward], [b * (1 - half) for b in backward], v)
             if a.end > a.start]
    span = max(b.end for b in boxes)
    scale, unit = (1e3, "ms") if from_costs else (1.0, "forward of one micro-batch = 1")
    busy = sum(b.end - b.start for b in boxes)

    fig, ax = _figure(14, 1.2 + 0.55 * p)
    colors = {"F": colormaps["Blues"], "B": colormaps["Oranges"], "I": colormaps["Oranges"], "W": colormaps["Greens"]}
    shade = lambda c: 0.45 + 0.4 * (c / max(v - 1, 1)) if v > 1 else 0.55  # noqa: E731
    width_px = fig.get_figwidth() * fig.dpi * 0.8
    for b in boxes:
        chunk = b.stage // p
        color = colors[b.kind](shade(chunk))
        ax.add_patch(patches.Rectangle((b.start * scale, b.rank - 0.4), (b.end - b.start) * scale, 0.8,
                                       facecolor=color, edgecolor="white", linewidth=0.6))
        label = str(b.micro_batch)
        if (b.end - b.start) / span * width_px >= 7 * len(label) + 4:
            ax.text((b.start + b.end) / 2 * scale, b.rank, label, ha="center", va="center", fontsize=8,
                    color="white" if b.kind != "F" or chunk else "black")
    ax.set_xlim(0, span * scale * 1.005)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" + (f" (stages {', '.join(map(str, schedule.stages_of(r, p, v)))})" if v > 1
                                       else f" (stage {r})") for r in range(p)])
    ax.set_xlabel(f"time ({unit})")
    parts = [("F", "forward"), ("I", "input gradients"), ("W", "weight gradients")] if schedule.split_backward \
        else [("F", "forward"), ("B", "backward")]
    legend = [patches.Patch(color=colors[kind](shade(c)), label=f"{what}{f' chunk {c}' if v > 1 else ''}")
              for kind, what in parts for c in range(v)]
    legend.append(patches.Patch(facecolor="white", edgecolor="grey", label="idle (bubble)"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    source = "stage times from the plan's per-node costs" if from_costs else \
        "equal stage times assumed: the plan holds no per-stage costs"
    chunk_note = f", {v} chunks per rank" if v > 1 else ""
    ax.set_title(f"{pl.schedule} pipeline: {p} stages, {m} micro-batches{chunk_note}; numbers are micro-batches; "
                 f"idle {1 - busy / (p * span):.0%} of rank time\n{plan.model} ({source})", fontsize=10)
    return _save(fig, path)


# --- memory per device ---------------------------------------------------------------


def memory_per_device(plan, path: str | Path, capacity: float | None = None) -> Path:
    """Predicted bytes per device stacked by kind (GiB; MiB for a plan under 1 GiB), with the device
    memory line when known (``capacity`` in bytes, else ``plan.solver["memory_limit"]``)."""
    memory = plan.predicted.memory
    capacity = capacity if capacity is not None else plan.solver.get("memory_limit")
    total_bytes = sum(memory.values())
    scale, unit = (GIB, "GiB") if total_bytes >= GIB else (MIB, "MiB")
    total = total_bytes / scale
    cap = capacity / scale if capacity else None
    show_cap = cap is not None and total >= 0.05 * cap  # else the bar would vanish beside the line
    top = max(total, cap if show_cap else 0.0) or 1.0
    devices = math.prod(plan.mesh_shape)
    who = (f"the fullest pipeline rank\n(its {devices // plan.pipeline.stages} devices)" if plan.pipeline
           else f"each of the {devices} devices")
    fig, ax = _figure(7, 5.5)
    colors = dict(zip(["parameters", "gradients", "optimizer", "activations"],
                      ["#4c72b0", "#55a868", "#c44e52", "#dd8452"]))
    bottom = 0.0
    for k, kind in enumerate(_kinds(memory)):
        size = memory[kind] / scale
        ax.bar([0], [size], bottom=bottom, width=0.5, color=colors.get(kind, f"C{4 + k}"),
               label=f"{kind}: {size:.3g} {unit}")
        if size > 0.08 * top:
            ax.text(0, bottom + size / 2, f"{kind}\n{size:.3g} {unit}", ha="center", va="center", color="white",
                    fontsize=9)
        bottom += size
    used = "" if not cap else f" ({total / cap:.0%} of the device)" if total >= 0.01 * cap else " (<1% of the device)"
    ax.text(0, total, f"total {total:.3g} {unit}{used}", ha="center", va="bottom", fontsize=10, fontweight="bold")
    if show_cap:
        ax.axhline(cap, color="black", linestyle="--", linewidth=1.2)
        ax.text(0.88, cap, f"device memory {cap:.3g} {unit}", va="bottom", ha="right",
                fontsize=9)
    elif cap is not None:
        ax.text(0.88, top * 1.1, f"device memory {gib_text(capacity)}: off the scale",
                va="top", ha="right", fontsize=9)
    ax.set_xlim(-0.6, 0.9)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks([0])
    ax.set_xticklabels([who])
    ax.set_ylabel(f"{unit} per device")
    ax.legend(loc="center right", fontsize=8, frameon=False, reverse=True)
    ax.set_title(f"Predicted memory per device: {plan.model}\n{plan.kind} plan on mesh "
                 f"{'x'.join(map(str, plan.mesh_shape))} ({', '.join(plan.axis_names)})", fontsize=10)
    return _save(fig, path)


# --- weight placement ------------------------------------------------------------------

_PLACEMENT_COLORS = {"R": "#e6e6e6", "S(0)": "#4c72b0", "S(1)": "#dd8452", "S(2)": "#55a868", "S(3)": "#8172b3",
                     "P": "#c44e52"}
_ZERO_COLORS = {0: "#ffffff", 1: "#fff2b3", 2: "#ffd24d", 3: "#e69500"}


def placement_groups(plan) -> list[tuple[str, list[tuple[str, str, int]]]]:
    """(group label, [(parameter label, storage spec, ZeRO level)]): the parameters outside
    repeated layers one by one, then each run of consecutive layers whose parameters are placed
    alike as one group (with the pipeline stages it spans), named by the layer's own parameter
    names (``attn.q.weight``)."""
    groups = []
    outside = sorted(fqn for fqn in plan.params if fqn not in plan.param_layers)
    if outside:
        groups.append(("outside repeated layers", [(f, plan.params[f], plan.zero.get(f, 0)) for f in outside]))

    def signature(layer: int) -> tuple:
        mine = sorted(f for f, k in plan.param_layers.items() if k == layer and f in plan.params)
        prefix = _common_prefix(mine)
        return tuple((f[len(prefix):], plan.params[f], plan.zero.get(f, 0)) for f in mine)

    stage = _layer_stages(plan)
    layers = sorted(set(plan.param_layers.values()))
    for sig, run in groupby(layers, key=signature):
        run = list(run)
        label = f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}\u2013{run[-1]} (each)"
        stages = sorted({stage[k] for k in run if k in stage})
        if stages:
            label += f", stage {stages[0]}" if len(stages) == 1 else f", stages {stages[0]}\u2013{stages[-1]}"
        groups.append((label, list(sig)))
    return groups


def _layer_stages(plan) -> dict[int, int]:
    """Repeated-layer number -> pipeline stage, from the per-node breakdown (empty without a pipeline)."""
    if plan.pipeline is None:
        return {}
    out = {}
    for name, row in plan.breakdown.items():
        if "layer" in row and name in plan.pipeline.stage_of:
            out.setdefault(int(row["layer"]), plan.pipeline.stage_of[name])
    return out


def weight_placement(plan, path: str | Path) -> Path:
    """Parameters x mesh axes, each cell the storage placement on that axis; a ZeRO column."""
    from matplotlib import patches

    groups = placement_groups(plan)
    axes = [(n, s) for a, (n, s) in enumerate(zip(plan.axis_names, plan.mesh_shape))
            if plan.pipeline is None or a != plan.pipeline.axis]  # stages' parameters live on the other axes
    _, by_expert = expert_axes(plan)
    columns = [f"{n}\n({s})" + ("\nby expert" if plan.axis_names.index(n) in by_expert else "")
               for n, s in axes] + ["ZeRO"]
    rows = sum(1 + len(members) for _, members in groups)
    fig, ax = _figure(2.5 + 0.8 * len(columns), 1.6 + 0.26 * rows)
    labels, y, bold = [], 0, []
    seen_specs, seen_zero = set(), set()
    for title, members in groups:
        labels.append(title)
        bold.append(y)
        y += 1
        for name, spec, level in members:
            for a, text in enumerate(spec_str((p,)) for p in parse_spec(spec)):
                seen_specs.add(text)
                _cell(ax, patches, a, y, text, _PLACEMENT_COLORS.get(text, "#8172b3"))
            seen_zero.add(level)
            _cell(ax, patches, len(axes), y, str(level), _ZERO_COLORS.get(level, "#ffffff"))
            labels.append(name)
            y += 1
    ax.set_xlim(-0.5, len(columns) - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks(range(rows))
    ax.set_yticklabels(labels, fontsize=8)
    for k, tick in enumerate(ax.get_yticklabels()):
        if k in bold:
            tick.set_fontweight("bold")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    legend = [patches.Patch(facecolor=_PLACEMENT_COLORS.get(s, "#8172b3"), edgecolor="grey",
                            label="R: replicated" if s == "R" else f"{s}: sharded on tensor dim {s[2:-1]}"
                            if s.startswith("S") else s) for s in sorted(seen_specs)]
    legend += [patches.Patch(facecolor=_ZERO_COLORS.get(z, "#ffffff"), edgecolor="grey", label=_ZERO_WORDS[z])
               for z in sorted(seen_zero) if z in _ZERO_WORDS]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    pp = f"; pipeline axis {plan.axis_names[plan.pipeline.axis]}: by stage" if plan.pipeline else ""
    pp += "; experts split by expert on the axes so marked" if by_expert else ""
    ax.set_title(f"Where each weight is stored: {plan.model} on mesh {'x'.join(map(str, plan.mesh_shape))}{pp}",
                 fontsize=10, pad=12)
    return _save(fig, path)


_ZERO_WORDS = {0: "ZeRO 0: stored as used", 1: "ZeRO 1: optimizer state sharded",
               2: "ZeRO 2: + gradients sharded", 3: "ZeRO 3: + parameters gathered at each use"}


def _cell(ax, patches, x: int, y: int, text: str, color: str) -> None:
    from matplotlib.colors import to_rgb

    ax.add_patch(patches.Rectangle((x - 0.45, y - 0.42), 0.9, 0.84, facecolor=color, edgecolor="#bbbbbb",
                                   linewidth=0.5))
    dark = sum(to_rgb(color)) < 2.0
    ax.text(x, y, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")


def _figure(width: float, height: float):
    """A figure drawn by the Agg renderer, outside pyplot (no global figure state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


PICTURES = {  # name -> (file name, drawing function)
    "pipeline schedule": ("pipeline.png", pipeline_schedule),
    "memory per device": ("memory.png", memory_per_device),
    "weight placement": ("weights.png", weight_placement),
}
