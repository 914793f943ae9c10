"""The report of ``autopar.bench``: ratios, ``results.json``, ``table.md`` and PNG charts.

Charts (matplotlib, Agg backend, imported inside the functions that draw):

- ``step_<mesh>.png``: step time per layout, one panel per model, predicted and (gloo)
  measured bars side by side, log scale;
- ``predicted_vs_measured.png``: every measured plan, predicted against measured step
  time, log-log, with the line y = x;
- ``memory_<mesh>.png``: memory per rank per layout, predicted and (gloo) measured bars.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from autopar.costmodels.units import GIB, MIB, gib_text

MANUAL_EXCLUDED = ("n/a", "does not fit")
LOSS_TOLERANCE = 1e-4  # relative; float32 sums in other orders differ by about 1e-7
COLUMNS = ("model", "layout", "pred step", "meas step", "meas ÷ pred", "pred mem/rank", "meas mem/rank",
           "meas ÷ pred mem", "planning s", "÷ best manual (pred)", "÷ best manual (meas)", "dry run", "note")
SUMMARY_COLUMNS = ("model", "mesh", "auto plan", "auto pred", "best manual (pred)", "auto ÷ best manual (pred)",
                   "auto meas", "best manual (meas)", "auto ÷ best manual (meas)", "auto planning s")
DRY_RUN_COLUMNS = ("mesh", "model", "auto plan", "dry run", "worst-rank peak", "predicted ÷ peak", "dry run s")


def add_ratios(rows: list[dict]) -> list[dict]:
    """Per model x mesh: the best manual layout (predicted; measured) and every row's ratio to it."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mesh"], row["model"]), []).append(row)
    for group in groups.values():
        manual = [r for r in group if r["layout"] != "auto"]
        best_pred = _best(manual, "predicted_step", lambda r: r.get("fits") and r.get("status") not in MANUAL_EXCLUDED)
        best_meas = _best(manual, "measured_step", lambda r: r.get("status") == "measured")
        for row in group:
            if best_pred and row.get("predicted_step") is not None:
                row["vs_best_manual_predicted"] = row["predicted_step"] / best_pred[1]
                row["best_manual_predicted"] = best_pred[0]
            if best_meas and row.get("measured_step") is not None:
                row["vs_best_manual_measured"] = row["measured_step"] / best_meas[1]
                row["best_manual_measured"] = best_meas[0]
            if row.get("measured_step") and row.get("predicted_step"):
                row["measured_over_predicted"] = row["measured_step"] / row["predicted_step"]
            if row.get("measured_memory_total") and row.get("predicted_memory_total"):
                row["memory_measured_over_predicted"] = row["measured_memory_total"] / row["predicted_memory_total"]
        _check_first_losses(group)
    return rows


def _check_first_losses(group: list[dict]) -> None:
    """Every layout starts from the same weights and batch: a first loss that differs from the
    others' median is a wrong program, noted on its row."""
    losses = sorted(r["first_loss"] for r in group if r.get("first_loss") is not None)
    if len(losses) < 2:
        return
    median = losses[len(losses) // 2]
    for row in group:
        loss = row.get("first_loss")
        if loss is not None and abs(loss - median) > LOSS_TOLERANCE * max(abs(median), 1.0):
            row["what"] = "; ".join(filter(None, [row.get("what"), f"first loss {loss:.6g}, others {median:.6g}"]))


def _best(rows: list[dict], key: str, keep) -> tuple[str, float] | None:
    kept = [(r["layout"], r[key]) for r in rows if keep(r) and r.get(key) is not None]
    return min(kept, key=lambda lt: lt[1]) if kept else None


def write(rows: list[dict], meta: dict, out: Path) -> Path:
    add_ratios(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    charts = draw_charts(rows, meta, out)
    table = out / "table.md"
    table.write_text(markdown(rows, meta, charts))
    return table


def load_average() -> str:
    """1, 5 and 15 minute load averages: other jobs on the machine slow the run."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


# --- the table ---------------------------------------------------------------------------
def _time(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "–"
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} µs"


def _mem(b: float | None) -> str:
    return "–" if b is None else gib_text(b)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _row_note(row: dict) -> str:
    parts = []
    if row.get("status") in ("n/a", "does not fit", "failed"):
        parts.append(f"**{row['status']}**: {row.get('error', '')}")
    if row.get("what"):
        parts.append(row["what"])
    if row.get("reshards") is not None and "same_as" not in row:
        parts.append(f"{row['reshards']} reshards")
    return "; ".join(parts).replace("|", "/")


def _table(header: tuple[str, ...], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
            + ["| " + " | ".join(cells) + " |" for cells in body])


def markdown(rows: list[dict], meta: dict, charts: list[str]) -> str:
    lines = ["# autopar bench: automatic plan versus manual layouts", "",
             f"{meta['date']}; {meta['seconds'] / 60:.1f} minutes; meshes {', '.join(meta['meshes'])}; "
             f"planner time limit {meta['time_limit_s']:g} s per plan; measured: median of {meta['steps']} steps "
             f"after {2 + meta['warmup']} warm-up (the first, compiling, and the one measuring memory)"
             f"{' (quick run)' if meta['quick'] else ''}; load average "
             f"{meta['load']} at the start, {load_average()} at the end (2 cores).", "",
             "## Summary", ""]
    summary = []
    for row in rows:
        if row["layout"] != "auto":
            continue
        summary.append([row["model"], row["mesh"], _row_note(row) or row.get("status", ""),
                        _time(row.get("predicted_step")),
                        _best_cell(rows, row, "predicted_step", "best_manual_predicted"),
                        _ratio(row.get("vs_best_manual_predicted")), _time(row.get("measured_step")),
                        _best_cell(rows, row, "measured_step", "best_manual_measured"),
                        _ratio(row.get("vs_best_manual_measured")), f"{row.get('plan_seconds', math.nan):.1f}"])
    lines += _table(SUMMARY_COLUMNS, summary)
    for mesh in meta["meshes"]:
        shape = "x".join(map(str, meta["mesh_shapes"][mesh]))
        kind = "gloo ranks on this machine, predicted and measured" if mesh.startswith("gloo") else \
            "H100 preset, meta-device models, predicted only"
        lines += ["", f"## {mesh} (mesh {shape}: {kind})", ""]
        for model in meta["models"]:
            label = next((r["label"] for r in rows if r["mesh"] == mesh and r["model"] == model), "")
            lines.append(f"- {model}: {label}")
        lines.append("")
        body = []
        for row in rows:
            if row["mesh"] != mesh:
                continue
            body.append([row["model"], row["layout"], _time(row.get("predicted_step")),
                         _time(row.get("measured_step")), _ratio(row.get("measured_over_predicted")),
                         _mem(row.get("predicted_memory_total")), _mem(row.get("measured_memory_total")),
                         _ratio(row.get("memory_measured_over_predicted")),
                         f"{row['plan_seconds']:.1f}" if "plan_seconds" in row else "–",
                         _ratio(row.get("vs_best_manual_predicted")), _ratio(row.get("vs_best_manual_measured")),
                         _dry_run_cell(row.get("dry_run")), _row_note(row)])
        lines += _table(COLUMNS, body)
    if meta.get("dry_run"):
        lines += ["", "## Dry runs of the H100 auto plans (`autopar.dry_run`)", ""]
        lines += _table(DRY_RUN_COLUMNS, [_dry_run_line(row) for row in rows if row.get("dry_run")])
    lines += ["", "## Legend", "", *LEGEND, ""]
    if charts:
        lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    return "\n".join(lines)


def _dry_run_cell(dry: dict | None) -> str:
    """The per-mesh table's dry-run column: ok with the worst rank's peak and predicted ÷ peak, or failed."""
    if not dry:
        return "–"
    if dry["status"] != "ok":
        return f"**failed**: {dry['error']}".replace("|", "/")
    return f"{_dry_verdict(dry)}: {_mem(dry['peak'])}, pred ÷ peak {_ratio(dry.get('ratio'))}, {dry['seconds']:.0f} s"


def _dry_verdict(dry: dict) -> str:
    """ok, or ok with a peak over the device's memory (the plan would not fit: a planner bug)."""
    if dry.get("over_memory"):
        return f"ok, **peak over the device's {_mem(dry['memory_limit'])}**"
    return "ok"


def _dry_run_line(row: dict) -> list[str]:
    dry = row["dry_run"]
    verdict = _dry_verdict(dry) if dry["status"] == "ok" else f"**failed**: {dry['error']}".replace("|", "/")
    peak = _mem(dry["peak"]) if dry.get("peak") else "–"
    return [row["mesh"], row["model"], dry.get("plan", ""), verdict, peak, _ratio(dry.get("ratio")) + _per_rank(dry),
            f"{dry['seconds']:.0f}" + _replayed(dry)]


def _replayed(dry: dict) -> str:
    """" (M' of M micro-batches)" for a pipeline plan: the fewest replayed with the same peak."""
    replayed, planned = dry.get("micro_batches") or (0, 0)
    return f" ({replayed} of {planned} micro-batches)" if planned else ""


def _per_rank(dry: dict) -> str:
    """The least and most of every rank's own predicted ÷ peak, where they differ (pipeline ranks)."""
    low, high = dry.get("rank_ratios") or (0.0, 0.0)
    return f" (per rank {low:.2f}–{high:.2f})" if high - low >= 0.005 else ""


def _best_cell(rows: list[dict], auto: dict, key: str, best_key: str) -> str:
    name = auto.get(best_key)
    if name is None:
        return "–"
    best = next(r for r in rows if r["mesh"] == auto["mesh"] and r["model"] == auto["model"] and r["layout"] == name)
    return f"{name} {_time(best.get(key))}"


LEGEND = [
    "- **pred step**: the plan's predicted training step (forward, backward, AdamW step; the model and "
    "its loss planned together), from the same cost model for every row: this machine's measured gloo "
    "profile on `gloo-*` meshes, the H100 preset on `h100-*` meshes.",
    "- **meas step**: the median wall time of a training step on gloo ranks sharing this machine's 2 cores "
    "(barrier before and after each step; the layouts of one model run interleaved, step by step, "
    "in one torchrun launch per mesh). This machine is shared and noisy: read ratios, not absolute times.",
    "- **meas ÷ pred**: measured / predicted step time (1.00 is a perfect prediction).",
    "- **pred mem/rank**: predicted bytes per device (parameters, gradients, AdamW state, saved "
    "activations; the most loaded pipeline rank).",
    "- **meas mem/rank**: the same four kinds, measured on the most loaded rank by "
    "`ParallelModule.measure_memory` over one training step: bytes of the rank's parameter shards and "
    "buffers (plus gathered whole copies kept for backward, ZeRO-1/2), their gradients and the optimizer "
    "state tensors after the step, and the distinct storages autograd keeps for backward at the end of "
    "forward (the loss's included; parameters' own storages not). Not counted: transient buffers freed "
    "within forward or backward, communication buffers, the Python process. Not an allocator peak (no GPU "
    "here; on CUDA `torch.cuda.max_memory_allocated` would be the measure).",
    "- **planning s**: auto: capture plus the whole search (`plan_captured` under the time limit); a manual "
    "layout: what planning it alone takes after capture (strategy graph and cost tables, then the layout "
    "completed and costed).",
    "- **reshards** (note): the resharding steps in the rank's model program (each is one or more "
    "collectives, each a DTensor redistribute with its Python overhead).",
    "- **÷ best manual**: this row's step time / the fastest manual layout's (predicted: among layouts "
    "predicted to fit; measured: among layouts that ran). On the auto row it is auto ÷ best manual.",
    "- Layouts: `autopar.layouts.LAYOUTS`; on H100 meshes also `pp+<layout>` / `3d`: the planner's "
    "pipeline search over that layout (the fastest mesh split is shown; predicted time only). "
    "The planner searches pipelines only with a preset, so gloo meshes have none.",
    "- **dry run** (`--dry-run`, H100 auto plans): `autopar.dry_run` of the plan at its full world size on "
    "torch's fake process group and fake tensors: ok, with the worst rank's peak memory (MemTracker) and "
    "predicted ÷ that peak, and its seconds (a peak over the device's memory is flagged: the plan would not "
    "fit); or failed, with the first failing rank's `autopar:` message.",
    "- **n/a**: the layout does not apply to this model (the planner's reason); **does not fit**: "
    "predicted over the device memory; **failed**: compiling or running it raised (its first line).",
]


# --- the charts ----------------------------------------------------------------------------
def draw_charts(rows: list[dict], meta: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    names = []
    for mesh in meta["meshes"]:
        names.append(_bars(rows, meta, mesh, out, "step", ("predicted_step", "measured_step"), 1e3, "step time (ms)"))
        gib = mesh.startswith("h100")
        names.append(_bars(rows, meta, mesh, out, "memory", ("predicted_memory_total", "measured_memory_total"),
                           1 / GIB if gib else 1 / MIB, f"memory per rank ({'GiB' if gib else 'MiB'})"))
    scatter = _scatter(rows, out)
    return [n for n in names + [scatter] if n]


def _bars(rows, meta, mesh, out: Path, kind: str, keys: tuple[str, str], scale: float, ylabel: str) -> str | None:
    import matplotlib.pyplot as plt
    import numpy as np

    models = [m for m in meta["models"] if any(r["mesh"] == mesh and r["model"] == m and r.get(keys[0]) for r in rows)]
    if not models:
        return None
    cols = min(len(models), 3)
    lines = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5.5 * cols, 4 * lines), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        group = [r for r in rows if r["mesh"] == mesh and r["model"] == model and r.get(keys[0])]
        x = np.arange(len(group))
        for i, (key, label) in enumerate(zip(keys, ("predicted", "measured"))):
            values = [(r.get(key) or 0.0) * scale for r in group]
            if any(values):
                ax.bar(x + (i - 0.5) * 0.4, values, 0.4, label=label)
        ax.set_xticks(x, [r["layout"] for r in group], rotation=60, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(f"{kind} per layout on {mesh}")
    fig.tight_layout()
    name = f"{kind}_{mesh}.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def _scatter(rows: list[dict], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    points = [r for r in rows if r.get("measured_step") and r.get("predicted_step")]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {}
    for r in points:
        key = (r["model"], r["mesh"])
        if key not in markers:
            markers[key] = "os^Dv<>ph*"[len(markers) % 10]
    for (model, mesh), marker in markers.items():
        mine = [r for r in points if r["model"] == model and r["mesh"] == mesh]
        ax.scatter([r["predicted_step"] * 1e3 for r in mine], [r["measured_step"] * 1e3 for r in mine],
                   marker=marker, label=f"{model} {mesh}", alpha=0.8)
    lo = min(min(r["predicted_step"], r["measured_step"]) for r in points) * 1e3 / 2
    hi = max(max(r["predicted_step"], r["measured_step"]) for r in points) * 1e3 * 2
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title("predicted vs measured step time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = "predicted_vs_measured.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name
