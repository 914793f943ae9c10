"""How well does the cost model predict this machine? Predict, then measure.

    python -m benchmarks.costmodel_accuracy                 # 2, 4 and 8 gloo ranks
    python -m benchmarks.costmodel_accuracy --ranks 2 4     # a subset

For each world size this launches ``torchrun`` on costmodel_worker.py, which measures
a fresh profile and then compares predictions with measurements of (1) each collective
at message sizes the fit did not use, (2) matmuls, pointwise kinds and attention at
the benchmark GPT's shapes (each timed right after its own fit), (3) a whole GPT
training step under DP, Megatron TP and ZeRO-3: autopar's own compiled step, predicted
by its plan (the planner's cost tables), with its time blocked in collectives; and the
same layouts by hand (DDP; parallelize_module on the MLPs; FSDP2), predicted by
``autopar.costmodels.step_time`` and timed by phase. It prints markdown tables (fitted
alpha/beta, every row, and the median absolute error per category) and writes them to
``benchmarks/results/costmodel_accuracy_gloo_<yyyymmdd>.md`` (``--out``), and with the raw rows
as JSON under results/ (``--results``, gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import add_out_argument, write_results

REPO = Path(__file__).resolve().parents[1]
# the step target applies to autopar's compiled step; the hand-written steps are a reference
TARGETS = {"collective": 0.15, "op": 0.15, "step": 0.20, "step by hand": 0.20}
CATEGORY = {"step": "step (autopar, compiled)", "step by hand": "step by hand (torch DDP/DTensor/FSDP2; reference)"}


def run_world(n: int, out: Path, steps: int, sweep: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(n),
        "-m",
        "benchmarks.costmodel_worker",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--sweep",
        sweep,
    ]
    t0 = time.time()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"autopar: the {n}-rank benchmark run failed (exit {run.returncode}); see above.")
    data = json.loads(out.read_text())
    data["wall_s"] = time.time() - t0
    return data


def err(row: dict) -> float:
    return (row["predicted"] - row["measured"]) / row["measured"]


def fmt_s(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.1f} us"


def fit_table(results: list[dict]) -> list[str]:
    lines = ["| ranks | collective | alpha | beta (bus bandwidth) | fit | in a step (after compute): alpha | beta | fit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for data in results:
        axis = data["profile"]["axes"][0]
        for c, fit in axis["collectives"].items() if data["ranks"] > 1 else ():
            step = axis.get("in_step", {}).get(c)
            lines.append(
                f"| {data['ranks']} | {c} | {fmt_s(fit['alpha_s'])} | "
                f"{fit['beta_bytes_per_s'] / 1e6:.0f} MB/s | {fit['source']} | "
                + (f"{fmt_s(step['alpha_s'])} | {step['beta_bytes_per_s'] / 1e6:.0f} MB/s | {step['source']} |"
                   if step else "- | - | - |")
            )
    lines += [
        "",
        "| ranks | dtype | matmul latency | matmul rate | attention fwd / bwd: fixed cost, GFLOP/s per head size |",
        "| --- | --- | --- | --- | --- |",
    ]

    def heads(rate: dict) -> str:
        """The fixed cost, and the FLOP rate of each measured head size (MFLOP per head)."""
        sizes = ", ".join(f"{f / 1e6:.1f}M: {f / t / 1e9:.1f}" for f, t in rate.get("points", []))
        return f"{fmt_s(rate['latency_s'])}, {sizes or '{:.1f}'.format(rate['rate'] / 1e9)}"

    for data in results:
        dev = data["profile"]["device"]
        for d in dev["matmul"]:
            mm, att = dev["matmul"][d], dev["attention"]
            lines.append(
                f"| {data['ranks']} | {d} | {fmt_s(mm['latency_s'])} | {mm['rate'] / 1e9:.1f} GFLOP/s | "
                f"{heads(att['forward'][d])} / {heads(att['backward'][d])} |"
            )
    kinds = list(results[0]["profile"]["device"]["pointwise"]) if results else []
    lines += [
        "",
        "Pointwise kinds, fp32: effective bandwidth (every input and output counted once) and fixed cost.",
        "",
        "| ranks | " + " | ".join(kinds) + " |",
        "| --- |" + " --- |" * len(kinds),
    ]
    for data in results:
        pw = data["profile"]["device"]["pointwise"]
        cells = [f"{pw[k]['fp32']['rate'] / 1e9:.2f} GB/s, {fmt_s(pw[k]['fp32']['latency_s'])}" for k in kinds]
        lines.append(f"| {data['ranks']} | " + " | ".join(cells) + " |")
    return lines


def rows_table(results: list[dict]) -> list[str]:
    lines = [
        "| ranks | kind | what | predicted | measured | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        for r in data["rows"]:
            lines.append(
                f"| {data['ranks']} | {r['kind']} | {r['name']} | {fmt_s(r['predicted'])} | "
                f"{fmt_s(r['measured'])} | {100 * err(r):+.1f}% |"
            )
    return lines


def cell(p: float, m: float) -> str:
    return f"{fmt_s(p)} / {fmt_s(m)} ({100 * (p - m) / m:+.0f}%)" if m > 0 else f"{fmt_s(p)} / {fmt_s(m)}"


def compiled_table(results: list[dict]) -> list[str]:
    """autopar's compiled steps: the plan's prediction by part against the step. Measured
    communication is the time the step spent blocked in collectives on the rank that waited
    least (and most: the others wait for the slowest rank); measured compute is the rest.
    "runtime priced" is the same profile applied op by op and call by call to what one
    compiled step ran (recorded, the loss included; its collectives at the back-to-back
    fits, where the plan prices an activation's moves by the fits after compute): where
    it differs from the plan, the planner's inventory of ops or collectives differs from
    the runtime's, whatever the rates. The plan covers the model; the loss program the runtime lays out after it is
    priced by the same tables and added to the prediction. The plan's communication is what it
    leaves exposed; "hidden" is what it counts as run beside compute (``costmodels.overlap``),
    and the last step column prices the same plan with nothing hidden, side by side."""
    lines = [
        "| ranks | layout | compute: plan / runtime priced / measured | "
        "communication: plan / runtime priced / measured blocked (least, most) | hidden (plan) | "
        "loss program (planner's tables) | step: plan + loss / measured | step with nothing hidden / measured | "
        "ops, collectives per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        for r in data["rows"]:
            if r["kind"] == "step":
                b, m, rt = r["breakdown"], r["measured_phases"], r["runtime_priced"]
                lines.append(
                    f"| {data['ranks']} | {r['group']} | {fmt_s(b['compute'])} / {fmt_s(rt['compute'])} / "
                    f"{fmt_s(m['compute'])} | "
                    f"{fmt_s(b['communication'])} / {fmt_s(rt['communication'])} / {fmt_s(m['communication'])}, "
                    f"{fmt_s(m['communication_most'])} | {fmt_s(b.get('hidden', 0.0))} | {fmt_s(b['loss'])} | "
                    f"{cell(r['predicted'], r['measured'])} | "
                    f"{cell(r['predicted'] + b.get('hidden', 0.0), r['measured'])} | {rt['ops']}, {rt['collectives']} |"
                )
    return lines


def breakdown_table(results: list[dict]) -> list[str]:
    """Each hand-written step's prediction by phase against the same phases timed in the step."""
    lines = [
        "| ranks | layout | forward + comm: predicted / measured | backward + comm: predicted / measured | "
        "optimizer: predicted / measured | step: predicted / measured | forward (no_grad) measured |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    for data in results:
        for r in data["rows"]:
            if r["kind"] == "step by hand":
                b, m = r["breakdown"], r["measured_phases"]
                lines.append(
                    f"| {data['ranks']} | {r['group']} | {cell(b['forward'] + b['forward_comm'], m['forward'])} | "
                    f"{cell(b['backward'] + b['backward_comm'], m['backward'])} | "
                    f"{cell(b['optimizer'], m['optimizer'])} | {cell(r['predicted'], r['measured'])} | "
                    f"{fmt_s(m['forward_no_grad'])} |"
                )
    lines += [
        "",
        "| ranks | layout | forward | backward | fwd comm | bwd comm | optimizer (predicted) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        for r in data["rows"]:
            if r["kind"] == "step by hand":
                b = r["breakdown"]
                lines.append(
                    f"| {data['ranks']} | {r['group']} | {fmt_s(b['forward'])} | {fmt_s(b['backward'])} | "
                    f"{fmt_s(b['forward_comm'])} | {fmt_s(b['backward_comm'])} | {fmt_s(b['optimizer'])} |"
                )
    return lines


def drift_table(results: list[dict]) -> list[str]:
    """How far the fp32 matmul rate and the all-reduce fit moved between the profile and
    the end of the run: the noise floor of this machine."""
    lines = [
        "| ranks | load avg | wall s | quantity | profile | end of run | drift |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        load = ", ".join(f"{k} {v:.1f}" for k, v in data["load"].items())
        wall = ", ".join(f"{k} {v:.0f}" for k, v in data["wall_s_by_phase"].items())
        for name, (x, y) in data["drift"].items():
            lines.append(
                f"| {data['ranks']} | {load} | {wall} | {name} | {x:.1f} | {y:.1f} | {100 * (y - x) / x:+.0f}% |"
            )
    return lines


def summary_table(results: list[dict]) -> list[str]:
    lines = [
        "| ranks | category | rows | median abs error | target | within target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[float]] = {}
    for data in results:
        for r in data["rows"]:
            groups.setdefault((data["ranks"], r["kind"], r["group"]), []).append(abs(err(r)))
            groups.setdefault((data["ranks"], r["kind"], "all"), []).append(abs(err(r)))
    for (n, kind, group), errs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "all", kv[0][2])
    ):
        med = statistics.median(errs)
        target = TARGETS[kind]
        lines.append(
            f"| {n} | {CATEGORY.get(kind, kind)}: {group} | {len(errs)} | {100 * med:.1f}% | {100 * target:.0f}% | "
            f"{'yes' if med <= target else 'NO'} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=7, help="timed training steps per layout")
    ap.add_argument("--sweep", choices=("default", "thorough"), default="default",
                    help="the profiler's sweep: Sweep() or Sweep.thorough()")
    ap.add_argument(
        "--results", default=str(REPO / "results"), help="where to write the report ('' for nowhere)"
    )
    add_out_argument(ap)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            print(f"running {n} gloo ranks ...", file=sys.stderr, flush=True)
            results.append(run_world(n, Path(tmp) / f"rows{n}.json", args.steps, args.sweep))
    load = os.getloadavg()
    title = "Cost-model accuracy on this machine"
    body = [
        f"{os.cpu_count()} CPUs, gloo, OMP_NUM_THREADS=1, the profiler's {args.sweep} sweep, load average at "
        f"the end {load[0]:.2f}. "
        "Error = (predicted - measured) / measured. Each held-out row is the median of timed batches: "
        + ", ".join(f"{k} {v}" for k, v in (results[0].get("repeats", {}) if results else {}).items())
        + " (steps: timed steps per layout).",
        "",
        "## Median absolute error",
        "",
        *summary_table(results),
        "",
        "## Fitted profile (fresh, per world size)",
        "",
        *fit_table(results),
        "",
        "## Noise floor: the profile's fp32 matmul and all-reduce fits measured again at the end",
        "",
        *drift_table(results),
        "",
        "## autopar's compiled step: the plan's prediction by part against the step",
        "",
        *compiled_table(results),
        "",
        "## Hand-written step by phase: predicted against measured",
        "",
        *breakdown_table(results),
        "",
        "## Every row",
        "",
        *rows_table(results),
    ]
    print("\n".join([f"# {title}", "", *body]))
    text = write_results("costmodel_accuracy", "gloo", title, body, args.out).read_text()
    if args.results:
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "costmodel_accuracy.md").write_text(text)
        (out / "costmodel_accuracy.json").write_text(json.dumps(results, indent=1))
        print(f"\nwritten: {out / 'costmodel_accuracy.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
